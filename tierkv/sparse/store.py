"""A sparse prefill, kept for the next run: the index file beside the page store.

Pages go to the NVMe store like any block; what lives in memory (per layer:
sinks, window, key basis, chunk summaries, outliers) is written to one
safetensors file named by the index id, a hash of everything that shaped it::

    id   = H("tierkv-sparse-v1" | model id | page layout | sparse settings that shape it | prompt ids)
    file = <dir>/<id>.safetensors          tensors "L<layer>.<name>" (landmarks one per KV head:
                                           "L<layer>.landmarks.h<j>"); metadata: tokens, pages per
                                           layer, prefill seconds, the xxh3-64 of every tensor's bytes
    partial = <dir>/<id>.partial.safetensors   the same, part way through the prefill (a checkpoint)
    page = H(id | "page" | layer | p)      (SparseSequence.page_key)

Loading checks every checksum and that every page is still stored; any
failure means "not reusable" (the caller prefills again), never wrong KV.
The file is written to a temporary name, fsynced, then renamed.

A checkpoint lets a long prefill that was stopped (killed, out of time)
resume where it was saved: its state is that of the prompt's first
``tokens`` tokens, and the pages it names were flushed to the store before
it was written. Pages sealed after it may be in the store too; a key names
its content (the same prompt, settings and prefix give the same page), so
the resumed prefill finds them or writes them again.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tierkv.keys import BlockKey
from tierkv.sparse.config import SparseConfig
from tierkv.layout import BlockLayout
from tierkv.sparse.sequence import SparseSequence

log = logging.getLogger(__name__)
VERSION = "2"                # 2: landmarks saved per KV head, as they lie in memory
READABLE = ("1", "2")


def index_id(model_id: str, layout: BlockLayout, config: SparseConfig, needs: frozenset[str],
             prompt_ids: Sequence[int]) -> BlockKey:
    settings = repr((config.identity(), sorted(needs)))      # only what shapes the index (INDEX_FIELDS)
    return BlockKey.of("tierkv-sparse-v1", model_id, layout.name, settings,
                       np.asarray(prompt_ids, dtype=np.int64).tobytes())


def index_path(directory: Path, key: BlockKey) -> Path:
    return Path(directory) / f"{key.hex()}.safetensors"


def checkpoint_path(directory: Path, key: BlockKey) -> Path:
    return Path(directory) / f"{key.hex()}.partial.safetensors"


def save_index(seq: SparseSequence, path: Path, *, prefill_s: float = 0.0) -> None:
    """Write ``seq``'s in-memory part; ``prefill_s``: seconds its prefill took so far (all runs).

    The tensors are written from where they lie (the landmarks of 1M tokens are 1.5 GB: a copy
    for the save would add that much to the peak memory of every checkpoint)."""
    tensors: dict[str, torch.Tensor] = {}
    for layer, state in enumerate(seq.layers):
        parts = {"sink_k": state.sink_k, "sink_v": state.sink_v, "win_k": state.win_k.rows(),
                 "win_v": state.win_v.rows(), "basis": state.basis.basis} | state.index.state()
        for name, tensor in parts.items():
            tensors[f"L{layer}.{name}"] = tensor if tensor.is_contiguous() else tensor.contiguous()
    meta = {"version": VERSION, "tokens": json.dumps([s.length for s in seq.layers]),
            "pages": json.dumps([len(s.pages) for s in seq.layers]),
            "energy": json.dumps([s.basis.energy_kept for s in seq.layers]), "prefill_s": repr(prefill_s),
            "checksums": json.dumps({name: _digest(t) for name, t in tensors.items()})}
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_index(seq: SparseSequence, path: Path) -> dict[str, str] | None:
    """Fill a fresh ``seq`` from ``path`` and return the file's metadata; None (``seq`` untouched)
    if it is absent, damaged or stale.

    The file is read one layer at a time into fresh layer states that take the tensors as read
    (no second copy, no mapping of the file kept), each tensor checked against its checksum;
    ``seq`` gets them only once all are read and every page they name is still stored."""
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt", backend="pread") as f:
            meta = f.metadata() or {}
            if meta.get("version") not in READABLE:
                raise ValueError(f"version {meta.get('version')!r}, expected one of {', '.join(READABLE)}")
            sums = json.loads(meta["checksums"])
            if set(sums) != set(f.keys()):
                raise ValueError("the tensors in the file are not those its checksums name")
            pages = json.loads(meta["pages"])
            if len(pages) != len(seq.layers):
                raise ValueError(f"{len(pages)} layers, the model has {len(seq.layers)}")
            layers = _read_layers(seq, f, sums, meta, pages)
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError) as error:
        log.warning("sparse index %s is not usable (%s); prefilling again", path.name, error)
        return None
    if not seq.manager.protect([key for state in layers for key in state.pages]):
        log.warning("sparse index %s: some of its pages are no longer stored; prefilling again", path.name)
        return None
    seq.layers = layers
    return meta


def _read_layers(seq: SparseSequence, f: safe_open, sums: dict[str, str], meta: dict[str, str],
                 pages: list[int]) -> list:
    lengths, energy = json.loads(meta["tokens"]), json.loads(meta["energy"])
    names = sorted(sums)
    layers = []
    for layer in range(len(seq.layers)):
        prefix = f"L{layer}."
        get = {name[len(prefix):]: _checked(f, name, sums[name]) for name in names if name.startswith(prefix)}
        state = seq.new_layer(layer)
        state.sink_k, state.sink_v = get["sink_k"], get["sink_v"]
        state.win_k.push(get["win_k"])
        state.win_v.push(get["win_v"])
        state.basis.basis, state.basis.energy_kept = get["basis"], energy[layer]
        state.index.load(get)
        state.pages = [seq.page_key(layer, p) for p in range(pages[layer])]
        state.length = lengths[layer]
        layers.append(state)
    return layers


def _checked(f: safe_open, name: str, digest: str) -> torch.Tensor:
    tensor = f.get_tensor(name)
    if _digest(tensor) != digest:
        raise ValueError(f"tensor {name} fails its checksum")
    return tensor


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy() if tensor.numel() else b""
    return xxhash.xxh3_64_hexdigest(raw)
