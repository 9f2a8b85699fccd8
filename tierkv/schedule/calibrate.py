"""Measure this machine for the cost model, and cache the result.

Links come from `tierkv.profile.probe` (host memcpy, NVMe read and write; cached by it). Compute
is measured on the model's own first decoder layer, through the same functions the runner calls::

    layer(M)            one layer on M rows of one token (matmuls, norms, MLP, overhead), for
                        M = 1, 4, 16, ... up to the first point at or past ``max_rows`` (the most
                        tokens one GPU batch computes at once: rows x prompt in prefill, at most
                        4096 measured); linear in between and beyond
    attention           seconds per (row x query x key) at decode (1 query) and prefill (many),
                        timed on the runner's own ``attend`` (SDPA with a dense boolean mask: a
                        causal prefill costs the full query x key product, masked or not); not as
                        a layer's time minus a layer without keys, a difference that load on a
                        shared machine drives below zero
    head(M)             embedding + final norm + lm_head for M rows
    dequant             bytes/s of int4 KV decoded (tierkv.codec)
    convert             bytes/s of streamed weights converted from each storage dtype
                        (``policy.weight_dtype``: bf16, fp16) to the compute dtype, counted as stored

The measurements are cached in ``$TIERKV_CACHE_DIR/batch-calibration.json`` (default
~/.cache/tierkv), one entry per host, model shape, dtype and thread count; ``refresh=True``
measures again (``tierkv batch --recalibrate``).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tierkv.knobs import cache_dir
from tierkv.layout import BlockLayout
from tierkv.model import arch
from tierkv.schedule.compute import GpuBatch, attend, keep_mask, layer_forward
from tierkv.schedule.cost import COMPRESSED, Machine, ModelShape, Terms, compute_s
from tierkv.schedule.policy import WEIGHT_DTYPES

CACHE_FILE = "batch-calibration.json"
VERSION = 4   # 2: attention timed directly, prefill priced over the full query x key product; 3: convert;
#               4: medians, not minima


def calibrate(model: nn.Module, *, nvme_dir: Path | None = None, max_rows: int = 1024,
              refresh: bool = False, cache_dir: Path | None = None) -> Machine:
    """The machine as the cost model sees it, measured (or read from the cache)."""
    from tierkv.profile.probe import probe_links
    links = probe_links(nvme_dir, refresh=refresh)["links"]
    shape = ModelShape.of(model)
    key = f"{socket.gethostname()}|{shape}|{torch.get_num_threads()}"
    path = cache_path(cache_dir)
    cached = _read(path)
    entry = cached.get(key)
    stale = entry is None or entry.get("version") != VERSION or max(entry["layer"])[0] < min(max_rows, 4096)
    if refresh or stale:
        entry = measure_compute(model, max_rows)
        cached[key] = entry
        _write(path, cached)
    return machine_from(entry, links)


def machine_from(entry: dict, links: dict) -> Machine:
    memcpy = links["cpu->cpu"]["gbps"] * 1e9
    read = links.get("nvme->cpu", {}).get("gbps", 2.0) * 1e9
    write = links.get("cpu->nvme", {}).get("gbps", 2.0) * 1e9
    layer = _interpolate(entry["layer"])
    head = _interpolate(entry["head"])
    per_decode, per_prefill = entry["attention_decode"], entry["attention_prefill"]

    def attention(rows: int, queries: int, keys: int) -> float:
        return rows * queries * keys * (per_decode if queries == 1 else per_prefill)
    return Machine(memcpy, read, write, layer, attention, head, entry["dequant"], convert=entry["convert"],
                   copies_on_compute=not torch.cuda.is_available())


# -- in the run -----------------------------------------------------------------
IN_RUN_STEPS = 2   # the prefill and the first decode step of a block


def in_run_factor(t: Terms, step_compute_s: list[float], steps: int = IN_RUN_STEPS) -> float:
    """How many times slower the first ``steps`` token steps of a real block computed than ``t``
    (the block's terms on the calibrated machine) prices them: the runner's compute time of those
    steps, waits excluded, over the model's compute of the same steps. Only the compute is
    measured; copies, waits, the overlap and the later steps are still the model's."""
    ran = next((i for i, s in enumerate(step_compute_s) if s <= 0), len(step_compute_s))   # a block may stop early
    steps = min(steps, ran)
    predicted = compute_s(t, steps) if steps else 0.0
    return sum(step_compute_s[:steps]) / predicted if predicted > 0 else 1.0


# -- measuring ------------------------------------------------------------------
@torch.no_grad()
def measure_compute(model: nn.Module, max_rows: int) -> dict:
    layer = arch.decoder_layers(model)[0]
    group = arch.model_spec(model).group
    ladder = (1, 4, 16, 64, 256, 1024, 4096)        # beyond the last point time grows linearly in M
    rows = sorted({m for m in ladder if m < max_rows} | {next((m for m in ladder if m >= max_rows), ladder[-1])})
    table = [(m, _time(_layer_call(model, layer, group, m, 1, 1))) for m in rows]   # decode-shaped
    decode_keys, prefill_tokens = 1024, 256
    decode = _time(_attend_call(model, 8, 1, decode_keys))
    prefill = _time(_causal_call(model, prefill_tokens))
    head = [(m, _time(lambda m=m: _head_once(model, m))) for m in (1, 64, 512) if m <= max(64, max_rows)]
    shape = (1, arch.model_spec(model).num_kv_heads, 256, arch.model_spec(model).head_dim)
    layout = BlockLayout.batch_kv(shape[1], shape[3], torch.bfloat16, shape[2], 8, codec=COMPRESSED)
    packed = torch.stack([layout.pack(torch.randn(layout.fields[0].shape), torch.randn(layout.fields[0].shape))] * 4)
    dequant = packed.numel() / _time(lambda: layout.unpack(packed))
    convert = {name: _convert_rate(getattr(torch, name), arch.model_spec(model).dtype) for name in WEIGHT_DTYPES}
    return {"version": VERSION, "layer": table, "head": head,
            "attention_decode": max(decode, 0.0) / (8 * decode_keys),
            "attention_prefill": max(prefill, 0.0) / (prefill_tokens * prefill_tokens),
            "dequant": dequant, "convert": convert}


def _convert_rate(stored: torch.dtype, compute: torch.dtype, numel: int = 8 * 1024 * 1024) -> float:
    """Bytes/s (as stored) of a flat tensor converted into a preallocated one, as a weight load does."""
    src = torch.randn(numel).to(stored)
    dst = torch.empty(numel, dtype=compute)
    return src.numel() * src.element_size() / _time(lambda: dst.copy_(src))


def _layer_call(model: nn.Module, layer: nn.Module, group: int, rows: int, tokens: int,
                past: int) -> Callable[[], object]:
    """One layer on ``rows`` x ``tokens`` new tokens over ``past`` cached keys, inputs prepared."""
    spec = arch.model_spec(model)
    pad = torch.zeros(rows, dtype=torch.long)
    batch = GpuBatch(torch.zeros(rows, past + tokens, dtype=torch.long), pad)
    batch.cos, batch.sin = arch.rope_cos_sin(model, torch.arange(past, past + tokens).expand(rows, -1))
    batch.mask = keep_mask(pad, past, tokens).repeat(1, 1, group, 1)
    h = torch.randn(rows, tokens, spec.hidden).to(spec.dtype)
    shape = (rows, spec.num_kv_heads, past + tokens, spec.head_dim)        # with room for the new columns
    kv = (torch.randn(shape).to(spec.dtype), torch.randn(shape).to(spec.dtype)) if past else None

    def call() -> object:
        batch.h = h
        return layer_forward(layer, batch, kv)
    return call


def _attend_call(model: nn.Module, rows: int, queries: int, keys: int) -> Callable[[], object]:
    """The runner's attention for ``rows`` x ``queries`` new tokens over ``keys`` keys, inputs prepared."""
    spec = arch.model_spec(model)
    q = torch.randn(rows, spec.num_heads, queries, spec.head_dim).to(spec.dtype)
    k, v = (torch.randn(rows, spec.num_kv_heads, keys, spec.head_dim).to(spec.dtype) for _ in range(2))
    mask = keep_mask(torch.zeros(rows, dtype=torch.long), keys - queries, queries).repeat(1, 1, spec.group, 1)
    return lambda: attend(q, k, v, mask)


def _causal_call(model: nn.Module, tokens: int) -> Callable[[], object]:
    """The prefill's attention of one sequence of ``tokens`` (causal: the kernel skips the masked half)."""
    spec = arch.model_spec(model)
    q = torch.randn(1, spec.num_heads, tokens, spec.head_dim).to(spec.dtype)
    k, v = (torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim).to(spec.dtype) for _ in range(2))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=spec.group > 1)


