"""Probing this machine's links: every link measured, the disk file cleaned up, results cached."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tierkv.profile import probe

TINY = probe.ProbeSize(copy_bytes=2**20, file_bytes=2**20, request_bytes=2**16, queue_depth=2,
                       latency_samples=4, min_seconds=0.0)
MEMORY_LINKS = {"cpu->cpu", "cpu->gpu", "gpu->cpu"}
DISK_LINKS = {"cpu->nvme", "nvme->cpu"}


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "QUICK", TINY)


def _check_link(link: dict[str, object]) -> None:
    assert link["gbps"] > 0 and link["latency_us"] > 0
    assert link["queue_depth"] >= 1 and link["request_bytes"] > 0 and link["how"]


def test_quick_probe_measures_every_link_in_a_few_seconds(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    start = time.perf_counter()
    result = probe.probe_links(disk, cache_dir=tmp_path / "cache")
    assert time.perf_counter() - start < 15  # ~1 s on an idle 2-core machine
    assert set(result["links"]) == MEMORY_LINKS | DISK_LINKS
    for link in result["links"].values():
        _check_link(link)
    assert result["quick"] is True and result["nvme_dir"] == str(disk)
    assert result["links"]["nvme->cpu"]["queue_depth"] == probe.QUICK.queue_depth
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # measured beside it; no file, no directory left
    assert json.loads((tmp_path / "cache" / "probe.json").read_text())["version"] == probe.VERSION


def test_without_a_disk_only_memory_links_are_measured(tiny: None, tmp_path: Path) -> None:
    result = probe.probe_links(None, cache_dir=tmp_path)
    assert set(result["links"]) == MEMORY_LINKS
    assert "no CUDA" in result["links"]["cpu->gpu"]["how"] or "CUDA copy" in result["links"]["cpu->gpu"]["how"]


def test_results_come_from_the_cache_until_refresh(tiny: None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    first = probe.probe_links(tmp_path / "disk", cache_dir=tmp_path)
    calls: list[bool] = []

    def measure(nvme_dir: Path | None, *, quick: bool = True) -> dict[str, object]:
        calls.append(quick)
        return {"quick": quick, "links": {}, "nvme_dir": str(nvme_dir)}

    monkeypatch.setattr(probe, "measure_links", measure)
    assert probe.probe_links(tmp_path / "disk", cache_dir=tmp_path) == first
    assert calls == []
    probe.probe_links(tmp_path / "disk", cache_dir=tmp_path, quick=False)  # quick does not answer full
    probe.probe_links(tmp_path / "disk", cache_dir=tmp_path, quick=True)   # full answers quick
    probe.probe_links(tmp_path / "disk", cache_dir=tmp_path, refresh=True)
    probe.probe_links(tmp_path / "other", cache_dir=tmp_path)              # one entry per directory
    assert calls == [False, True, True]


def test_a_damaged_cache_is_measured_again(tiny: None, tmp_path: Path) -> None:
    (tmp_path / "probe.json").write_text("{not json")
    result = probe.probe_links(None, cache_dir=tmp_path)
    assert set(result["links"]) == MEMORY_LINKS
    assert json.loads((tmp_path / "probe.json").read_text())["results"][""] == result


def test_the_cache_lives_under_tierkv_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    assert probe.cache_path() == tmp_path / "probe.json"
    monkeypatch.delenv("TIERKV_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert probe.cache_path() == tmp_path / "home" / ".cache" / "tierkv" / "probe.json"


def test_buffered_io_with_fsync_where_o_direct_is_missing(tiny: None, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    links = probe.disk_links(tmp_path, TINY)
    assert list(tmp_path.iterdir()) == []
    assert set(links) == DISK_LINKS
    assert links["nvme->cpu"]["how"].startswith("buffered + fsync")
    for link in links.values():
        _check_link(link)


def test_a_full_disk_under_the_probe_is_named_as_such(tiny: None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv.errors import DiskFullError
    monkeypatch.setattr(probe.os, "pwritev", lambda fd, buffers, offset: 4096)    # what a full tmpfs does
    with pytest.raises(DiskFullError, match=f"{tmp_path}: no room for the disk probe's test file"):
        probe.disk_links(tmp_path, TINY)
    assert list(tmp_path.iterdir()) == []


def test_link_lines_name_each_link_with_its_rate(tiny: None, tmp_path: Path) -> None:
    lines = probe.link_lines(probe.probe_links(tmp_path / "d", cache_dir=tmp_path))
    assert [line.split()[0] for line in lines] == ["cpu->cpu", "cpu->gpu", "gpu->cpu", "cpu->nvme", "nvme->cpu"]
    assert all("GB/s" in line and "us/request" in line for line in lines)


def test_a_run_finds_the_links_probed_on_this_host_without_measuring(tiny: None, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's trace carries the probed limits (``tierkv profile`` showed '?' for every link): the disk's only
    where that directory was probed, the memory links of any probe of this host, nothing of another host."""
    cache = tmp_path / "cache"
    assert probe.cached_links(tmp_path / "disk", cache_dir=cache) is None
    probe.probe_links(tmp_path / "disk", cache_dir=cache)
    monkeypatch.setattr(probe, "measure_links", lambda *a, **k: pytest.fail("cached_links measured"))
    assert set(probe.cached_links(tmp_path / "disk", cache_dir=cache)["links"]) == MEMORY_LINKS | DISK_LINKS
    assert set(probe.cached_links(tmp_path / "other", cache_dir=cache)["links"]) == MEMORY_LINKS
    assert set(probe.cached_links(None, cache_dir=cache)["links"]) == MEMORY_LINKS
    monkeypatch.setattr(probe.socket, "gethostname", lambda: "another-host")   # a cache dir shared by machines
    assert probe.cached_links(tmp_path / "disk", cache_dir=cache) is None
