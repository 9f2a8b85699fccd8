"""A summarization job: documents -> prompts -> blocks through the batch engine -> output lines.

    read inputs, skip ids already in --out          (documents.py: resume)
    prompt = chat template(document + instruction)  too long / empty / unreadable -> an error line
    policy = search(calibrated machine)  or  a policy file
    sort prompts by length (less padding), cut into blocks of policy.block_size
    per block: engine.generate -> one line per document, flushed
    after the first block: the in-run calibration (its first token steps' compute against the
        model's); predict again with it, and search again when it departs by more than 25 %

Measured throughput counts the tokens actually generated (each summary up to its end token)
over the wall time of the blocks, prefill included; the prediction is the cost model's for the
policy as placed (tensor- and block-granular fractions), with each GPU batch padded to its longest
prompt (the prompts sorted by length, as the job runs them). ``predicted_calibrated`` is made from
the cached calibration alone; ``predicted_tokens_per_s`` from the same machine slowed or sped up by
the in-run factor (`tierkv.schedule.calibrate.in_run_factor`): a shared host's speed drifts by
half within minutes, so a calibration taken earlier says little about this run's cores. Only the
compute rate comes from the run; copies, waits and the later steps are still the model's.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tierkv.device import auto_dtype
from tierkv.errors import ConfigError
from tierkv.model.arch import decoder_layers
from tierkv.model.loading import LoadedModel, load_model, resolve_source
from tierkv.model.prompt import DEFAULT_QUESTION, chat_ids
from tierkv.schedule.cost import (
    Budgets,
    Machine,
    ModelShape,
    Workload,
    fractions,
    policy_terms,
    predict,
    slowed,
)
from tierkv.schedule.documents import Document, OutputLog, read_inputs
from tierkv.schedule.engine import BLOCK_TOKENS, BatchEngine, EngineLimits
from tierkv.schedule.policy import Placement, Policy, check_weight_dtype, read_policy
from tierkv.schedule.weights import parameter_sizes, tensor_homes
from tierkv.tiers.nvme_share import prepare_store_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"        # bf16 where the device computes it natively, fp32 elsewhere (see compute_dtype)
Progress = Callable[[int, int, float, int], None]   # (documents, tokens, seconds, total) per block; (0, 0, 0, total) first


@dataclass(frozen=True, slots=True)
class JobConfig:
    inputs: Path
    out: Path
    model: str = "smollm2"
    policy: str = "auto"               # "auto" or a policy JSON file
    gpu_budget: int = 4 * 1024**3
    cpu_budget: int = 8 * 1024**3
    nvme_dir: Path | None = None
    nvme_budget: int = 64 * 1024**3
    max_new_tokens: int = 64
    max_prompt_tokens: int = 2048
    instruction: str = DEFAULT_QUESTION
    dtype: str = "float32"
    recalibrate: bool = False
    allow_compress: bool = False
    weight_dtype: str | None = None    # streamed weights' storage dtype; None: the compute dtype (or the policy file's)
    retry_failed: bool = False         # run again the documents whose line says they failed (documents.OutputLog)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES and self.dtype != AUTO_DTYPE:
            raise ConfigError(f"dtype={self.dtype!r}: allowed: {', '.join(DTYPES)}, {AUTO_DTYPE}")
        check_weight_dtype(self.weight_dtype, "--weight-dtype")
        for name in ("max_new_tokens", "max_prompt_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)}: must be > 0")
        if not self.instruction.strip():
            raise ConfigError("--instruction: must not be empty")

    def output_settings(self, fixed: Policy | None = None) -> dict[str, object]:
        """What shapes a summary, by its flag's name (``fixed``: the --policy file's policy). The placement
        and budgets do not: greedy decoding is the same wherever the weights and KV live; int4 KV is lossy."""
        dtype = str(compute_dtype(self.dtype)).removeprefix("torch.")
        weight_dtype = self.weight_dtype or (fixed.weight_dtype if fixed is not None else None)
        compress = fixed.compress_kv if fixed is not None else self.allow_compress
        return {"--model": self.model, "--instruction": self.instruction, "--max-new-tokens": self.max_new_tokens,
                "--max-prompt-tokens": self.max_prompt_tokens, "--dtype": dtype, "--weight-dtype": weight_dtype,
                "--compress-kv": compress}


@dataclass(slots=True)
class JobResult:
    documents: int = 0            # written by this run (summaries and errors)
    failed: int = 0
    skipped: int = 0              # already in --out
    generated_tokens: int = 0
    seconds: float = 0.0          # blocks' wall time
    policy: Policy | None = None
    predicted_tokens_per_s: float | None = None   # from the calibration, then again with the in-run factor
    memory: dict[str, float] = field(default_factory=dict)
    predicted_calibrated: float | None = None     # the prediction before any block ran
    in_run_factor: float | None = None            # compute time of the first block's first steps / the model's
    step_compute_s: list[float] = field(default_factory=list)   # the latest block's, per token step

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


@dataclass(frozen=True, slots=True)
class _Prompt:
    doc: Document
    ids: list[int]


def run_job(config: JobConfig, *, loaded: LoadedModel | None = None, progress: Progress | None = None,
            on_policy: Callable[[Policy, float], None] | None = None) -> JobResult:
    fixed = None if config.policy == "auto" else read_policy(Path(config.policy))   # fail before the model loads
    check_here(config, model=loaded is None)
    docs = read_inputs(config.inputs, out=config.out)
    with OutputLog(config.out, config.output_settings(fixed), retry_failed=config.retry_failed) as out:
        todo = [d for d in docs if d.id not in out.done]
        if not todo:
            return JobResult(skipped=len(docs))
        loaded = loaded or load_model(config.model, dtype=compute_dtype(config.dtype))
        result = summarize(config, loaded, todo, out.write, progress=progress, on_policy=on_policy, fixed=fixed)
        result.skipped = len(docs) - len(todo)
    return result


def check_here(config: JobConfig, *, model: bool = True) -> None:
    """What this machine must have for the job, said before ``--out`` is read: the model (``model``: it is
    loaded here), and a scratch folder it can use."""
    if model:
        resolve_source(config.model)          # an unknown model is named as such
    if config.nvme_dir is not None:
        prepare_store_dir(config.nvme_dir)    # not at the first spill


def summarize(config: JobConfig, loaded: LoadedModel, docs: list[Document], write: Callable[[dict], None], *,
              progress: Progress | None = None, on_policy: Callable[[Policy, float], None] | None = None,
              fixed: Policy | None = None) -> JobResult:
    """Summarize ``docs``, handing one record per document to ``write`` (errors included) as blocks finish."""
    result = JobResult()
    if fixed is not None and config.weight_dtype is not None:
        fixed = replace(fixed, weight_dtype=config.weight_dtype)
    prompts = []
    for doc in docs:
        prompt = _prompt(loaded.tokenizer, doc, config)
        if isinstance(prompt, str):
            write({"id": doc.id, "error": prompt})
            result.documents += 1
            result.failed += 1
        else:
            prompts.append(prompt)
    if prompts:
        _generate(config, loaded, prompts, write, result, progress, on_policy, fixed)
    return result


def compute_dtype(name: str) -> torch.dtype:
    """``--dtype`` as a torch dtype; ``auto``: bf16 where the machine computes it natively, fp32 elsewhere
    (`tierkv.device.auto_dtype`; an AVX2 CPU measured 3 GFLOP/s in bf16 against 25 in fp32)."""
    return auto_dtype() if name == AUTO_DTYPE else DTYPES[name]


def _prompt(tokenizer, doc: Document, config: JobConfig) -> _Prompt | str:
    """The chat-formatted prompt of a document, or the error that keeps it from running."""
    if doc.error is not None:
        return doc.error
    if not doc.text.strip():
        return "empty document"
    ids = chat_ids(tokenizer, [{"role": "user", "content": f"{doc.text}\n\n{config.instruction}"}])
    if len(ids) > config.max_prompt_tokens:
        return (f"too long: {len(ids)} prompt tokens, the limit is {config.max_prompt_tokens} "
                f"(--max-prompt-tokens)")
    return _Prompt(doc, ids)


def _generate(config: JobConfig, loaded: LoadedModel, prompts: list[_Prompt], write: Callable[[dict], None],
              result: JobResult, progress: Progress | None,
              on_policy: Callable[[Policy, float], None] | None, fixed: Policy | None) -> None:
    prompts = sorted(prompts, key=lambda p: len(p.ids), reverse=True)
    work = _workload(prompts, config.max_new_tokens)
    limits = EngineLimits(work.max_prompt_len, config.max_new_tokens)
    model = _Measured.of(loaded, limits)     # before an engine runs: it empties the weights it streams
    policy, machine = choose_policy(config, model, work, fixed)
    placed = model.place(policy)
    estimate = predict(placed, model.shape, work, machine)
    result.policy, result.predicted_tokens_per_s, result.memory = placed, estimate.tokens_per_s, estimate.memory
    result.predicted_calibrated = estimate.tokens_per_s
    if on_policy:
        on_policy(placed, estimate.tokens_per_s)
    eos = eos_ids(loaded)
    live = [BatchEngine(loaded, policy, limits, nvme_dir=config.nvme_dir)]   # the engine running (none mid-swap)
    if progress:
        progress(0, 0, 0.0, len(prompts))
    try:
        start = 0
        while start < len(prompts):
            block = prompts[start:start + policy.block_size]
            _run_block(live[0], block, config, loaded, eos, write, result, progress, len(prompts))
            start += len(block)
            if result.in_run_factor is None:   # the first block: calibrate in the run, predict again
                machine = _recalibrated(result, model, placed, block, work, machine, config.max_new_tokens)
                if start < len(prompts) and fixed is None and abs(math.log(result.in_run_factor)) > REPLAN:
                    rest = _workload(prompts[start:], config.max_new_tokens)
                    policy = _replan(config, model, rest, machine, limits, policy, live, on_policy)
                    result.policy = model.place(policy)
                    rest_memory = predict(result.policy, model.shape, rest, machine).memory
                    result.memory = {tier: max(used, rest_memory.get(tier, 0)) for tier, used in result.memory.items()}
    finally:
        for engine in live:
            engine.close(restore=True)


REPLAN = math.log(1.25)   # the in-run compute rate departs from the calibration by more: search again


def _workload(prompts: list[_Prompt], new: int) -> Workload:
    lengths = [len(p.ids) for p in prompts]
    return Workload(math.ceil(sum(lengths) / len(lengths)), new, len(lengths), max_prompt_len=max(lengths),
                    lengths=tuple(lengths))


def _run_block(engine: BatchEngine, block: list[_Prompt], config: JobConfig, loaded: LoadedModel, eos: list[int],
               write: Callable[[dict], None], result: JobResult, progress: Progress | None, total: int) -> None:
    began = time.perf_counter()
    outputs = engine.generate([p.ids for p in block], max_new_tokens=config.max_new_tokens, eos_ids=eos)
    seconds = time.perf_counter() - began
    made = sum(len(o) for o in outputs)
    for prompt, tokens in zip(block, outputs):
        write(_record(loaded.tokenizer, prompt, tokens, eos, seconds, len(block), made))
    result.documents += len(block)
    result.generated_tokens += made
    result.seconds += seconds
    if progress:
        progress(len(block), made, seconds, total)
    result.step_compute_s = list(engine.runner.stats.step_compute_s)


@dataclass(frozen=True, slots=True)
class _Measured:
    """The model's sizes as the search and the placement need them, taken once before any engine runs."""
    loaded: LoadedModel
    limits: EngineLimits
    shape: ModelShape
    sizes: dict[str, int]           # bytes of each parameter of a decoder layer

    @classmethod
    def of(cls, loaded: LoadedModel, limits: EngineLimits) -> _Measured:
        return cls(loaded, limits, ModelShape.of(loaded.model), parameter_sizes(decoder_layers(loaded.model)[0]))

    def place(self, policy: Policy) -> Policy:
        return placed_policy(policy, self.loaded, self.limits, self.sizes)


