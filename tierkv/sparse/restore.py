"""Restore points of a sparse prefill: small files from which a stretch of it can run again.

A page lost or damaged after its prefill is rebuilt by running the prefill again from the
last point before it until the page is sealed anew, exactly as it first ran (the same chunks,
the same state), so it comes back byte for byte and the pages after it need nothing::

    restore point at token c     per layer: the window at c (exact K, V), the outlier set and
                                 the candidate flags at c, the pages and chunks indexed by then
    the rest of the state at c   a prefix of the final index: sinks, key basis, the first
                                 chunks' landmarks and bounds, the first pages' keys
    file                         <index stem>.restore-<c>.safetensors  (every tensor and the
                                 metadata checksummed, as a stored index is)

The prefill saves one between chunks every ``spacing(tokens)`` tokens (a 32nd of the prompt,
at least 2K), once every layer has its key basis: a repair then computes at most that much
and the window. A point holds the window and the outliers exact (32-43 MB for SmolLM2 in float32,
measured at 32K and 128K), so the 32 of a long document take about 1.4 GB (at 128K: beside an
8 GiB page file).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tierkv.keys import BlockKey
from tierkv.sparse.index import ChunkIndex
from tierkv.sparse.layer_state import LayerState
from tierkv.sparse.sequence import SparseSequence
from tierkv.sparse.store import VERSION, checked, read_checked_meta, write_checked

MIN_SPACING = 2048   # a repair of a short document replays at most this and the window (a 16th at 32K)


@dataclass(slots=True)
class Origin:
    """The stored state a sequence's first pages belong to: what a repair of them replays."""
    path: Path                   # the stored index (its restore points lie beside it)
    tokens: list[int]            # the token ids it covers
    root: BlockKey               # the key its pages are named under
    pages: list[int]             # per layer, how many of the sequence's first pages are its
    repairs: list = field(default_factory=list)   # what was repaired (tierkv.session.repair.Repair)

    @classmethod
    def of(cls, seq: SparseSequence, path: Path, tokens: list[int]) -> Origin:
        return cls(path, list(tokens), seq.root, [len(state.pages) for state in seq.layers])


def spacing(tokens: int) -> int:
    return max(MIN_SPACING, tokens // 32)


def restore_path(index: Path, tokens: int) -> Path:
    return index.with_name(f"{restore_prefix(index)}{tokens}.safetensors")


def restore_points(index: Path, elsewhere: Iterable[str] = ()) -> list[tuple[int, Path]]:
    """(token, file) of the restore points saved for ``index``, ascending; ``elsewhere``: names of files
    kept in another place (a remote store's), taken where they are restore points of ``index`` (their
    path is where they go beside it)."""
    prefix = restore_prefix(index)
    names = {path.name for path in index.parent.glob(f"{prefix}*.safetensors")} | set(elsewhere)
    found = []
    for name in names:
        tokens = name.removesuffix(".safetensors").removeprefix(prefix)
        if name.startswith(prefix) and name.endswith(".safetensors") and tokens.isdigit():
            found.append((int(tokens), index.with_name(name)))
    return sorted(found)


def restore_prefix(index: Path) -> str:
    """How the names of ``index``'s restore points begin."""
    return f"{index.name.removesuffix('.safetensors')}.restore-"


def restore_pages(path: Path) -> list[int] | None:
    """Per layer, the pages sealed by the restore point at ``path`` (None: it is damaged)."""
    try:
        with safe_open(str(path), framework="pt", backend="pread") as f:
            return json.loads(read_checked_meta(f)[0]["pages"])
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError):
        return None


def save_restore(seq: SparseSequence, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for layer, state in enumerate(seq.layers):
        ids, k_out, v_out = state.index.exact()
        scores = torch.tensor([state.index.outliers[i][0] for i in ids.tolist()], dtype=torch.float32)
        parts = {"win_k": state.win_k.rows(), "win_v": state.win_v.rows(), "candidates": state.index.candidates,
                 "outlier_ids": ids, "outlier_scores": scores} | ({"outlier_k": k_out, "outlier_v": v_out}
                                                                  if ids.numel() else {})
        tensors |= {f"L{layer}.{name}": t.contiguous() for name, t in parts.items()}
    meta = {"version": VERSION, "tokens": str(seq.length(0)),
            "pages": json.dumps([len(s.pages) for s in seq.layers]),
            "chunks": json.dumps([s.index.chunks for s in seq.layers])}
    write_checked(path, tensors, meta, "restore")


def restored(final: SparseSequence, path: Path, fresh: SparseSequence) -> bool:
    """Put into ``fresh`` (a new sequence of the same index) the state of ``final``'s prefill at the
    restore point ``path``; False (``fresh`` untouched) if the file is damaged."""
    try:
        with safe_open(str(path), framework="pt", backend="pread") as f:
            meta, sums = read_checked_meta(f)
            pages, chunks = json.loads(meta["pages"]), json.loads(meta["chunks"])
            layers = [_layer(final, fresh, layer, int(meta["tokens"]), pages[layer], chunks[layer],
                             {name.split(".", 1)[1]: checked(f, name, digest) for name, digest in sums.items()
                              if name.startswith(f"L{layer}.")})
                      for layer in range(len(final.layers))]
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError, IndexError):
        return False
    fresh.layers = layers
    return True


def _layer(final: SparseSequence, fresh: SparseSequence, layer: int, tokens: int, pages: int, chunks: int,
           saved: dict[str, torch.Tensor]) -> LayerState:
    done = final.layers[layer]
    state = fresh.new_layer(layer)
    state.sink_k, state.sink_v, state.basis = done.sink_k, done.sink_v, done.basis
    state.index = ChunkIndex.prefix_of(done.index, chunks, saved)
    state.pages = done.pages[:pages]
    state.win_k.push(saved["win_k"])
    state.win_v.push(saved["win_v"])
    state.length = tokens
    return state
