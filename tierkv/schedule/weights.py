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

With a storage dtype (``policy.weight_dtype``, e.g. bf16 under an fp32 compute) the region holds
the streamed tensors in that dtype: the tiers keep and move half the bytes. ``load`` then fills
one shared raw buffer and converts each tensor into the slot, still on the loader's thread, so
the conversion overlaps the previous layer's compute::

    tier blocks --copy--> raw [gate up down] (bf16) --convert--> slot s [gate up down] (fp32)
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
from torch import nn

from tierkv.device import new_event, new_stream, on_stream
from tierkv.keys import BlockKey
from tierkv.manager import BlockingTierManager
from tierkv.schedule.policy import WEIGHT_DTYPES, Placement

ALIGN = 64  # byte offset of each tensor in a region: any dtype views cleanly
STORAGE_DTYPES = {name: getattr(torch, name) for name in WEIGHT_DTYPES}


def storage_dtype(name: str | None) -> torch.dtype | None:
    """``policy.weight_dtype`` (validated by the policy) as a torch dtype; None: the compute dtype."""
    return None if name is None else STORAGE_DTYPES[name]


def stored_nbytes(p: torch.Tensor, store: torch.dtype | None) -> int:
    """Bytes of ``p`` kept in the tiers (floating tensors in ``store`` when given)."""
    return p.numel() * _stored(p, store).itemsize


def _stored(p: torch.Tensor, store: torch.dtype | None) -> torch.dtype:
    return store if store is not None and p.is_floating_point() else p.dtype


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed tensor: its bytes in its layer's region (as stored) and in a slot (as computed)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype          # the compute's
    stored: torch.dtype         # in the region and the tiers
    offset: int                 # in the region
    nbytes: int                 # in the region
    at: int                     # in a staging slot (== offset when nothing converts)

    @property
    def slot_nbytes(self) -> int:
        return self.nbytes // self.stored.itemsize * self.dtype.itemsize


def tensor_homes(layer: nn.Module, placement: Placement, sizes: dict[str, int] | None = None) -> dict[str, str]:
    """Parameter name -> home tier (gpu, cpu or disk), by cumulative bytes (``sizes``: each parameter's, as
    `parameter_sizes` measured them; by default measured now)."""
    sizes = parameter_sizes(layer) if sizes is None else sizes
    total = sum(sizes.values()) or 1
    homes, start = {}, 0
    for name, nbytes in sizes.items():
        end = start + nbytes
        homes[name] = placement.home(start / total, end / total)
        start = end
    return homes


def parameter_sizes(layer: nn.Module) -> dict[str, int]:
    """Bytes of each of ``layer``'s parameters, in order. Measured before an engine streams the weights:
    while one runs, a streamed parameter is an empty tensor between its uses."""
    return {name: p.numel() * p.element_size() for name, p in layer.named_parameters()}


class WeightStore:
    def __init__(self, layers: nn.ModuleList, placement: Placement, manager: BlockingTierManager | None,
                 homes: set, block_bytes: int, device: torch.device, store: torch.dtype | None = None) -> None:
        self.layers, self.manager, self.block_bytes = layers, manager, block_bytes
        self.device, self.store = device, store
        self._converting = store is not None and any(_stored(p, store) != p.dtype for p in layers.parameters())
        self.run = os.urandom(8)
        self.streamed: list[list[Streamed]] = []
        self.keys: list[list[BlockKey]] = []
        self.bytes = {"gpu": 0, "cpu": 0, "disk": 0}        # over all layers, as kept (cpu/disk: stored dtype)
        for j, layer in enumerate(layers):
            self._offload(j, layer, tensor_homes(layer, placement), homes)
        if self.streams and manager is None:
            raise ValueError("weights stream from the tiers, but no tier manager was given")
        converts = self._converting and self.streams
        slot_bytes = max((_round_up(s.at + s.slot_nbytes, ALIGN) for layout in self.streamed for s in layout),
                         default=0) if converts else self.layer_stream_bytes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)] \
            if self.streams else []
        self._raw = torch.empty(self.layer_stream_bytes, dtype=torch.uint8, device=device) if converts else None
        self._raw_lock = threading.Lock()      # loads share the raw buffer: one at a time
        self._stream = new_stream(device)
        self._ready = [new_event(device), new_event(device)]

    @property
    def streams(self) -> bool:
        return any(self.keys)

    @property
    def converts(self) -> bool:
        """Loads convert from the storage dtype (and fill the shared raw buffer first)."""
        return self._raw is not None

    @property
    def layer_stream_bytes(self) -> int:
        """Bytes one layer's load moves (the largest layer), as stored."""
        return max((len(k) * self.block_bytes for k in self.keys), default=0)

    def _offload(self, j: int, layer: nn.Module, homes: dict[str, str], home_keys: set) -> None:
        params = dict(layer.named_parameters())
        layout: list[Streamed] = []
        offset, at, cpu_end = 0, 0, 0
        for tier in ("cpu", "disk"):
            for name in (n for n, h in homes.items() if h == tier):
                p = params[name]
                s = Streamed(name, tuple(p.shape), p.dtype, _stored(p, self.store), offset,
                             stored_nbytes(p, self.store), at if self._converting else offset)
                layout.append(s)
                offset = _round_up(offset + s.nbytes, ALIGN)
                at = _round_up(at + s.slot_nbytes, ALIGN)
            offset = _round_up(offset, self.block_bytes)
            cpu_end = offset if tier == "cpu" else cpu_end
        for name, home in homes.items():
            self.bytes[home] += stored_nbytes(params[name], None if home == "gpu" else self.store)
        region = torch.zeros(offset, dtype=torch.uint8)
        for s in layout:
            value = params[s.name].detach().cpu().to(s.stored).reshape(-1)
            region[s.offset:s.offset + s.nbytes].copy_(value.view(torch.uint8))
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
        """Fill staging ``slot`` with ``layer``'s streamed tensors (loader thread); returns bytes moved."""
        keys = self.keys[layer]
        if not keys:
            return 0
        if self._raw is None:
            self._fill(layer, self.slots[slot], slot)
        else:
            with self._raw_lock:
                self._fill(layer, self._raw, slot, convert_into=self.slots[slot])
        return len(keys) * self.block_bytes

    def _fill(self, layer: int, buffer: torch.Tensor, slot: int, convert_into: torch.Tensor | None = None) -> None:
        """Copy ``layer``'s blocks into ``buffer``; then, converting, each tensor into ``convert_into``."""
        bb = self.block_bytes
        with self.manager.blocks(self.keys[layer], "cpu", layer=layer) as views, on_stream(self._stream):
            for i, view in enumerate(views):
                buffer[i * bb:(i + 1) * bb].copy_(view, non_blocking=True)
            if convert_into is not None:
                for s in self.streamed[layer]:
                    _slot_view(convert_into, s).copy_(buffer[s.offset:s.offset + s.nbytes].view(s.stored))
            self._ready[slot].record(self._stream)
            self._ready[slot].synchronize()   # the lease (and the raw buffer) ends here: its bytes must have arrived

    def bind(self, layer: int, slot: int) -> None:
        buffer, module = self.slots[slot] if self.slots else None, self.layers[layer]
        for s in self.streamed[layer]:
            module.get_parameter(s.name).data = _slot_view(buffer, s).view(s.shape)

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


def _slot_view(buffer: torch.Tensor, s: Streamed) -> torch.Tensor:
    """``s`` in a staging slot, flat, in the compute dtype."""
    return buffer[s.at:s.at + s.slot_nbytes].view(s.dtype)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
