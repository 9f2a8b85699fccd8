"""Decoder-layer weights placed by a policy: resident on the compute device, or streamed from tiers.

Within each layer, tensors are assigned whole (FlexGen's rule): a tensor's home is the tier where
the midpoint of its cumulative byte range falls under ``policy.weights``. Resident (gpu) tensors
stay bound to the layer. The others are packed into one region per layer, cpu-home first, cut
into blocks and put into a tier manager (cpu tier, or the NVMe store for disk-home blocks)::

    layer j:  q  k  v  o | gate  up  down        cumulative bytes 0 .. 1
              gpu gpu ...|  cpu  cpu  disk       (weights g/c/d = 0.2/0.6/0.2)
    region:   [gate up ..pad][down ..pad]        block i -> key (run, "w", j, i)

Two staging slots on the compute device receive streamed regions; ``load`` fills a slot on the
loader's thread (a CUDA stream where there is one), ``bind`` points the layer's streamed
parameters at the slot just before the compute, ``unbind`` drops them again so a compute that
runs without its weights loaded fails loudly instead of reading stale bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from tierkv.device import new_event, new_stream, on_stream
from tierkv.keys import BlockKey
from tierkv.manager import BlockingTierManager
from tierkv.schedule.policy import Placement

ALIGN = 64  # byte offset of each tensor in a region: any dtype views cleanly


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed tensor: where its bytes sit in its layer's region."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def tensor_homes(layer: nn.Module, placement: Placement) -> dict[str, str]:
    """Parameter name -> home tier (gpu, cpu or disk), by cumulative bytes."""
    params = list(layer.named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in params) or 1
    homes, start = {}, 0
    for name, p in params:
        end = start + p.numel() * p.element_size()
        homes[name] = placement.home(start / total, end / total)
        start = end
    return homes


class WeightStore:
    def __init__(self, layers: nn.ModuleList, placement: Placement, manager: BlockingTierManager | None,
                 homes: set, block_bytes: int, device: torch.device) -> None:
        self.layers, self.manager, self.block_bytes = layers, manager, block_bytes
        self.device = device
        self.run = os.urandom(8)
        self.streamed: list[list[Streamed]] = []
        self.keys: list[list[BlockKey]] = []
        self.bytes = {"gpu": 0, "cpu": 0, "disk": 0}        # over all layers
        for j, layer in enumerate(layers):
            self._offload(j, layer, tensor_homes(layer, placement), homes)
        if self.streams and manager is None:
            raise ValueError("weights stream from the tiers, but no tier manager was given")
        slot_bytes = max((len(k) * block_bytes for k in self.keys), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)] \
            if self.streams else []
        self._stream = new_stream(device)
        self._ready = [new_event(device), new_event(device)]
        self._empty = {}

    @property
    def streams(self) -> bool:
        return any(self.keys)

    @property
    def layer_stream_bytes(self) -> int:
        """Bytes one layer's load moves (the largest layer)."""
        return max((len(k) * self.block_bytes for k in self.keys), default=0)

    def _offload(self, j: int, layer: nn.Module, homes: dict[str, str], home_keys: set) -> None:
        params = dict(layer.named_parameters())
        layout: list[Streamed] = []
        offset, cpu_end = 0, 0
        for tier in ("cpu", "disk"):
            for name in (n for n, h in homes.items() if h == tier):
                p = params[name]
                layout.append(Streamed(name, tuple(p.shape), p.dtype, offset, p.numel() * p.element_size()))
                offset = _round_up(offset + layout[-1].nbytes, ALIGN)
            offset = _round_up(offset, self.block_bytes)
            cpu_end = offset if tier == "cpu" else cpu_end
        for name, home in homes.items():
            self.bytes[home] += params[name].numel() * params[name].element_size()
        region = torch.zeros(offset, dtype=torch.uint8)
        for s in layout:
            region[s.offset:s.offset + s.nbytes].copy_(params[s.name].detach().cpu().reshape(-1).view(torch.uint8))
            params[s.name].data = torch.empty(0, dtype=s.dtype, device=self.device)
        keys = []
        for i in range(offset // self.block_bytes):
            key = BlockKey.of(self.run, "w", j, i)
            tier = "cpu" if i * self.block_bytes < cpu_end else "nvme"
            if tier == "cpu":
                home_keys.add(key)
            self.manager.put(key, region[i * self.block_bytes:(i + 1) * self.block_bytes], tier=tier, layer=j)
            keys.append(key)
        self.streamed.append(layout)
        self.keys.append(keys)

    # -- per step -----------------------------------------------------------
    def load(self, layer: int, slot: int) -> int:
        """Fill staging ``slot`` with ``layer``'s streamed region (loader thread); returns bytes moved."""
        keys = self.keys[layer]
        if not keys:
            return 0
        buffer = self.slots[slot]
        with self.manager.blocks(keys, "cpu", layer=layer) as views, on_stream(self._stream):
            for i, view in enumerate(views):
                buffer[i * self.block_bytes:(i + 1) * self.block_bytes].copy_(view, non_blocking=True)
            self._ready[slot].record(self._stream)
            self._ready[slot].synchronize()   # the lease ends here: its bytes must have arrived
        return len(keys) * self.block_bytes

    def bind(self, layer: int, slot: int) -> None:
        buffer, module = self.slots[slot] if self.slots else None, self.layers[layer]
        for s in self.streamed[layer]:
            view = buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
            module.get_parameter(s.name).data = view

    def unbind(self, layer: int) -> None:
        module = self.layers[layer]
        for s in self.streamed[layer]:
            module.get_parameter(s.name).data = torch.empty(0, dtype=s.dtype, device=self.device)

    def restore(self) -> None:
        """Give every layer its streamed tensors back as ordinary tensors (the model works alone again)."""
        for j, layer in enumerate(self.layers):
            if self.keys[j]:
                self.load(j, 0)
                self.bind(j, 0)
                for s in self.streamed[j]:
                    param = layer.get_parameter(s.name)
                    param.data = param.data.clone()

    def close(self, *, restore: bool = False) -> None:
        """Drop the streamed blocks; with ``restore`` first hand the tensors back to the layers."""
        if restore:
            self.restore()
        keys = [k for layer in self.keys for k in layer]
        if keys and self.manager is not None:
            self.manager.drop(keys)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
