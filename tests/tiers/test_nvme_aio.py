"""Native AIO reads of the NVMe tier: real O_DIRECT files, short reads, refusals, interrupted batches."""
from __future__ import annotations

import errno
import os
import threading
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv.device import host_buffer
from tierkv.errors import ConfigError, StoreReadError
from tierkv.keys import BlockKey
from tierkv.knobs import IOKnobs
from tierkv.tiers import nvme_aio
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.nvme_io import o_direct_supported

BB = 16 * 1024


@pytest.fixture
def direct_file(tmp_path: Path):
    """A 64-block file of known bytes (block i: byte i + 1 and its offset pattern), open O_DIRECT."""
    if not o_direct_supported(tmp_path) or not nvme_aio.available():
        pytest.skip("no O_DIRECT or no native AIO here")
    path = tmp_path / "blocks.dat"
    data = np.arange(64 * BB, dtype=np.uint32).astype(np.uint8).reshape(64, BB)
    data[:, 0] = np.arange(1, 65)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    yield fd, data
    os.close(fd)


def landing(n: int) -> tuple[torch.Tensor, np.ndarray]:
    rows = host_buffer(n * BB, pinned=False).view(n, BB)
    rows.zero_()
    addresses = rows.data_ptr() + np.arange(n, dtype=np.uint64) * BB
    return rows, addresses


def test_a_batch_of_random_slots_lands_whole_and_each_block_is_reported_once(direct_file) -> None:
    fd, data = direct_file
    slots = np.random.default_rng(3).permutation(64)[:40]
    rows, addresses = landing(len(slots))
    seen: list[int] = []
    results = nvme_aio.read_blocks(fd, slots, addresses, BB, seen.extend, depth=7)
    assert (results == BB).all()
    assert sorted(seen) == list(range(len(slots)))
    assert np.array_equal(rows.numpy(), data[slots])


def test_a_block_past_the_end_of_the_file_is_short_and_not_reported(direct_file) -> None:
    fd, data = direct_file
    slots = np.array([5, 64, 70, 6])
    rows, addresses = landing(4)
    seen: list[int] = []
    results = nvme_aio.read_blocks(fd, slots, addresses, BB, seen.extend)
    assert results.tolist() == [BB, 0, 0, BB]
    assert sorted(seen) == [0, 3]
    assert np.array_equal(rows.numpy()[[0, 3]], data[[5, 6]])


def test_a_misaligned_buffer_fails_that_block_or_is_refused_whole(direct_file) -> None:
    fd, data = direct_file
    rows, addresses = landing(3)
    addresses[1] += 8   # O_DIRECT wants aligned buffers
    seen: list[int] = []
    try:
        results = nvme_aio.read_blocks(fd, np.array([1, 2, 3]), addresses, BB, seen.extend)
    except nvme_aio.AioRefused as exc:
        assert exc.errno == errno.EINVAL and not seen   # the kernel took none of it: nothing landed
        return
    assert results[0] == BB and results[1] < 0 and 1 not in seen


def test_a_batch_the_kernel_refuses_raises_before_anything_lands() -> None:
    if not nvme_aio.available():
        pytest.skip("no native AIO here")
    rows, addresses = landing(2)
    with pytest.raises(nvme_aio.AioRefused, match="io_submit of 2 reads"):
        nvme_aio.read_blocks(1 << 20, np.array([0, 1]), addresses, BB, lambda done: None)   # no such fd


def test_an_error_while_blocks_land_reaps_every_read_before_it_propagates(direct_file) -> None:
    fd, data = direct_file
    rows, addresses = landing(48)

    def stop(done: list[int]) -> None:
        raise KeyError("stop")

    with pytest.raises(KeyError):
        nvme_aio.read_blocks(fd, np.arange(48), addresses, BB, stop, depth=48)
    # nothing of that batch is left in this thread's context: a new batch gets only its own completions
    rows, addresses = landing(16)
    seen: list[int] = []
    assert (nvme_aio.read_blocks(fd, np.arange(16, 32), addresses, BB, seen.extend) == BB).all()
    assert sorted(seen) == list(range(16)) and np.array_equal(rows.numpy(), data[16:32])


