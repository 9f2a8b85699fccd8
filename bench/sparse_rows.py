"""The sparse rows of ``bench/decode.py``: ShadowKV-style decode at long contexts against DynamicCache.

One passkey prompt per context; its sparse prefill runs once and is stored
(``--sparse-store``): later runs load the index and the pages instead of
prefilling again, which is what keeps a 128K row affordable on a CPU.
Configurations (one sparse decoder at a time: they share the store's lock)::

    dynamic-cache      transformers DynamicCache holding the KV that the sparse prefill stored
                       (keys rebuilt at full length from the pages): every step reads all of it
    dynamic-cache-folded   the same with attention "tierkv" (a decode step's GQA heads folded: the fast
                       path of transformers' sdpa on a CPU in bf16, see bench/decode.py's dense rows)
    sparse-ram         SparseEngine, every page in the gpu tier (loaded before timing), no prefetch
    sparse-ram-chunks  the same, each KV head attending only its own chunks (attend="chunks"): the
                       cost of attending whole pages (the default)
    sparse-nvme        gpu 10 % + cpu 10 % of the pages, the rest only on NVMe, speculative prefetch
    sparse-nvme-no-prefetch   the same without prefetch (the default: each layer attends to its pages in
                              memory while the rest load, then to those)
    sparse-nvme-no-overlap    no prefetch, and each layer waits for all of its pages before attending
                              (``--no-sparse-overlap``)
    sparse-ram[int4], sparse-nvme-no-prefetch[int4]   with ``--sparse-page-dtypes int4`` (any codec of
                       tierkv.codec): the same two rows over pages quantized, from a prefill of their own;
                       ``sparse_nvme_int4_vs_bf16`` divides the nvme row by the bf16 pages' one

The nvme rows start with empty memory tiers and time their steady state: the
steps until both tiers are full (at most `MAX_WARMUP_STEPS`) are untimed, and
reported as ``warmup_tokens_per_s`` (the first step, which also opens the
index, aside).

``sparse_nvme_vs_dynamic`` is the default configuration's (no prefetch: on a CPU a guess costs
more than it hides; overlap), whose stall is ``stall_fraction_no_prefetch``;
``sparse_nvme_speculative_vs_dynamic`` the speculative row's, whose stall is
``stall_fraction_sparse_nvme``; ``sparse_nvme_no_overlap_vs_dynamic`` and
``stall_fraction_no_overlap`` the row without overlap.

``sparse-ram`` and its dense peers (``dynamic-cache``, ``dynamic-cache-folded``, ``llama-cpp``) take
turns of ``TURN`` tokens, where the host has room for all of their KV at once (at 32K, not at 128K
on 24 GiB): the machine's swings of speed then hit a ratio's two rows alike. The first token of a
turn is not timed: the other rows' turns pushed this one's weights out of the CPU's caches. The
other rows run one after another; a row's ``interleaved`` says which way it ran.

DynamicCache attends at the real positions (past SmolLM2's 8K window its tokens are noise) and
sparse at remapped ones, so the tokens differ; the rows compare speed, not text.
"""
from __future__ import annotations

import copy
import functools
import random
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from llama_rows import LlamaDecoder, context_for, kv_bytes, version as llama_version
from report import Report, available_ram, random_read_rate
from tierkv.config import TierConfig
from tierkv.knobs import IOKnobs
from tierkv.manager import BlockingTierManager
from tierkv.session.prefill import shelf_of, sparse_state
from tierkv.model.arch import weight_bytes
from tierkv.model.loading import LoadedModel, resolve_source
from tierkv.model.prompt import passkey_prompt
from tierkv.model.sparse_engine import SparseEngine
from tierkv.events import EventRecorder
from tierkv.hf import ATTENTION
from tierkv.sparse import SparseConfig

