"""How fast does decode run over tiered KV, against transformers' own caches, and what bounds it?

Per context, one passkey prompt and ONE prefill (transformers, DynamicCache); its KV seeds every
configuration, which then runs the same greedy steps and must produce DynamicCache's tokens::

    config               the KV lives in                         per step, over the whole KV
    dynamic-cache        DynamicCache, memory                     torch.cat copies each layer, attention reads it
    static-cache         StaticCache, preallocated to ctx+steps   index_copy of one token; attention over the
                                                                  preallocated length, masked
    tiered-cache         TieredCache, gpu tier holds all          one appending buffer per layer; attention
                                                                  "tierkv" (tierkv.hf: a decode step's query
                                                                  heads folded onto their KV heads)
    tiered-cache-small   TieredCache, gpu tier 10 % + cpu         blocks read in place from any memory tier
                                                                  (without CUDA gpu = host memory); "tierkv"
    dynamic-cache-folded DynamicCache, memory                     the dynamic-cache row with attention "tierkv":
                                                                  what the attention alone gives
    native-ram           tierkv Engine, gpu tier holds all        blockwise attention + LSE merge (the loop's
                                                                  own cost, without disk)
    native-nvme          tierkv Engine, gpu 10 % + cpu 10 %,      blockwise attention + LSE merge; blocks that
                         the rest only on NVMe                    miss memory are read from disk
    llama-cpp            llama.cpp's own KV cache, the same GGUF    (bench/llama_rows.py; only where
                         (quantized weights), the same threads      llama_cpp imports: the bench extra)

The configurations are built side by side (one after another where RAM is short) and stepped in
turn, so the shared machine's noise hits them alike; each one's first step is an untimed warm-up
(the sparse NVMe rows also leave untimed the steps that fill their memory tiers).
Prefill once, decode many: a second ``tierkv run`` over the same prompt reuses the stored KV;
``ttft_second_vs_first@CTX`` compares the two runs' time to first token.

Sparse rows (``bench/sparse_rows.py``): at 128K (quick: 32K), ShadowKV-style decode with every page
in memory and with >= 80 % of them only on NVMe (with and without prefetch) against DynamicCache;
the in-memory sparse row and its peers take turns of three tokens where they fit together.
Branching rows (``bench/branch_rows.py``): speculative decoding over tiered KV at 4K and 32K (quick:
4K), and the memory four beams hold.

    python bench/decode.py --quick --out bench/out/decode-quick.json
    python bench/decode.py --contexts 4K,16K --out bench/out/decode.json
    python bench/decode.py --contexts none --reuse-at none --branch-contexts none --sparse-page-dtypes int4
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import DynamicCache, StaticCache

from report import Help, Report, available_ram, filesystem, machine, out_file, whole
from tiers import RawFile, fill_pattern
from tierkv.config import TierConfig
from tierkv.device import host_buffer
from tierkv.errors import ConfigError
from tierkv.hf import ATTENTION, TieredCache
from tierkv.knobs import IOKnobs
from tierkv.manager import BlockingTierManager
from tierkv.model.arch import weight_bytes
from tierkv.model.engine import Engine
from tierkv.session.run import RunResult, run
from tierkv.model.settings import DTYPES, RunConfig
from tierkv.model.loading import LoadedModel, load_model, resolve_source
from tierkv.model.weights import WEIGHTS
from tierkv.model.prompt import passkey_prompt
from tierkv.sparse import SparseConfig
from tierkv.layout import BlockLayout
from tierkv.events import EventRecorder, busy_seconds
from branch_rows import measure_branching
from llama_rows import LlamaDecoder, repacking_off, version as llama_version
from sparse_rows import SPARSE_ROWS, measure_sparse

K, MiB = 1024, 1024**2
BLOCK_TOKENS = 256
SMALL_SHARE = 0.10          # gpu tier of tiered-cache-small; gpu and cpu tiers of native-nvme each
TARGETS = {"ttft_second_vs_first@16K": 10.0, "dense_vs_llamacpp@4K": 0.5, "dense_tiered_vs_dynamic@4K": 1.3,
           "dense_tiered_vs_dynamic@16K": 1.2}


@dataclass(slots=True)
class Decoded:
    """Greedy steps of one configuration: its tokens, each timed step's seconds, its own figures, the
    seconds of the untimed steps before (the first step, and any that filled its caches), and those of
    every step its figures count (the timed ones, and the untimed first of a later turn: ``interleave``)."""

    tokens: list[int]
    seconds: list[float]
    figures: dict[str, object] = field(default_factory=dict)
    warmup: list[float] = field(default_factory=list)
    counted: list[float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return len(self.seconds) / sum(self.seconds)

    @property
    def counted_steps(self) -> int:
        """The steps a figure such as bytes read spans: a per-token figure divides by these."""
        return len(self.seconds if self.counted is None else self.counted)

    @property
    def counted_s(self) -> float:
        """Their seconds: a figure such as the time waited is a share of these."""
        return sum(self.seconds if self.counted is None else self.counted)

    def ms(self, q: float) -> float:
        ordered = sorted(self.seconds)
        return 1e3 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Decoder(Protocol):
    """One configuration, ready to decode after the prompt: ``step`` feeds a token, returns the next."""

    def step(self, token: int) -> int: ...
    def start_timing(self) -> None: ...      # called after the untimed warm-up steps
    def figures(self) -> dict[str, object]: ...
    def close(self) -> None: ...


# -- transformers caches ----------------------------------------------------------
@torch.inference_mode()
def prefill_hf(model, ids: list[int]) -> tuple[int, DynamicCache, float]:
    """The prompt through transformers once: (first generated token, its DynamicCache, seconds)."""
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(input_ids=torch.tensor([ids], device=model.device), cache=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax()), cache, time.perf_counter() - start


class HfDecoder:
    """transformers' own forward over a cache with the ``attention`` implementation (transformers' own
    ``sdpa`` unless told); adds up the seconds attention spends in ``cache.update``."""

    def __init__(self, model, cache, pos: int, attention: str = "sdpa") -> None:
        self.model, self.cache, self.pos, self.attention = model, cache, pos, attention
        self.kv_seconds = 0.0
        inner = cache.update

        def timed_update(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.kv_seconds += time.perf_counter() - start

        cache.update = timed_update   # attention calls cache.update(k, v, layer_idx, ...)

    @torch.inference_mode()
    def step(self, token: int) -> int:
        self.model.set_attn_implementation(self.attention)   # configs share the model (~0.3 ms)
        device = self.model.device
        out = self.model(input_ids=torch.tensor([[token]], device=device),
                         position_ids=torch.tensor([[self.pos]], device=device),
                         cache=self.cache, use_cache=True, logits_to_keep=1)
        self.pos += 1
        return int(out.logits[0, -1].argmax())

    def start_timing(self) -> None:
        self.kv_seconds = 0.0

    def figures(self) -> dict[str, object]:
        return {"kv_seconds": self.kv_seconds}

    def close(self) -> None:
        if isinstance(self.cache, TieredCache):
            self.cache.close()
        self.cache = None


def static_from(prefilled: DynamicCache, config, max_len: int) -> StaticCache:
    cache = StaticCache(config=config, max_cache_len=max_len)
    for src, dst in zip(prefilled.layers, cache.layers):
        dst.update(src.keys, src.values)
    return cache


def tiered_from(prefilled: DynamicCache, config, gpu: int, cpu: int) -> TieredCache:
    cache = TieredCache(config, gpu=gpu, cpu=cpu, block_tokens=BLOCK_TOKENS)
    with torch.inference_mode():
        for src, dst in zip(prefilled.layers, cache.layers):
            dst.update(src.keys, src.values)   # seals the prompt's blocks into the tiers
    return cache


# -- the native loop over NVMe -----------------------------------------------------
class NativeDecoder:
    """The Engine over tiers built from ``config``; the prompt's KV is the transformers prefill's.

    That KV (the same post-RoPE K/V the engine stores) is sealed into the tiers, and written back
    to the NVMe store when there is one, before decoding starts.
    """

    def __init__(self, loaded: LoadedModel, ids: list[int], prefilled: DynamicCache, layout: BlockLayout,
                 config: TierConfig, record: bool = True) -> None:
        self.recorder = EventRecorder(enabled=record)
        self.manager = BlockingTierManager.from_config(config, namespace=layout.name, recorder=self.recorder)
        self.engine = Engine(loaded, self.manager)
        self.seq = self.engine.new_sequence()
        self.seq.add_tokens(ids)
        with torch.inference_mode():
            for layer, src in enumerate(prefilled.layers):
                self.seq.append(layer, src.keys, src.values)
        self.manager.flush()
        self.memory_bytes = config.gpu + config.cpu
        self.mark, self.read_before, self.resident = 0, 0, {}

    def step(self, token: int) -> int:
        return int(self.engine.decode(self.seq, token).argmax())

    def start_timing(self) -> None:
        mgr = self.manager.manager
        self.mark, self.read_before = len(self.recorder.events), self._nvme_read()
        self.resident = {name: mgr.tiers[name].pool.used for name in mgr.memory_tiers}

    def figures(self) -> dict[str, object]:
        mgr = self.manager.manager
        events = self.recorder.events[self.mark:]
        waited = {"waited_s": sum(e.seconds for e in events if e.kind == "wait")}
        if mgr.store is None:
            return waited
        loads = [e for e in events if e.src == "nvme" and e.kind in ("load", "prefetch")]
        blocks = sum(len(layer) for layer in self.seq.blocks)
        nvme_only = sum(1 for e in mgr.directory if list(e.copies) == ["nvme"])
        return waited | {"nvme_read_bytes": self._nvme_read() - self.read_before,
                         "nvme_busy_s": busy_seconds([(e.start, e.done) for e in loads]),
                         "nvme_only_share": round(nvme_only / blocks, 3), "memory_tier_bytes": self.memory_bytes,
                         "memory_blocks_at_start": self.resident}

    def _nvme_read(self) -> int:
        return self.manager.tier_stats().get("nvme", {}).get("bytes_read", 0)

    def close(self) -> None:
        self.seq.release(keep=False)
        self.manager.close()


# -- one context ---------------------------------------------------------------------
def interleave(decoders: dict[str, Decoder], first: int, steps: int, turn: int = 1) -> dict[str, Decoded]:
    """Step every config in turn, ``turn`` tokens at a time, so the shared machine's noise hits them alike.
    A config's first step is untimed, and so are the next ones while it says its caches are still filling
    (``warming``, where it has one): the timed steps are its steady state. With ``turn`` > 1 the first
    token of each later turn is untimed too: it brings back into the CPU's caches what the other configs'
    turns pushed out (a bf16 SmolLM2's weights fit a large L3 between its own steps), so that a timed
    step runs as it would alone."""
    tokens = {name: [first] for name in decoders}
    seconds: dict[str, list[float]] = {name: [] for name in decoders}
    warmup: dict[str, list[float]] = {name: [] for name in decoders}
    counted: dict[str, list[float]] = {name: [] for name in decoders}   # every step since timing started
    timing = dict.fromkeys(decoders, False)
    while any(len(s) < steps for s in seconds.values()):
        for name, decoder in decoders.items():
            for i in range(turn):
                if len(seconds[name]) == steps:
                    break
                start = time.perf_counter()
                tokens[name].append(decoder.step(tokens[name][-1]))
                took = time.perf_counter() - start
                if timing[name]:
                    counted[name].append(took)
                    if i or turn == 1:       # (the first of a later turn re-warms the caches)
                        seconds[name].append(took)
                    continue
                warmup[name].append(took)
                if not getattr(decoder, "warming", lambda: False)():
                    decoder.start_timing()
                    timing[name] = True
    return {name: Decoded(tokens[name][1:], seconds[name], d.figures(), warmup[name], counted[name])
            for name, d in decoders.items()}


def decode_all(builders: dict[str, Callable[[], Decoder]], first: int, steps: int,
               together: bool, turn: int = 1) -> dict[str, Decoded]:
    runs: dict[str, Decoded] = {}
    for group in [list(builders)] if together else [[name] for name in builders]:
        gc.collect()
        with contextlib.ExitStack() as stack:
            decoders = {name: stack.enter_context(contextlib.closing(builders[name]())) for name in group}
            runs |= interleave(decoders, first, steps, turn if len(group) > 1 else 1)
    return runs


DENSE_ROWS = ("dynamic-cache", "static-cache", "tiered-cache", "tiered-cache-small", "dynamic-cache-folded",
              "native-ram", "native-nvme", "native-nvme-no-events", "llama-cpp")


def measure_context(report: Report, loaded: LoadedModel, ctx: int, steps: int, workdir: Path,
                    rows: frozenset[str] | None = None) -> dict[str, Decoded]:
    """The dense rows at one context; ``rows``: only these configurations (dynamic-cache always runs: every
    ratio and token check is against it)."""
    model, spec = loaded.model, loaded.spec
    ids = passkey_prompt(loaded.tokenizer, ctx).ids
    first, prefilled, prefill_s = prefill_hf(model, ids)
    progress(f"{ctx // K}K: transformers prefill {prefill_s:.1f} s")
    report.add_row("dynamic-cache", "prefill_s", round(prefill_s, 2), "s", context=ctx)
    layout = BlockLayout.kv(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, BLOCK_TOKENS)
    pos, length = len(ids), len(ids) + steps + 1
    n_blocks = spec.num_layers * -(-length // BLOCK_TOKENS)
    all_kv = (n_blocks + spec.num_layers) * layout.block_bytes
    small = max(2 * spec.num_layers, round(SMALL_SHARE * n_blocks)) * layout.block_bytes
    builders: dict[str, Callable[[], Decoder]] = {
        "dynamic-cache": lambda: HfDecoder(model, copy.deepcopy(prefilled), pos),
        "static-cache": lambda: HfDecoder(model, static_from(prefilled, model.config, length), pos),
        "tiered-cache": lambda: HfDecoder(model, tiered_from(prefilled, model.config, all_kv, 0), pos, ATTENTION),
        "tiered-cache-small": lambda: HfDecoder(model, tiered_from(prefilled, model.config, small, all_kv), pos,
                                                ATTENTION),
        "dynamic-cache-folded": lambda: HfDecoder(model, copy.deepcopy(prefilled), pos, ATTENTION),
        "native-ram": lambda: NativeDecoder(loaded, ids, prefilled, layout,
                                            TierConfig(layout.block_bytes, gpu=all_kv, cpu=0)),
        "native-nvme": lambda: NativeDecoder(loaded, ids, prefilled, layout, TierConfig(
            layout.block_bytes, gpu=small, cpu=small, nvme_dir=workdir / f"native-{ctx}")),
        "native-nvme-no-events": lambda: NativeDecoder(loaded, ids, prefilled, layout, TierConfig(
            layout.block_bytes, gpu=small, cpu=small, nvme_dir=workdir / f"native-quiet-{ctx}"), record=False),
    }
    if llama_version() is not None:
        builders["llama-cpp"] = lambda: LlamaDecoder(resolve_source("smollm2"), ids, length + 16, torch.get_num_threads())
    if rows is not None:
        builders = {name: build for name, build in builders.items() if name in rows or name == "dynamic-cache"}
    kv_bytes = pos * spec.kv_bytes_per_token
    together = 8 * length * spec.kv_bytes_per_token < 0.5 * available_ram()
    runs = decode_all(builders, first, steps, together)
    reference = runs["dynamic-cache"].tokens
    progress(f"{ctx // K}K: " + ", ".join(f"{name} {d.tokens_per_s:.2f}" for name, d in runs.items()) + " tok/s")
    for name, d in runs.items():
        report.add_row(name, "decode_tokens_per_s", round(d.tokens_per_s, 3), "tok/s", context=ctx,
                       median_ms=round(d.ms(0.5), 1), p90_ms=round(d.ms(0.9), 1), same_tokens=d.tokens == reference,
                       kv_bytes=kv_bytes, steps=steps, interleaved=together, **_row_figures(d),
                       **({"text": loaded.tokenizer.decode([first, *d.tokens])} if name == "dynamic-cache" else {}))
    return runs


def _row_figures(d: Decoded) -> dict[str, object]:
    f, total, steps = d.figures, d.counted_s, d.counted_steps
    if not f:
        return {}
    if "kv_seconds" in f:
        return {"kv_share": round(f["kv_seconds"] / total, 3)}
    row = {"stall_fraction": round(f["waited_s"] / total, 3)}
    if "nvme_read_bytes" in f:
        busy = f["nvme_busy_s"]
        row |= {"nvme_bytes_per_token": f["nvme_read_bytes"] // steps,
                "nvme_read_gbps": round(f["nvme_read_bytes"] / busy / 1e9, 3) if busy else None,
                **{k: f[k] for k in ("nvme_only_share", "memory_tier_bytes", "memory_blocks_at_start")}}
    return row


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


VS_DYNAMIC = {  # ratio -> (config, what it divides by DynamicCache's decode tok/s in the same run)
    "dense_tiered_vs_dynamic": ("tiered-cache", "decode tok/s of TieredCache with all KV in its gpu tier "
                                                "(attention \"tierkv\"; DynamicCache: transformers' sdpa)"),
    "dynamic_folded_vs_dynamic": ("dynamic-cache-folded", "decode tok/s of DynamicCache with attention \"tierkv\" "
                                                          "(what the folded decode attention alone gives)"),
    "native_ram_vs_dynamic": ("native-ram", "decode tok/s of the native loop with all KV in memory"),
    "native_nvme_vs_dynamic": ("native-nvme", "decode tok/s of the native loop with ~80 % of KV only on NVMe"),
}


def add_context_ratios(report: Report, ctx: int, runs: dict[str, Decoded]) -> None:
    """The ratios whose rows ran (``--dense-rows`` may leave some out)."""
    tag, base = f"@{ctx // K}K", runs["dynamic-cache"].tokens_per_s
    for name, (config, meaning) in VS_DYNAMIC.items():
        if config in runs:
            report.add_ratio(name + tag, round(runs[config].tokens_per_s / base, 3), TARGETS.get(name + tag),
                             f"{meaning} / DynamicCache all in memory, same run")
    if {"tiered-cache", "dynamic-cache-folded"} <= runs.keys():
        report.add_ratio(f"dense_tiered_vs_dynamic_folded{tag}",
                         round(runs["tiered-cache"].tokens_per_s / runs["dynamic-cache-folded"].tokens_per_s, 3),
                         None, "decode tok/s of TieredCache / DynamicCache, both with attention \"tierkv\": the "
                         "cache's own share of dense_tiered_vs_dynamic, same run")
    if {"llama-cpp", "native-ram"} <= runs.keys():
        llama = runs["llama-cpp"].tokens_per_s
        report.add_ratio(f"dense_vs_llamacpp{tag}", round(runs["native-ram"].tokens_per_s / llama, 3),
                         TARGETS.get(f"dense_vs_llamacpp{tag}"),
                         "decode tok/s of the native loop with all KV in memory / llama.cpp on the same GGUF "
                         "(its quantized weights, its own KV cache), same threads, same run"
                         + (f"; TieredCache / llama.cpp: {runs['tiered-cache'].tokens_per_s / llama:.3f}"
                            if "tiered-cache" in runs else ""))
    if not {"native-nvme", "native-nvme-no-events"} <= runs.keys():
        return
    native = runs["native-nvme"]
    quiet = runs["native-nvme-no-events"]
    report.add_ratio(f"profiler_overhead{tag}", round(quiet.tokens_per_s / native.tokens_per_s - 1, 3), 0.03,
                     "native-nvme decode tok/s without event recording / with it, minus 1 (same run, "
                     "interleaved steps; the target is a ceiling: below 0.03 meets it)", ceiling=True)
    report.add_ratio(f"stall_fraction_native_nvme{tag}", round(native.figures["waited_s"] / native.counted_s, 3),
                     None, "native-nvme: seconds decode waited on tier loads ('wait' events) / decode seconds")


# -- prefill once, decode many -----------------------------------------------------------
def measure_reuse(report: Report, loaded: LoadedModel, ctx: int, dtype: str, workdir: Path) -> None:
    config = RunConfig.of(synthetic_tokens=ctx, nvme_dir=workdir / f"reuse-{ctx}", max_new_tokens=4, dtype=dtype)
    (first, first_cpu), (second, second_cpu) = _timed_run(config, loaded), _timed_run(config, loaded)
    same = second.text == first.text
    progress(f"{ctx // K}K: tierkv run ttft {first.ttft_s:.1f} s, then {second.ttft_s:.1f} s")
    for name, r, cpu in (("tierkv-run-first", first, first_cpu), ("tierkv-run-second", second, second_cpu)):
        report.add_row(name, "ttft_s", round(r.ttft_s, 2), "s", context=ctx, ttft_cpu_s=round(cpu, 2),
                       reused_prompt_tokens=r.reused_prompt_tokens, same_tokens=same, text=r.text)
    name = f"ttft_second_vs_first@{ctx // K}K"
    report.add_ratio(name, round(first.ttft_s / second.ttft_s, 2), TARGETS.get(name),
                     f"tierkv run over the same {ctx}-token prompt: first ttft / second ttft, wall (CPU seconds of "
                     f"all threads: {first_cpu / second_cpu:.2f}x); the second reuses {second.reused_prompt_tokens} "
                     f"stored prompt tokens; texts {'match' if same else 'DIFFER'}")


def _timed_run(config: RunConfig, loaded: LoadedModel) -> tuple[RunResult, float]:
    """``run`` and the process CPU seconds (every thread) until its prefill is done."""
    start, cpu = time.process_time(), [0.0]

    def on_prefill(done: int, total: int) -> None:
        if done >= total:
            cpu[0] = time.process_time() - start

    return run(config, loaded=loaded, on_prefill=on_prefill), cpu[0]


# -- the machine's limits -------------------------------------------------------------------
def measure_limits(workdir: Path, nbytes: int = 256 * MiB, rounds: int = 3) -> dict[str, float]:
    """Best of ``rounds``: memcpy, a read-only pass (an int64 sum) and raw O_DIRECT reads, in GB/s."""
    src, dst = host_buffer(nbytes, pinned=False), host_buffer(nbytes, pinned=False)
    fill_pattern(src)
    dst.zero_()
    probes = {"memcpy_gbps": lambda: dst.copy_(src), "read_gbps": lambda: src.view(torch.int64).sum()}
    raw = RawFile(workdir / "raw.dat", src)
    try:
        raw.write(4)
        probes["odirect_read_gbps"] = lambda: raw.read(4)   # 4 threads, 4 MiB calls
        best = {name: float("inf") for name in probes}
        for _ in range(rounds):
            for name, probe in probes.items():
                start = time.perf_counter()
                probe()
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        raw.close()
    return {name: round(nbytes / seconds / 1e9, 2) for name, seconds in best.items()}


def step_weight_bytes(model) -> int:
    """Weight bytes a decode step reads: all of them, but the embedding table's when the output head is
    not that table (``--weights int4`` unties it): a step then looks up one row of it."""
    table = model.model.embed_tokens.weight
    tied = getattr(model.lm_head, "weight", None) is table
    return weight_bytes(model) - (0 if tied else table.numel() * table.element_size())


def add_bounds(report: Report, loaded: LoadedModel, limits: dict[str, float], workdir: Path) -> None:
    weights = step_weight_bytes(loaded.model)
    fstype, device, _ = filesystem(workdir)
    report.add_bound(f"limits measured in this run (best of 3, 256 MiB): memcpy {limits['memcpy_gbps']} GB/s, "
                     f"read-only pass {limits['read_gbps']} GB/s, raw O_DIRECT read {limits['odirect_read_gbps']} "
                     f"GB/s (4 threads, 4 MiB calls, {fstype} on {device}); every config reads the {weights / MiB:.0f}"
                     f" MiB of weights and the whole KV ({loaded.spec.kv_bytes_per_token} B/token) each step")
    on_cuda = loaded.model.device.type == "cuda"
    if on_cuda:
        report.add_bound(f"device: the model, its caches and TieredCache's gpu tier are on {torch.cuda.get_device_name()}"
                         f" (torch {torch.__version__}, CUDA {torch.version.cuda}); the cpu tier is pinned host "
                         f"memory, so tiered-cache-small and native-nvme copy blocks over PCIe every step")
    for row in report.rows:
        if row["metric"] == "decode_tokens_per_s" and "kv_bytes" in row and row["config"] != "llama-cpp" \
                and not on_cuda:   # the floors are host-memory ones
            report.add_bound(_row_bound(row, weights, limits))
    if not all(row.get("interleaved", True) for row in report.rows if "kv_bytes" in row):
        report.add_bound("where a dense row says interleaved=false, RAM was short for every config's KV at once: "
                         "the configs ran one after another and the machine's load drift is not shared between them")
    if not on_cuda:
        report.add_bound("tiered-cache-small: without CUDA its gpu tier is host memory too, and TieredCache reads a "
                         "block in place from whichever memory tier holds it, so it moves no more bytes than "
                         "tiered-cache")
    if any(row["config"] == "tierkv-run-second" for row in report.rows):
        report.add_bound("ttft reuse: a run adopts stored blocks only up to the last whole 1024-token chunk before the "
                         "prompt's last token, so the second run recomputes that chunk against the whole stored "
                         "context; a prompt of exactly CTX tokens (a multiple of 1024) is the worst case: 1024 "
                         "tokens recomputed")
    if llama_version() is None:
        report.add_bound("llama-cpp: llama_cpp does not import here (pip install -e '.[bench]'), not measured")
    else:
        gguf = resolve_source("smollm2")
        report.add_bound(f"llama-cpp {llama_version()}: {gguf.name} ({gguf.stat().st_size / MiB:.0f} MiB of quantized "
                         f"weights per step against tierkv's {weights / MiB:.0f} MiB"
                         + (" (4-bit layers, 8-bit head)" if "+int4" in loaded.model_id
                            else f" of {loaded.spec.dtype} ones") + "), "
                         f"its own KV cache (f16), {torch.get_num_threads()} threads"
                         + (", use_extra_bufts off (AMX)" if repacking_off() else ""))


def _row_bound(row: dict, weights: int, limits: dict[str, float]) -> str:
    kv, step_ms = row["kv_bytes"], row["median_ms"]
    floor_ms = 1e3 * (weights + kv) / (limits["read_gbps"] * 1e9)
    text = (f"{row['config']}@{row['context'] // K}K: {step_ms} ms/step median; reading weights + KV "
            f"({kv / MiB:.0f} MiB) once at the read-only speed takes {floor_ms:.0f} ms")
    if row.get("kv_share") is not None:
        text += f"; {100 * row['kv_share']:.0f} % of the step is spent inside cache.update"
    if "nvme_bytes_per_token" in row:
        disk_ms = 1e3 * row["nvme_bytes_per_token"] / (limits["odirect_read_gbps"] * 1e9)
        text += (f"; reads {row['nvme_bytes_per_token'] / MiB:.0f} MiB/token from NVMe ({row['nvme_only_share']:.0%} "
                 f"of blocks only there; blocks in memory tiers when timing began: {row['memory_blocks_at_start']})"
                 f" = {disk_ms:.0f} ms at raw O_DIRECT speed; loads achieved {row['nvme_read_gbps']} GB/s while busy")
    if "stall_fraction" in row:
        text += (f"; ~{step_ms * row['stall_fraction']:.0f} ms of a step waited on loads, the rest is compute and "
                 f"hops (one attention kernel call and one LSE merge per 256-token block)")
    return text + ("" if row["same_tokens"] else "; TOKENS DIFFER from dynamic-cache")


# -- command line ---------------------------------------------------------------------------
def parse_contexts(text: str, flag: str = "--contexts") -> tuple[int, ...]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            tokens = int(part[:-1]) * K if part.upper().endswith("K") else int(part)
        except ValueError:
            raise SystemExit(f"{flag}: {part!r} is not a size like 4K or 16384") from None
        if tokens <= 0:
            raise SystemExit(f"{flag}: {part!r}: a context must be > 0 tokens")
        out.append(tokens)
    return tuple(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=Help)
    parser.add_argument("--quick", action="store_true", help="4K only, 8 steps, reuse at 4K (~2 min on 2 cores)")
    parser.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    parser.add_argument("--contexts", help="comma-separated, like 4K,16K, or 'none' (default 4K,16K,32K; quick 4K)")
    parser.add_argument("--long", action="store_true", help="add 64K and 128K to the contexts")
    parser.add_argument("--steps", type=whole(1), help="greedy decode steps per config (default 16, quick 8)")
    parser.add_argument("--reuse-at", help="context of the prefill-once reuse runs, or 'none' (default 16K, quick 4K)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (default float32)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the NVMe stores go; a real disk, not tmpfs (default: the temp dir)")
    parser.add_argument("--threads", type=whole(1), help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--sparse-contexts", help="contexts of the sparse rows, or 'none' (default 128K, quick 32K)")
    parser.add_argument("--branch-contexts", help="contexts of the speculative-decoding rows, or 'none' "
                                                  "(default 4K,32K; quick 4K); the beam row runs unless 'none'")
    parser.add_argument("--sparse-rows", help="only these sparse configurations, like sparse-ram,"
                                               f"sparse-nvme-no-prefetch (default: all): {', '.join(SPARSE_ROWS)}")
    parser.add_argument("--dense-rows", help="only these dense configurations, like tiered-cache,native-ram "
                                              f"(default: all; dynamic-cache always runs): {', '.join(DENSE_ROWS)}")
    parser.add_argument("--weights", choices=WEIGHTS, help="keep the weights quantized in memory (tierkv.model.weights; "
                                                          "every row, transformers' too, runs on them; CPU only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model and its caches compute (default cpu; cuda measures the dense rows only)")
    parser.add_argument("--sparse-page-dtypes", default="",
                        help="quantized pages measured beside bf16 in the sparse rows, like int4 (their own prefill)")
    parser.add_argument("--sparse-store", type=Path, default=Path(tempfile.gettempdir()) / "tierkv-sparse-store",
                        help="NVMe store of the sparse rows, kept between runs: the prefill runs once (default: "
                             "tierkv-sparse-store in the temp dir)")
    args = parser.parse_args(argv)
    unknown = set(filter(None, (args.dense_rows or "").split(","))) - set(DENSE_ROWS)
    if unknown:
        parser.error(f"--dense-rows: {', '.join(sorted(unknown))} unknown; the dense rows are {', '.join(DENSE_ROWS)}")
    unknown = set(filter(None, (args.sparse_rows or "").split(","))) - set(SPARSE_ROWS)
    if unknown:
        parser.error(f"--sparse-rows: {', '.join(sorted(unknown))} unknown; the sparse rows are "
                     f"{', '.join(SPARSE_ROWS)}")
    if args.device == "cuda":
        if args.weights:
            parser.error(f"--weights {args.weights} runs on the CPU only; leave it out with --device cuda")
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
        if any(given != "none" for given in (args.reuse_at, args.sparse_contexts, args.branch_contexts)):
            parser.error("--device cuda measures the dense rows only: pass --reuse-at none --sparse-contexts none "
                         "--branch-contexts none (the sparse engine and tierkv run compute on the CPU)")
    for name in filter(None, args.sparse_page_dtypes.split(",")):
        try:
            SparseConfig(page_dtype=name)
        except ConfigError as exc:
            parser.error(f"--sparse-page-dtypes: {exc}")
    return args


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    contexts = () if args.contexts == "none" else parse_contexts(args.contexts or ("4K" if args.quick else "4K,16K,32K"))
    contexts += (64 * K, 128 * K) if args.long else ()
    steps = args.steps or (8 if args.quick else 16)
    reuse_at = parse_contexts(args.reuse_at or ("4K" if args.quick else "16K"), "--reuse-at") \
        if args.reuse_at != "none" else ()
    sparse_contexts = () if args.sparse_contexts == "none" else \
        parse_contexts(args.sparse_contexts or ("32K" if args.quick else "128K"), "--sparse-contexts")
    branch_contexts = () if args.branch_contexts == "none" else \
        parse_contexts(args.branch_contexts or ("4K" if args.quick else "4K,32K"), "--branch-contexts")
    if args.threads:
        torch.set_num_threads(args.threads)
    IOKnobs.from_env().apply_to_process()    # as the tierkv command sets its own process, for every row alike
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the stores still go
    args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".tierkv-decode-", dir=args.dir))
    report = Report("decode", args.quick, machine(workdir))
    started = time.perf_counter()
    try:
        limits = measure_limits(workdir)
        loaded = load_model("smollm2", dtype=DTYPES[args.dtype], weights=args.weights)
        loaded.model.to(args.device)
        dense_rows = frozenset(args.dense_rows.split(",")) if args.dense_rows else None
        for ctx in contexts:
            add_context_ratios(report, ctx, measure_context(report, loaded, ctx, steps, workdir, dense_rows))
        for ctx in reuse_at:
            measure_reuse(report, loaded, ctx, args.dtype, workdir)
        for ctx in sparse_contexts:
            measure_sparse(report, loaded, ctx, steps, args.sparse_store, decode_all, HfDecoder,
                           tuple(p for p in args.sparse_page_dtypes.split(",") if p),
                           frozenset(args.sparse_rows.split(",")) if args.sparse_rows else None)
        if branch_contexts:
            measure_branching(report, loaded, branch_contexts, workdir)
        add_bounds(report, loaded, limits, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = round(time.perf_counter() - started, 1)
    report.add_bound(f"load: 1-min load average {report.machine['load_avg_1m']} at start, {os.getloadavg()[0]:.2f} "
                     f"at end, on {report.machine['threads']} CPUs; OMP_WAIT_POLICY="
                     f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; switch interval {sys.getswitchinterval()} s, "
                     f"malloc keeps {IOKnobs.from_env().malloc_keep >> 20} MiB freed; dtype {args.dtype}"
                     + (f", {args.weights} weights" if args.weights else "") + f", {steps} timed steps per config")
    if args.out:
        report.write_json(args.out)
    report.print_table(TABLE_COLUMNS)
    return report


TABLE_COLUMNS = (("context", "ctx"), ("config", "config"), ("metric", "metric"), ("value", "value"),
                 ("unit", "unit"), ("median_ms", "median ms"), ("p90_ms", "p90 ms"), ("kv_share", "in update"),
                 ("same_tokens", "same tokens"), ("stall_fraction", "stall"),
                 ("nvme_bytes_per_token", "nvme B/token"), ("reuse_rate", "reuse"), ("reused_prompt_tokens", "reused"))


if __name__ == "__main__":
    main()
