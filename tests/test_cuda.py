"""The CUDA path (skipped without a CUDA device; bench/gpu.sh runs these on a GPU machine)."""
import pytest
import torch

from tierkv.config import TierConfig
from tierkv.device import staging_pool
from tierkv.keys import BlockKey
from tierkv.manager import BlockingTierManager
from tierkv.model.kv_buffer import BufferBudget, KVBuffer

pytestmark = pytest.mark.cuda
BLOCK = 64 * 1024


def blocks(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=g) for _ in range(n)]


def test_blocks_round_trip_through_the_disk_into_device_memory(tmp_path):
    data = blocks(48)
    keys = [BlockKey.of("cuda-test", i) for i in range(len(data))]
    config = TierConfig(BLOCK, gpu=8 * BLOCK, cpu=8 * BLOCK, nvme_dir=tmp_path / "kv")
    with BlockingTierManager.from_config(config) as mgr:
        assert mgr.manager.tiers["gpu"].device.type == "cuda"
        for key, raw in zip(keys, data):
            mgr.put(key, raw.cuda(), persist=True)
        mgr.flush()
        made = staging_pool(BLOCK).made
        for first in range(0, len(keys), 4):          # most come back from the disk through staging buffers
            out = torch.empty(4, BLOCK, dtype=torch.uint8)
            mgr.read(keys[first:first + 4], into=out, tier="gpu").wait()
            assert all(torch.equal(out[i], data[first + i]) for i in range(4))
        assert staging_pool(BLOCK).made - made <= 64      # reused, not made per block per read


def test_a_layer_buffer_lives_on_the_device():
    budget = BufferBudget(1 << 24)
    buffer = KVBuffer((1, 2, 16, 8), torch.float16, "cuda", budget)
    assert buffer.reserve(40) and buffer.k.device.type == "cuda"
    k = torch.randn(1, 2, 40, 8, dtype=torch.float16)
    buffer.write(0, k, k)
    assert torch.equal(buffer.view(40)[0].cpu(), k)
    buffer.close()
    assert budget.used == 0


def test_tiered_cache_on_the_device_gives_dynamic_cache_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers import DynamicCache

    from tierkv.hf import TieredCache
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().cuda()
    ids = torch.randint(0, 256, (1, 300), device="cuda")

    def greedy(cache):
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()
    expected = greedy(DynamicCache(config=config))
    for buffer in (0, None):                        # every step gathers blocks; layers kept as one tensor
        with TieredCache(config, gpu=4 * 32768, cpu=8 * 32768, nvme_dir=tmp_path / f"kv{buffer}", block_tokens=32,
                         buffer=buffer) as cache:
            assert greedy(cache) == expected


def test_the_native_loop_on_the_device_gives_the_host_loop_logits(tmp_path):
    from tinymodels import tiny_model

    from tierkv.layout import BlockLayout
    from tierkv.model.arch import model_spec
    from tierkv.model.engine import Engine, EngineConfig
    from tierkv.model.loading import LoadedModel
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()

    def logits_on(device: str) -> torch.Tensor:
        model = tiny_model("llama").to(device)
        loaded = LoadedModel(model, None, "tiny-llama", model_spec(model))
        s = loaded.spec
        layout = BlockLayout.kv(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, 16)
        config = TierConfig(layout.block_bytes, gpu=6 * layout.block_bytes, cpu=6 * layout.block_bytes,
                            nvme_dir=tmp_path / device)                 # most blocks come back from the disk
        with BlockingTierManager.from_config(config, namespace=layout.name) as mgr:
            engine = Engine(loaded, mgr, EngineConfig(16, 32, reuse=False))
            seq = engine.new_sequence()
            logits, _ = engine.prefill(seq, ids)
            assert seq.layers[0].tail_k.device.type == torch.device(device).type   # the tail never leaves it
            out = [logits.cpu()]
            for _ in range(6):
                out.append(engine.decode(seq, int(out[-1].argmax())).cpu())
            seq.release(keep=False)
        return torch.stack(out)
    torch.testing.assert_close(logits_on("cuda"), logits_on("cpu"), atol=1e-4, rtol=1e-3)