K = 1024
SMALL_SHARE = 0.10     # of the pages, per memory tier, in the nvme rows
MAX_WARMUP_STEPS = 24
PAGE_DTYPE = "bfloat16"
DEPTH = 0.3            # the same prompt as bench/scale.py's first 128K depth: one prefill serves both
TURN = 3               # tokens a config decodes at its turn among the in-memory rows (the first re-warms)


class SparseDecoder:
    def __init__(self, loaded: LoadedModel, ids: list[int], store: Path, *, gpu: int, cpu: int,
                 prefetch: str, warm: bool, attend: str = "pages", fill: bool = False, overlap: bool = True,
                 page_dtype: str = PAGE_DTYPE) -> None:
        """``warm``: every page read into the gpu tier first; ``fill``: the steps until the memory
        tiers are full are untimed (``warming``); ``overlap``: SparseConfig.overlap."""
        cfg = SparseConfig(prefetch=prefetch, attend=attend, overlap=overlap, page_dtype=page_dtype)
        layout = SparseEngine.page_layout(loaded, cfg)
        self.recorder = EventRecorder()
        tiers = TierConfig(block_bytes=layout.block_bytes, gpu=gpu, cpu=cpu, nvme_dir=store / layout.name)
        self.manager = BlockingTierManager.from_config(tiers, namespace=layout.name, recorder=self.recorder)
        self.engine = SparseEngine(loaded, self.manager, cfg)
        opened = sparse_state(self.engine, ids[:-1], shelf_of(self.engine, store))
        self.seq, reused = opened.state.seq, opened.reused
        if not reused:
            raise RuntimeError("the sparse index was not found in the store: run the prefill first")
        if warm:    # every page read into the gpu tier before timing starts
            pages, group = self.seq.all_pages(), 2048
            scratch = torch.empty(group, layout.block_bytes, dtype=torch.uint8)
            for first in range(0, len(pages), group):
                keys = pages[first:first + group]
                self.manager.read(keys, into=scratch[:len(keys)], tier="gpu").wait()
        self.mark = 0
        self.nvme_before = 0
        self.fill, self.steps = fill, 0

    def step(self, token: int) -> int:
        self.steps += 1
        return int(self.engine.decode(self.seq, token).argmax())

    def warming(self) -> bool:
        """Whether a memory tier still has free slots (loads fill the gpu tier, its evictions the cpu
        tier): until then a step loads more from NVMe than it will once they are full."""
        mgr = self.manager.manager
        free = any(mgr.tiers[name].pool.free for name in mgr.memory_tiers)
        return self.fill and free and self.steps < MAX_WARMUP_STEPS

    def start_timing(self) -> None:
        self.mark, self.nvme_before = len(self.recorder.events), self._nvme_read()
        self.stats_before = (self.seq.stats.pages, self.seq.stats.reused, self.seq.stats.tokens,
                             self.seq.stats.steps)

    def figures(self) -> dict[str, object]:
        events = self.recorder.events[self.mark:]
        pages = self.seq.stats.pages - self.stats_before[0]
        reused = self.seq.stats.reused - self.stats_before[1]
        return {"waited_s": sum(e.seconds for e in events if e.kind == "wait"),
                "nvme_read_bytes": self._nvme_read() - self.nvme_before,
                "reuse_rate": reused / pages if pages else 0.0, "pages_read": pages,
                "tokens_per_layer_step": (self.seq.stats.tokens - self.stats_before[2]) /
                max(1, self.seq.stats.steps - self.stats_before[3]),
                "page_bytes": self.engine.layout.block_bytes}

    def _nvme_read(self) -> int:
        return self.manager.tier_stats().get("nvme", {}).get("bytes_read", 0)

    def close(self) -> None:
        self.seq.release(keep=True)
        self.manager.close()


