"""The quantized-KV rows of ``bench/accuracy.py --page-dtypes int8,int4,int2``: what each codec
(``tierkv.codec``) costs in fidelity and saves in bytes, against bfloat16 pages in the same run.

    bf16                 SparseConfig(page_dtype="bfloat16"): the reference every ratio divides by
    int8 / int4 / int2   the same selector and budget, pages quantized (values per token, key factors
                         per channel over the page), landmarks int8 (the default with quantized pages)
    bf16+int8-landmarks  bf16 pages, int8 landmarks: what quantizing the landmarks alone costs
    int4+float-landmarks int4 pages with landmarks in the model's dtype: the other half of that answer
    dense-int8 / -int4 / -int2   the dense engine with KV blocks in that codec (--kv-dtype), teacher-forced
                         over the same steps, against transformers' DynamicCache logits

Ratios: ``page_bytes_vs_bf16@X`` (bytes per stored token, 4 KiB padding and scales included),
``kl_vs_bf16@X`` (mean KL(bf16 run || X run), nats per step), ``top1_vs_bf16@X`` (steps whose argmax
equals the bf16 run's), ``passkey_quant_vs_bf16`` (cases bf16 solves that every codec solves),
``dense_X_vs_dynamic`` (steps whose argmax equals DynamicCache's), ``store_bytes_vs_bf16@1M@int4``
(pages and landmarks of a 1M-token document, computed from the layouts), and the encode cost.
"""
from __future__ import annotations

import time

import torch
from logits import kl, mean, top1
from report import Report
from torch import Tensor

from tierkv.config import TierConfig
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine, EngineConfig
from tierkv.model.loading import LoadedModel
from tierkv.model.sparse_engine import SparseEngine
from tierkv.sparse.config import SparseConfig

REFERENCE = "bf16"
TARGETS = {"page_bytes_vs_bf16@int8": 0.55, "page_bytes_vs_bf16@int4": 0.30, "page_bytes_vs_bf16@int2": 0.18,
           "kl_vs_bf16@int8": 0.005, "top1_vs_bf16@int4": 0.97, "passkey_quant_vs_bf16": 1.0,
           "dense_int8_vs_dynamic": 0.99, "store_bytes_vs_bf16@1M@int4": 0.30}
CEILINGS = {"page_bytes_vs_bf16@int8", "page_bytes_vs_bf16@int4", "page_bytes_vs_bf16@int2", "kl_vs_bf16@int8",
            "store_bytes_vs_bf16@1M@int4"}


def quant_configs(page_dtypes: list[str]) -> dict[str, SparseConfig]:
    """The runs: bf16 pages, each codec, and the landmark comparisons."""
    configs = {REFERENCE: SparseConfig(page_dtype="bfloat16")}
    configs |= {name: SparseConfig(page_dtype=name) for name in page_dtypes}
    configs["bf16+int8-landmarks"] = SparseConfig(page_dtype="bfloat16", landmark_dtype="int8")
    if "int4" in page_dtypes:
        configs["int4+float-landmarks"] = SparseConfig(page_dtype="int4", landmark_dtype="float")
    return configs


def add_quant(report: Report, loaded: LoadedModel, runs: list, cases: list, page_dtypes: list[str]) -> None:
    """``runs``: accuracy.py's DocRuns (with logits), ``cases``: its passkey cases over the same names."""
    by_name = {run.name: run for run in runs}
    ref = by_name.get(REFERENCE)
    for name in page_dtypes:
        ratio(report, f"page_bytes_vs_bf16@{name}", round(bytes_per_token(loaded, SparseConfig(page_dtype=name)) /
                                                        bytes_per_token(loaded, SparseConfig(page_dtype="bfloat16")), 4),
              f"bytes per stored token of an {name} page ({page_layout(loaded, name).tokens} tokens, "
              f"{page_layout(loaded, name).block_bytes} B) / a bf16 page's (16 tokens, 12288 B)")
    if ref is not None:
        for run in runs:
            if run is ref or run.name.startswith("dense"):
                continue
            ratio(report, f"kl_vs_bf16@{run.name}", kl(ref.logits, run.logits),
                  f"mean KL(bf16 pages || {run.name}) per teacher-forced step, nats, {run.steps} steps")
            ratio(report, f"top1_vs_bf16@{run.name}", top1(run.logits, ref.logits),
                  f"steps whose argmax equals the bf16 run's ({run.name})")
            ratio(report, f"recall_vs_bf16@{run.name}", round(mean(run.per_layer["recall"]) /
                                                             mean(ref.per_layer["recall"]), 4),
                  f"dense attention mass the {run.name} run attends / the bf16 run's")
    if cases:
        solved = [c for c in cases if c.found(REFERENCE)]

        def share(names: list[str]) -> float:
            return round(sum(c.found(n) for c in solved for n in names) / max(1, len(solved) * len(names)), 3)
        held = [name for name in page_dtypes if name in ("int8", "int4")]     # the codecs with fidelity targets
        if held:
            ratio(report, "passkey_quant_vs_bf16", share(held), f"passkey cases bf16 pages solve ({len(solved)} "
                  f"of {len(cases)}) that {' and '.join(held)} pages solve")
        for name in page_dtypes:
            ratio(report, f"passkey_{name}_vs_bf16", share([name]), f"the same for {name} alone")
    store_ratio(report, loaded)
    encode_cost(report, loaded, page_dtypes)