def test_threads_read_at_once_each_with_its_own_completions(direct_file) -> None:
    fd, data = direct_file
    bad: list[str] = []

    def reader(k: int) -> None:
        slots = np.random.default_rng(k).permutation(64)
        rows, addresses = landing(64)
        for _ in range(5):
            seen: list[int] = []
            nvme_aio.read_blocks(fd, slots, addresses, BB, seen.extend, depth=16)
            if sorted(seen) != list(range(64)) or not np.array_equal(rows.numpy(), data[slots]):
                bad.append(f"reader {k}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


# -- through the store ---------------------------------------------------------
def key(i: int) -> BlockKey:
    return BlockKey.of("aio-block", i)


def stored(tier: NvmeTier, n: int, seed: int, damaged: int, lost_from: int) -> tuple[torch.Tensor, list]:
    """``n`` random blocks written and flushed, block ``damaged`` with one flipped byte, the file cut
    short so that blocks in slots ``lost_from``.. are lost: (the blocks, the (key, slot, block) items)."""
    blocks = torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    items = [(key(i), tier.pool.reserve(), blocks[i]) for i in range(n)]
    tier.write(items)
    for _, slot, _ in items:
        tier.pool.commit(slot)
    tier.flush()
    with open(tier.directory / "slots.dat", "r+b") as f:
        f.seek(items[damaged][1] * BB + 99)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    os.truncate(tier.directory / "slots.dat", lost_from * BB + 100)
    return blocks, items


@pytest.mark.parametrize("aio", ["1", "0"])
def test_the_store_reads_by_aio_or_on_its_workers_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        aio: str) -> None:
    if not o_direct_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    monkeypatch.setenv("TIERKV_NVME_AIO", aio)
    with NvmeTier(tmp_path / "store", BB, 64 * BB, backend="odirect") as tier:
        assert tier._io.native_reads == (aio == "1" and nvme_aio.available())
        blocks, items = stored(tier, 24, seed=1, damaged=7, lost_from=20)
        rows = host_buffer(24 * BB, pinned=False).view(24, BB)
        failed = tier.read([(k, slot, rows[i]) for i, (k, slot, _) in enumerate(items)], aligned=True)
        lost = {k for k, slot, _ in items if slot >= 20} | {items[7][0]}
        assert set(failed) == lost
        for i, (k, _, _) in enumerate(items):
            if k not in lost:
                assert torch.equal(rows[i], blocks[i]), i


@pytest.mark.parametrize("aio", ["1", "0"])
def test_reads_into_a_host_tier_by_address_fail_the_same_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                aio: str) -> None:
    """A load into a host tier hands the store its slots' addresses at once (no request asked of each
    buffer): a damaged block, a lost one and a key the store does not hold fail; the rest land."""
    if not o_direct_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    monkeypatch.setenv("TIERKV_NVME_AIO", aio)
    with NvmeTier(tmp_path / "store", BB, 64 * BB, backend="odirect") as tier:
        blocks, items = stored(tier, 24, seed=2, damaged=3, lost_from=22)
        host = CpuTier(BB, 32 * BB)
        slots = host.pool.reserve_many(25)[::-1]                          # any order of host slots
        asked = [(k, slot) for k, slot, _ in items] + [(key(99), 7)]      # a key the store never held
        failed = tier.read([(k, s, view) for (k, s), view in zip(asked, host.buffers(slots))], aligned=True,
                           addresses=host.addresses(slots))
        lost = {k for k, slot, _ in items if slot >= 22} | {key(3), key(99)}
        assert set(failed) == lost and len(failed) == len(lost)
        for i, (k, _, _) in enumerate(items):
            if k not in lost:
                assert torch.equal(host.view(slots[i]), blocks[i]), i


