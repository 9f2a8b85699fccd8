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
from tierkv.config import TierConfig, parse_size
from tierkv.device import has_cuda
from tierkv.errors import ConfigError
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine, EngineConfig
from tierkv.model.loading import LoadedModel, load_model
from tierkv.model.prompt import Prompt, document_prompt, passkey_prompt
from tierkv.model.sequence import KVLayout
from tierkv.profile.access import AccessRecorder
from tierkv.profile.events import Event, EventRecorder
from tierkv.profile.trace import write_trace

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("dense",)


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
    gpu_policy: str = "lru"          # eviction policy per tier: a policies name or module:Class
    cpu_policy: str = "lru"
    nvme_policy: str = "lru"
    prefetch: str = "next-layer"     # a policies.prefetch name
    mode: str = "dense"
    dtype: str = "float32"
    block_tokens: int = 256
    chunk_tokens: int = 1024
    reuse: bool = True
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
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}: allowed: {', '.join(MODES)} "
                              "(sparse decode is not available in this version)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: allowed: {', '.join(DTYPES)}")
        for name in ("gpu_budget", "cpu_budget", "nvme_budget"):
            parse_size(getattr(self, name), name)
        for name in ("gpu_policy", "cpu_policy", "nvme_policy"):
            make_policy(getattr(self, name))  # unknown names list the valid ones
        EngineConfig(self.block_tokens, self.chunk_tokens, prefetch=self.prefetch)  # validates the pair


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
    kv_bytes: int = 0
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


def tier_config(config: RunConfig, layout: KVLayout) -> TierConfig:
    nvme_dir = None if config.nvme_dir is None else Path(config.nvme_dir) / layout.name
    return TierConfig(block_bytes=layout.block_bytes, gpu=config.gpu_budget, cpu=config.cpu_budget,
                      nvme_dir=nvme_dir, nvme_budget=config.nvme_budget, gpu_policy=config.gpu_policy,
                      cpu_policy=config.cpu_policy, nvme_policy=config.nvme_policy)


def run(config: RunConfig, *, on_text: Callable[[str], None] = lambda s: None,
        on_prefill: Callable[[int, int], None] = lambda done, total: None,
        loaded: LoadedModel | None = None) -> RunResult:
    loaded = loaded or load_model(config.model, dtype=DTYPES[config.dtype])
    prompt = build_prompt(config, loaded)
    spec = loaded.spec
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, config.block_tokens)
    recorder = EventRecorder()
    result = RunResult(prompt_tokens=len(prompt.ids), answer=prompt.answer,
                       kv_bytes=(len(prompt.ids) + config.max_new_tokens) * spec.kv_bytes_per_token)
    with BlockingTierManager.from_config(tier_config(config, layout), namespace=layout.name,
                                         recorder=recorder) as manager:
        engine = Engine(loaded, manager, EngineConfig(config.block_tokens, config.chunk_tokens, config.reuse,
                                                      prefetch=config.prefetch))
        seq = engine.new_sequence()
        access = None
        if config.record_access is not None:
            access = AccessRecorder(read_tier=seq.read_tier, info={
                "model": loaded.model_id, "prompt_tokens": len(prompt.ids)}).attach(manager.manager)
        done = [0]

        def progress(n: int) -> None:
            done[0] += n
            on_prefill(done[0], len(prompt.ids))

        start = time.perf_counter()
        logits, result.reused_prompt_tokens = engine.prefill(seq, prompt.ids, progress)
        token = int(logits.argmax())
        result.ttft_s = result.prefill_s = time.perf_counter() - start
        recorder.record(Event("prefill", "", "", None, 0, start, start, start + result.prefill_s))
        generated = _decode(engine, seq, token, config.max_new_tokens, loaded.tokenizer, on_text, result)
        result.text = loaded.tokenizer.decode(generated, skip_special_tokens=True)
        if prompt.answer is not None:
            result.found = prompt.answer in result.text
        manager.flush()
        if access is not None:
            access.save(config.record_access, manager.manager)
        seq.release(keep=manager.manager.store is not None)
        result.tiers = tier_report(manager)
    if config.trace is not None:
        meta = {"block_bytes": layout.block_bytes, "tiers": result.tiers}
        write_trace(config.trace, recorder.events, recorder.origin, meta=meta)
    return result


def _decode(engine: Engine, seq, token: int, max_new: int, tokenizer, on_text, result: RunResult) -> list[int]:
    recorder = engine.manager.manager.events
    eos = _eos_ids(tokenizer, engine.model)
    generated = [token]
    shown = ""
    start = time.perf_counter()
    first_event = len(recorder.events)
    while len(generated) < max_new and token not in eos:
        step = time.perf_counter()
        token = int(engine.decode(seq, token).argmax())
        recorder.record(Event("step", "", "", None, 0, step, step, time.perf_counter()))
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        on_text(text[len(shown):])
        shown = text
    result.decode_s = time.perf_counter() - start
    result.generated_tokens = len(generated)
    steps = len(generated) - 1
    result.decode_tokens_per_s = steps / result.decode_s if steps else 0.0
    waited = sum(e.done - e.start for e in recorder.events[first_event:] if e.kind == "wait")
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
