"""One ``tierkv run``: load the model, build the prompt, prefill, decode, report.

The result carries everything the summary and ``--json`` print: times,
reuse, stall share, and per tier its budget, peak and final bytes, bytes
read and written, and the backend that moved them.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from policies import make_policy
from tierkv.config import TierConfig
from tierkv.sizes import parse_size
from tierkv.device import has_cuda
from tierkv.errors import ConfigError
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine, EngineConfig
from tierkv.model.loading import LoadedModel, load_model
from tierkv.model.prompt import Prompt, document_prompt, passkey_prompt
from tierkv.layout import BlockLayout
from tierkv.profile.access import AccessRecorder
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.profile.trace import write_trace
from tierkv.model.sparse_engine import SparseEngine
from tierkv.sparse import SparseConfig, SparseSequence
from tierkv.sparse.store import checkpoint_path, index_id, index_path, load_index, save_index

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("auto", "dense", "sparse")


@dataclass(frozen=True, slots=True)
class RunConfig:
    model: str = "smollm2"
    doc: Path | None = None
    synthetic_tokens: int | None = None
    question: str | None = None
    max_new_tokens: int = 32
    gpu_budget: str | int = "256MiB"
    cpu_budget: str | int = "1GiB"
    nvme_dir: Path | None = None
    nvme_budget: str | int = "64GiB"
    cxl_budget: str | int = 0        # a simulated CXL pool between cpu and nvme (0: none)
    cxl_preset: str = "cxl2-x8"
    gpu_policy: str = "lru"          # eviction policy per tier: a policies name or module:Class
    cpu_policy: str = "lru"
    nvme_policy: str = "lru"
    prefetch: str = "next-layer"     # a policies.prefetch name
    mode: str = "auto"               # auto: sparse past the model's trained window (see resolve_mode)
    sparse_budget: str | int = 2048  # sparse: selected tokens per KV head, or a share like "2%"
    layer_budgets: str = ""          # sparse: decode budgets of single layers, like "0:6144"
    layer_allocation: str = "uniform"    # sparse: the same budget in every layer, or adaptive
    sparse_attend: str = "pages"     # sparse decode: every head attends the pages read, or its own chunks
    prefill_budget: str | int = 1024  # sparse: the same for each sparse prefill chunk
    rank: int | None = None          # sparse: rank of the low-rank keys (None: by the key width)
    selector: str = "shadowkv"       # sparse: a policies.selectors name
    sparse_prefetch: str = "none"
    sparse_overlap: bool = False     # sparse decode: attend to the pages in place while the rest load
    positions: str = "auto"          # sparse: original | remap | auto (remap past the trained window)
    dense_prefill_tokens: int | None = None   # sparse: exact prefill up to here (None: auto)
    page_dtype: str | None = None    # sparse: dtype of stored values and key factors (None: the model's)
    page_tokens: int = 16            # sparse: tokens per stored page (the read unit)
    dtype: str = "float32"
    block_tokens: int = 256
    chunk_tokens: int = 1024
    reuse: bool = True
    checkpoint_s: float = 300.0      # sparse + --nvme-dir: save a long prefill's state this often (0: never)
    depth: float = 0.5
    seed: int = 0
    filler: str = "repeat"
    trace: Path | None = None
    record_access: Path | None = None

    def __post_init__(self) -> None:
        if (self.doc is None) == (self.synthetic_tokens is None):
            raise ConfigError("give exactly one of --doc FILE or --synthetic-tokens N")
        if self.synthetic_tokens is not None and self.synthetic_tokens < 64:
            raise ConfigError(f"synthetic_tokens={self.synthetic_tokens}: must be >= 64")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not self.checkpoint_s >= 0:
            raise ConfigError(f"checkpoint_s={self.checkpoint_s}: must be >= 0 seconds (0: no checkpoints)")
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}: allowed: {', '.join(MODES)}")
        self.sparse_config()  # validates budget, rank, selector, prefetch, positions
        for name in ("dtype", "page_dtype"):
            if getattr(self, name) not in (*DTYPES, None if name == "page_dtype" else "float32"):
                raise ConfigError(f"{name}={getattr(self, name)!r}: allowed: {', '.join(DTYPES)}")
        for name in ("gpu_budget", "cpu_budget", "nvme_budget", "cxl_budget"):
            parse_size(getattr(self, name), name)
        for name in ("gpu_policy", "cpu_policy", "nvme_policy"):
            make_policy(getattr(self, name))  # unknown names list the valid ones
        EngineConfig(self.block_tokens, self.chunk_tokens, prefetch=self.prefetch)  # validates the pair


    def sparse_config(self) -> SparseConfig:
        return SparseConfig(budget=self.sparse_budget, layer_budgets=self.layer_budgets,
                            allocation=self.layer_allocation, attend=self.sparse_attend,
                            prefill_budget=self.prefill_budget, rank=self.rank,
                            selector=self.selector, page_tokens=self.page_tokens,
                            prefetch=self.sparse_prefetch, overlap=self.sparse_overlap, positions=self.positions,
                            dense_prefill_tokens=self.dense_prefill_tokens)


def resolve_mode(mode: str, prompt_tokens: int, trained_tokens: int) -> str:
    """``auto`` is sparse past the model's trained window: there dense attention leaves the positions
    the model knows (SmolLM2 at 16K: perplexity > 200), and each step would read every key."""
    if mode != "auto":
        return mode
    return "sparse" if prompt_tokens > trained_tokens else "dense"


@dataclass(slots=True)
class RunResult:
    text: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    stall_fraction: float = 0.0
    reused_prompt_tokens: int = 0
    mode: str = "dense"
    kv_bytes: int = 0
    sparse: dict[str, object] = field(default_factory=dict)
    answer: str | None = None
    found: bool | None = None
    tiers: dict[str, dict[str, object]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


def build_prompt(config: RunConfig, loaded: LoadedModel) -> Prompt:
    if config.doc is not None:
        return document_prompt(loaded.tokenizer, config.doc, config.question)
    return passkey_prompt(loaded.tokenizer, config.synthetic_tokens, depth=config.depth,
                          seed=config.seed, filler=config.filler)


def tier_config(config: RunConfig, block_bytes: int, name: str) -> TierConfig:
    nvme_dir = None if config.nvme_dir is None else Path(config.nvme_dir) / name
    return TierConfig(block_bytes=block_bytes, gpu=config.gpu_budget, cpu=config.cpu_budget,
                      nvme_dir=nvme_dir, nvme_budget=config.nvme_budget, cxl=config.cxl_budget,
                      cxl_preset=config.cxl_preset, gpu_policy=config.gpu_policy,
                      cpu_policy=config.cpu_policy, nvme_policy=config.nvme_policy)


def run(config: RunConfig, *, on_text: Callable[[str], None] = lambda s: None,
        on_prefill: Callable[[int, int], None] = lambda done, total: None,
        loaded: LoadedModel | None = None) -> RunResult:
    loaded = loaded or load_model(config.model, dtype=DTYPES[config.dtype])
    prompt = build_prompt(config, loaded)
    spec = loaded.spec
    recorder = EventRecorder()
    mode = resolve_mode(config.mode, len(prompt.ids), spec.max_position)
    result = RunResult(prompt_tokens=len(prompt.ids), answer=prompt.answer, mode=mode,
                       kv_bytes=(len(prompt.ids) + config.max_new_tokens) * spec.kv_bytes_per_token)
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        on_prefill(done[0], len(prompt.ids))

    session = _sparse_session if mode == "sparse" else _dense_session
    block_bytes = session(config, loaded, prompt.ids, recorder, result, progress, on_text)
    if prompt.answer is not None:
        result.found = prompt.answer in result.text
    if config.trace is not None:
        meta = {"block_bytes": block_bytes, "tiers": result.tiers}
        write_trace(config.trace, recorder.events, recorder.origin, meta=meta)
    return result


def _dense_session(config: RunConfig, loaded: LoadedModel, ids: list[int], recorder: EventRecorder,
                   result: RunResult, progress: Callable[[int], None], on_text: Callable[[str], None]) -> int:
    spec = loaded.spec
    layout = BlockLayout.kv(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, config.block_tokens)
    with BlockingTierManager.from_config(tier_config(config, layout.block_bytes, layout.name),
                                         namespace=layout.name, recorder=recorder) as manager:
        engine = Engine(loaded, manager, EngineConfig(config.block_tokens, config.chunk_tokens, config.reuse,
                                                      prefetch=config.prefetch))
        seq = engine.new_sequence()
        access = _access_recorder(config, loaded, len(ids), seq.read_tier, manager)
        start = time.perf_counter()
        logits, result.reused_prompt_tokens = engine.prefill(seq, ids, progress)
        _prefilled(recorder, result, start)
        _generate(engine, seq, int(logits.argmax()), config, loaded, on_text, result)
        manager.flush()
        if access is not None:
            access.save(config.record_access, manager.manager)
        seq.release(keep=manager.manager.store is not None)
        result.tiers = tier_report(manager)
    return layout.block_bytes


def _sparse_session(config: RunConfig, loaded: LoadedModel, ids: list[int], recorder: EventRecorder,
                    result: RunResult, progress: Callable[[int], None], on_text: Callable[[str], None]) -> int:
    sparse = config.sparse_config()
    page_dtype = None if config.page_dtype is None else DTYPES[config.page_dtype]
    layout = SparseEngine.page_layout(loaded, sparse, page_dtype)
    with BlockingTierManager.from_config(tier_config(config, layout.block_bytes, layout.name),
                                         namespace=layout.name, recorder=recorder) as manager:
        engine = SparseEngine(loaded, manager, sparse, chunk_tokens=config.chunk_tokens, page_dtype=page_dtype)
        start = time.perf_counter()
        recorder.enabled = config.trace is not None   # a 1M-token prefill makes millions of transfer events
        seq, result.reused_prompt_tokens = open_sparse(engine, ids, config, progress)
        recorder.enabled = True
        access = _access_recorder(config, loaded, len(ids), seq.read_tier, manager)
        logits = engine.decode(seq, ids[-1])
        _prefilled(recorder, result, start)
        _generate(engine, seq, int(logits.argmax()), config, loaded, on_text, result)
        manager.flush()
        if access is not None:
            access.save(config.record_access, manager.manager)
        result.sparse = sparse_report(engine, seq, len(ids))
        seq.release(keep=manager.manager.store is not None)
        result.tiers = tier_report(manager)
    return layout.block_bytes


def open_sparse(engine: SparseEngine, ids: list[int], config: RunConfig,
                progress: Callable[[int], None]) -> tuple[SparseSequence, int]:
    """A sequence holding ``ids[:-1]``: loaded from a stored index when there is one, else prefilled
    (and stored, with ``--nvme-dir``). A prefill that an earlier run started and saved a checkpoint
    of resumes there. Returns the sequence and the number of prompt tokens not computed here."""
    store = engine.manager.manager.store
    resolved = engine.resolved(len(ids))
    key = index_id(engine.loaded.model_id, engine.layout, resolved, engine.needs, ids[:-1])
    seq = engine.new_sequence(len(ids), root=key, persist=store is not None)
    if config.nvme_dir is None:
        engine.prefill(seq, ids[:-1], progress)
        progress(1)
        return seq, 0
    directory = Path(config.nvme_dir) / "sparse-indexes"
    path, partial = index_path(directory, key), checkpoint_path(directory, key)
    if config.reuse:
        if (meta := load_index(seq, path)) is not None:
            seq.prefill_s = float(meta.get("prefill_s", 0.0))
            progress(len(ids))
            return seq, len(ids) - 1
        if (meta := load_index(seq, partial)) is not None:
            seq.resumed_tokens, seq.prefill_s = seq.length(0), float(meta.get("prefill_s", 0.0))
            progress(seq.resumed_tokens)
    checkpoints = _Checkpoints(engine, partial, seq.prefill_s, config.checkpoint_s)
    engine.prefill(seq, ids[:-1], progress, checkpoints if config.checkpoint_s else None)
    progress(1)
    engine.manager.flush()
    seq.prefill_s = checkpoints.total_s()
    save_index(seq, path, prefill_s=seq.prefill_s)
    partial.unlink(missing_ok=True)
    seq.persist = False          # pages sealed while decoding are not part of the stored prompt
    return seq, seq.resumed_tokens


class _Checkpoints:
    """Saves a long prefill's state every ``every_s`` seconds, so a stopped run resumes there."""

    def __init__(self, engine: SparseEngine, path: Path, earlier_s: float, every_s: float) -> None:
        self.engine, self.path, self.earlier_s, self.every_s = engine, path, earlier_s, every_s
        self.start = self.last = time.perf_counter()

    def total_s(self) -> float:
        return self.earlier_s + time.perf_counter() - self.start

    def __call__(self, seq: SparseSequence) -> None:
        if time.perf_counter() - self.last < self.every_s:
            return
        self.engine.manager.flush()              # every page the checkpoint names is stored first
        save_index(seq, self.path, prefill_s=self.total_s())
        self.last = time.perf_counter()


