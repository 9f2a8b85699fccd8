"""Sparse decode past the model's trained window, with the pages on NVMe.

    .venv/bin/python examples/sparse_decode.py          # a few minutes on 2 CPU cores

A 12K-token passkey document (SmolLM2 was trained on 8K): the first 4K tokens
are prefilled exactly, the rest sparsely; each decode step selects 2048 tokens
per KV head at remapped positions (and attends to up to twice as many: the rest
of the pages it read, `--sparse-attend pages`). The run is repeated: the
second one loads the stored index and starts decoding at once.
"""
import tempfile
import time

from tierkv.session.run import run
from tierkv.model.settings import RunConfig
from tierkv.model.loading import load_model

loaded = load_model("smollm2")
with tempfile.TemporaryDirectory() as store:
    config = RunConfig.of(synthetic_tokens=12_000, mode="sparse", max_new_tokens=10, gpu_budget="16MiB",
                       cpu_budget="32MiB", nvme_dir=store, page_dtype="bfloat16")
    for attempt in ("first", "second"):
        start = time.perf_counter()
        result = run(config, loaded=loaded)
        s = result.sparse
        print(f"{attempt} run: {time.perf_counter() - start:.0f} s, reused {result.reused_prompt_tokens} tokens, "
              f"answer {result.text.strip()!r}, passkey {result.answer} found: {result.found}")
        print(f"  per step and layer: {s['tokens_per_layer_step']:.0f} tokens attended beside sinks and window, "
              f"{100 * s['reuse_rate']:.0f} % of pages reused from the step before; positions {s['positions']}; "
              f"index in memory {s['index_bytes'] / 2**20:.0f} MiB; NVMe written "
              f"{result.tiers['nvme']['bytes_written'] / 2**20:.0f} MiB")
