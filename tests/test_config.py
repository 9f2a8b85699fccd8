import pytest

from tierkv.config import TierConfig

from tierkv.knobs import IOKnobs

from tierkv.sizes import format_size, parse_size
from tierkv.errors import ConfigError


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                           ("4096", 4096), (" 64 KiB ", 65536), (123, 123)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4 parsecs", "-1", "GiB", "", True, -5])
def test_bad_sizes_name_the_field(text):
    with pytest.raises(ConfigError, match="cpu_budget"):
        parse_size(text, "cpu_budget")


def test_format_size():
    assert format_size(3 * 2**20) == "3.0 MiB" and format_size(100) == "100 B"


def test_tier_config_validates_fields():
    assert TierConfig(cpu="1GiB").cpu == 2**30
    with pytest.raises(ConfigError, match="block_bytes=1000: must be a multiple of 4096"):
        TierConfig(block_bytes=1000)
    with pytest.raises(ConfigError, match="gpu=4096: a non-zero budget must hold at least one block"):
        TierConfig(gpu=4096)
    with pytest.raises(ConfigError, match="at least one tier"):
        TierConfig(gpu=0, cpu=0)
    with pytest.raises(ConfigError, match="cpu='lots'"):
        TierConfig(cpu="lots")


def test_env_knobs():
    knobs = IOKnobs.from_env({"TIERKV_IO_THREADS": "8", "TIERKV_INFLIGHT_BYTES": "64MiB"})
    assert knobs.io_threads == 8 and knobs.inflight_bytes == 64 * 2**20
    with pytest.raises(ConfigError, match="TIERKV_NVME_BACKEND='fast'.*odirect"):
        IOKnobs.from_env({"TIERKV_NVME_BACKEND": "fast"})
    with pytest.raises(ConfigError, match="TIERKV_IO_THREADS='x'"):
        IOKnobs.from_env({"TIERKV_IO_THREADS": "x"})
