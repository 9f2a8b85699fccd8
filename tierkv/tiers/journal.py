"""The NVMe store's journal: which key lives in which slot, with its checksum.

``index.log`` is an append-only sequence of fixed-size binary records; there
is no header, so a file of ``n`` whole records is always ``48 * n`` bytes::

    offset  0      4    5      8         16                32         40      44     48
            +------+----+------+---------+-----------------+----------+-------+------+
            |magic |op  | pad  | slot    | key (16 bytes)  | checksum | pad   | crc  |
            |"TKVJ"|u8  | 0x00 | u64 LE  | BlockKey.digest | u64 LE   | 0x00  | u32  |
            +------+----+------+---------+-----------------+----------+-------+------+
    op: 1 = PUT (key now lives in slot, its bytes hash to checksum: xxh3_64)
        2 = DROP (key is gone wherever it lives; slot and checksum are 0): written
            by stores that only one process opened, still replayed
        3 = DROP_AT (key is gone from slot, if it lives there; checksum is 0)
    crc: zlib.crc32 of bytes 0..43

Replay applies records in order; the last PUT for a slot owns it, so a key
whose slot was taken over by a later PUT disappears even if its DROP record
was lost. Processes sharing a store may each write the same block: every copy
stays live until its own slot is rewritten or a DROP_AT names it, and the
index shows the newest (`Replay.extra` lists the others). A record whose
magic, op or CRC is wrong is skipped; everything after the last good record
(a torn append, garbage) is cut off by an opener
alone with the store, so appends continue a valid prefix. Skipping a damaged record is safe because a
read also checks the block's checksum: a resurrected or stale entry can make
a block fail, never serve wrong bytes.

Appends are batched (one ``pwrite`` per batch; a batch of PUTs is packed by
one struct call per 64 records, see `encode_puts`) and never fsync'd here; a
failed append is truncated away, so the file is always a valid prefix.

Several processes share one journal (see tierkv.tiers.nvme_share)::

    append    flock LOCK_EX on index.log; cut a partial record a process killed
              mid-append left at the end; pwrite at the real end; unlock
    tail      flock LOCK_SH; read the whole records appended since the last look
    repair    cut a torn tail, compact (`rewrite`): only an opener alone with the store

Every record lands on the 48-byte grid, so a record torn by a dead writer is
cut before anything follows it, and whole records that fail their checks stay
skipped wherever they are. A process journals only the slots it owns: a PUT
when it writes one, a DROP_AT when it drops the block in it.
"""
from __future__ import annotations

import enum
import fcntl
import functools
import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierkv.failpoints import due, failpoint, kill
from tierkv.keys import KEY_BYTES, BlockKey
from tierkv.tiers.block_index import Index
from tierkv.tiers.nvme_io import flocked, fsync_dir, open_private

log = logging.getLogger(__name__)

MAGIC = b"TKVJ"
_BODY = struct.Struct(f"<4sB3xQ{KEY_BYTES}sQ4x")
_CRC = struct.Struct("<I")
RECORD_BYTES = _BODY.size + _CRC.size  # 48
_PACK_RECORDS = 64  # records per struct call in encode_puts
_KEY_AT = 16
_LAYOUT = np.dtype({"names": ["magic", "op", "slot", "checksum", "crc"],
                    "formats": ["S4", "u1", "<u8", "<u8", "<u4"],
                    "offsets": [0, 4, 8, _KEY_AT + KEY_BYTES, _BODY.size], "itemsize": RECORD_BYTES})


class Op(enum.IntEnum):
    PUT = 1
    DROP = 2
    DROP_AT = 3


Row = tuple[int, bytes, int, int]   # a good record: op, key digest, slot, checksum


@dataclass(frozen=True, slots=True)
class Record:
    op: Op
    key: BlockKey
    slot: int = 0
    checksum: int = 0

    def encode(self) -> bytes:
        body = _BODY.pack(MAGIC, self.op, self.slot, self.key.digest, self.checksum)
        return body + _CRC.pack(zlib.crc32(body))


