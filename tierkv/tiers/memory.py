"""An arena of fixed-size slots in memory: what the gpu, cpu and cxl tiers share.

The arena grows in extents as slots are first used and never beyond the
budget, so a large budget costs nothing until blocks arrive::

    slot:    0 1 2 3 | 4 5 6 7 | 8 9 .      (extent_slots = 4)
    extent:  [  0    ] [  1    ] [ 2 ...
    view(s) = extents[s // extent_slots][s % extent_slots]     (an extent is [slots, block_bytes])

Host extents start on a 4096-byte boundary so the NVMe tier can read and
write them with O_DIRECT without a bounce buffer. Plain host extents are large
(`EXTENT_BYTES`): the OS commits their pages only as they are first written, and
a caller that reads blocks in place (`locate_many`) then finds a read's blocks in
one or two of them. Pinned and device memory is committed when allocated, so its
extents stay small (`PINNED_EXTENT_BYTES`).

Plain host tiers of one manager may share one `HostSpace`: one mapping of memory in which each
tier owns a range of rows, so blocks spread over several such tiers are rows of one tensor, and a
reader takes the rows it wants of all of them with one index and copies no block whole::

    space:   | zeros | gpu tier's slots 0..n-1 | cpu tier's slots 0..m-1 |      (rows of block_bytes)
    row of (tier, slot) = tier.space_first + slot                              (`MemoryTier.space_rows`)

Row 0 (`ZERO_ROW`) is no tier's: never written, it reads as zeros, what a reader takes for a block
still loading.

`gather` and `scatter` move many slots to or from one contiguous tensor,
adjacent slots of one extent as one copy (a run; runs stop at extent edges)::

    slots  [5, 6, 7, 2, 3]   ->  runs  (pos 0, slot 5, 3 blocks) (pos 3, slot 2, 2 blocks)
    out    | b5 b6 b7 | b2 b3 |      two memmoves

Host to host each run is one ``memmove``, not a torch copy: torch splits even
a 256 KiB copy over its intra-op threads and waits for the slowest, which on
a loaded machine costs several times the copy. A batch of at least
`SPLIT_BYTES` shares its runs out to ``torch.get_num_threads()`` threads
(the caller and lazily started helpers) as each comes free, so a helper the
scheduler holds back delays one run, not half the batch.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat

import numpy as np
import torch

from tierkv.device import ALIGN, has_cuda, host_buffer
from tierkv.errors import ConfigError
from tierkv.tiers.base import Medium
from tierkv.tiers.pool import BlockPool

EXTENT_BYTES = 1024**3             # plain host memory: committed as it is written
PINNED_EXTENT_BYTES = 64 * 1024**2  # pinned host and device memory: committed when allocated
SPLIT_BYTES = 4 * 1024**2  # host gathers/scatters this big also run on torch's other intra-op threads
INDEXED_BYTES = 64 * 1024  # host copies of blocks this small go by numpy indexing, not a memmove each
MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0   # (mmap's own constant: Python 3.12 on)
ZERO_ROW = 0      # a HostSpace's row that no tier claims: zeros


class HostSpace:
    """Rows of ``block_bytes`` of plain host memory that several host tiers share, each claiming a range
    of them when it is made; mapped on first use, all at once and without reserving swap, so the OS
    commits a page only when it is first written (as with the tiers' own extents)::

        space = HostSpace(block_bytes)
        first = space.claim(slots)        # rows first .. first + slots - 1 are the claimer's
        space.rows()                      # uint8 [rows, block_bytes]: ZERO_ROW, then every claimer's rows
    """

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.claimed = ZERO_ROW + 1       # rows taken: the zero row, then the claims'
        self._rows: torch.Tensor | None = None
        self._lock = threading.Lock()

    def claim(self, slots: int) -> int:
        """Rows for ``slots`` blocks; the first of them. Only before the space is first used."""
        with self._lock:
            if self._rows is not None:
                raise RuntimeError("HostSpace.claim: the space is already mapped; claim every range first")
            first, self.claimed = self.claimed, self.claimed + slots
            return first

    def rows(self) -> torch.Tensor:
        """Every claimed row, uint8 [rows, block_bytes], starting on a page boundary (mapped on first use;
        a ConfigError where the claims are more than the OS will map)."""
        if self._rows is None:
            with self._lock:
                if self._rows is None:
                    nbytes = self.claimed * self.block_bytes
                    try:
                        mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
                    except OSError as e:
                        raise ConfigError(f"the host tiers' memory ({nbytes / 2**30:.1f} GiB, the gpu and cpu "
                                          f"budgets without CUDA) could not be mapped: {e.strerror}; give the "
                                          f"tiers smaller budgets (where the OS commits memory strictly, "
                                          f"vm.overcommit_memory=2, their sum must fit its limit)") from e
                    self._rows = torch.frombuffer(mapped, dtype=torch.uint8).view(self.claimed, self.block_bytes)
        return self._rows


class MemoryTier:
    """Slots of ``block_bytes`` in memory on ``device``, at most ``budget`` bytes of them."""

    def __init__(self, name: str, medium: Medium, device: torch.device, block_bytes: int,
                 budget: int, *, pinned: bool = False, space: HostSpace | None = None) -> None:
        self.name = name
        self.medium = medium
        self.device = device
        self.block_bytes = block_bytes
        self.pinned = pinned
        self.pool = BlockPool(budget // block_bytes, generations=True)   # read unpinned: see `BlockPool`
        plain = device.type == "cpu" and not (pinned and has_cuda())
        if space is not None and (not plain or space.block_bytes != block_bytes):
            raise ValueError(f"tier {name}: a HostSpace holds plain host memory of {space.block_bytes}-byte "
                             f"blocks; this tier is {'plain host' if plain else 'pinned or device'} memory "
                             f"of {block_bytes}-byte blocks")
        # in a space, the tier's slots are one range of its rows (one extent); rows of host tiers
        # sharing it are read in place together (`space_rows`)
        self.space, self.space_first = space, None if space is None else space.claim(self.pool.capacity)
        extent_bytes = EXTENT_BYTES if plain else PINNED_EXTENT_BYTES
        slots = self.pool.capacity if space else min(self.pool.capacity, extent_bytes // block_bytes)
        self.extent_slots = max(1, slots)
        self._extents: list[torch.Tensor] = []  # each [slots, block_bytes] uint8
        self._arrays: list[np.ndarray] = []     # host tiers: the same extents as numpy arrays
        self._grow_lock = threading.Lock()
        self._copy_pool: ThreadPoolExecutor | None = None  # started by the first big host gather/scatter
        # host extents start on an ALIGN boundary: with whole multiples of it per block, every slot does
        self.aligned_slots = device.type == "cpu" and block_bytes % ALIGN == 0

    @property
    def budget_bytes(self) -> int:
        return self.pool.capacity * self.block_bytes

    @property
    def allocated_bytes(self) -> int:
        return sum(extent.numel() for extent in self._extents)

    def view(self, slot: int) -> torch.Tensor:
        index, offset = self._locate(slot)
        return self._extents[index][offset]

    def buffers(self, slots: Sequence[int]) -> list[np.ndarray] | list[torch.Tensor]:
        """The blocks in ``slots`` as flat uint8 views: numpy arrays on the host (what the NVMe
        tier reads into, at a fraction of a tensor view's cost), tensors on a device."""
        if self.device.type != "cpu":
            return [self.view(slot) for slot in slots]
        arrays, per = self._arrays, self.extent_slots
        if slots and not 0 <= min(slots) <= max(slots) < min(len(arrays) * per, self.pool.capacity):
            for slot in slots:
                self._locate(slot)
        return [arrays[slot // per][slot % per] for slot in slots]

    def locate_many(self, slots: Sequence[int]) -> tuple[torch.Tensor, np.ndarray] | None:
        """Where ``slots`` lie, to be read in place while they are pinned: the one extent
        [slots, block_bytes] holding them all and each one's row in it; None where they span extents."""
        at = np.asarray(slots, dtype=np.int64)
        if not at.size:
            return None
        if at.min() < 0 or at.max() >= self.pool.capacity:
            bad = int(at.min() if at.min() < 0 else at.max())
            raise IndexError(f"slot={bad}: outside 0..{self.pool.capacity - 1} of tier {self.name}")
        extent, offset = np.divmod(at, self.extent_slots)
        if (extent != extent[0]).any():
            return None
        if int(extent[0]) >= len(self._extents):
            self._grow(int(extent[0]))
        return self._extents[int(extent[0])], offset

    def space_rows(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each slot's row of the tier's ``space`` (``HostSpace.rows()``), where it may be read in place
        while it is pinned. A ValueError for a tier in no space."""
        if self.space is None:
            raise ValueError(f"tier {self.name} is in no HostSpace: its slots are not rows of one")
        _, offset = self._locate_many(slots)        # (checked; in a space the tier is one extent)
        return offset + self.space_first

    def gather(self, slots: Sequence[int], out: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Copy the blocks in ``slots``, in that order, into ``out``: contiguous, ``len(slots) * block_bytes``
        bytes; or, given ``rows``, block i into row ``rows[i]`` of ``out`` (contiguous, [n, block_bytes])."""
        self._copy_runs(slots, out, into_slots=False, rows=rows)

    def scatter(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Copy ``src`` (contiguous, ``len(slots) * block_bytes`` bytes) into ``slots``, block i into slots[i]."""
        self._copy_runs(slots, src, into_slots=True)

    def addresses(self, slots: Sequence[int]) -> np.ndarray:
        """Where each slot's bytes start (uint64), in a few numpy passes: what ``memmove`` and a native
        reader write to."""
        if not len(slots):
            return np.empty(0, np.uint64)
        extent, offset = self._locate_many(slots)
        bases = np.fromiter((e.data_ptr() for e in self._extents), np.uint64, len(self._extents))
        return bases[extent] + offset.astype(np.uint64) * np.uint64(self.block_bytes)

    def copy_slots(self, slots: Sequence[int], dst: MemoryTier, dst_slots: Sequence[int]) -> None:
        """Copy block ``slots[i]`` into ``dst``'s ``dst_slots[i]``, host to host: one ``memmove``
        each. A torch copy per block costs ~50 us of dispatch under load; a memmove of 12 KiB ~1."""
        if self.device.type != "cpu" or dst.device.type != "cpu":
            raise ValueError(f"copy_slots is host to host; {self.name} is on {self.device}, "
                             f"{dst.name} on {dst.device}")
        moves = list(zip(dst.addresses(dst_slots).tolist(), self.addresses(slots).tolist(), repeat(self.block_bytes)))
        self._memmove_all(moves, len(moves) * self.block_bytes)

    def close(self) -> None:
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        self._extents.clear()
        self._arrays.clear()

    # -- internals -----------------------------------------------------------
    def _locate(self, slot: int) -> tuple[int, int]:
        """``(extent, offset in it)`` of a valid slot, allocating its extent on first use."""
        if not 0 <= slot < self.pool.capacity:
            raise IndexError(f"slot={slot}: outside 0..{self.pool.capacity - 1} of tier {self.name}")
        index, offset = divmod(slot, self.extent_slots)
        if index >= len(self._extents):
            self._grow(index)
        return index, offset

    def _locate_many(self, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``_locate`` of each of ``slots`` (not empty): their extents and offsets, in numpy passes."""
        at = np.asarray(slots, dtype=np.int64)
        if at.min() < 0 or at.max() >= self.pool.capacity:
            bad = int(at.min() if at.min() < 0 else at.max())
            raise IndexError(f"slot={bad}: outside 0..{self.pool.capacity - 1} of tier {self.name}")
        extent, offset = np.divmod(at, self.extent_slots)
        if extent.max() >= len(self._extents):
            self._grow(int(extent.max()))
        return extent, offset

    def _runs(self, slots: Sequence[int], rows: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """``(row, extent, offset, count)`` per run of adjacent slots within one extent going to
        (coming from) adjacent rows."""
        runs = []
        pos, n = 0, len(slots)
        while pos < n:
            index, offset = self._locate(slots[pos])
            room = min(self.extent_slots - offset, self.pool.capacity - slots[pos])
            end = pos + 1
            while end < n and end - pos < room and slots[end] == slots[end - 1] + 1 and rows[end] == rows[end - 1] + 1:
                end += 1
            runs.append((rows[pos], index, offset, end - pos))
            pos = end
        return runs

    def _copy_runs(self, slots: Sequence[int], flat: torch.Tensor, *, into_slots: bool,
                   rows: Sequence[int] | None = None) -> None:
        bb = self.block_bytes
        need = (len(slots) if rows is None else max(rows, default=-1) + 1) * bb
        if not flat.is_contiguous() or flat.nbytes != need and (rows is None or flat.nbytes < need):
            raise ValueError(f"{tuple(flat.shape)} {flat.dtype}, contiguous={flat.is_contiguous()}: expected "
                             f"{need // bb} x {bb} = {need} contiguous bytes")
        if flat.device.type == "cpu" and self.device.type == "cpu" and bb <= INDEXED_BYTES and len(slots) > 1:
            self._copy_indexed(slots, flat, into_slots=into_slots, rows=rows)
            return
        runs = self._runs(slots, range(len(slots)) if rows is None else rows)
        if flat.device.type == "cpu" and self.device.type == "cpu":
            base, moves = flat.data_ptr(), []
            for pos, index, offset, count in runs:
                ours, theirs = self._extents[index].data_ptr() + offset * bb, base + pos * bb
                moves.append((ours, theirs, count * bb) if into_slots else (theirs, ours, count * bb))
            self._memmove_all(moves, len(slots) * bb)
            return
        flat = flat.view(-1).view(torch.uint8)
        for pos, index, offset, count in runs:
            ours, theirs = self._extents[index][offset:offset + count].view(-1), flat[pos * bb:(pos + count) * bb]
            dst, src = (ours, theirs) if into_slots else (theirs, ours)
            dst.copy_(src)

    def _copy_indexed(self, slots: Sequence[int], flat: torch.Tensor, *, into_slots: bool,
                      rows: Sequence[int] | None) -> None:
        """Host to host for small blocks (sparse pages): one indexed copy per extent, no Python per
        block. Pages read at random rarely sit in adjacent slots, and a memmove per 12 KiB page
        costs several times the copy (4.0 against 0.9 ms for a layer's 526 pages)."""
        extent, offset = self._locate_many(slots)
        top = int(extent.max())
        rows_of = flat.view(-1).view(torch.uint8).view(-1, self.block_bytes)
        blocks = rows_of.numpy()
        targets = np.arange(len(offset)) if rows is None else np.asarray(rows, dtype=np.int64)
        for index in np.unique(extent).tolist():
            mine = np.flatnonzero(extent == index) if top else slice(None)
            dst, src = targets[mine], offset[mine]
            if into_slots:
                self._arrays[index][src] = blocks[dst]
            elif len(dst) and dst[-1] - dst[0] == len(dst) - 1 and (len(dst) == 1 or (np.diff(dst) == 1).all()):
                # rows in a run: a take lands them in place (0.19 ms for a layer's 526 pages of 12 KiB;
                # fancy indexing builds a temporary first: 0.55). Not torch's index_select (0.1 ms): on a
                # mover's thread it wakes an OpenMP team of that thread, which then spins beside the
                # model's (15 us of CPU a page in bench/tiers.py's page reads).
                np.take(self._arrays[index], src, axis=0, out=blocks[int(dst[0]):int(dst[0]) + len(dst)],
                        mode="clip")   # "clip": no copy of ``out``; the slots were checked above
            else:
                blocks[dst] = self._arrays[index][src]

    def _memmove_all(self, moves: list[tuple[int, int, int]], nbytes: int) -> None:
        """``memmove(dst, src, n)`` each; the runs of a big batch are shared out as threads come free."""
        helpers = min(torch.get_num_threads(), len(moves)) - 1 if nbytes >= SPLIT_BYTES else 0
        pending, take = iter(moves), threading.Lock()

        def drain() -> None:
            while True:
                with take:
                    move = next(pending, None)
                if move is None:
                    return
                ctypes.memmove(*move)  # releases the GIL

        pool = self._helpers(helpers) if helpers > 0 else None
        futures = [pool.submit(drain) for _ in range(helpers)] if pool else []
        try:
            drain()
        finally:
            for future in futures:  # they still copy the caller's bytes: wait for every one
                future.result()

    def _helpers(self, wanted: int) -> ThreadPoolExecutor:
        """The tier's copy helpers, started on first use; shut down by `close`."""
        with self._grow_lock:
            if self._copy_pool is None:
                self._copy_pool = ThreadPoolExecutor(wanted, thread_name_prefix=f"tierkv-{self.name}-copy")
            return self._copy_pool

    def _grow(self, index: int) -> None:
        with self._grow_lock:
            while len(self._extents) <= index:
                first = len(self._extents) * self.extent_slots
                slots = min(self.extent_slots, self.pool.capacity - first)
                extent = self._allocate(slots * self.block_bytes).view(slots, self.block_bytes)
                self._extents.append(extent)
                if self.device.type == "cpu":
                    self._arrays.append(extent.numpy())

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.space is not None:        # the tier's one extent: its range of the space
            return self.space.rows()[self.space_first:self.space_first + self.pool.capacity].view(-1)[:nbytes]
        if self.device.type == "cpu":
            return host_buffer(nbytes, pinned=self.pinned)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