def _head_once(model: nn.Module, rows: int) -> None:
    h = arch.embed(model, torch.zeros(rows, 1, dtype=torch.long))
    arch.final_logits(model, h).argmax(-1)


def _time(fn: Callable[[], object], min_s: float = 0.05, repeats: int = 5) -> float:
    """Median seconds of one call, over ``repeats`` batches lasting at least ``min_s``.

    The median, not the best: a batch job meets the machine as it usually is. On a shared host,
    timings from the quietest of three batches predicted a 1.2B model's run 47 % faster than it went."""
    fn()  # warm-up
    per_call = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        per_call.append(elapsed / n)
    return statistics.median(per_call)


def _interpolate(table: list) -> Callable[[int], float]:
    """Piecewise-linear in M through the measured points; linear beyond the last two."""
    points = sorted({int(m): float(t) for m, t in table}.items())     # one point per M
    xs = [m for m, _ in points]

    def at(m: int) -> float:
        if len(points) == 1:
            return points[0][1] * max(m, 1) / max(xs[0], 1)
        i = min(max(bisect_left(xs, m), 1), len(points) - 1)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return max(y0 + (y1 - y0) * (m - x0) / (x1 - x0), 0.0)
    return at


# -- the cache ------------------------------------------------------------------
def cache_path(root: Path | None = None) -> Path:
    return Path(root or cache_dir()).expanduser() / CACHE_FILE


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