def sparse_report(engine: SparseEngine, seq: SparseSequence, prompt_tokens: int) -> dict[str, object]:
    c = seq.config
    stats = seq.stats
    return {
        "budget_tokens": c.budget_tokens(seq.length(0)), "allocation": c.allocation, "attend": c.attend,
        "layer_tokens": [int(seq.chosen[layer].shape[-1]) * c.chunk_tokens for layer in sorted(seq.chosen)],
        "rank": engine.rank, "selector": c.selector,
        "prefetch": c.prefetch, "overlap": c.overlap, "positions": c.positions, "chunk_tokens": c.chunk_tokens,
        "page_tokens": c.page_tokens, "page_bytes": engine.layout.block_bytes,
        "dense_prefill_tokens": c.dense_prefill_tokens,
        "approximate_prefill": prompt_tokens - 1 > c.dense_prefill_tokens,
        "pages_read": stats.pages, "reuse_rate": stats.reused / stats.pages if stats.pages else 0.0,
        "tokens_per_layer_step": stats.tokens / stats.steps if stats.steps else 0.0,
        "key_energy_kept": min(layer.basis.energy_kept for layer in seq.layers),
        "index_bytes": seq.memory_bytes(),
        "resumed_prefill_tokens": seq.resumed_tokens, "prefill_s_all_runs": round(seq.prefill_s, 1),
    }