def encode_puts(digests: Sequence[bytes], slots: Sequence[int], checksums: Sequence[int]) -> bytes:
    """PUT records for a batch, the same bytes as `Record.encode` of each, packed in bulk."""
    out = bytearray()
    for lo in range(0, len(slots), _PACK_RECORDS):
        fields: list[object] = []
        for digest, slot, checksum in zip(digests[lo:lo + _PACK_RECORDS], slots[lo:lo + _PACK_RECORDS],
                                          checksums[lo:lo + _PACK_RECORDS]):
            fields += (MAGIC, Op.PUT, slot, digest, checksum)
        out += _records_struct(len(fields) // 5).pack(*fields)
    view = memoryview(out)
    for at in range(0, len(out), RECORD_BYTES):
        _CRC.pack_into(out, at + _BODY.size, zlib.crc32(view[at:at + _BODY.size]))
    view.release()
    return bytes(out)


@functools.cache  # at most _PACK_RECORDS entries
def _records_struct(n: int) -> struct.Struct:
    """``n`` records back to back, their CRCs left zero."""
    return struct.Struct("<" + n * f"4sB3xQ{KEY_BYTES}sQ4x{_CRC.size}x")


@dataclass(slots=True)
class Replay:
    """What a journal says after replay: the live entries and how it got there."""

    index: Index = field(default_factory=Index)
    records: int = 0       # good records read
    damaged: int = 0       # records skipped in the middle
    cut_bytes: int = 0     # bytes cut off the tail
    lost: list[tuple[BlockKey, int]] = field(default_factory=list)   # live entries at or past ``slots``
    extra: list[tuple[bytes, int, int]] = field(default_factory=list)   # older live copies of indexed keys:
                                                                        # (digest, slot, checksum)

    @property
    def garbage(self) -> int:
        """Records a compaction would remove."""
        return self.records + self.damaged - len(self.index)


def replay_store(directory: Path, block_bytes: int) -> Replay:
    """The journal of the store in ``directory`` replayed, read only, against its data file's slots of
    ``block_bytes`` (either file may be missing: a store that holds nothing)."""
    journal, data = directory / "index.log", directory / "slots.dat"
    raw = journal.read_bytes() if journal.exists() else b""
    return replay(raw, slots=(data.stat().st_size if data.exists() else 0) // block_bytes)[0]


def replay(raw: bytes, slots: int | None = None) -> tuple[Replay, int]:
    """Apply the records in ``raw``; returns the state and the length of the valid prefix. Entries
    in slots at or past ``slots`` (the data file's end, the budget) are left out, listed in ``lost``.

    Vectorised: a PUT of key k into slot s is live at the end exactly when no later record PUTs
    into s, DROPs k, or DROP_ATs k from s. Where several PUTs of k are live (processes sharing the
    store each wrote it), the index holds the newest and ``extra`` the others.
    """
    good, _ = check(raw)
    valid = int(good[-1]) + 1 if len(good) else 0
    state = Replay(records=len(good), damaged=valid - len(good), cut_bytes=len(raw) - valid * RECORD_BYTES)
    whole = len(raw) // RECORD_BYTES
    table = np.frombuffer(raw, _LAYOUT, count=whole)[good]
    halves = np.frombuffer(raw, "<u8", count=whole * RECORD_BYTES // 8).reshape(whole, RECORD_BYTES // 8)[good][:, 2:4]
    live = _live_puts(table["op"], table["slot"], halves)
    live_slots = table["slot"][live]
    kept = live if slots is None else live[live_slots < slots]
    if slots is not None and len(kept) < len(live):
        gone = live[live_slots >= slots]
        state.lost = list(zip(BlockKey.many(np.ascontiguousarray(halves[gone]).tobytes()),
                              table["slot"][gone].tolist()))
    newest = _newest_per_key(halves[kept])
    older = kept[~newest]
    if len(older):
        state.extra = list(zip([k.digest for k in BlockKey.many(np.ascontiguousarray(halves[older]).tobytes())],
                               table["slot"][older].tolist(), table["checksum"][older].tolist()))
    kept = kept[newest]
    state.index.load(halves[kept], table["slot"][kept].astype(np.int64), table["checksum"][kept])
    return state, valid * RECORD_BYTES


def _newest_per_key(halves: np.ndarray) -> np.ndarray:
    """Whether each row (in record order) is the last of its key."""
    if not len(halves):
        return np.zeros(0, bool)
    position = np.arange(len(halves))
    return position == _last(_groups(halves[:, 0], halves[:, 1]), np.ones(len(halves), bool))



def _live_puts(ops: np.ndarray, slots: np.ndarray, halves: np.ndarray) -> np.ndarray:
    """The positions of the PUT records no later record undoes (see `replay`)."""
    if not len(ops):
        return np.empty(0, np.int64)
    key = _groups(halves[:, 0], halves[:, 1])
    put, drop, drop_at = ops == Op.PUT, ops == Op.DROP, ops == Op.DROP_AT
    position = np.arange(len(ops))
    live = put & (position == _last(_groups(slots), put))
    if drop.any():      # a later DROP of the key, wherever it lives
        live &= position > _last(key, drop)
    if drop_at.any():   # a later DROP_AT of the same key from the same slot
        live &= position > _last(_groups(key, slots), drop_at)
    return np.flatnonzero(live)


def _groups(*columns: np.ndarray) -> np.ndarray:
    """A dense group number per row, equal for rows equal in every column."""
    order = np.lexsort(columns)
    change = np.zeros(len(order), bool)
    for column in columns:
        ordered = column[order]
        change[1:] |= ordered[1:] != ordered[:-1]
    group = np.empty(len(order), np.int64)
    group[order] = np.cumsum(change)
    return group


def _last(group: np.ndarray, among: np.ndarray) -> np.ndarray:
    """For each row, the position of the last row of ``among`` in its ``group`` (-1 if none)."""
    last = np.full(int(group.max()) + 1, -1, np.int64)
    where = np.flatnonzero(among)
    np.maximum.at(last, group[where], where)
    return last[group]


def check(raw: bytes) -> tuple[np.ndarray, int]:
    """The positions of the good records among the whole ones in ``raw``, and how many whole ones
    there are. All are checked at once (numpy over the fixed layout)."""
    n = len(raw) // RECORD_BYTES
    table = np.frombuffer(raw, _LAYOUT, count=n) if n else np.empty(0, _LAYOUT)
    view = memoryview(raw)
    crcs = np.fromiter((zlib.crc32(view[i:i + _BODY.size]) for i in range(0, n * RECORD_BYTES, RECORD_BYTES)),
                       np.uint32, count=n)
    ok = (table["crc"] == crcs) & (table["magic"] == MAGIC) & np.isin(table["op"], list(Op))
    return np.flatnonzero(ok), n


def rows(raw: bytes, good: np.ndarray) -> Iterator[Row]:
    """The records at positions ``good`` of ``raw``, in order."""
    table = np.frombuffer(raw, _LAYOUT, count=len(raw) // RECORD_BYTES)[good]
    for i, op, slot, checksum in zip(good.tolist(), table["op"].tolist(), table["slot"].tolist(),
                                     table["checksum"].tolist()):
        yield op, raw[i * RECORD_BYTES + _KEY_AT:i * RECORD_BYTES + _KEY_AT + KEY_BYTES], slot, checksum


class Journal:
    """``index.log``: replay on open, batched appends at the real end, `tail`, compaction by rewrite.

    ``repair``: the opener has the store to itself, so it may cut a torn tail here and `rewrite`
    later; a process that shares the store leaves both to such an opener.
    """

    def __init__(self, path: Path, *, repair: bool = True, slots: int | None = None) -> None:
        """``slots``: entries at or past it are left out of the index (`replay`)."""
        self.path = path
        self._what = f"NVMe store {path.parent}"
        self._fd = open_private(path)
        with flocked(self._fd, fcntl.LOCK_EX if repair else fcntl.LOCK_SH, self._what):
            raw = _read(self._fd, 0, os.fstat(self._fd).st_size)
            self.state, valid = replay(raw, slots)
            if repair and self.state.cut_bytes:
                log.warning("%s: cut %d bytes of torn or damaged tail", path, self.state.cut_bytes)
                os.ftruncate(self._fd, valid)
                os.fsync(self._fd)
        self._seen = valid if repair else len(raw) // RECORD_BYTES * RECORD_BYTES
        self._end = self._seen
        if self.state.damaged:
            log.warning("%s: skipped %d damaged record(s)", path, self.state.damaged)

    @property
    def size(self) -> int:
        """The end of the file as this process last saw it (replay, its own appends)."""
        return self._end

    def append(self, records: Iterable[Record]) -> None:
        """Append in one write; on failure the file is truncated back and the error raised."""
        self._append(b"".join(r.encode() for r in records))

    def append_encoded(self, data: bytes) -> None:
        """`append` of records already encoded (`encode_puts`), likewise all or nothing."""
        if len(data) % RECORD_BYTES:
            raise ValueError(f"{len(data)} bytes: not whole {RECORD_BYTES}-byte records")
        self._append(data)

    def tail(self) -> list[Row]:
        """The good records appended (by any process, this one too) since the last `tail` or open.

        One fstat when nothing is new; the read happens under a shared flock, so it never sees
        half of an append."""
        if os.fstat(self._fd).st_size < self._seen + RECORD_BYTES:
            return []
        with flocked(self._fd, fcntl.LOCK_SH, self._what):
            end = os.fstat(self._fd).st_size // RECORD_BYTES * RECORD_BYTES
            raw = _read(self._fd, self._seen, end)
        self._seen = end
        good, _ = check(raw)
        return list(rows(raw, good))

    def rewrite(self, index: Index) -> None:
        """Replace the file with one PUT per live entry (write new, fsync, rename). Only for an
        opener alone with the store: another process would go on appending to the old file."""
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = open_private(tmp, os.O_TRUNC)
        try:
            data = encode_puts(*index.records())
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        os.close(self._fd)
        self._fd, self._seen, self._end = fd, len(data), len(data)

    def fsync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _append(self, data: bytes) -> None:
        with flocked(self._fd, fcntl.LOCK_EX, self._what):
            end = self._whole_end()
            written = 0
            if due("journal.mid-record"):           # a crash test: die with half the records written
                os.pwrite(self._fd, data[:len(data) // 2 + RECORD_BYTES // 2], end)
                kill()
            try:
                while written < len(data):
                    written += os.pwrite(self._fd, data[written:], end + written)
            except BaseException:
                os.ftruncate(self._fd, end)
                raise
        failpoint("journal.after-record")
        self._end = end + len(data)

    def _whole_end(self) -> int:
        """The real end of the file (another process may have appended), on the record grid: the
        bytes of a record torn by a process killed mid-append are cut (caller holds LOCK_EX)."""
        size = os.fstat(self._fd).st_size
        torn = size % RECORD_BYTES
        if torn:
            log.warning("%s: cut %d bytes of a record torn by a writer that died", self.path, torn)
            os.ftruncate(self._fd, size - torn)
        return size - torn


def _read(fd: int, start: int, end: int) -> bytes:
    chunks, offset = [], start
    while offset < end:
        chunk = os.pread(fd, end - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