def _recalibrated(result: JobResult, model: _Measured, placed: Policy, block: list[_Prompt], work: Workload,
                  machine: Machine, new: int) -> Machine:
    """The machine as the first block's first steps found it; the job's prediction made again with it."""
    from tierkv.schedule.calibrate import in_run_factor
    shape = model.shape
    t = policy_terms(placed, shape, _workload(block, new), machine)
    result.in_run_factor = in_run_factor(t, fractions(placed), result.step_compute_s)
    machine = slowed(machine, result.in_run_factor)
    result.predicted_tokens_per_s = predict(placed, shape, work, machine).tokens_per_s
    return machine


def _replan(config: JobConfig, model: _Measured, rest: Workload, machine: Machine, limits: EngineLimits,
            policy: Policy, live: list[BatchEngine], on_policy: Callable[[Policy, float], None] | None) -> Policy:
    """The policy searched again on the recalibrated machine; ``live``'s engine replaced only when it changed."""
    found = _search(config, model, rest, machine)
    if found.policy == policy:
        return policy
    live.pop().close(restore=True)
    if on_policy:
        on_policy(found.policy, found.estimate.tokens_per_s)
    live.append(BatchEngine(model.loaded, found.policy, limits, nvme_dir=config.nvme_dir))
    return found.policy


