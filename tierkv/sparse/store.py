"""A sparse prefill, kept for the next run: the index file beside the page store.

Pages go to the NVMe store like any block; what lives in memory (per layer:
sinks, window, key basis, chunk summaries, outliers) is written to one
safetensors file named by the tokens it covers (``Shelf``)::

    identity = H("tierkv-sparse-v2" | model id | page layout | sparse settings that shape it)
    id       = H(identity | token ids covered)
    file     = <dir>/<identity[:16]>-<tokens>-<id>.safetensors
                                           tensors "L<layer>.<name>" (landmarks one per KV head:
                                           "L<layer>.landmarks.h<j>"); metadata: tokens, pages per
                                           layer, prefill seconds, the xxh3-64 of every tensor's bytes
    partial  = the same name ending .partial.safetensors: part way through the prefill (a checkpoint)
    page = H(id | "page" | layer | p)      (SparseSequence.page_key_run)

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

import contextlib
import errno
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tierkv.errors import ConfigError, StoreWriteError
from tierkv.failpoints import failpoint
from tierkv.keys import BlockKey
from tierkv.sparse.config import SparseConfig
from tierkv.layout import BlockLayout
from tierkv.sparse.sequence import SparseSequence
from tierkv.tiers.nvme_io import DISK_FULL, disk_full

log = logging.getLogger(__name__)
VERSION = "3"                # 2: landmarks saved per KV head, as they lie in memory; 3: metadata checksummed
READABLE = ("1", "2", "3")


def identity_key(model_id: str, layout: BlockLayout, config: SparseConfig, needs: frozenset[str]) -> BlockKey:
    """What every index stored for this model, page layout and settings (as given, before ``resolve``,
    which depends only on the tokens covered) has in common."""
    settings = repr((config.identity(), sorted(needs)))      # only what shapes the index (INDEX_FIELDS)
    return BlockKey.of("tierkv-sparse-v2", model_id, layout.name, settings)


def index_id(model_id: str, layout: BlockLayout, config: SparseConfig, needs: frozenset[str],
             ids: Sequence[int]) -> BlockKey:
    """The name of the state that covers exactly ``ids``."""
    return Shelf(Path(), identity_key(model_id, layout, config, needs)).key(ids)


@dataclass(frozen=True, slots=True)
class Shelf:
    """The stored indexes of one identity in a directory, each named by the tokens it covers::

        <identity[:16]>-<tokens>-<id>.safetensors            id = H(identity | token ids)
        <identity[:16]>-<tokens>-<id>.partial.safetensors    a checkpoint of a prefill under way

    A prompt that starts with the tokens of a stored index reuses it (``longest``): a document read
    once serves every question asked after it."""

    directory: Path
    identity: BlockKey

    def key(self, ids: Sequence[int]) -> BlockKey:
        return BlockKey.of(self.identity.digest, np.asarray(ids, dtype=np.int64).tobytes())

    def path(self, ids: Sequence[int]) -> Path:
        return self.directory / f"{self._stem(ids)}.safetensors"

    def check(self, ids: Sequence[int]) -> None:
        """That the index of ``ids`` can be stored here: said before a prefill, not after it."""
        if self.directory.exists() and not self.directory.is_dir():
            raise ConfigError(f"{self.directory}: not a folder (the store keeps its sparse indexes there); move "
                              "it aside")
        for path in (self.path(ids), self.checkpoint(ids)):
            if path.exists() and not path.is_file():
                raise ConfigError(f"sparse index {path}: not a file; move it aside")

    def checkpoint(self, ids: Sequence[int]) -> Path:
        return self.directory / f"{self._stem(ids)}.partial.safetensors"

    def longest(self, ids: Sequence[int], *, at_most: int) -> int:
        """The most tokens of ``ids`` (at most ``at_most``) a stored index covers; 0 for none."""
        best = 0
        if not self.directory.is_dir():
            return 0
        for path in self.directory.glob(f"{self.identity.hex()[:16]}-*.safetensors"):
            n = self.covers(path.name, ids)
            if n is not None and best < n <= at_most:
                best = n
        return best

    def covers(self, name: str, ids: Sequence[int]) -> int | None:
        """The tokens of ``ids`` the index file ``name`` covers (a prefix of them); None if it covers no
        prefix of ``ids`` (or is a checkpoint, a restore point, a stranger)."""
        stem, _, rest = name.partition(".")
        parts = stem.split("-")
        if rest != "safetensors" or len(parts) != 3 or not parts[1].isdigit() \
                or parts[0] != self.identity.hex()[:16]:
            return None
        n = int(parts[1])
        return n if n <= len(ids) and parts[2] == self.key(ids[:n]).hex() else None

    def _stem(self, ids: Sequence[int]) -> str:
        return f"{self.identity.hex()[:16]}-{len(ids)}-{self.key(ids).hex()}"


def save_index(seq: SparseSequence, path: Path, *, prefill_s: float = 0.0, point: str = "index",
               ids: Sequence[int] | None = None, identity: BlockKey | None = None) -> None:
    """Write ``seq``'s in-memory part; ``prefill_s``: seconds its prefill took so far (all runs);
    ``ids``: the token ids it covers (what a repair replays, and what a load checks the prompt against);
    ``identity``: its shelf's (with ``ids``, what its name must be: `tierkv store verify` checks it).

    The tensors are written from where they lie (the landmarks of 1M tokens are 1.5 GB: a copy
    for the save would add that much to the peak memory of every checkpoint)."""
    tensors: dict[str, torch.Tensor] = {}
    for layer, state in enumerate(seq.layers):
        parts = {"sink_k": state.sink_k, "sink_v": state.sink_v, "win_k": state.win_k.rows(),
                 "win_v": state.win_v.rows(), "basis": state.basis.basis} | state.index.state()
        for name, tensor in parts.items():
            tensors[f"L{layer}.{name}"] = tensor if tensor.is_contiguous() else tensor.contiguous()
    if ids is not None:
        tensors["ids"] = torch.tensor(list(ids), dtype=torch.int64)
    meta = {"version": VERSION, "tokens": json.dumps([s.length for s in seq.layers]),
            "pages": json.dumps([len(s.pages) for s in seq.layers]),
            "energy": json.dumps([s.basis.energy_kept for s in seq.layers]), "prefill_s": repr(prefill_s),
            "settings": json.dumps(index_settings(seq.layout, seq.config), default=str)}
    if identity is not None:
        meta["identity"] = identity.hex()
    write_checked(path, tensors, meta, point)


def index_settings(layout: BlockLayout, config: SparseConfig) -> dict[str, object]:
    """What shaped an index besides the model (``identity_key``), as a repair with other settings is told."""
    return {"pages": layout.name, **dict(config.identity())}


def place_file(path: Path, payload: bytes) -> None:
    """``payload`` as the file ``path`` (one fetched from a remote store), whole or not at all; its own
    checksums are checked where it is read."""
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        part.write_bytes(payload)
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)


def write_checked(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str], point: str) -> None:
    """``tensors`` and ``meta`` to ``path`` with an xxh3-64 of every tensor and of the metadata itself:
    written to a temporary name, fsynced, renamed (``point``: its failpoint's prefix)."""
    meta = meta | {"checksums": json.dumps({name: _digest(t) for name, t in tensors.items()})}
    meta["meta_checksum"] = _meta_digest(meta)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")   # two processes saving one index never share it
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        save_file(tensors, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        failpoint(f"{point}.before-rename")
        os.replace(tmp, path)
    except (OSError, SafetensorError) as error:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _not_written(path, error, sum(t.nbytes for t in tensors.values())) from None


def _not_written(path: Path, error: Exception, nbytes: int) -> OSError:
    """The error a failed write of ``path`` is told as: safetensors' own says its cause only in words."""
    told = re.search(r"os error (\d+)", str(error))
    code = error.errno if isinstance(error, OSError) and error.errno else int(told[1]) if told else errno.EIO
    if code in DISK_FULL:
        return disk_full(path.parent, nbytes, what=f"sparse index {path.name}")
    return StoreWriteError(code, f"sparse index {path}: cannot be written ({os.strerror(code)})")


def load_index(seq: SparseSequence, path: Path, *, missing: list[BlockKey] | None = None,
               ids: Sequence[int] | None = None, identity: BlockKey | None = None) -> dict[str, str] | None:
    """Fill a fresh ``seq`` from ``path`` and return the file's metadata; None (``seq`` untouched)
    if it is absent, damaged or stale, or holds other tokens than ``ids`` (a checkpoint: than a prefix
    of them), or was stored under another ``identity`` (model and settings), where it records them: a
    file renamed or copied over another is another document's, or another model's.

    The file is read one layer at a time into fresh layer states that take the tensors as read
    (no second copy, no mapping of the file kept), each tensor checked against its checksum;
    ``seq`` gets them only once all are read and every page they name is still stored, or, given a
    ``missing`` list, with the pages no longer stored put in it (to be computed again)."""
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt", backend="pread") as f:
            meta, sums = read_checked_meta(f)
            if ids is not None and "ids" in sums:
                _check_ids(checked(f, "ids", sums["ids"]).tolist(), ids, path)
            if identity is not None and meta.get("identity", identity.hex()) != identity.hex():
                raise ValueError("it was stored for another model or settings (a file copied from another store)")
            pages = json.loads(meta["pages"])
            if len(pages) != len(seq.layers):
                raise ValueError(f"{len(pages)} layers, the model has {len(seq.layers)}")
            layers = _read_layers(seq, f, sums, meta, pages)
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError) as error:
        log.warning("sparse index %s is not usable (%s); prefilling again", path.name, error)
        return None
    keys = [key for state in layers for key in state.pages]
    if missing is None and not seq.manager.protect(keys):
        log.warning("sparse index %s: some of its pages are no longer stored; prefilling again", path.name)
        return None
    if missing is not None:
        missing.extend(seq.manager.hold(keys))
    seq.layers = layers
    return meta


def _check_ids(stored: list[int], ids: Sequence[int], path: Path) -> None:
    partial = path.name.endswith(".partial.safetensors")
    if stored != list(ids[:len(stored)] if partial else ids):
        raise ValueError("it holds the tokens of another document (a file renamed, or copied over another)")


def index_name_problem(path: Path, meta: dict[str, str], ids: list[int]) -> str | None:
    """What is wrong with the name of the index at ``path`` (not a checkpoint's), whose metadata and
    token ids these are; None where it is right, or the file does not record what shaped its name."""
    if "identity" not in meta:
        return None
    identity = BlockKey(bytes.fromhex(meta["identity"]))
    if path.name != Shelf(path.parent, identity).path(ids).name:
        return "named for other tokens than it holds (a file renamed, or copied over another's)"
    return None


def read_checked_meta(f: safe_open) -> tuple[dict[str, str], dict[str, str]]:
    """A file's metadata and tensor checksums, checked (ValueError naming what is wrong)."""
    meta = f.metadata() or {}
    if meta.get("version") not in READABLE:
        raise ValueError(f"version {meta.get('version')!r}, expected one of {', '.join(READABLE)}")
    if meta["version"] >= "3" and meta.get("meta_checksum") != _meta_digest(meta):
        raise ValueError("its metadata fails its checksum")
    sums = json.loads(meta["checksums"])
    if set(sums) != set(f.keys()):
        raise ValueError("the tensors in the file are not those its checksums name")
    return meta, sums


def read_ids(path: Path) -> list[int] | None:
    """The token ids a stored index covers (None: the file does not record them, or is damaged)."""
    try:
        with safe_open(str(path), framework="pt", backend="pread") as f:
            _, sums = read_checked_meta(f)
            return checked(f, "ids", sums["ids"]).tolist() if "ids" in sums else None
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError):
        return None