def _access_recorder(config: RunConfig, loaded: LoadedModel, prompt_tokens: int, read_tier: str | None,
                     manager: BlockingTierManager) -> AccessRecorder | None:
    if config.record_access is None:
        return None
    return AccessRecorder(read_tier=read_tier, info={"model": loaded.model_id, "prompt_tokens": prompt_tokens}
                          ).attach(manager.manager)


def _prefilled(recorder: EventRecorder, result: RunResult, start: float) -> None:
    result.ttft_s = result.prefill_s = time.perf_counter() - start
    recorder.record(Event(EventKind.PREFILL, "", "", None, 0, start, start, start + result.prefill_s))


def _generate(engine, seq, token: int, config: RunConfig, loaded: LoadedModel, on_text, result: RunResult) -> None:
    generated = _decode(engine, seq, token, config.max_new_tokens, loaded.tokenizer, on_text, result)
    result.text = loaded.tokenizer.decode(generated, skip_special_tokens=True)


def _decode(engine: Engine | SparseEngine, seq, token: int, max_new: int, tokenizer, on_text, result: RunResult) -> list[int]:
    recorder = engine.manager.manager.events
    eos = _eos_ids(tokenizer, engine.model)
    generated = [token]
    shown = ""
    start = time.perf_counter()
    first_event = len(recorder.events)
    while len(generated) < max_new and token not in eos:
        step = time.perf_counter()
        token = int(engine.decode(seq, token).argmax())
        recorder.record(Event(EventKind.STEP, "", "", None, 0, step, step, time.perf_counter()))
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        on_text(text[len(shown):])
        shown = text
    result.decode_s = time.perf_counter() - start
    result.generated_tokens = len(generated)
    steps = len(generated) - 1
    result.decode_tokens_per_s = steps / result.decode_s if steps else 0.0
    waited = sum(e.done - e.start for e in recorder.events[first_event:] if e.kind == EventKind.WAIT)
    result.stall_fraction = waited / result.decode_s if result.decode_s else 0.0
    return generated


def _eos_ids(tokenizer, model) -> set[int]:
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    return {i for i in [tokenizer.eos_token_id, *ids] if i is not None}


def tier_report(manager: BlockingTierManager) -> dict[str, dict[str, object]]:
    mgr = manager.manager
    report = {}
    for name in mgr.order:
        tier, stats = mgr.tiers[name], mgr.stats[name]
        report[name] = {
            "budget_bytes": tier.budget_bytes,
            "peak_bytes": stats.peak_slots * mgr.block_bytes,
            "final_bytes": mgr.used_bytes(name),
            "bytes_read": stats.bytes_out,
            "bytes_written": stats.bytes_in,
            "backend": _backend(tier),
        }
    return report


def _backend(tier) -> str:
    if hasattr(tier, "backend"):
        return tier.backend
    if tier.name == "gpu":
        return "cuda" if tier.device.type == "cuda" else "host memory (no CUDA)"
    return "pinned host memory" if has_cuda() else "host memory"
