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


from tierkv.device import has_cuda
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine
from tierkv.model.loading import LoadedModel, load_model
from tierkv.model.prompt import Prompt, document_prompt, passkey_prompt
from tierkv.model.settings import RunConfig
from tierkv.layout import BlockLayout
from tierkv.profile.access import AccessRecorder
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.profile.trace import write_trace
from tierkv.model.sparse_engine import SparseEngine
from tierkv.sparse import SparseSequence
from tierkv.sparse.store import checkpoint_path, index_id, index_path, load_index, save_index

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
    if config.prompt.doc is not None:
        return document_prompt(loaded.tokenizer, config.prompt.doc, config.prompt.question)
    return passkey_prompt(loaded.tokenizer, config.prompt.synthetic_tokens, depth=config.prompt.depth,
                          seed=config.prompt.seed, filler=config.prompt.filler)


def run(config: RunConfig, *, on_text: Callable[[str], None] = lambda s: None,
        on_prefill: Callable[[int, int], None] = lambda done, total: None,
        loaded: LoadedModel | None = None) -> RunResult:
    loaded = loaded or load_model(config.engine.model, dtype=config.engine.torch_dtype)
    prompt = build_prompt(config, loaded)
    spec = loaded.spec
    recorder = EventRecorder()
    mode = config.engine.resolve_mode(len(prompt.ids), spec.max_position)
    result = RunResult(prompt_tokens=len(prompt.ids), answer=prompt.answer, mode=mode,
                       kv_bytes=(len(prompt.ids) + config.output.max_new_tokens) * spec.kv_bytes_per_token)
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        on_prefill(done[0], len(prompt.ids))

    session = _sparse_session if mode == "sparse" else _dense_session
    block_bytes = session(config, loaded, prompt.ids, recorder, result, progress, on_text)
    if prompt.answer is not None:
        result.found = prompt.answer in result.text
    if config.output.trace is not None:
        meta = {"block_bytes": block_bytes, "tiers": result.tiers}
        write_trace(config.output.trace, recorder.events, recorder.origin, meta=meta)
    return result


def _dense_session(config: RunConfig, loaded: LoadedModel, ids: list[int], recorder: EventRecorder,
                   result: RunResult, progress: Callable[[int], None], on_text: Callable[[str], None]) -> int:
    spec = loaded.spec
    layout = BlockLayout.kv(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, config.engine.block_tokens)
    with BlockingTierManager.from_config(config.tiers.tier_config(layout.block_bytes, layout.name),
                                         namespace=layout.name, recorder=recorder) as manager:
        engine = Engine(loaded, manager, config.engine.dense_engine())
        seq = engine.new_sequence()
        access = _access_recorder(config, loaded, len(ids), seq.read_tier, manager)
        start = time.perf_counter()
        logits, result.reused_prompt_tokens = engine.prefill(seq, ids, progress)
        _prefilled(recorder, result, start)
        _generate(engine, seq, int(logits.argmax()), config, loaded, on_text, result)
        manager.flush()
        if access is not None:
            access.save(config.output.record_access, manager.manager)
        seq.release(keep=manager.manager.store is not None)
        result.tiers = tier_report(manager)
    return layout.block_bytes


def _sparse_session(config: RunConfig, loaded: LoadedModel, ids: list[int], recorder: EventRecorder,
                    result: RunResult, progress: Callable[[int], None], on_text: Callable[[str], None]) -> int:
    sparse = config.sparse
    layout = SparseEngine.page_layout(loaded, sparse)
    with BlockingTierManager.from_config(config.tiers.tier_config(layout.block_bytes, layout.name),
                                         namespace=layout.name, recorder=recorder) as manager:
        engine = SparseEngine(loaded, manager, sparse, chunk_tokens=config.engine.chunk_tokens)
        start = time.perf_counter()
        recorder.enabled = config.output.trace is not None   # a 1M-token prefill makes millions of transfer events
        seq, result.reused_prompt_tokens = open_sparse(engine, ids, config, progress)
        recorder.enabled = True
        access = _access_recorder(config, loaded, len(ids), seq.read_tier, manager)
        logits = engine.decode(seq, ids[-1])
        _prefilled(recorder, result, start)
        _generate(engine, seq, int(logits.argmax()), config, loaded, on_text, result)
        manager.flush()
        if access is not None:
            access.save(config.output.record_access, manager.manager)
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
    if config.tiers.nvme_dir is None:
        engine.prefill(seq, ids[:-1], progress)
        progress(1)
        return seq, 0
    directory = Path(config.tiers.nvme_dir) / "sparse-indexes"
    path, partial = index_path(directory, key), checkpoint_path(directory, key)
    if config.engine.reuse:
        if (meta := load_index(seq, path)) is not None:
            seq.prefill_s = float(meta.get("prefill_s", 0.0))
            progress(len(ids))
            return seq, len(ids) - 1
        if (meta := load_index(seq, partial)) is not None:
            seq.resumed_tokens, seq.prefill_s = seq.length(0), float(meta.get("prefill_s", 0.0))
            progress(seq.resumed_tokens)
    checkpoints = _Checkpoints(engine, partial, seq.prefill_s, config.engine.checkpoint_every)
    engine.prefill(seq, ids[:-1], progress, checkpoints if config.engine.checkpoint_every else None)
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
    if config.output.record_access is None:
        return None
    return AccessRecorder(read_tier=read_tier, info={"model": loaded.model_id, "prompt_tokens": prompt_tokens}
                          ).attach(manager.manager)


def _prefilled(recorder: EventRecorder, result: RunResult, start: float) -> None:
    result.ttft_s = result.prefill_s = time.perf_counter() - start
    recorder.record(Event(EventKind.PREFILL, "", "", None, 0, start, start, start + result.prefill_s))


def _generate(engine, seq, token: int, config: RunConfig, loaded: LoadedModel, on_text, result: RunResult) -> None:
    generated = _decode(engine, seq, token, config.output.max_new_tokens, loaded.tokenizer, on_text, result)
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