def _record(tokenizer, prompt: _Prompt, tokens: list[int], eos: list[int], seconds: float,
            block_docs: int, block_tokens: int) -> dict:
    text_ids = [t for t in tokens if t not in eos]
    return {"id": prompt.doc.id, "summary": tokenizer.decode(text_ids, skip_special_tokens=True).strip(),
            "prompt_tokens": len(prompt.ids), "tokens": len(tokens),
            "timings": {"block_s": round(seconds, 3), "block_documents": block_docs,
                        "block_tokens_per_s": round(block_tokens / seconds, 2) if seconds else None}}


def eos_ids(loaded: LoadedModel) -> list[int]:
    ids = loaded.model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    tok = loaded.tokenizer.eos_token_id
    return ids + ([tok] if tok is not None and tok not in ids else [])


def choose_policy(config: JobConfig, model: _Measured, work: Workload, fixed: Policy | None = None):
    """The policy (``fixed``, or searched as the engine places it) and the calibrated machine."""
    from tierkv.schedule.calibrate import calibrate
    machine = calibrate(model.loaded.model, nvme_dir=config.nvme_dir, max_rows=work.num_sequences * work.prompt_len,
                        refresh=config.recalibrate)
    if fixed is not None:
        return fixed, machine
    return _search(config, model, work, machine).policy, machine


