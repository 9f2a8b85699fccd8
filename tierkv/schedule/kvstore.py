"""The KV of one block of sequences, kept in a tier manager per (layer, GPU batch).

Each cell ``(layer, batch)`` appends K/V columns every step. Full ``block_tokens`` columns are
sealed into one tier block; the newest columns stay in a tail on the compute device::

    (layer l, batch b)   [ blk 0 ][ blk 1 ][ blk 2 ][ blk 3 ][ tail ]
    home (kv g/c/d)        gpu      cpu      cpu      disk               Placement.split(blocks)

    block bytes   K [rows, Hkv, T, D] then V, in the model's dtype, or both int4
                  (tierkv.codec) when the policy compresses KV; padded to 4096

A block is put into its home tier and, being a home, is never evicted there (`HomePolicy`).
``load`` pins the memory-home blocks in place and loads the disk-home ones into the cpu tier's
staging room, then gathers everything with the tail into one K and one V for the compute, with
room at the end for the step's own columns (one copy of the cell's KV per step, not two).
"""
from __future__ import annotations

import os
from contextlib import ExitStack

import torch
from torch import Tensor

from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.schedule.policy import Placement

TIER_OF_HOME = {"gpu": "gpu", "cpu": "cpu", "disk": "nvme"}


class BlockKV:
    """Sealed KV blocks in ``manager`` and per-cell tails, for ``rows_per_batch`` GPU batches."""

    def __init__(self, manager: BlockingTierManager, layout: BlockLayout, num_layers: int,
                 rows_per_batch: list[int], placement: Placement, blocks_per_cell: int,
                 homes: set) -> None:
        self.manager, self.layout, self.homes = manager, layout, homes
        self.rows = rows_per_batch
        self.layouts = {rows: layout.with_rows(rows) for rows in set(rows_per_batch)}
        self.split = placement.split(blocks_per_cell)
        self.run = os.urandom(8)
        cells = [(layer, b) for layer in range(num_layers) for b in range(len(rows_per_batch))]
        self.blocks: dict[tuple[int, int], list[BlockKey]] = {c: [] for c in cells}
        self.tails: dict[tuple[int, int], tuple[Tensor, Tensor] | None] = {c: None for c in cells}
        self.bytes_read = {"gpu": 0, "cpu": 0, "disk": 0}
        self.bytes_written = {"gpu": 0, "cpu": 0, "disk": 0}

    def home(self, index: int) -> str:
        gpu, cpu, _ = self.split
        return "gpu" if index < gpu else "cpu" if index < gpu + cpu else "disk"

    # -- storing ------------------------------------------------------------
    def store(self, layer: int, b: int, k: Tensor, v: Tensor) -> None:
        """Append K/V [rows, Hkv, t, D] to cell (layer, b); whole blocks go to their home tier."""
        cell, T = (layer, b), self.layout.tokens
        tail = self.tails[cell]
        k, v = (k, v) if tail is None else (torch.cat([tail[0], k], 2), torch.cat([tail[1], v], 2))
        full = k.shape[2] // T
        for i in range(full):
            self._seal(cell, k[:, :, i * T:(i + 1) * T], v[:, :, i * T:(i + 1) * T])
        rest = k.shape[2] - full * T
        self.tails[cell] = (k[:, :, full * T:].clone(), v[:, :, full * T:].clone()) if rest else None

    def _seal(self, cell: tuple[int, int], k: Tensor, v: Tensor) -> None:
        index = len(self.blocks[cell])
        key = BlockKey.of(self.run, cell[0], cell[1], index)
        home = self.home(index)
        if home != "disk":
            self.homes.add(key)
        raw = self.layouts[k.shape[0]].pack(k, v, out=torch.zeros(self.layout.block_bytes, dtype=torch.uint8))
        self.manager.put(key, raw, tier=TIER_OF_HOME[home], layer=cell[0], index=index)
        self.blocks[cell].append(key)
        self.bytes_written[home] += self.layout.block_bytes

    # -- loading ------------------------------------------------------------
    def load(self, layer: int, b: int, room: int = 0) -> tuple[Tensor, Tensor] | None:
        """K, V [rows, Hkv, S + room, D] of everything cell (layer, b) holds, the last ``room``
        columns left unset (for the step's new K/V), or None when the cell is empty."""
        cell = (layer, b)
        keys, tail = self.blocks[cell], self.tails[cell]
        homes = [self.home(i) for i in range(len(keys))]     # gpu first, then cpu, then disk
        in_memory = [k for k, h in zip(keys, homes) if h != "disk"]
        on_disk = [k for k, h in zip(keys, homes) if h == "disk"]
        with ExitStack() as leases:
            views = list(leases.enter_context(self.manager.blocks(in_memory))) if in_memory else []
            if on_disk:  # loaded into the cpu tier's staging room, read once, evictable after
                views += leases.enter_context(self.manager.blocks(on_disk, "cpu"))
            parts = [self.layouts[self.rows[b]].unpack(raw) for raw in views]
            if tail is not None:
                parts.append(tail)
            if not parts:
                return None
            if room:
                k0 = parts[0][0]
                spare = k0.new_empty(k0.shape[0], k0.shape[1], room, k0.shape[3])
                parts.append((spare, spare))
            kv = torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)
        for home in homes:
            self.bytes_read[home] += self.layout.block_bytes
        return kv

    def close(self) -> None:
        """Drop every block of this block of sequences from every tier."""
        keys = [k for cell in self.blocks.values() for k in cell]
        self.homes.difference_update(keys)
        if keys:
            self.manager.drop(keys)
        self.blocks = {c: [] for c in self.blocks}
        self.tails = {c: None for c in self.tails}
