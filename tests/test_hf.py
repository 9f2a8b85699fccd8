"""TieredCache gives transformers' own greedy tokens, with most KV on NVMe."""
import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tierkv.hf import TieredCache  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, initializer_range=0.2)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
}


def greedy(model, ids, cache, n=12):
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, cache=cache, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def block_bytes(config, block_tokens, dtype=torch.float32):
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * heads * block_tokens * head_dim * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_models_match_dynamic_cache_with_kv_on_nvme(family, tmp_path):
    torch.manual_seed(0)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 256, (1, 640))
    expected = greedy(model, ids, DynamicCache(config=config))
    block = block_bytes(config, 32)
    with TieredCache(config, gpu=4 * block, cpu=8 * block, nvme_dir=tmp_path / "kv", block_tokens=32) as cache:
        assert greedy(model, ids, cache) == expected
        stats = cache.manager.manager.stats
        stored = cache.manager.manager.tiers["nvme"].pool.used
        assert stored > 12 * 3  # most of the 3 layers x 20 blocks sit only on NVMe
        assert stats["nvme"].bytes_out > 0  # and were read back from there
        assert cache.manager.manager.stats["gpu"].peak_slots <= 4


@pytest.mark.model
def test_smollm2_matches_dynamic_cache_with_most_kv_on_nvme(smollm2, tmp_path):
    tok = smollm2.tokenizer
    text = "The pass key is 31337. " + "The grass is green. The sky is blue. " * 90 + "What is the pass key?"
    ids = torch.tensor([tok(text)["input_ids"]])
    model = smollm2.model
    expected = greedy(model, ids, DynamicCache(config=model.config), n=8)
    block = block_bytes(model.config, 64)
    with TieredCache(model.config, gpu=8 * block, cpu=8 * block, nvme_dir=tmp_path / "kv", block_tokens=64) as cache:
        assert greedy(model, ids, cache, n=8) == expected
        mgr = cache.manager.manager
        total = sum(len(layer) for layer in cache.sequence.blocks)
        in_memory = mgr.tiers["gpu"].pool.used + mgr.tiers["cpu"].pool.used
        assert total >= 4 * in_memory  # most KV lives only on NVMe


def test_close_drops_blocks_and_unsupported_operations_say_so(tmp_path):
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = TieredCache(config, gpu="1MiB", cpu="1MiB", block_tokens=32)
    greedy(model, torch.randint(0, 256, (1, 100)), cache, n=2)
    assert cache.get_seq_length() == 101
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.layers[0].reorder_cache(torch.tensor([0]))
    manager = cache.manager.manager
    cache.close()
    assert len(manager.directory) == 0
    cache.close()  # idempotent