def _search(config: JobConfig, model: _Measured, work: Workload, machine: Machine):
    """The fastest policy within the job's budgets, as the engine places it."""
    from tierkv.schedule.search import search
    budgets = Budgets(config.gpu_budget, config.cpu_budget, config.nvme_budget if config.nvme_dir else 0)
    return search(model.shape, work, machine, budgets, allow_compress=config.allow_compress, place=model.place,
                  weight_dtype=config.weight_dtype)


def placed_policy(policy: Policy, loaded: LoadedModel, limits: EngineLimits,
                  sizes: dict[str, int] | None = None) -> Policy:
    """The policy with the fractions the runner really places (whole tensors, whole KV blocks); ``sizes``:
    a decoder layer's parameters as `parameter_sizes` measured them (by default now: no engine may run)."""
    layer = decoder_layers(loaded.model)[0]
    sizes = parameter_sizes(layer) if sizes is None else sizes
    homes = tensor_homes(layer, policy.weights, sizes)
    total = sum(sizes.values())
    weights = Placement(*(sum(s for n, s in sizes.items() if homes[n] == t) / total for t in ("gpu", "cpu", "disk")))
    blocks = limits.blocks_per_cell
    kv = Placement(*(n / blocks for n in policy.kv.split(blocks)))
    return replace(policy, weights=weights, kv=kv)


__all__ = ["BLOCK_TOKENS", "JobConfig", "JobResult", "compute_dtype", "run_job", "summarize"]