def dynamic_from_store(loaded: LoadedModel, ids: list[int], store: Path) -> DynamicCache:
    """A DynamicCache holding the stored sparse prefill's KV, keys rebuilt from the pages at full length."""
    cfg = SparseConfig(page_dtype=PAGE_DTYPE)
    layout = SparseEngine.page_layout(loaded, cfg)
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu="64MiB", cpu=0, nvme_dir=store / layout.name)
    cache = DynamicCache(config=loaded.model.config)
    with BlockingTierManager.from_config(tiers, namespace=layout.name) as manager, torch.inference_mode():
        engine = SparseEngine(loaded, manager, cfg)
        seq = sparse_state(engine, ids[:-1], shelf_of(engine, store)).state.seq
        for layer in range(len(engine.layers)):
            chunks = seq.index(layer).candidates.nonzero().flatten().expand(layout.num_kv_heads, -1)
            k_mid, v_mid, _ = seq.gather(layer, chunks)           # every chunk: candidates + outliers
            sink_k, sink_v = seq.sinks(layer)
            win_k, win_v = seq.window(layer)
            k = torch.cat([sink_k.float().transpose(0, 1), k_mid, win_k.float().transpose(0, 1)], dim=1)
            v = torch.cat([sink_v.float().transpose(0, 1), v_mid, win_v.float().transpose(0, 1)], dim=1)
            k = engine.rope.rotate_heads(k, torch.arange(k.shape[1]).expand(k.shape[0], -1))
            cache.update(k.unsqueeze(0).to(loaded.spec.dtype), v.unsqueeze(0).to(loaded.spec.dtype), layer)
        seq.release(keep=True)
    return cache


def ensure_prefilled(loaded: LoadedModel, ids: list[int], store: Path, page_dtype: str = PAGE_DTYPE) -> float:
    """Sparse prefill of ``ids`` into ``store`` unless it is there already; returns its seconds (0: reused)."""
    cfg = SparseConfig(page_dtype=page_dtype)
    layout = SparseEngine.page_layout(loaded, cfg)
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu="512MiB", cpu="1GiB", nvme_dir=store / layout.name)
    start = time.perf_counter()
    with BlockingTierManager.from_config(tiers, namespace=layout.name) as manager:
        engine = SparseEngine(loaded, manager, cfg)
        opened = sparse_state(engine, ids[:-1], shelf_of(engine, store))
        seq, reused = opened.state.seq, opened.reused
        manager.flush()
        seq.release(keep=True)
    return 0.0 if reused else time.perf_counter() - start


SPARSE_ROWS = ("sparse-ram", "sparse-nvme", "sparse-nvme-no-prefetch", "sparse-nvme-no-overlap", "dynamic-cache",
               "dynamic-cache-folded", "llama-cpp")      # the rows measure_sparse may run, as --sparse-rows names them


