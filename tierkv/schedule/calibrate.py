"""Measure this machine for the cost model, and cache the result.

Links come from `tierkv.profile.probe` (host memcpy, NVMe read and write; cached by it). Compute
is measured on the model's own first decoder layer, through the same functions the runner calls::

    layer(M)            one layer on M rows of one token (matmuls, norms, MLP, overhead), for
                        M = 1, 4, 16, ... up to the first point at or past ``max_rows`` (the most
                        tokens one GPU batch computes at once: rows x prompt in prefill, at most
                        4096 measured); linear in between and beyond
    attention           seconds per (row x query x key) at decode (1 query, the runner's own
                        ``attend``: SDPA under the keep-mask) and prefill (one sequence, causal, as
                        the prefill groups run); not as a layer's time minus a layer without
                        keys, a difference that load on a shared machine drives below zero
    head(M)             embedding + final norm + lm_head for M rows
    dequant             bytes/s of int4 KV decoded (tierkv.codec)
    convert             bytes/s of streamed weights converted from each storage dtype
                        (``policy.weight_dtype``: bf16, fp16) to the compute dtype, counted as stored

Every call is timed in interleaved rounds (``_time_all``) and the median kept. The machine still
drifts between a calibration and a run: a job measures its first block's first token steps and
rescales the calibration by them (``in_run_factor``).

The measurements are cached in ``$TIERKV_CACHE_DIR/batch-calibration.json`` (default
~/.cache/tierkv), one entry per host, model shape, dtype and thread count; ``refresh=True``
measures again (``tierkv batch --recalibrate``).
"""
from __future__ import annotations

import socket
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tierkv.knobs import cache_dir, read_cache, write_cache
from tierkv.layout import BlockLayout
from tierkv.model import arch
from tierkv.schedule.compute import GpuBatch, attend, keep_mask, layer_forward
from tierkv.schedule.cost import COMPRESSED, Machine, ModelShape, Terms, compute_s
from tierkv.schedule.policy import WEIGHT_DTYPES

CACHE_FILE = "batch-calibration.json"
VERSION = 5   # 2: attention timed directly, prefill priced over the full query x key product; 3: convert;
#               4: medians, not minima; 5: interleaved rounds, causal prefill attention, decode-shaped layers


def calibrate(model: nn.Module, *, nvme_dir: Path | None = None, max_rows: int = 1024,
              refresh: bool = False, cache_dir: Path | None = None) -> Machine:
    """The machine as the cost model sees it, measured (or read from the cache)."""
    from tierkv.profile.probe import probe_links
    links = probe_links(nvme_dir, refresh=refresh)["links"]
    shape = ModelShape.of(model)
    key = f"{socket.gethostname()}|{shape}|{torch.get_num_threads()}"
    path = cache_path(cache_dir)
    cached = read_cache(path)
    entry = cached.get(key)
    stale = entry is None or entry.get("version") != VERSION or max(entry["layer"])[0] < min(max_rows, 4096)
    if refresh or stale:
        entry = measure_compute(model, max_rows)
        cached[key] = entry
        write_cache(path, cached)
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


def in_run_factor(t: Terms, x: dict[str, float], step_compute_s: list[float], steps: int = IN_RUN_STEPS) -> float:
    """How many times slower the first ``steps`` token steps of a real block computed than ``t``
    (the block's terms on the calibrated machine, at fractions ``x``) prices them: the runner's
    compute time of those steps, waits excluded, over what the model says that time covers
    (`tierkv.schedule.cost.compute_s`). Disk links, the overlap, waits and the later steps are
    still the model's."""
    ran = next((i for i, s in enumerate(step_compute_s) if s <= 0), len(step_compute_s))   # a block may stop early
    steps = min(steps, ran)
    predicted = compute_s(t, x, steps) if steps else 0.0
    return sum(step_compute_s[:steps]) / predicted if predicted > 0 else 1.0


# -- measuring ------------------------------------------------------------------
@torch.no_grad()
def measure_compute(model: nn.Module, max_rows: int) -> dict:
    layer = arch.decoder_layers(model)[0]
    spec = arch.model_spec(model)
    ladder = (1, 4, 16, 64, 256, 1024, 4096)        # beyond the last point time grows linearly in M
    rows = sorted({m for m in ladder if m < max_rows} | {next((m for m in ladder if m >= max_rows), ladder[-1])})
    heads = [m for m in (1, 64, 512) if m <= max(64, max_rows)]
    decode_keys, prefill_tokens = 1024, 256
    layout = BlockLayout.batch_kv(spec.num_kv_heads, spec.head_dim, torch.bfloat16, 256, 8, codec=COMPRESSED)
    packed = torch.stack([layout.pack(torch.randn(layout.fields[0].shape), torch.randn(layout.fields[0].shape))] * 4)
    calls = {("layer", m): _layer_call(model, layer, spec.group, m, 1, 1) for m in rows}   # decode-shaped
    calls |= {("head", m): (lambda m=m: _head_once(model, m)) for m in heads}
    calls |= {("decode", 0): _attend_call(model, 8, 1, decode_keys), ("prefill", 0): _causal_call(model, prefill_tokens),
              ("dequant", 0): lambda: layout.unpack(packed)}
    calls |= {("convert", name): _convert_call(getattr(torch, name), spec.dtype) for name in WEIGHT_DTYPES}
    took = _time_all(calls)
    return {"version": VERSION, "layer": [(m, took["layer", m]) for m in rows],
            "head": [(m, took["head", m]) for m in heads],
            "attention_decode": took["decode", 0] / (8 * decode_keys),
            "attention_prefill": took["prefill", 0] / (prefill_tokens * prefill_tokens),
            "dequant": packed.numel() / took["dequant", 0],
            "convert": {name: CONVERT_NUMEL * getattr(torch, name).itemsize / took["convert", name]
                        for name in WEIGHT_DTYPES}}


CONVERT_NUMEL = 8 * 1024 * 1024


def _convert_call(stored: torch.dtype, compute: torch.dtype) -> Callable[[], object]:
    """A flat tensor converted into a preallocated one, as a weight load does (rate counted as stored)."""
    src = torch.randn(CONVERT_NUMEL).to(stored)
    dst = torch.empty(CONVERT_NUMEL, dtype=compute)
    return lambda: dst.copy_(src)


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


def _time_all(calls: dict, min_s: float = 0.04, rounds: int = 7) -> dict:
    """Median seconds of one call of each, over ``rounds`` rounds that each time every call once for
    at least ``min_s``.

    Round-robin, not one call after another: on a shared host a burst of someone else's work lasts
    seconds, and timed one after another it landed on a few ladder points and not the others (two
    calibrations a minute apart read one layer at 32 rows as 29.8 and 15.2 ms while the runner
    computed it in 17.4-17.9 ms both times). Interleaved, a burst slows every point of a round alike
    and the median over rounds drops it. The median, not the best: a batch job meets the machine as
    it usually is (the quietest of three batches predicted a 1.2B model's run 47 % fast)."""
    for fn in calls.values():
        fn()   # warm-up
    per_call: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            n, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < min_s or n == 0:
                fn()
                n += 1
            per_call[name].append(elapsed / n)
    return {name: statistics.median(t) for name, t in per_call.items()}


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
