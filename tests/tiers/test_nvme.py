"""NvmeTier: roundtrips, reopen from another process, checksums, locking, manifest, backends."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import stat
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv.device import has_cuda_driver, host_buffer
from tierkv.errors import ConfigError, DiskFullError, StoreLocked
from tierkv.keys import BlockKey
from tierkv.tiers import journal, nvme, nvme_io, nvme_scan, nvme_striped
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.nvme_io import o_direct_supported, probe_backends
from tierkv.tiers.nvme_striped import plan_runs
from tierkv.tiers.pool import SlotState

BB = 16 * 1024  # block bytes: small, still a multiple of 4096


def key(i: int) -> BlockKey:
    return BlockKey.of("test-block", i)


def expected(k: BlockKey, block_bytes: int = BB) -> torch.Tensor:
    """Deterministic bytes derived from the key alone (any process can check them)."""
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, block_bytes, dtype=np.uint8))


def put(tier: NvmeTier, ids: list[int], *, aligned: bool = True) -> dict[BlockKey, int]:
    """Reserve, write and commit blocks ``ids``; returns key -> slot."""
    items = []
    for i in ids:
        data = expected(key(i), tier.block_bytes)
        if aligned:
            data = host_buffer(tier.block_bytes, pinned=False).copy_(data)
        items.append((key(i), tier.pool.reserve(), data))
    tier.write(items)
    for _, slot, _ in items:
        tier.pool.commit(slot)
    return {k: slot for k, slot, _ in items}


def read_back(tier: NvmeTier, placed: dict[BlockKey, int], *, aligned: bool = True) -> tuple[list, dict]:
    make = (lambda: host_buffer(tier.block_bytes, pinned=False)) if aligned else (
        lambda: torch.empty(tier.block_bytes + 8, dtype=torch.uint8)[8:])
    items = [(k, slot, make()) for k, slot in placed.items()]
    failed = tier.read(items)
    return failed, {k: dst for k, _, dst in items}


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERKV_NVME_BACKEND", raising=False)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


# -- roundtrips ---------------------------------------------------------------
@pytest.mark.parametrize("backend", ["odirect", "buffered"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_roundtrip_random_data(store: Path, backend: str, aligned: bool) -> None:
    if backend == "odirect" and not o_direct_supported(store.parent):
        pytest.skip("no O_DIRECT here")
    with NvmeTier(store, BB, 64 * BB, backend=backend, io_threads=3) as tier:
        assert tier.backend == backend
        gap = [tier.pool.reserve() for _ in range(3)]  # leave holes: runs are not one extent
        placed = put(tier, list(range(10)), aligned=aligned)
        tier.pool.release(gap[1])
        placed |= put(tier, [10, 11], aligned=aligned)
        failed, got = read_back(tier, placed, aligned=not aligned)
        assert failed == []
        for k, dst in got.items():
            assert torch.equal(dst, expected(k)), k


def test_concurrent_batches_from_several_threads(store: Path) -> None:
    with NvmeTier(store, BB, 64 * BB, io_threads=3) as tier:
        slots = {i: tier.pool.reserve() for i in range(48)}

        def worker(ids: list[int]) -> list[BlockKey]:
            tier.write([(key(i), slots[i], expected(key(i))) for i in ids])
            failed, got = read_back(tier, {key(i): slots[i] for i in ids}, aligned=False)
            return failed + [k for k, v in got.items() if not torch.equal(v, expected(k))]

        with ThreadPoolExecutor(4) as pool:
            bad = list(pool.map(worker, [list(range(j, 48, 4)) for j in range(4)]))
        assert bad == [[], [], [], []]
        assert len(tier.items()) == 48


def test_write_makes_blocks_visible_and_leaves_pool_states_alone(store: Path) -> None:
    with NvmeTier(store, BB, 8 * BB) as tier:
        slot = tier.pool.reserve()
        assert tier.lookup(key(0)) is None
        tier.write([(key(0), slot, expected(key(0)))])
        assert tier.lookup(key(0)) == slot
        assert tier.items() == [(key(0), slot)]
        assert tier.pool.state(slot) is SlotState.RESERVED


def test_read_of_unknown_key_or_wrong_slot_fails_without_io(store: Path) -> None:
    with NvmeTier(store, BB, 8 * BB) as tier:
        placed = put(tier, [0, 1])
        wrong = {key(0): placed[key(1)], key(7): 5, key(1): placed[key(1)]}
        failed, got = read_back(tier, wrong)
        assert failed == [key(0), key(7)]
        assert torch.equal(got[key(1)], expected(key(1)))


def test_drop_hides_the_block_now_and_after_reopen(store: Path) -> None:
    with NvmeTier(store, BB, 8 * BB) as tier:
        placed = put(tier, [0, 1, 2])
        tier.drop(key(1))
        tier.drop(key(1))  # idempotent
        assert tier.lookup(key(1)) is None
        assert read_back(tier, placed)[0] == [key(1)]
    with NvmeTier(store, BB, 8 * BB) as tier:
        assert sorted(k for k, _ in tier.items()) == sorted([key(0), key(2)])
        assert tier.pool.used == 2
        assert [tier.pool.state(placed[key(i)]) for i in range(3)] == [
            SlotState.READY, SlotState.FREE, SlotState.READY]
        assert tier.pool.reserve() == placed[key(1)]  # the hole is reused first


def test_reopen_in_a_new_process_reads_blocks_bit_exact(store: Path) -> None:
    with NvmeTier(store, BB, 32 * BB) as tier:
        put(tier, list(range(12)))
    code = textwrap.dedent(f"""
        import json, sys, numpy as np, torch
        from tierkv.tiers.nvme import NvmeTier
        with NvmeTier({str(store)!r}, {BB}, {32 * BB}) as tier:
            items = [(k, s, torch.empty({BB}, dtype=torch.uint8)) for k, s in tier.items()]
            failed = tier.read(items)
            ok = sum(bool(np.array_equal(dst.numpy(), np.random.default_rng(
                int.from_bytes(k.digest[:8], "little")).integers(0, 256, {BB}, dtype=np.uint8))) for k, _, dst in items)
            print(json.dumps({{"blocks": len(items), "failed": len(failed), "exact": ok,
                              "ready": tier.pool.used, "backend": tier.backend}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"blocks": 12, "failed": 0, "exact": 12, "ready": 12, "backend": report["backend"]}


# -- damage -----------------------------------------------------------------
def test_flipped_byte_in_slots_dat_fails_that_block_only(store: Path) -> None:
    with NvmeTier(store, BB, 8 * BB) as tier:
        placed = put(tier, [0, 1, 2])
        tier.flush()
        with open(store / "slots.dat", "r+b") as f:
            f.seek(placed[key(1)] * BB + 1234)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        failed, got = read_back(tier, placed)
        assert failed == [key(1)]
        assert torch.equal(got[key(2)], expected(key(2)))


@pytest.mark.parametrize("backend", ["odirect", "buffered"])
def test_truncated_slots_dat_fails_the_lost_blocks_without_raising(store: Path, backend: str) -> None:
    with NvmeTier(store, BB, 8 * BB, backend=backend) as tier:
        placed = put(tier, list(range(6)))
        os.truncate(store / "slots.dat", 3 * BB + BB // 2)  # slot 3 half there, 4 and 5 gone
        failed, _ = read_back(tier, placed)
        assert sorted(failed) == sorted(k for k, s in placed.items() if s >= 3)
    with NvmeTier(store, BB, 8 * BB) as tier:  # reopen hides what the file cannot back
        assert sorted(s for _, s in tier.items()) == [0, 1, 2]
        assert read_back(tier, {k: s for k, s in placed.items() if s < 3})[0] == []


def test_failed_write_makes_nothing_visible_and_keeps_the_journal(store: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with NvmeTier(store, BB, 16 * BB, io_threads=2) as tier:
        put(tier, [0])
        size = (store / "index.log").stat().st_size
        calls = 0
        real = tier._file.pwritev

        def flaky(bufs, offset):
            nonlocal calls
            calls += 1
            if calls == 2:
                raise OSError(errno.EIO, "injected")
            real(bufs, offset)

        monkeypatch.setattr(tier._file, "pwritev", flaky)
        slots = [tier.pool.reserve() for _ in range(1, 7)]
        slots.pop(2)  # two runs
        with pytest.raises(OSError, match="injected"):
            tier.write([(key(i), s, expected(key(i))) for i, s in zip(range(1, 6), slots)])
        assert [k for k, _ in tier.items()] == [key(0)]
        assert (store / "index.log").stat().st_size == size


def test_failed_checksum_makes_nothing_visible(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with NvmeTier(store, BB, 16 * BB, io_threads=2) as tier:
        put(tier, [0])
        size = (store / "index.log").stat().st_size
        calls = 0
        real = nvme_striped.checksum

        def flaky(block):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("injected")
            return real(block)

        monkeypatch.setattr(nvme_striped, "checksum", flaky)
        with pytest.raises(RuntimeError, match="injected"):
            put(tier, list(range(1, 6)))
        assert [k for k, _ in tier.items()] == [key(0)]
        assert (store / "index.log").stat().st_size == size


def test_journal_enospc_is_truncated_back_and_reported(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with NvmeTier(store, BB, 16 * BB) as tier:
        put(tier, [0])
        size = (store / "index.log").stat().st_size
        slots = [tier.pool.reserve() for _ in range(3)]  # claims are written before the disk fills
        real = os.pwrite

        def half_then_full(fd, data, offset):
            if len(data) > journal.RECORD_BYTES:
                return real(fd, data[:len(data) // 2 + 5], offset)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(journal.os, "pwrite", half_then_full)
        with pytest.raises(DiskFullError) as info:
            tier.write([(key(i), slot, expected(key(i))) for i, slot in zip([1, 2, 3], slots)])
        monkeypatch.undo()
        assert str(store) in str(info.value) and info.value.errno == errno.ENOSPC
        assert (store / "index.log").stat().st_size == size
        assert [k for k, _ in tier.items()] == [key(0)]
    with NvmeTier(store, BB, 16 * BB) as tier:
        assert [k for k, _ in tier.items()] == [key(0)]


def test_compaction_on_open_rewrites_a_journal_of_mostly_drops(store: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme, "COMPACT_MIN_GARBAGE", 8)
    with NvmeTier(store, BB, 32 * BB) as tier:
        placed = put(tier, list(range(20)))
        for i in range(15):
            tier.drop(key(i))
    assert (store / "index.log").stat().st_size == 35 * journal.RECORD_BYTES
    with NvmeTier(store, BB, 32 * BB) as tier:
        assert (store / "index.log").stat().st_size == 5 * journal.RECORD_BYTES
        kept = {k: s for k, s in placed.items() if k in {key(i) for i in range(15, 20)}}
        failed, got = read_back(tier, kept)
        assert failed == [] and all(torch.equal(v, expected(k)) for k, v in got.items())


def test_blocks_past_a_smaller_budget_are_hidden_on_reopen(store: Path) -> None:
    with NvmeTier(store, BB, 8 * BB) as tier:
        put(tier, list(range(6)))
    with NvmeTier(store, BB, 4 * BB) as tier:
        assert sorted(s for _, s in tier.items()) == [0, 1, 2, 3]
        assert tier.budget_bytes == 4 * BB


# -- growth, files, lock, manifest -------------------------------------------
def test_slots_dat_grows_in_big_steps_capped_at_the_budget(store: Path) -> None:
    with NvmeTier(store, BB, 100 * BB) as tier:
        put(tier, [0])
        assert (store / "slots.dat").stat().st_size == 100 * BB  # 64 MiB step, capped
    with NvmeTier(store.parent / "big", 1 << 20, 1 << 30) as tier:
        put(tier, [0])
        assert (store.parent / "big" / "slots.dat").stat().st_size == nvme.GROW_MIN


def test_store_directory_is_0700_and_files_0600_whatever_the_umask(store: Path) -> None:
    old = os.umask(0)
    try:
        with NvmeTier(store, BB, 8 * BB) as tier:
            put(tier, [0])
            owners = list((store / "owners").iterdir())
            assert len(owners) == 1 and stat.S_IMODE(owners[0].stat().st_mode) == 0o600
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    names = sorted(p.name for p in store.iterdir())
    assert names == ["claims", "index.log", "lock", "owners", "slots.dat", "store.json"]
    assert list((store / "owners").iterdir()) == []  # removed on close
    for p in store.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p


def _flock_probe(path: Path, mode: str) -> str:
    """Whether another process can take ``path``'s flock in ``mode`` ("LOCK_EX" or "LOCK_SH") now."""
    probe = (f"import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
             f"try: fcntl.flock(fd, fcntl.{mode} | fcntl.LOCK_NB); print('free')\n"
             f"except BlockingIOError: print('held')")
    return subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True,
                          timeout=30, check=True).stdout.strip()


def test_a_second_opener_shares_the_store(store: Path) -> None:
    # flock is per open file description: a second open in this process counts as another process
    with NvmeTier(store, BB, 8 * BB) as first, NvmeTier(store, BB, 8 * BB) as second:
        assert (_flock_probe(store / "lock", "LOCK_EX"), _flock_probe(store / "lock", "LOCK_SH")) == ("held", "free")
        placed = put(first, [0, 1])
        assert second.lookup(key(0)) is None
        changes = second.refresh()
        assert sorted(changes.added) == sorted(placed.items()) and changes.removed == []
        assert read_back(second, placed)[0] == []
        assert second.refresh().added == []   # nothing new: nothing twice
    assert _flock_probe(store / "lock", "LOCK_EX") == "free"


def test_a_process_holding_the_store_exclusively_makes_an_opener_raise_store_locked(store: Path) -> None:
    NvmeTier(store, BB, 8 * BB).close()
    fd = os.open(store / "lock", os.O_RDWR)  # what a tierkv from before shared stores holds
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, b"4711\n", 0)
        with pytest.raises(StoreLocked, match=f"{store}.*pid 4711"):
            NvmeTier(store, BB, 8 * BB)
    finally:
        os.close(fd)
    NvmeTier(store, BB, 8 * BB).close()  # the failed open left nothing held


def test_manifest_mismatch_is_a_config_error(store: Path) -> None:
    NvmeTier(store, BB, 8 * BB, namespace="llama").close()
    manifest = json.loads((store / "store.json").read_text())
    assert (manifest["block_bytes"], manifest["namespace"], manifest["version"]) == (BB, "llama", 1)
    with pytest.raises(ConfigError, match="block_bytes=16384"):
        NvmeTier(store, 2 * BB, 8 * BB, namespace="llama")
    with pytest.raises(ConfigError, match="namespace='llama'"):
        NvmeTier(store, BB, 8 * BB, namespace="qwen")
    NvmeTier(store, BB, 8 * BB, namespace="llama").close()  # the lock was released by the failures


def test_a_damaged_manifest_is_rebuilt_only_where_the_blocks_vouch_for_the_opener_s_settings(tmp_path: Path) -> None:
    store = tmp_path / "llama"                           # named after its namespace, as tierkv names stores
    with NvmeTier(store, BB, 8 * BB, namespace="llama") as tier:
        slots = [tier.pool.reserve() for _ in range(3)]
        tier.write([(key(i), slot, torch.full((BB,), i, dtype=torch.uint8)) for i, slot in enumerate(slots)])
    good = (store / "store.json").read_text()
    (store / "store.json").write_text(good.replace(str(BB), str(BB + 4096)))      # fails its checksum
    for size, namespace in ((2 * BB, "llama"), (BB // 2, "llama"), (BB, "qwen")):  # the blocks fail, or another name
        with pytest.raises(ConfigError, match=f"store.json fails its checksum.*do not vouch for block_bytes={size}, "
                                              f"namespace={namespace!r}, the settings given"):
            NvmeTier(store, size, 8 * BB, namespace=namespace)
    with NvmeTier(store, BB, 8 * BB, namespace="llama") as tier:                   # rebuilt, the blocks kept
        assert sorted(k for k, _ in tier.items()) == sorted(key(i) for i in range(3))
    assert json.loads((store / "store.json").read_text())["block_bytes"] == BB
    empty = tmp_path / "empty"
    NvmeTier(empty, BB, 8 * BB, namespace="empty").close()
    (empty / "store.json").write_text("{")
    NvmeTier(empty, 2 * BB, 8 * BB, namespace="empty").close()      # no block to lose: rebuilt as asked


def test_foreign_directory_without_manifest_is_refused(store: Path) -> None:
    store.mkdir()
    (store / "slots.dat").write_bytes(b"x")
    with pytest.raises(ConfigError, match="no store.json"):
        NvmeTier(store, BB, 8 * BB)


def test_close_is_idempotent_and_later_calls_fail(store: Path) -> None:
    tier = NvmeTier(store, BB, 8 * BB)
    tier.close()
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.write([(key(0), 0, expected(key(0)))])


def test_bad_block_tensor_is_rejected(store: Path) -> None:
    with NvmeTier(store, BB, 8 * BB) as tier:
        slot = tier.pool.reserve()
        with pytest.raises(ValueError, match="16384 contiguous bytes"):
            tier.write([(key(0), slot, torch.zeros(BB // 2, dtype=torch.uint8))])
        with pytest.raises(ValueError, match="outside"):
            tier.write([(key(0), 99, expected(key(0)))])
        tier.write([(key(0), slot, expected(key(0)).view(torch.int32))])  # any dtype, same bytes
        assert read_back(tier, {key(0): slot})[0] == []


# -- backends -----------------------------------------------------------------
def test_probe_backends_reports_each_backend(tmp_path: Path) -> None:
    report = probe_backends(tmp_path)
    assert set(report) == {"kvikio", "odirect", "buffered"}
    assert report["buffered"] == "ok"
    if not has_cuda_driver():
        assert "libcuda.so.1" in report["kvikio"]
    assert not list(tmp_path.iterdir())  # probe files are removed


def test_auto_picks_odirect_here_and_the_env_knob_overrides(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if has_cuda_driver() or not o_direct_supported(store.parent):
        pytest.skip("expects a machine without a CUDA driver and with O_DIRECT")
    with NvmeTier(store, BB, 8 * BB) as tier:
        assert tier.backend == "odirect"
    monkeypatch.setenv("TIERKV_NVME_BACKEND", "buffered")
    with NvmeTier(store, BB, 8 * BB) as tier:
        assert tier.backend == "buffered"


def test_unaligned_block_size_falls_back_to_buffered(store: Path) -> None:
    with NvmeTier(store, 5000, 10 * 5000) as tier:
        assert tier.backend in ("buffered", "kvikio")
        placed = put(tier, [0, 1], aligned=False)
        assert read_back(tier, placed, aligned=False)[0] == []
    with pytest.raises(ConfigError, match="multiple of 4096"):
        NvmeTier(store, 5000, 10 * 5000, backend="odirect")


def test_asking_for_kvikio_without_a_driver_is_a_config_error(store: Path) -> None:
    if has_cuda_driver():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(ConfigError, match="kvikio.*libcuda.so.1"):
        NvmeTier(store, BB, 8 * BB, backend="kvikio")
    NvmeTier(store, BB, 8 * BB).close()  # the failed open released the lock


def test_unknown_backend_lists_the_valid_ones(store: Path) -> None:
    with pytest.raises(ConfigError, match="auto, kvikio, odirect, buffered"):
        NvmeTier(store, BB, 8 * BB, backend="io_uring")


def test_plan_runs_coalesces_adjacent_slots() -> None:
    assert plan_runs([3, 4, 5, 6, 9, 10, 20], 4) == [(0, 4), (4, 6), (6, 7)]
    assert plan_runs([0, 1, 2, 3, 4], 2) == [(0, 2), (2, 4), (4, 5)]
    assert plan_runs([], 4) == []
    rng = random.Random(5)
    for _ in range(500):   # against cutting one slot at a time
        slots, limit = sorted(rng.sample(range(80), rng.randint(1, 60))), rng.randint(1, 9)
        cuts, lo = [], 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1 or i - lo == limit:
                cuts.append((lo, i))
                lo = i
        assert plan_runs(slots, limit) == cuts


@pytest.mark.gds
def test_kvikio_roundtrip_of_cuda_tensors(store: Path) -> None:
    if not has_cuda_driver():
        pytest.skip("no CUDA driver (libcuda.so.1 does not load)")
    pytest.importorskip("kvikio")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with NvmeTier(store, BB, 8 * BB, backend="kvikio") as tier:
        assert tier.backend == "kvikio"
        slot = tier.pool.reserve()
        tier.write([(key(0), slot, expected(key(0)).cuda())])
        dst = torch.empty(BB, dtype=torch.uint8, device="cuda")
        assert tier.read([(key(0), slot, dst)]) == []
        assert torch.equal(dst.cpu(), expected(key(0)))
    assert nvme_io.BACKENDS["kvikio"] is nvme_io.KvikioFile


def test_a_store_is_scanned_without_joining_it_empty_damaged_cut_short_or_with_a_damaged_record(
        tmp_path: Path) -> None:
    """`scan_read_only` (store verify): the blocks and those that fail their checksum, as a read through the
    store finds them; blocks past the end of a data file cut short, and journal records damaged in the
    middle, counted (an opener drops them with a line in its log); a torn last record is no damage."""
    with NvmeTier(tmp_path / "empty", 4096, 16 * 4096):
        pass
    assert nvme_scan.scan_read_only(tmp_path / "empty") == nvme_scan.Scan()
    with NvmeTier(tmp_path / "s", 4096, 16 * 4096) as tier:
        keys = [BlockKey.of("scan", i) for i in range(5)]
        slots = [tier.pool.reserve() for _ in keys]
        tier.write([(k, slot, torch.full((4096,), i, dtype=torch.uint8))
                    for i, (k, slot) in enumerate(zip(keys, slots))])
    with open(tmp_path / "s" / "slots.dat", "r+b") as f:
        f.seek(slots[2] * 4096 + 100)
        f.write(b"\xff")
    scan = nvme_scan.scan_read_only(tmp_path / "s")
    assert sorted(scan.keys) == sorted(keys) and scan.damaged == [keys[2]] and not scan.lost
    files = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
    os.truncate(tmp_path / "s" / "slots.dat", (max(slots) - 1) * 4096 + 10)   # the last two slots' blocks gone
    log_path = tmp_path / "s" / "index.log"
    raw = bytearray(log_path.read_bytes())
    raw[journal.RECORD_BYTES + 5] ^= 0xFF                                           # the second record damaged
    log_path.write_bytes(bytes(raw) + b"\x01" * 10)                          # and a torn last one
    scan = nvme_scan.scan_read_only(tmp_path / "s")
    assert len(scan.lost) == 2 and scan.bad_records == 1 and scan.torn_bytes == 10
    assert {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file() and p.suffix not in (".dat", ".log")} \
        == {p: b for p, b in files.items() if p.suffix not in (".dat", ".log")}        # nothing else written




def test_a_growth_the_disk_refused_halfway_is_given_back(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system may keep part of a fallocate that then fails for want of room: slots.dat is cut back
    to its size before, so a full disk leaves no slots past what the journal knows."""
    with NvmeTier(store, BB, 1024 * BB) as tier:
        before = os.fstat(tier._file.fd).st_size

        def partly(fd: int, offset: int, length: int) -> None:
            os.ftruncate(fd, offset + length // 2)               # half of it taken, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(nvme.os, "posix_fallocate", partly)
        with pytest.raises(DiskFullError):
            tier._grow_to(before + 512 * BB)
        assert os.fstat(tier._file.fd).st_size == before