def measure_sparse(report: Report, loaded: LoadedModel, ctx: int, steps: int, store: Path, interleave,
                   hf_decoder, page_dtypes: tuple[str, ...] = (), rows: frozenset[str] | None = None) -> None:
    """``interleave`` and ``hf_decoder``: decode.py's ``decode_all`` and ``HfDecoder`` (the dense rows' own);
    ``page_dtypes``: quantized pages measured beside bf16 (``quantized_rows``); ``rows``: only these
    configurations (None: all)."""
    ids = passkey_prompt(loaded.tokenizer, ctx, depth=DEPTH).ids
    store.mkdir(parents=True, exist_ok=True)
    prefill_s = ensure_prefilled(loaded, ids, store)
    print(f"{ctx // K}K sparse prefill: {'reused from the store' if not prefill_s else f'{prefill_s:.0f} s'}",
          file=sys.stderr, flush=True)
    layout, (all_pages, small) = tier_sizes(loaded, ctx, PAGE_DTYPE)
    wanted = lambda name: rows is None or name in rows   # noqa: E731
    stored = functools.cache(lambda: dynamic_from_store(loaded, ids, store))   # read from the store once
    dense = {"dynamic-cache": lambda: hf_decoder(loaded.model, copy.deepcopy(stored()), len(ids) - 1),
             "dynamic-cache-folded": lambda: hf_decoder(loaded.model, copy.deepcopy(stored()), len(ids) - 1,
                                                        ATTENTION)}
    if llama_version() is not None:   # dense, at real positions
        dense["llama-cpp"] = lambda: LlamaDecoder(resolve_source("smollm2"), ids[:-1], context_for(len(ids), steps),
                                                  torch.get_num_threads(), store / "llama-state")
    peers = {name: build for name, build in dense.items() if wanted(name)}
    builders = {
        "sparse-ram": lambda: SparseDecoder(loaded, ids, store, gpu=all_pages, cpu=0, prefetch="none", warm=True),
        "sparse-ram-chunks": lambda: SparseDecoder(loaded, ids, store, gpu=all_pages, cpu=0, prefetch="none",
                                                   warm=True, attend="chunks"),
        "sparse-nvme": lambda: SparseDecoder(loaded, ids, store, gpu=small, cpu=small, prefetch="speculative",
                                             warm=False, fill=True),
        "sparse-nvme-no-prefetch": lambda: SparseDecoder(loaded, ids, store, gpu=small, cpu=small,
                                                         prefetch="none", warm=False, fill=True),
        "sparse-nvme-no-overlap": lambda: SparseDecoder(loaded, ids, store, gpu=small, cpu=small, prefetch="none",
                                                        warm=False, fill=True, overlap=False),
    }
    together = wanted("sparse-ram") and bool(peers) and fits_together(loaded, ctx, all_pages, peers)
    runs = interleave({**peers, "sparse-ram": builders.pop("sparse-ram")}, ids[-1], steps, together=True,
                      turn=TURN) if together else {}
    stored.cache_clear()
    runs |= interleave({k: v for k, v in builders.items() if wanted(k)}, ids[-1], steps, together=False)
    for page_dtype in page_dtypes:
        runs |= quantized_rows(report, loaded, ids, ctx, steps, store, interleave, page_dtype)
    threads = IOKnobs.from_env().io_threads
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu=layout.block_bytes, cpu=0, nvme_dir=store / layout.name)
    with BlockingTierManager.from_config(tiers, namespace=layout.name) as manager:   # the stored pages' slots
        slots = [slot for _, slot in manager.manager.store.items()]
    rate = page_read_rate(store / layout.name / "slots.dat", layout.block_bytes, slots, threads)
    if rate:
        report.add_bound(f"page reads@{ctx // K}K: the store's device serves {rate / 1e3:.1f}K random "
                         f"{layout.block_bytes // 1024} KiB O_DIRECT reads/s with {threads} threads "
                         f"({rate * layout.block_bytes / 1e6:.0f} MB/s), measured on the stored pages in this run")
    if not together:
        runs |= interleave(peers, ids[-1], steps, together=False)
        stored.cache_clear()
    add_sparse_rows(report, ctx, runs, steps, prefill_s, loaded, rate,
                    frozenset(peers) | {"sparse-ram"} if together else frozenset())


def fits_together(loaded: LoadedModel, ctx: int, page_bytes: int, peers: dict) -> bool:
    """Whether sparse-ram's pages, the dense rows' KV (the copy read from the store and one per row)
    and llama.cpp's (16-bit) fit in half the host's free memory at once."""
    dense = sum(name.startswith("dynamic-cache") for name in peers)
    stored = (dense + 1) * ctx * loaded.spec.kv_bytes_per_token if dense else 0
    llama = kv_bytes(loaded.spec, ctx) if "llama-cpp" in peers else 0
    return page_bytes + stored + llama < 0.5 * available_ram()