def _read_layers(seq: SparseSequence, f: safe_open, sums: dict[str, str], meta: dict[str, str],
                 pages: list[int]) -> list:
    lengths, energy = json.loads(meta["tokens"]), json.loads(meta["energy"])
    names = sorted(sums)
    layers = []
    for layer in range(len(seq.layers)):
        prefix = f"L{layer}."
        get = {name[len(prefix):]: checked(f, name, sums[name]) for name in names if name.startswith(prefix)}
        state = seq.new_layer(layer)
        state.sink_k, state.sink_v = get["sink_k"], get["sink_v"]
        state.win_k.push(get["win_k"])
        state.win_v.push(get["win_v"])
        state.basis.basis, state.basis.energy_kept = get["basis"], energy[layer]
        state.index.load(get)
        state.pages = seq.page_key_run(layer, 0, pages[layer])
        state.length = lengths[layer]
        layers.append(state)
    return layers


def checked(f: safe_open, name: str, digest: str) -> torch.Tensor:
    tensor = f.get_tensor(name)
    if _digest(tensor) != digest:
        raise ValueError(f"tensor {name} fails its checksum")
    return tensor


def _meta_digest(meta: dict[str, str]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps({k: v for k, v in meta.items() if k != "meta_checksum"},
                                               sort_keys=True).encode())


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy() if tensor.numel() else b""
    return xxhash.xxh3_64_hexdigest(raw)
