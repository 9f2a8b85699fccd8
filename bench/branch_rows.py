"""Branching KV rows of ``bench/decode.py``: speculative decoding over tiered KV, and beam memory.

Speculative decoding, per context: a document that repeats itself (the passkey haystack's filler,
"The grass is green. The sky is blue. ...", without the question), continued as plain text, so
the model's greedy continuation repeats it too and prompt-lookup drafts hold. One prefill on
tiered KV (gpu and cpu tiers 10 % of the KV each, the rest on NVMe), then from forks of it::

    greedy        one token a pass                                  (tierkv.session.generation)
    speculative   up to 8 drafted tokens verified a pass, the same tokens

    speculative_vs_greedy@CTX   tok/s speculative / tok/s greedy, same run, same tokens (checked)

Beam memory: transformers' beam search (4 beams) over a 2K-token prompt with a ``TieredCache``:
the blocks the beams hold at the end / 4 x the blocks of one sequence as long (``beam_memory_vs_copies``;
the beams share the prompt's blocks and hold their own only past it).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from report import Report
from tierkv.model.loading import LoadedModel
from tierkv.model.prompt import FILLER, INTRO
from tierkv.model.settings import SessionConfig
from tierkv.session import Session

STEPS_SPEC = 48
DRAFT = 8


def repetitive(loaded: LoadedModel, n_tokens: int) -> list[int]:
    encode = lambda text: loaded.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head, unit = encode(INTRO), encode(FILLER)
    return head + (unit * (n_tokens // len(unit) + 1))[:n_tokens - len(head)]


def measure_speculative(report: Report, loaded: LoadedModel, ctx: int, workdir: Path) -> None:
    ids = repetitive(loaded, ctx)
    kv = ctx * loaded.spec.kv_bytes_per_token
    config = SessionConfig.of(mode="dense", nvme_dir=workdir / f"spec-{ctx}", gpu_budget=max(kv // 10, 4 << 20),
                              cpu_budget=max(kv // 10, 4 << 20))
    with Session(config, loaded=loaded) as session:
        session.read_ids(ids[:-1])
        runs = {name: session.complete(ids, max_new_tokens=STEPS_SPEC, draft_tokens=k)
                for name, k in (("greedy", 0), ("speculative", DRAFT), ("greedy-again", 0))}
    label = f"{ctx // 1024}K"
    same = runs["greedy"].tokens == runs["speculative"].tokens == runs["greedy-again"].tokens
    greedy = (runs["greedy"].decode_tokens_per_s + runs["greedy-again"].decode_tokens_per_s) / 2
    spec = runs["speculative"]
    for name, answer in runs.items():
        report.add_row(f"{name}-tiered", "decode_tokens_per_s", round(answer.decode_tokens_per_s, 3), "tok/s",
                       context=ctx, same_tokens=same, drafted=answer.drafted, accepted=answer.accepted)
    report.add_ratio(f"speculative_vs_greedy@{label}", round(spec.decode_tokens_per_s / greedy, 3), None,
                     f"decode tok/s with prompt-lookup drafts (up to {DRAFT}) / one token a pass (the mean of the "
                     "runs before and after), dense over tiered KV, a repeating document, same tokens: "
                     f"{'yes' if same else 'NO'}")
    report.add_ratio(f"draft_acceptance@{label}", round(spec.accepted / max(1, spec.drafted), 3), None,
                     "share of drafted tokens that greedy decoding kept")
    report.add_bound(f"speculative@{label}: {spec.generated_tokens} tokens in {spec.decode_s:.2f} s; a pass over "
                     f"a draft reads every block of every layer once, as one step does ({kv / 2**20:.0f} MiB of KV, "
                     "mostly on NVMe)")


def measure_beams(report: Report, loaded: LoadedModel, prompt_tokens: int = 2048, new_tokens: int = 32) -> None:
    from tierkv.hf import TieredCache
    ids = torch.tensor([repetitive(loaded, prompt_tokens)])
    model = loaded.model
    with TieredCache(model.config, gpu="2GiB", cpu=0, block_tokens=64) as cache, torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, cache=cache, num_beams=4, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
        held = sum(stats["final_bytes"] for stats in cache.manager.tier_stats().values())
        length = cache.get_seq_length()
        rows = len(cache.layers[0].rows)
    one = length * loaded.spec.kv_bytes_per_token
    report.add_row("beams-4-tiered", "kv_bytes_held", held, "B", context=prompt_tokens, beams=rows,
                   seconds=round(seconds, 1))
    report.add_ratio("beam_memory_vs_copies", round(held / (rows * one), 3), 0.3,
                     f"KV bytes {rows} beams hold in the tiers after {new_tokens} tokens past a {prompt_tokens}-token "
                     f"prompt / {rows} x one sequence of that length (the beams share the prompt's blocks)",
                     ceiling=True)


def measure_branching(report: Report, loaded: LoadedModel, contexts: tuple[int, ...], workdir: Path) -> None:
    for ctx in contexts:
        measure_speculative(report, loaded, ctx, Path(tempfile.mkdtemp(dir=workdir)))
    measure_beams(report, loaded)