def tier_sizes(loaded: LoadedModel, ctx: int, page_dtype: str):
    """The page layout, and the memory tier bytes of the rows: every page, or ``SMALL_SHARE`` of them."""
    layout = SparseEngine.page_layout(loaded, SparseConfig(page_dtype=page_dtype))
    n_pages = len(loaded.model.model.layers) * (ctx // layout.tokens + 2)
    return layout, ((n_pages + 64) * layout.block_bytes, int(SMALL_SHARE * n_pages) * layout.block_bytes)


def quantized_rows(report: Report, loaded: LoadedModel, ids: list[int], ctx: int, steps: int, store: Path,
                   interleave, page_dtype: str) -> dict:
    """sparse-ram and sparse-nvme-no-prefetch over ``page_dtype`` pages, from their own stored prefill."""
    prefill_s = ensure_prefilled(loaded, ids, store, page_dtype)
    print(f"{ctx // K}K sparse prefill, {page_dtype} pages: "
          f"{'reused from the store' if not prefill_s else f'{prefill_s:.0f} s'}", file=sys.stderr, flush=True)
    report.add_row(f"sparse-prefill[{page_dtype}]", "prefill_s", round(prefill_s, 1), "s", context=ctx,
                   note="0: reused from the store")
    _, (all_pages, small) = tier_sizes(loaded, ctx, page_dtype)
    return interleave({
        f"sparse-ram[{page_dtype}]": lambda: SparseDecoder(loaded, ids, store, gpu=all_pages, cpu=0, prefetch="none",
                                                           warm=True, page_dtype=page_dtype),
        f"sparse-nvme-no-prefetch[{page_dtype}]": lambda: SparseDecoder(
            loaded, ids, store, gpu=small, cpu=small, prefetch="none", warm=False, fill=True, page_dtype=page_dtype),
    }, ids[-1], steps, together=False)


def page_read_rate(path: Path, page_bytes: int, slots: list[int], threads: int, reads: int = 4000) -> float | None:
    """Random O_DIRECT reads of one stored page each, ``threads`` at a time, from the store's own
    file: reads per second. None where O_DIRECT is refused."""
    offsets = [slot * page_bytes for slot in random.Random(0).choices(slots, k=reads)]
    return random_read_rate(path, page_bytes, offsets, threads)


def add_sparse_rows(report: Report, ctx: int, runs: dict, steps: int, prefill_s: float, loaded: LoadedModel,
                    page_reads_per_s: float | None = None, interleaved: frozenset[str] = frozenset()) -> None:
    """``interleaved``: the rows that stepped in turn (the others ran one after another)."""
    tag = f"@{ctx // K}K"
    base = runs["dynamic-cache"].tokens_per_s if "dynamic-cache" in runs else None

    def add(name: str, value: float | None, target: float | None, meaning: str, *, ceiling: bool = False) -> None:
        if value is not None:               # None: a row not measured in this run (--sparse-rows)
            report.add_ratio(name, value, target, meaning, ceiling=ceiling)
    for name, d in runs.items():
        f, total, counted = d.figures, d.counted_s, d.counted_steps
        extra = {}
        if "waited_s" in f:
            extra = {"stall_fraction": round(f["waited_s"] / total, 3), "reuse_rate": round(f["reuse_rate"], 3),
                     "nvme_bytes_per_token": f["nvme_read_bytes"] // counted,
                     "pages_per_token": f["pages_read"] // counted}
        if len(d.warmup) > 1:     # the steps that filled the memory tiers, the first (opening the index) aside
            extra |= {"warmup_steps": len(d.warmup),
                      "warmup_tokens_per_s": round((len(d.warmup) - 1) / sum(d.warmup[1:]), 3)}
        report.add_row(name, "decode_tokens_per_s", round(d.tokens_per_s, 3), "tok/s", context=ctx,
                       median_ms=round(d.ms(0.5), 1), p90_ms=round(d.ms(0.9), 1), steps=steps,
                       interleaved=name in interleaved, **extra)
    report.add_row("sparse-prefill", "prefill_s", round(prefill_s, 1), "s", context=ctx,
                   note="0: reused from the store")
    add_sparse_bounds(report, ctx, runs, steps, loaded, page_reads_per_s)
    report.add_bound(f"sparse rows{tag}: " + (f"{', '.join(sorted(interleaved))} took turns of {TURN} tokens, the "
                     "first untimed (a ratio of two of them shares the machine's moment, each timed step as warm "
                     "as alone); the others ran one after another"
                     if interleaved else "one after another (the host had no room for sparse-ram's pages and its "
                     "peers' KV at once, or a peer was not asked for): a ratio spans minutes of the machine's drift"))
    ratio = lambda n: round(runs[n].tokens_per_s / base, 3) if base and n in runs else None   # noqa: E731
    at_target = ctx >= 128 * K    # the targets are set at 128K (and 32K for pages in memory); others report
    add(f"sparse_ram_vs_dynamic{tag}", ratio("sparse-ram"), 6.0 if at_target else 1.5 if ctx == 32 * K else None,
                     "decode tok/s of sparse with every page in memory / DynamicCache all in memory, same run")
    folded = runs.get("dynamic-cache-folded")
    add(f"sparse_ram_vs_dynamic_folded{tag}", round(runs["sparse-ram"].tokens_per_s / folded.tokens_per_s, 3)
        if folded and "sparse-ram" in runs else None, None,
        "decode tok/s of sparse with every page in memory / DynamicCache with attention \"tierkv\", same run")
    add(f"sparse_nvme_vs_dynamic{tag}", ratio("sparse-nvme-no-prefetch"), 5.0 if at_target else None,
                     "decode tok/s of sparse with >= 80 % of the pages only on NVMe, default settings (no "
                     "prefetch, overlap) / DynamicCache")
    if "llama-cpp" in runs:
        llama = runs["llama-cpp"].tokens_per_s
        add(f"sparse_vs_llamacpp{tag}", round(runs["sparse-ram"].tokens_per_s / llama, 3) if "sparse-ram" in runs
            else None, 1.0 if ctx == 32 * K else None,
            "decode tok/s of sparse with every page in memory / llama.cpp dense over the same prompt ids (same "
            "GGUF, its quantized weights, its own KV cache, same threads, prefill state saved once), same run"
            + (f"; sparse, >= 80 % of pages only on NVMe / llama.cpp: "
               f"{runs['sparse-nvme-no-prefetch'].tokens_per_s / llama:.3f}" if "sparse-nvme-no-prefetch" in runs
               else ""))
    add(f"sparse_nvme_speculative_vs_dynamic{tag}", ratio("sparse-nvme"), None,
                     "the same with speculative prefetch")
    add(f"sparse_ram_chunks_vs_dynamic{tag}", ratio("sparse-ram-chunks"), None,
                     "sparse all in memory, each KV head attending only its own chunks (attend=chunks)")
    stall = lambda n: round(runs[n].figures["waited_s"] / runs[n].counted_s, 3) if n in runs else None  # noqa: E731
    add(f"stall_fraction_sparse_nvme{tag}", stall("sparse-nvme"), None,
                     "share of decode time waiting on page loads, speculative prefetch (target: at most 0.10)")
    add(f"stall_fraction_no_prefetch{tag}", stall("sparse-nvme-no-prefetch"), 0.10 if at_target else None,
        "the same run without prefetch, the default configuration (overlap)", ceiling=True)
    add(f"sparse_nvme_no_overlap_vs_dynamic{tag}", ratio("sparse-nvme-no-overlap"), None,
                     "no prefetch, each layer waiting for all of its pages (--no-sparse-overlap)")
    add(f"stall_fraction_no_overlap{tag}", stall("sparse-nvme-no-overlap"), None, "its stall")
    add(f"reuse_rate{tag}", round(runs["sparse-ram"].figures["reuse_rate"], 3) if "sparse-ram" in runs else None, None,
                     "share of a layer's pages that the same layer read in the previous step (cross-step reuse)")
    for name, run in runs.items():
        if name.startswith("sparse-nvme-no-prefetch["):
            codec = name[name.index("[") + 1:-1]
            if "sparse-nvme-no-prefetch" not in runs or "sparse-ram" not in runs:
                continue
            report.add_ratio(f"sparse_nvme_{codec}_vs_bf16{tag}", round(run.tokens_per_s /
                                                                         runs["sparse-nvme-no-prefetch"].tokens_per_s, 3),
                             1.3 if at_target and codec == "int4" else None,
                             f"decode tok/s of the default NVMe row with {codec} pages / the same row with bf16 pages")
            report.add_ratio(f"sparse_ram_{codec}_vs_bf16{tag}", round(runs[f"sparse-ram[{codec}]"].tokens_per_s /
                                                                        runs["sparse-ram"].tokens_per_s, 3), None,
                             "the same with every page in memory")


def add_sparse_bounds(report: Report, ctx: int, runs: dict, steps: int, loaded: LoadedModel,
                      page_reads_per_s: float | None) -> None:
    weights = weight_bytes(loaded.model) // 2**20
    dtype = str(loaded.spec.dtype).removeprefix("torch.")
    for name, d in runs.items():
        step_ms = 1e3 * sum(d.seconds) / len(d.seconds)
        if name == "llama-cpp":
            report.add_bound(f"{name}@{ctx // K}K: {step_ms:.0f} ms/step; reads its whole KV ({kv_bytes(loaded.spec, ctx) // 2**20} MiB "
                             f"in f16) and the GGUF's quantized weights each step")
            continue
        if "pages_read" not in d.figures:
            report.add_bound(f"{name}@{ctx // K}K: {step_ms:.0f} ms/step; reads the whole KV "
                             f"({ctx * loaded.spec.kv_bytes_per_token // 2**20} MiB in {dtype}) and torch.cat copies "
                             "it each step")
            continue
        f, counted = d.figures, d.counted_steps
        gathered = f["pages_read"] * f["page_bytes"] / counted
        report.add_bound(f"{name}@{ctx // K}K: {step_ms:.0f} ms/step; gathers {f['pages_read'] // counted} pages "
                         f"({gathered / 2**20:.1f} MiB: values + key factors of the chosen chunks' pages, all layers) "
                         f"per token, {f['nvme_read_bytes'] / counted / 2**20:.1f} MiB of them from NVMe; "
                         f"{100 * f['reuse_rate']:.0f} % of a layer's pages were read by it the step before; "
                         f"stall {100 * f['waited_s'] / d.counted_s:.0f} %; the rest is the weights "
                         f"({weights} MiB of {dtype} read per token) and per-layer selection, key rebuild and "
                         f"attention over {f['tokens_per_layer_step'] / 1e3:.1f}K tokens per KV head beside sinks and "
                         "window"
                         + _disk_share(f, counted, step_ms, page_reads_per_s) + _warmup(d.warmup))


def _warmup(seconds: list[float]) -> str:
    if len(seconds) < 2:
        return ""
    return (f"; timed once its memory tiers were full: the {len(seconds) - 1} steps that filled them (after "
            f"the first) ran at {(len(seconds) - 1) / sum(seconds[1:]):.3f} tok/s")


def _disk_share(f: dict, steps: int, step_ms: float, page_reads_per_s: float | None) -> str:
    """What the NVMe page loads of a step cost at the device's measured random-read rate."""
    loads = f["nvme_read_bytes"] / f["page_bytes"] / steps
    if loads < 1 or not page_reads_per_s:
        return ""
    disk_ms = 1e3 * loads / page_reads_per_s
    return (f"; its {loads:.0f} page loads from NVMe per token take {disk_ms:.0f} ms at the device's random-read "
            f"rate ({100 * disk_ms / step_ms:.0f} % of the step)")
