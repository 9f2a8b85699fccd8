"""Generate with transformers while the KV cache lives in tierkv's tiers.

    .venv/bin/python examples/tiered_cache.py

Budgets are tiny on purpose: most of the KV goes to the NVMe store in a
temporary directory, and the output equals transformers' own DynamicCache.
"""
import tempfile

import torch
from transformers import DynamicCache

from tierkv.hf import TieredCache
from tierkv.model.loading import load_model

loaded = load_model("smollm2")
model, tok = loaded.model, loaded.tokenizer
text = "The pass key is 4242. " + "The grass is green. The sky is blue. " * 150 + "What is the pass key? It is"
ids = torch.tensor([tok(text)["input_ids"]])

with torch.inference_mode(), tempfile.TemporaryDirectory() as spill:
    reference = model.generate(ids, max_new_tokens=8, do_sample=False, cache=DynamicCache(config=model.config))
    with TieredCache(model.config, gpu="2MiB", cpu="4MiB", nvme_dir=spill) as cache:
        tiered = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
        where = {name: stats["final_bytes"] for name, stats in cache.manager.tier_stats().items()}

print("prompt tokens:", ids.shape[1])
print("output       :", tok.decode(tiered[0, ids.shape[1]:]))
print("same as DynamicCache:", torch.equal(reference, tiered))
print("KV bytes per tier at the end:", where)
