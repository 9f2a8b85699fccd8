"""A sparse prefill, kept for the next run: the index file beside the page store.

Pages go to the NVMe store like any block; what lives in memory (per layer:
sinks, window, key basis, chunk summaries, outliers) is written to one
safetensors file named by the index id, a hash of everything that shaped it::

    id   = H("tierkv-sparse-v1" | model id | page layout | resolved sparse settings | prompt ids)
    file = <dir>/<id>.safetensors          tensors "L<layer>.<name>"; metadata: tokens, pages per
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
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tierkv.keys import BlockKey
from tierkv.sparse.config import SparseConfig
from tierkv.sparse.pages import PageLayout
from tierkv.sparse.sequence import SparseSequence

log = logging.getLogger(__name__)
VERSION = "1"


def index_id(model_id: str, layout: PageLayout, config: SparseConfig, needs: frozenset[str],
             prompt_ids: Sequence[int]) -> BlockKey:
    settings = repr((replace(config, prefetch="none"), sorted(needs)))   # prefetch does not shape the index
    return BlockKey.of("tierkv-sparse-v1", model_id, layout.name, settings,
                       np.asarray(prompt_ids, dtype=np.int64).tobytes())


def index_path(directory: Path, key: BlockKey) -> Path:
    return Path(directory) / f"{key.hex()}.safetensors"


def checkpoint_path(directory: Path, key: BlockKey) -> Path:
    return Path(directory) / f"{key.hex()}.partial.safetensors"


def save_index(seq: SparseSequence, path: Path, *, prefill_s: float = 0.0) -> None:
    """Write ``seq``'s in-memory part; ``prefill_s``: seconds its prefill took so far (all runs)."""
    tensors: dict[str, torch.Tensor] = {}
    for layer, state in enumerate(seq.layers):
        basis = state.basis.basis
        parts = {"sink_k": state.sink_k, "sink_v": state.sink_v, "win_k": state.win_k.rows(),
                 "win_v": state.win_v.rows(), "basis": basis} | state.index.state()
        for name, tensor in parts.items():
            tensors[f"L{layer}.{name}"] = tensor.contiguous().clone()
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
    if it is absent, damaged or stale."""
    if not path.exists():
        return None
    try:
        tensors, meta = _read(path)
    except (OSError, SafetensorError, ValueError, KeyError) as error:
        log.warning("sparse index %s is not usable (%s); prefilling again", path.name, error)
        return None
    pages = json.loads(meta["pages"])
    if len(pages) != len(seq.layers):
        log.warning("sparse index %s has %d layers, the model %d; prefilling again",
                    path.name, len(pages), len(seq.layers))
        return None
    keys = [seq.page_key(layer, p) for layer, n in enumerate(pages) for p in range(n)]
    if not seq.manager.protect(keys):
        log.warning("sparse index %s: some of its pages are no longer stored; prefilling again", path.name)
        return None
    _fill(seq, tensors, meta, pages)
    return meta


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("version") != VERSION:
        raise ValueError(f"version {meta.get('version')!r}, expected {VERSION}")
    tensors = load_file(str(path))
    sums = json.loads(meta["checksums"])
    for name, tensor in tensors.items():
        if sums.get(name) != _digest(tensor):
            raise ValueError(f"tensor {name} fails its checksum")
    if set(sums) != set(tensors):
        raise ValueError("tensors missing from the file")
    return tensors, meta


def _fill(seq: SparseSequence, tensors: dict[str, torch.Tensor], meta: dict[str, str], pages: list[int]) -> None:
    lengths, energy = json.loads(meta["tokens"]), json.loads(meta["energy"])
    for layer, state in enumerate(seq.layers):
        get = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.startswith(f"L{layer}.")}
        state.sink_k, state.sink_v = get["sink_k"], get["sink_v"]
        state.win_k.push(get["win_k"])
        state.win_v.push(get["win_v"])
        state.basis.basis, state.basis.energy_kept = get["basis"], energy[layer]
        state.index.load(get)
        state.pages = [seq.page_key(layer, p) for p in range(pages[layer])]
        state.length = lengths[layer]


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy() if tensor.numel() else b""
    return xxhash.xxh3_64_hexdigest(raw)