def ratio(report: Report, name: str, value: float, meaning: str) -> None:
    report.add_ratio(name, value, TARGETS.get(name), meaning, ceiling=name in CEILINGS)


def page_layout(loaded: LoadedModel, page_dtype: str) -> BlockLayout:
    return SparseEngine.page_layout(loaded, SparseConfig(page_dtype=page_dtype))


def bytes_per_token(loaded: LoadedModel, config: SparseConfig) -> float:
    layout = SparseEngine.page_layout(loaded, config)
    return layout.block_bytes / layout.tokens


def landmark_bytes_per_token(loaded: LoadedModel, config: SparseConfig) -> float:
    """A chunk's landmark (and its scale when int8) and candidate flag, per token."""
    spec = loaded.spec
    if config.int8_landmarks:
        per_chunk = spec.num_kv_heads * (spec.head_dim + 2)
    else:
        per_chunk = spec.num_kv_heads * spec.head_dim * SparseEngine.page_layout(loaded, config).dtype.itemsize
    return (per_chunk + 1) / config.chunk_tokens


def store_ratio(report: Report, loaded: LoadedModel) -> None:
    tokens, layers = 1 << 20, loaded.spec.num_layers

    def store(config: SparseConfig) -> float:
        return tokens * layers * (bytes_per_token(loaded, config) + landmark_bytes_per_token(loaded, config))
    bf16, int4 = store(SparseConfig(page_dtype="bfloat16")), store(SparseConfig(page_dtype="int4"))
    ratio(report, "store_bytes_vs_bf16@1M@int4", round(int4 / bf16, 4),
          f"pages + landmarks of a 1M-token SmolLM2 document: {int4 / 2**30:.1f} GiB with int4 pages and int8 "
          f"landmarks / {bf16 / 2**30:.1f} GiB in bf16 (computed from the page layouts and the index's rows)")
    report.add_row("store@1M", "bytes", round(int4), "B", page_dtype="int4", bf16_bytes=round(bf16))


def encode_cost(report: Report, loaded: LoadedModel, page_dtypes: list[str]) -> None:
    """Microseconds to pack a token's values and key factors into pages, per layer (a prefill pays this
    once per token and layer), 64 pages at a time as a prefill chunk seals them."""
    spec = loaded.spec
    for name in (REFERENCE, *page_dtypes):
        layout = page_layout(loaded, "bfloat16" if name == REFERENCE else name)
        values = torch.randn(64, *layout.fields[0].shape)
        factors = torch.randn(64, *layout.fields[1].shape) * torch.linspace(20, 0.1, layout.rank)
        layout.pack(values, factors)                                   # warm-up
        start = time.perf_counter()
        for _ in range(8):
            layout.pack(values, factors)
        us = 1e6 * (time.perf_counter() - start) / (8 * 64 * layout.tokens)
        report.add_row(name, "encode_us_per_token_layer", round(us, 2), "us", page_tokens=layout.tokens,
                       per_token_all_layers_us=round(us * spec.num_layers, 1))


def dense_agreement(report: Report, loaded: LoadedModel, ids: list[int], prompt: int, dense: Tensor,
                    steps: int, kv_dtype: str = "int8") -> None:
    """The dense engine with quantized blocks, teacher-forced over the document's steps, against
    transformers' logits for the same steps (``dense`` [steps, vocab])."""
    config = EngineConfig(reuse=False, kv_dtype=kv_dtype)
    layout = config.layout(loaded.spec)
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu="2GiB", cpu=0)
    started = time.perf_counter()
    with BlockingTierManager.from_config(tiers, namespace=layout.name) as manager:
        engine = Engine(loaded, manager, config)
        seq = engine.new_sequence()
        logits, _ = engine.prefill(seq, ids[:prompt])
        rows = [logits.float()]
        for i in range(steps - 1):
            rows.append(engine.decode(seq, ids[prompt + i]).float())
        seq.release(keep=False)
    got = torch.stack(rows)
    name = f"dense_{kv_dtype}_vs_dynamic"
    exact = EngineConfig().layout(loaded.spec)
    report.add_row(f"dense-{kv_dtype}", "top1_agreement", top1(got, dense[:steps]), "share", context=prompt,
                   steps=steps, kl_mean=kl(dense[:steps], got), block_bytes=layout.block_bytes,
                   exact_block_bytes=exact.block_bytes, seconds=round(time.perf_counter() - started, 1))
    ratio(report, name, top1(got, dense[:steps]),
          f"dense engine with {kv_dtype} KV blocks ({layout.block_bytes / exact.block_bytes:.2f} of the "
          f"{loaded.spec.dtype} bytes): teacher-forced steps whose argmax equals DynamicCache's, {steps} steps")
