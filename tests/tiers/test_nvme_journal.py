"""The NVMe journal on its own: record layout, replay rules, append failure, rewrite."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from tierkv.keys import BlockKey
from tierkv.tiers import journal
from tierkv.tiers.journal import RECORD_BYTES, Journal, Op, Record, replay


def k(i: int) -> BlockKey:
    return BlockKey.of("journal", i)


def put(i: int, slot: int, checksum: int = 7) -> bytes:
    return Record(Op.PUT, k(i), slot, checksum).encode()


def drop(i: int) -> bytes:
    return Record(Op.DROP, k(i)).encode()


def test_record_is_48_bytes_with_magic_and_crc() -> None:
    raw = put(1, 3)
    assert len(raw) == RECORD_BYTES == 48
    assert raw[:4] == b"TKVJ" and raw[4] == Op.PUT
    assert raw[16:32] == k(1).digest


def test_replay_applies_puts_and_drops_in_order() -> None:
    state, end = replay(put(0, 0, 11) + put(1, 1) + drop(0) + put(2, 0, 22))
    assert end == 4 * RECORD_BYTES
    assert sorted((key.digest, e.slot, e.checksum) for key, e in state.index.items()) == sorted(
        [(k(1).digest, 1, 7), (k(2).digest, 0, 22)])
    assert state.garbage == 2 and state.damaged == 0


def test_a_later_put_for_a_slot_evicts_the_key_that_held_it() -> None:
    state, _ = replay(put(0, 5) + put(1, 5))
    assert state.index.get(k(0)) is None
    assert state.index.get(k(1)).slot == 5
    assert state.index.slots() == [5]


def test_damaged_middle_record_is_skipped_and_a_bad_tail_is_cut() -> None:
    bad = bytearray(put(1, 1))
    bad[10] ^= 1
    raw = put(0, 0) + bytes(bad) + put(2, 2) + b"\x01" * RECORD_BYTES + put(3, 3)[:20]
    state, end = replay(raw)
    assert end == 3 * RECORD_BYTES
    assert (state.records, state.damaged, state.cut_bytes) == (2, 1, RECORD_BYTES + 20)
    assert state.index.get(k(1)) is None and state.index.get(k(2)).slot == 2


def test_digest_with_trailing_zero_bytes_survives_replay() -> None:
    key = BlockKey(b"\x07" * 8 + b"\x00" * 8)
    state, _ = replay(Record(Op.PUT, key, 4, 9).encode())
    assert state.index.get(key).slot == 4


def test_failed_append_leaves_a_valid_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "index.log"
    log = Journal(path)
    log.append([Record(Op.PUT, k(0), 0, 1)])
    real = os.pwrite

    def torn(fd: int, data: bytes, offset: int) -> int:
        if len(data) == 3 * RECORD_BYTES:
            return real(fd, data[:RECORD_BYTES + 7], offset)
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(journal.os, "pwrite", torn)
    with pytest.raises(OSError, match="injected"):
        log.append([Record(Op.PUT, k(i), i, 1) for i in range(1, 4)])
    monkeypatch.undo()
    assert path.stat().st_size == RECORD_BYTES == log.size
    log.close()
    assert [key for key, _ in Journal(path).state.index.items()] == [k(0)]


def test_rewrite_keeps_live_entries_only_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "index.log"
    log = Journal(path)
    log.append(Record(Op.PUT, k(i), i, i) for i in range(10))
    log.append(Record(Op.DROP, k(i)) for i in range(8))
    state, _ = replay(path.read_bytes())
    log.rewrite(state.index)
    log.append([Record(Op.PUT, k(20), 20, 0)])
    log.close()
    assert path.stat().st_size == 3 * RECORD_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(e.slot for _, e in replay(path.read_bytes())[0].index.items()) == [8, 9, 20]
    assert not (tmp_path / "index.log.compact").exists()


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 130])
def test_encode_puts_is_the_bytes_of_each_record(n: int) -> None:
    keys, slots, sums = [k(i) for i in range(n)], [3 * i for i in range(n)], [2**64 - 1 - i for i in range(n)]
    packed = journal.encode_puts([key.digest for key in keys], slots, sums)
    assert packed == b"".join(Record(Op.PUT, key, s, c).encode() for key, s, c in zip(keys, slots, sums))


def test_append_encoded_takes_whole_records_only(tmp_path: Path) -> None:
    log = Journal(tmp_path / "index.log")
    log.append_encoded(journal.encode_puts([k(1).digest, k(2).digest], [1, 2], [11, 22]))
    with pytest.raises(ValueError, match="not whole 48-byte records"):
        log.append_encoded(put(3, 3)[:-1])
    log.close()
    state = Journal(tmp_path / "index.log").state
    assert sorted((e.slot, e.checksum) for _, e in state.index.items()) == [(1, 11), (2, 22)]


def drop_at(i: int, slot: int) -> bytes:
    return Record(Op.DROP_AT, k(i), slot).encode()


def test_drop_at_drops_the_key_only_from_that_slot() -> None:
    state, _ = replay(put(0, 5) + drop_at(0, 4))
    assert state.index.get(k(0)).slot == 5
    state, _ = replay(put(0, 5) + drop_at(0, 5) + put(1, 5) + drop_at(0, 5))
    assert state.index.get(k(0)) is None and state.index.get(k(1)).slot == 5


def test_tail_returns_what_any_opener_appended_since_the_last_look(tmp_path: Path) -> None:
    path = tmp_path / "index.log"
    first = Journal(path)
    first.append([Record(Op.PUT, k(0), 0, 1)])
    second = Journal(path, repair=False)   # opened beside the first: sees its record by replay
    assert [key for key, _ in second.state.index.items()] == [k(0)]
    assert second.tail() == []
    first.append([Record(Op.PUT, k(1), 1, 2), Record(Op.DROP_AT, k(0), 0)])
    second.append([Record(Op.PUT, k(2), 2, 3)])   # at the real end, after the first's records
    assert [(op, digest, slot) for op, digest, slot, _ in second.tail()] == [
        (Op.PUT, k(1).digest, 1), (Op.DROP_AT, k(0).digest, 0), (Op.PUT, k(2).digest, 2)]
    assert [digest for _, digest, _, _ in first.tail()] == [k(i).digest for i in (0, 1, 0, 2)]  # its own too
    first.close(), second.close()
    assert sorted(e.slot for _, e in Journal(path).state.index.items()) == [1, 2]


def test_an_append_cuts_a_record_torn_by_a_writer_that_died(tmp_path: Path) -> None:
    path = tmp_path / "index.log"
    log = Journal(path, repair=False)
    log.append([Record(Op.PUT, k(0), 0, 1)])
    with open(path, "ab") as f:   # another process killed mid-append
        f.write(put(9, 9)[:RECORD_BYTES // 3])
    assert [digest for _, digest, _, _ in log.tail()] == [k(0).digest]   # not the half record
    log.append([Record(Op.PUT, k(1), 1, 1)])
    assert path.stat().st_size == 2 * RECORD_BYTES == log.size
    assert [digest for _, digest, _, _ in log.tail()] == [k(1).digest]
    log.close()
    state = Journal(path).state
    assert (state.damaged, state.cut_bytes, len(state.index)) == (0, 0, 2)


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_replay_equals_applying_records_one_by_one(seed: int) -> None:
    """`replay` finds the live PUTs in array passes; applying every record in order must agree, for
    journals where keys move, slots are rewritten and DROP / DROP_AT records hit and miss."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(3000):
        op = rng.choice([Op.PUT, Op.PUT, Op.PUT, Op.DROP, Op.DROP_AT])
        key, slot = k(int(rng.integers(200))), int(rng.integers(120))
        records.append(Record(op, key, 0 if op == Op.DROP else slot, int(rng.integers(1 << 63)) if op == Op.PUT else 0))
    raw = b"".join(r.encode() for r in records)
    live: dict[int, tuple[int, bytes, int]] = {}    # slot -> (record number, digest, checksum), one by one
    for n, r in enumerate(records):
        if r.op == Op.PUT:
            live[r.slot] = (n, r.key.digest, r.checksum)
        elif r.op == Op.DROP:
            live = {slot: v for slot, v in live.items() if v[1] != r.key.digest}
        elif live.get(r.slot, (0, None))[1] == r.key.digest:
            del live[r.slot]

    def index_and_extra(below: int) -> tuple[list, list]:
        """Each key's newest live copy in a slot under ``below``, and its other live copies there."""
        newest: dict[bytes, tuple[int, int, int]] = {}
        for slot, (n, digest, checksum) in sorted(live.items(), key=lambda item: item[1][0]):
            if slot < below:
                newest[digest] = (n, slot, checksum)
        return (sorted((digest, slot, checksum) for digest, (_, slot, checksum) in newest.items()),
                sorted((digest, slot, checksum) for slot, (n, digest, checksum) in live.items()
                       if slot < below and newest[digest][0] != n))

    expected, older = index_and_extra(1 << 30)
    assert older, "the journal should hold keys live in several slots"
    state, _ = replay(raw)
    assert sorted((key.digest, e.slot, e.checksum) for key, e in state.index.items()) == expected
    assert sorted(state.extra) == older
    limited, _ = replay(raw, slots=60)   # entries at or past slot 60 are lost, the rest kept
    expected_below, older_below = index_and_extra(60)
    assert sorted((key.digest, e.slot, e.checksum) for key, e in limited.index.items()) == expected_below
    assert sorted(limited.extra) == older_below
    assert sorted((key.digest, slot) for key, slot in limited.lost) == \
        sorted((digest, slot) for slot, (_, digest, _) in live.items() if slot >= 60)
    slots, sums = state.index.find_many([BlockKey(digest) for digest, _, _ in expected] + [k(999)])
    assert slots.tolist() == [slot for _, slot, _ in expected] + [-1]
    assert sums[:-1].tolist() == [checksum for _, _, checksum in expected]


def test_index_takes_a_million_blocks_in_arrays() -> None:
    """The store's index of a 1M-token document (a million pages): tens of bytes a block, not hundreds."""
    n = 1_000_000
    digests = np.random.default_rng(0).integers(0, 1 << 63, (n, 2), dtype=np.uint64)
    index = journal.Index()
    index.load(digests, np.arange(n), np.arange(n, dtype=np.uint64))
    assert len(index) == n and index.nbytes() / n < 48
    probe = [digests[i].tobytes() for i in (0, 1234, n - 1)]
    assert index.find_many(probe)[0].tolist() == [0, 1234, n - 1]
    assert index.get(probe[1]).checksum == 1234
