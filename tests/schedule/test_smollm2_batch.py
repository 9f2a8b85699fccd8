"""The real model: batched offloaded summaries equal transformers' greedy output, one document at a time."""
import pytest
import torch

from tierkv.schedule.engine import BatchEngine, EngineLimits
from tierkv.schedule.job import eos_ids
from tierkv.schedule.policy import Placement, Policy

NEW = 8


@pytest.mark.model
def test_batch_summaries_equal_unbatched_greedy(smollm2, tmp_path):
    from pydoc_data.topics import topics
    tok = smollm2.tokenizer
    prompts = []
    for name, size in (("assert", 500), ("pass", 200), ("del", 350)):
        messages = [{"role": "user", "content": topics[name][:size] + "\n\nSummarize the document above."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    eos = eos_ids(smollm2)
    expected = []
    for p in prompts:
        out = smollm2.model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    policy = Policy(2, 2, weights=Placement(0.3, 0.4, 0.3), kv=Placement(0.2, 0.4, 0.4))
    engine = BatchEngine(smollm2, policy, EngineLimits(max(map(len, prompts)), NEW), nvme_dir=tmp_path)
    try:
        got = engine.generate(prompts, eos_ids=eos)
    finally:
        engine.close(restore=True)   # the session's shared model gets its weights back
    assert got == expected
    assert len({len(p) for p in prompts}) == 3      # mixed lengths: padding was exercised
