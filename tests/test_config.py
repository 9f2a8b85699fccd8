import platform
import subprocess
import sys

import pytest

from tierkv.config import TierConfig

from tierkv.knobs import IOKnobs

from tierkv.sizes import format_size, parse_size
from tierkv.errors import ConfigError


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                           ("4096", 4096), (" 64 KiB ", 65536), (123, 123)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4 parsecs", "-1", "GiB", "", True, -5, "99999999TiB", 2**61])
def test_bad_sizes_name_the_field(text):
    with pytest.raises(ConfigError, match="cpu_budget"):      # (a huge one was an OverflowError when mapped)
        parse_size(text, "cpu_budget")


def test_format_size():
    assert format_size(3 * 2**20) == "3.0 MiB" and format_size(100) == "100 B"


def test_tier_config_validates_fields(tmp_path):
    assert TierConfig(cpu="1GiB").cpu == 2**30
    with pytest.raises(ConfigError, match="block_bytes=1000: must be a multiple of 4096"):
        TierConfig(block_bytes=1000)
    with pytest.raises(ConfigError, match="gpu=4096: a non-zero budget must hold at least one block"):
        TierConfig(gpu=4096)
    with pytest.raises(ConfigError, match="at least one tier"):
        TierConfig(gpu=0, cpu=0)
    with pytest.raises(ConfigError, match="blocks are read from nvme into a memory tier"):   # not at the manager
        TierConfig(gpu=0, cpu=0, nvme_dir=tmp_path)
    with pytest.raises(ConfigError, match="cpu='lots'"):
        TierConfig(cpu="lots")


def test_env_knobs():
    knobs = IOKnobs.from_env({"TIERKV_IO_THREADS": "8", "TIERKV_INFLIGHT_BYTES": "64MiB"})
    assert knobs.io_threads == 8 and knobs.inflight_bytes == 64 * 2**20
    with pytest.raises(ConfigError, match="TIERKV_NVME_BACKEND='fast'.*odirect"):
        IOKnobs.from_env({"TIERKV_NVME_BACKEND": "fast"})
    with pytest.raises(ConfigError, match="TIERKV_IO_THREADS='x'"):
        IOKnobs.from_env({"TIERKV_IO_THREADS": "x"})


def test_malloc_keep_knob():
    assert IOKnobs.from_env({}).malloc_keep == 64 * 2**20
    assert IOKnobs.from_env({"TIERKV_MALLOC_KEEP": "0"}).malloc_keep == 0
    with pytest.raises(ConfigError, match="TIERKV_MALLOC_KEEP"):
        IOKnobs.from_env({"TIERKV_MALLOC_KEEP": "lots"})


def test_malloc_arenas_knob():
    assert IOKnobs.from_env({}).malloc_arenas == 2
    assert IOKnobs.from_env({"TIERKV_MALLOC_ARENAS": "0"}).malloc_arenas == 0
    with pytest.raises(ConfigError, match="TIERKV_MALLOC_ARENAS='two'"):
        IOKnobs.from_env({"TIERKV_MALLOC_ARENAS": "two"})
    with pytest.raises(ConfigError, match="TIERKV_MALLOC_ARENAS=-1"):
        IOKnobs.from_env({"TIERKV_MALLOC_ARENAS": "-1"})


HEAPS_PROBE = """
import ctypes, sys, threading
from tierkv.knobs import limit_heaps

limited = limit_heaps(int(sys.argv[1])) if sys.argv[1] != "0" else None
held, together = [], threading.Barrier(6)
def allocate():
    held.append(bytearray(100_000))      # malloc'd (under the mmap threshold), in this thread's heap
    together.wait()                      # all alive at once: none hands its heap on to the next
threads = [threading.Thread(target=allocate) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(limited, flush=True)
ctypes.CDLL(None).malloc_stats()          # to stderr: an "Arena N:" block per heap
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.parametrize("arenas", [0, 1, 2])
def test_threads_share_as_many_heaps_as_the_knob_allows(arenas):
    """Each thread that allocates gets a heap of its own, keeping its own freed memory; the tierkv command
    caps them (TIERKV_MALLOC_ARENAS)."""
    run = subprocess.run([sys.executable, "-c", HEAPS_PROBE, str(arenas)], capture_output=True, text=True, check=True)
    heaps = run.stderr.count("Arena ")
    if arenas:
        assert run.stdout.split() == ["True"] and heaps == arenas
    else:
        assert heaps > 2       # glibc's own: a heap per thread here, up to 8 per core


KEEP_PROBE = """
import resource, numpy as np
from tierkv.knobs import keep_freed_memory

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        blocks = [np.ones(4 << 20, np.uint8) for _ in range(6)]    # 24 MiB written, then freed together
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(faults(), keep_freed_memory(64 << 20), [faults(), faults()][1])     # the kept heap once grown
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_kept_for_reuse_stops_the_page_faults_of_every_allocation():
    """What a sparse layer's temporaries do: blocks of a few MiB freed together went back to the
    system at once, and the next ones faulted their pages in again."""
    out = subprocess.run([sys.executable, "-c", KEEP_PROBE], capture_output=True, text=True, check=True).stdout
    default, applied, kept = out.split()
    assert applied == "True"
    assert int(default) > 10 * 1024 and int(kept) < int(default) // 10     # 4 MiB: 1,024 pages


def test_a_budget_under_one_block_is_named_by_its_flag_with_the_block_s_size(tmp_path):
    from tierkv.model.settings import TierSettings
    with pytest.raises(ConfigError, match=r"gpu_budget=.1.0 KiB.: less than one KV block of this model and mode "
                                          r"\(384.0 KiB\); give at least that, or 0 for no such tier"):
        TierSettings(gpu_budget="1KiB").tier_config(393216, "store")          # not "gpu=1024: ..."
    with pytest.raises(ConfigError, match="nvme_budget=.64.0 KiB.: less than one KV block"):
        TierSettings(nvme_dir=tmp_path, nvme_budget="64KiB").tier_config(393216, "store")
    assert TierSettings(gpu_budget=0, nvme_budget="64KiB").tier_config(393216, "store").gpu == 0   # no store: no check
