"""The access-trace file: named numpy columns behind a JSON header, no pickle anywhere.

File format, version 2, every number little-endian::

    offset   bytes  field
    0        8      magic b"TKVTRACE"
    8        4      version, uint32 (2)
    12       4      H, the header's length in bytes, uint32
    16       H      header: UTF-8 JSON, space-padded to a multiple of 8
    16 + H   ...    the columns the header lists, in its order, each zero-padded to a multiple of 8

    header  {"format": "tierkv-access", "meta": {block_bytes, tiers: [{name, medium, slots,
             policy}], read_tier, persist, copy_threads, inflight_bytes, layers, timed, info,
             sources},
             "columns": [{"name": "op_kind", "dtype": "<u1", "count": 1234}, ...],
             "checksum": xxh3_64 hex of every column byte after the header, padding included}

Columns. A call's blocks are the next ``op_count`` entries of ``block`` (CSR)::

    per step         step_kind u1 (0 prefill, 1 decode)  step_tokens u4  step_time f8
    per call (op)    op_kind u1 (0 put, 1 get, 2 guess)  op_step u4  op_layer i4 (-1: none)
                     op_count u4  op_time f8  op_blocked f8 (seconds the caller waited inside the call)
                     op_source u1 (a guess: its index in meta.sources; 0 for puts and gets)
    per block entry  block u4 (dense id)   where u1 (index in meta.tiers of the fastest tier
                     holding the block when the call began; 254 arriving, 255 nowhere/unknown)
    per step, layer  layer_start f8 ([steps, layers] row-major; NaN: unknown)

    op i:  entries [start_i, start_i + op_count_i),  start = cumsum(op_count) - op_count

A guess is no call to the manager: it names the blocks a prefetcher guessed
layer ``op_layer`` would read (``meta.sources``: which prefetcher, e.g.
"speculative"), recorded whether or not the run prefetched them, so that a
replay can issue them. Version 1 files (no guesses, no ``op_source`` column,
no ``meta.sources``) are read too. Times are seconds since the recorder was made. What the columns mean
together is `tierkv.profile.access_trace`; this module only moves them
between memory and a file, and says what is wrong with a file that is not one.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
import xxhash

from tierkv.errors import ConfigError

MAGIC = b"TKVTRACE"
VERSION = 2
FORMAT = "tierkv-access"
_PREAMBLE = struct.Struct("<8sII")
T = TypeVar("T")

# name -> dtype, in file order; AccessTrace has one field per column, same names.
COLUMNS: dict[str, str] = {
    "step_kind": "<u1", "step_tokens": "<u4", "step_time": "<f8",
    "op_kind": "<u1", "op_step": "<u4", "op_layer": "<i4", "op_count": "<u4",
    "op_time": "<f8", "op_blocked": "<f8", "op_source": "<u1",
    "block": "<u4", "where": "<u1",
    "layer_start": "<f8",
}
# The columns of each version this module reads (a reader fills a column a version lacks).
COLUMNS_OF: dict[int, list[str]] = {1: [n for n in COLUMNS if n != "op_source"], 2: list(COLUMNS)}


def not_a_trace(path: str | Path, problem: str) -> ConfigError:
    return ConfigError(f"{path}: not a valid tierkv access trace: {problem}")


def write_columns(path: str | Path, meta: dict[str, Any], columns: Mapping[str, np.ndarray]) -> None:
    """Write ``columns`` (every name of COLUMNS) and the trace's ``meta`` as one file."""
    payload = [_padded(np.ascontiguousarray(columns[name], dtype=dtype).tobytes()) for name, dtype in COLUMNS.items()]
    digest = xxhash.xxh3_64()
    for chunk in payload:
        digest.update(chunk)
    header = {"format": FORMAT, "meta": meta,
              "columns": [{"name": n, "dtype": d, "count": len(columns[n])} for n, d in COLUMNS.items()],
              "checksum": digest.hexdigest()}
    text = json.dumps(header, allow_nan=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(_PREAMBLE.pack(MAGIC, VERSION, len(text)))
        f.write(text)
        for chunk in payload:
            f.write(chunk)


def read_columns(path: str | Path, parse_meta: Callable[[Any], T]) -> tuple[T, dict[str, np.ndarray]]:
    """The header's meta (through ``parse_meta``, whose ConfigError names what is wrong with it) and
    the columns of a trace file (those its version has); a malformed or truncated file raises
    ConfigError naming it."""
    try:
        with open(path, "rb") as f:
            return _parse(f, Path(path), parse_meta)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the access trace: {err.strerror or err}") from None


def _parse(f: BinaryIO, path: Path, parse_meta: Callable[[Any], T]) -> tuple[T, dict[str, np.ndarray]]:
    size = path.stat().st_size if path.is_file() else None      # (a pipe's is not known before it is read)
    head = f.read(_PREAMBLE.size)
    if len(head) < _PREAMBLE.size:
        raise not_a_trace(path, f"truncated: {len(head)} bytes, shorter than the {_PREAMBLE.size}-byte preamble")
    magic, version, header_len = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        hint = " (a JSON trace of tierkv run --trace? tierkv profile reads those)" if head.lstrip()[:1] == b"{" else ""
        raise not_a_trace(path, f"magic {magic!r}, expected {MAGIC!r}{hint}")
    if version not in COLUMNS_OF:
        raise not_a_trace(path, f"format version {version}; this tierkv reads versions "
                                f"{', '.join(map(str, COLUMNS_OF))}")
    header = _parse_header(f.read(header_len), header_len, path, COLUMNS_OF[version])
    try:
        meta = parse_meta(header["meta"])
    except ConfigError as err:
        raise not_a_trace(path, str(err)) from None
    if not isinstance(header.get("checksum"), str):
        raise not_a_trace(path, "the header has no checksum")
    columns = header["columns"]
    expected = _PREAMBLE.size + header_len + sum(_padded_len(c["count"] * np.dtype(c["dtype"]).itemsize)
                                                 for c in columns)
    if size is not None and size != expected:
        what = "truncated" if size < expected else "trailing bytes"
        raise not_a_trace(path, f"{what}: the header announces {expected} bytes, the file has {size}")
    digest = xxhash.xxh3_64()
    arrays: dict[str, np.ndarray] = {}
    for column in columns:
        length = _padded_len(column["count"] * np.dtype(column["dtype"]).itemsize)
        raw = f.read(length)
        if len(raw) < length:
            raise not_a_trace(path, f"truncated: the header announces {expected} bytes, and fewer came")
        digest.update(raw)
        arrays[column["name"]] = np.frombuffer(raw, dtype=column["dtype"], count=column["count"]).copy()
    if size is None and f.read(1):
        raise not_a_trace(path, f"trailing bytes: the header announces {expected} bytes, and more came")
    if digest.hexdigest() != header["checksum"]:
        raise not_a_trace(path, "the column bytes do not match the header's checksum (the file is corrupt)")
    return meta, arrays


def _parse_header(raw: bytes, length: int, path: Path, expected: list[str]) -> dict[str, Any]:
    if len(raw) < length:
        raise not_a_trace(path, f"truncated inside the {length}-byte header")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise not_a_trace(path, f"the header is not UTF-8 JSON ({err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise not_a_trace(path, f"the header's format is not {FORMAT!r}")
    columns = header.get("columns")
    names = [c.get("name") for c in columns] if isinstance(columns, list) and all(
        isinstance(c, dict) for c in columns) else None
    if names != expected:
        raise not_a_trace(path, f"the header lists columns {names}, expected {expected}")
    for column in columns:
        count = column.get("count")
        if column.get("dtype") != COLUMNS[column["name"]] or not isinstance(count, int) or count < 0:
            raise not_a_trace(path, f"column {column['name']!r}: dtype {column.get('dtype')!r} count {count!r}, "
                                    f"expected dtype {COLUMNS[column['name']]!r} and a count >= 0")
    if "meta" not in header:
        raise not_a_trace(path, "the header's meta is incomplete or has unknown fields ('meta')")
    return header


def _padded(raw: bytes) -> bytes:
    return raw + b"\0" * (-len(raw) % 8)


def _padded_len(n: int) -> int:
    return n + (-n % 8)