def one_block_store(tmp_path: Path) -> tuple[NvmeTier, int, torch.Tensor]:
    """An O_DIRECT store holding one block (skipped where there is no O_DIRECT or no native AIO)."""
    if not o_direct_supported(tmp_path) or not nvme_aio.available():
        pytest.skip("no O_DIRECT or no native AIO here")
    tier = NvmeTier(tmp_path / "store", BB, 8 * BB, backend="odirect")
    block = host_buffer(BB, pinned=False).fill_(7)
    slot = tier.pool.reserve()
    tier.write([(key(0), slot, block)])
    tier.pool.commit(slot)
    return tier, slot, block


def test_a_refused_read_falls_back_to_the_workers_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, slot, block = one_block_store(tmp_path)
    with tier:

        def refuse(*args, **kw):
            raise nvme_aio.AioRefused(errno.ENOSYS, "io_submit: refused")

        monkeypatch.setattr(nvme_aio, "read_blocks", refuse)
        out = host_buffer(BB, pinned=False)
        assert tier.read([(key(0), slot, out)], aligned=True) == []
        assert torch.equal(out, block) and not tier._io.native_reads


def test_a_read_refused_for_want_of_room_pauses_native_reads_a_while_only(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGAIN with nothing in flight: the system's AIO requests are used up by others for now; the store
    reads on its workers for a while, then natively again (it switched native reads off for good)."""
    from tierkv.tiers import nvme_striped
    tier, slot, block = one_block_store(tmp_path)
    with tier:
        real, calls = nvme_aio.read_blocks, []

        def busy_once(*args, **kw):
            calls.append(1)
            if len(calls) == 1:
                raise nvme_aio.AioRefused(errno.EAGAIN, "io_submit: resource temporarily unavailable")
            return real(*args, **kw)
        now = [100.0]                                        # the store's clock, moved by hand
        monkeypatch.setattr(nvme_aio, "read_blocks", busy_once)
        monkeypatch.setattr(nvme_striped, "time", SimpleNamespace(monotonic=lambda: now[0]))
        for _ in range(2):                                   # refused, then paused: both read by the workers
            out = host_buffer(BB, pinned=False)
            assert tier.read([(key(0), slot, out)], aligned=True) == [] and torch.equal(out, block)
            now[0] += nvme_striped.NATIVE_PAUSE_S / 2
        assert len(calls) == 1 and tier._io.native_reads
        now[0] += nvme_striped.NATIVE_PAUSE_S / 2
        out = host_buffer(BB, pinned=False)
        assert tier.read([(key(0), slot, out)], aligned=True) == [] and torch.equal(out, block)
        assert len(calls) == 2                               # native again


def test_the_aio_knob_takes_on_and_off_only() -> None:
    assert IOKnobs.from_env({"TIERKV_NVME_AIO": "0"}).nvme_aio is False
    assert IOKnobs.from_env({}).nvme_aio is True
    with pytest.raises(ConfigError, match="TIERKV_NVME_AIO='maybe'.*allowed: 1"):
        IOKnobs.from_env({"TIERKV_NVME_AIO": "maybe"})


def test_a_read_refused_halfway_reads_the_rest_on_the_workers_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not o_direct_supported(tmp_path) or not nvme_aio.available():
        pytest.skip("no O_DIRECT or no native AIO here")
    from tierkv.tiers import nvme_striped
    monkeypatch.setitem(nvme_striped.NATIVE_DEPTH, nvme_striped.URGENT, 4)   # waves of 4 requests
    real_call, submits = nvme_aio._call, []

    def second_submit_refused(number, *args):
        if number == nvme_aio._numbers[3]:
            submits.append(1)
            if len(submits) == 2:
                return -errno.ENOSYS
        return real_call(number, *args)

    with NvmeTier(tmp_path / "store", BB, 32 * BB, backend="odirect") as tier:
        blocks = torch.randint(0, 256, (12, BB), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
        items = [(key(i), tier.pool.reserve(), host_buffer(BB, pinned=False).copy_(blocks[i])) for i in range(12)]
        tier.write(items)
        for _, slot, _ in items:
            tier.pool.commit(slot)
        monkeypatch.setattr(nvme_aio, "_call", second_submit_refused)
        rows = host_buffer(12 * BB, pinned=False).view(12, BB)
        assert tier.read([(k, slot, rows[i]) for i, (k, slot, _) in enumerate(items)], aligned=True) == []
        assert torch.equal(rows, blocks) and len(submits) == 2 and not tier._io.native_reads


@pytest.mark.parametrize("where", ["submit", "reap"])
def test_a_batch_interrupted_between_a_call_and_its_count_leaves_nothing_in_flight(direct_file, monkeypatch,
                                                                                   where: str) -> None:
    """An interrupt right after ``io_submit`` or ``io_getevents`` returns, before the batch counts what
    it did: the thread's context goes with every request it held, so no read lands after the batch
    raised and the thread's next batch takes only its own completions (a stale one would pass a block
    past the end of the file for whole)."""
    fd, data = direct_file
    number = nvme_aio._numbers[3 if where == "submit" else 2]
    real = nvme_aio._call

    def interrupted(n, *args):
        got = real(n, *args)
        if n == number and got > 0:
            monkeypatch.setattr(nvme_aio, "_call", real)
            raise KeyboardInterrupt
        return got
    rows, addresses = landing(2)
    monkeypatch.setattr(nvme_aio, "_call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        nvme_aio.read_blocks(fd, np.arange(2), addresses, BB, lambda done: None)
    rows, addresses = landing(2)
    seen: list[int] = []
    results = nvme_aio.read_blocks(fd, np.array([3, 99]), addresses, BB, seen.extend)   # slot 99: past the end
    assert results[0] == BB and results[1] != BB and seen == [0]
    assert np.array_equal(rows[0].numpy(), data[3])


@pytest.mark.parametrize("aio", ["1", "0"])
def test_a_read_the_device_fails_raises_and_keeps_the_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           aio: str) -> None:
    """An I/O error is not a damaged block: the read raises `StoreReadError` and the store keeps the block,
    whole when read again (a failed checksum drops it; a passing fault must not)."""
    if not o_direct_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    monkeypatch.setenv("TIERKV_NVME_AIO", aio)
    with NvmeTier(tmp_path / "store", BB, 64 * BB, backend="odirect") as tier:
        blocks, items = stored(tier, 8, seed=4, damaged=0, lost_from=64)
        if tier._io.native_reads:
            real = nvme_aio._reap

            def failing(handle, events, outstanding):       # one completion comes back EIO, once
                got = real(handle, events, outstanding)
                monkeypatch.setattr(nvme_aio, "_reap", real)
                events["res"][0] = -errno.EIO
                return got
            monkeypatch.setattr(nvme_aio, "_reap", failing)
        else:
            file, real = tier._io.file, tier._io.file.preadv

            def failing(iov, offset):
                monkeypatch.setattr(file, "preadv", real)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            monkeypatch.setattr(file, "preadv", failing)
        rows = host_buffer(8 * BB, pinned=False).view(8, BB)
        asked = [(k, slot, rows[i]) for i, (k, slot, _) in enumerate(items)]
        with pytest.raises(StoreReadError, match="I/O error; the blocks are kept"):
            tier.read(asked, aligned=True)
        assert all(tier.lookup(k) == slot for k, slot, _ in items)
        assert tier.read(asked, aligned=True) == [items[0][0]]           # only the damaged block fails
        assert all(torch.equal(rows[i], blocks[i]) for i in range(1, 8))


def test_a_copy_dropped_by_its_slot_leaves_a_copy_of_the_key_written_elsewhere(tmp_path: Path) -> None:
    """A reader that found a key's block gone from the slot it knew (another process wrote the key again
    elsewhere) forgets its own copy only: the store's copy in the other slot stays."""
    with NvmeTier(tmp_path / "store", BB, 8 * BB) as tier:
        block = host_buffer(BB, pinned=False).fill_(5)
        slot = tier.pool.reserve()
        tier.write([(key(0), slot, block)])
        tier.pool.commit(slot)
        tier.drop(key(0), slot + 1)
        assert tier.lookup(key(0)) == slot
        tier.drop(key(0), slot)
        assert tier.lookup(key(0)) is None
