"""The native loop feeds the policies: positions to streaming, attention mass to h2o, plans to prefetch."""
import pytest
import torch

from tinymodels import tiny_model

from policies import make_policy
from tierkv.config import TierConfig
from tierkv.manager import BlockingTierManager
from tierkv.model.arch import model_spec
from tierkv.model.engine import Engine, EngineConfig
from tierkv.model.loading import LoadedModel
from tierkv.layout import BlockLayout


def _engine(gpu_policy: str, prefetch: str = "next-layer", **params):
    model = tiny_model("llama")
    loaded = LoadedModel(model, None, "tiny-llama", model_spec(model))
    s = loaded.spec
    layout = BlockLayout.kv(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, 16)
    config = TierConfig(block_bytes=layout.block_bytes, gpu=6 * layout.block_bytes, cpu=64 * layout.block_bytes)
    manager = BlockingTierManager.from_config(config, namespace=layout.name)
    manager.manager.policies["gpu"] = make_policy(gpu_policy, capacity=6, **params)
    return manager, Engine(loaded, manager, EngineConfig(16, 32, reuse=False, prefetch=prefetch))


def _generate(engine, n=4):
    seq = engine.new_sequence()
    ids = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, _ = engine.prefill(seq, ids)
    out = [logits]
    for _ in range(n):
        out.append(engine.decode(seq, int(out[-1].argmax())))
    return seq, torch.stack(out)


def test_h2o_receives_attention_mass_and_output_is_unchanged():
    m1, e1 = _engine("lru")
    m2, e2 = _engine("h2o")
    with m1, m2:
        assert not e1.scores and e2.scores
        _, ref = _generate(e1)
        seq, got = _generate(e2)
        m2.flush()
        torch.testing.assert_close(got, ref)
        h2o = m2.manager.policies["gpu"]
        scores = [h2o.score(k) for layer in seq.blocks for k in layer]
        assert all(s > 0 for s in scores)
        # each decode step gives a layer's stored blocks at most one unit of mass per head (4 heads)
        assert sum(h2o.score(k) for k in seq.blocks[0]) <= 4 * 4 + 1e-4


class _Described:
    """FIFO that writes down every position hint it gets."""

    def __init__(self, capacity=None):
        self.inner, self.seen = make_policy("fifo"), {}

    def insert(self, key):
        self.inner.insert(key)

    def touch(self, key):
        self.inner.touch(key)

    def remove(self, key):
        self.inner.remove(key)

    def evict(self, n, protected):
        return self.inner.evict(n, protected)

    def __len__(self):
        return len(self.inner)

    def describe(self, key, *, layer, index):
        self.seen[key] = (layer, index)


def test_policies_that_describe_blocks_learn_each_block_position():
    manager, engine = _engine("lru")
    with manager:
        gpu, cpu = _Described(), _Described()
        manager.manager.policies |= {"gpu": gpu, "cpu": cpu}
        seq, _ = _generate(engine, n=1)
        expected = {key: (layer, index) for layer, keys in enumerate(seq.blocks) for index, key in enumerate(keys)}
        assert gpu.seen and cpu.seen                       # blocks were placed in both, or demoted into cpu
        assert gpu.seen.items() <= expected.items() and cpu.seen.items() <= expected.items()
        assert gpu.seen.keys() | cpu.seen.keys() == expected.keys()


def test_streaming_runs_the_loop_unchanged():
    m1, e1 = _engine("lru")
    m2, e2 = _engine("streaming", sinks=1, window=1)
    with m1, m2:
        torch.testing.assert_close(_generate(e2, 2)[1], _generate(e1, 2)[1])


@pytest.mark.parametrize("prefetch", ["none", "next-layer-all", "streaming", "previous-step"])
def test_every_prefetch_strategy_runs_the_loop_unchanged(prefetch):
    m1, e1 = _engine("lru")
    m2, e2 = _engine("lru", prefetch=prefetch)
    with m1, m2:
        torch.testing.assert_close(_generate(e2, 2)[1], _generate(e1, 2)[1])
