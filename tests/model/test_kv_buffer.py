"""A layer's K/V kept as one tensor that only appends: the same values as its blocks, within a budget."""
import pytest
import torch

from tierkv.config import TierConfig
from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine, EngineConfig
from tierkv.model.kv_buffer import BufferBudget, KVBuffer
from tierkv.model.layer_kv import LayerKV
from tierkv.model.prompt import passkey_prompt

T, HKV, D = 16, 2, 8
LAYOUT = BlockLayout.kv(1, HKV, D, torch.float32, T)
PER_TOKEN = 2 * HKV * D * 4      # K and V bytes of one token in a buffer


def keys_for(seed):
    return lambda index: BlockKey.of("test-buffer", seed, index)


@pytest.fixture
def manager():
    with BlockingTierManager.from_config(TierConfig(LAYOUT.block_bytes, gpu=64 * LAYOUT.block_bytes, cpu=0)) as mgr:
        yield mgr


def fill(layer: LayerKV, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, HKV, tokens, D, generator=g), torch.randn(1, HKV, tokens, D, generator=g)
    for first in range(0, tokens, 5):               # in uneven pieces, as prefill chunks and decode steps come
        layer.append(k[:, :, first:first + 5], v[:, :, first:first + 5], keys_for(seed), persist=False)
    return k, v


def by_blocks(layer: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [kv for _, blocks in layer.groups(4) for kv in blocks] + [layer.tail()]
    return torch.cat([k for k, _ in parts], 2), torch.cat([v for _, v in parts], 2)


def test_the_buffer_holds_what_the_blocks_and_tail_hold(manager):
    budget = BufferBudget(1 << 20)
    layer = LayerKV(manager, LAYOUT, 0, budget=budget)
    k, v = fill(layer, 77)
    whole = layer.contiguous()
    assert torch.equal(whole[0], k) and torch.equal(whole[1], v)
    assert not layer.reads_blocks                                # every sealed block is in it
    more_k, more_v = fill(layer, 40, seed=1)
    assert torch.equal(layer.contiguous()[0], torch.cat([k, more_k], 2))
    assert torch.equal(layer.contiguous()[1], torch.cat([v, more_v], 2))
    layer.release(keep=False)
    assert budget.used == 0


@pytest.mark.parametrize("room", [1 << 20, 48 * PER_TOKEN])
def test_a_read_of_every_token_reserves_nothing_and_reads_what_the_buffer_lacks(manager, room):
    """``read`` gives every token's K/V, from the buffer, the tiers and the tail, and leaves the buffer and
    its budget as they were (``contiguous`` would grow it for the tail); ``room`` for 48 tokens: the
    buffer gave its bytes back when the layer outgrew it, and every block is read from the tiers."""
    budget = BufferBudget(room)
    layer = LayerKV(manager, LAYOUT, 0, budget=budget)
    k, v = fill(layer, 40)
    layer.contiguous()
    more_k, more_v = fill(layer, 45, seed=1)                     # 85 tokens: 5 blocks and a tail of 5
    used, filled, capacity = budget.used, layer.buffer.filled, layer.buffer.capacity
    got_k, got_v = layer.read()
    assert torch.equal(got_k, torch.cat([k, more_k], 2)) and torch.equal(got_v, torch.cat([v, more_v], 2))
    assert (budget.used, layer.buffer.filled, layer.buffer.capacity) == (used, filled, capacity)
    assert filled == (5 * T if room > 48 * PER_TOKEN else 0)
    got_k[:] = 0                                                  # a copy: the layer's own K is untouched
    assert torch.equal(by_blocks(layer)[0], torch.cat([k, more_k], 2))
    bare = LayerKV(manager, LAYOUT, 0)                            # no buffer: every block read
    k, v = fill(bare, 37, seed=2)
    assert all(map(torch.equal, bare.read(), (k, v))) and bare.buffer is None
    layer.release(keep=False)
    bare.release(keep=False)


def test_crop_fork_and_truncate_keep_buffer_and_blocks_in_agreement(manager):
    budget = BufferBudget(1 << 20)
    layer = LayerKV(manager, LAYOUT, 0, budget=budget)
    k, _ = fill(layer, 70)
    layer.contiguous()
    layer.crop(30, keep=False)                      # into a sealed block: it becomes the tail again
    assert torch.equal(layer.contiguous()[0], k[:, :, :40])
    twin = layer.fork()                             # no buffer of its own yet: read from the shared blocks
    assert twin.reads_blocks
    assert torch.equal(twin.contiguous()[0], k[:, :, :40])
    extra, _ = fill(twin, 9, seed=2)
    assert torch.equal(twin.contiguous()[0], torch.cat([k[:, :, :40], extra], 2))
    assert torch.equal(layer.contiguous()[0], k[:, :, :40])     # the branch's appends are its own
    twin.truncate(1, keep=False)
    assert torch.equal(twin.contiguous()[0], k[:, :, :T])
    for state in (layer, twin):
        state.release(keep=False)
    assert budget.used == 0


def test_a_spent_budget_falls_back_to_blocks_and_gives_its_bytes_back(manager):
    budget = BufferBudget(40 * PER_TOKEN)
    first, second = LayerKV(manager, LAYOUT, 0, budget=budget), LayerKV(manager, LAYOUT, 0, budget=budget)
    fill(first, 32)
    assert first.contiguous() is not None
    k, v = fill(second, 32, seed=3)
    assert second.contiguous() is None              # 32 more tokens do not fit in the 8 left
    assert second.reads_blocks and second.budget is None
    got_k, got_v = by_blocks(second)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert budget.used == first.buffer.nbytes
    first.release(keep=False)
    second.release(keep=False)
    assert budget.used == 0


def test_a_buffer_refused_growth_is_emptied():
    budget = BufferBudget(20 * PER_TOKEN)
    buffer = KVBuffer(LAYOUT.fields[0].shape, torch.float32, "cpu", budget)
    assert buffer.reserve(10) and buffer.capacity == T and budget.used == T * PER_TOKEN
    assert not buffer.reserve(T + 1)
    assert buffer.capacity == 0 and budget.used == 0
    with pytest.raises(ValueError, match=">= 0"):
        BufferBudget(-1)


def test_a_budget_sized_for_every_layer_keeps_every_layer_buffered_as_they_grow():
    layers, blocks = 30, 64                         # the prompt fills 64 blocks a layer; one block each to spare
    budget = BufferBudget(layers * (blocks + 1) * T * PER_TOKEN)
    buffers = [KVBuffer(LAYOUT.fields[0].shape, torch.float32, "cpu", budget) for _ in range(layers)]
    assert all(b.reserve(blocks * T) for b in buffers)
    assert all(b.reserve(blocks * T + 1) for b in buffers)          # the first decode step: one more block each
    assert budget.holders == layers and budget.used == budget.limit
    spacious = BufferBudget(1 << 30)                                # a roomy budget still grows by 1/8
    alone = KVBuffer(LAYOUT.fields[0].shape, torch.float32, "cpu", spacious)
    assert alone.reserve(blocks * T) and alone.reserve(blocks * T + 1) and alone.capacity == blocks * T * 9 // 8
    for b in [*buffers, alone]:
        b.close()
    assert budget.used == budget.holders == spacious.used == spacious.holders == 0
    roomier = BufferBudget(layers * (blocks + 3) * T * PER_TOKEN)     # three spare blocks each: room, shared
    buffers = [KVBuffer(LAYOUT.fields[0].shape, torch.float32, "cpu", roomier) for _ in range(layers)]
    assert all(b.reserve(blocks * T) for b in buffers) and all(b.reserve(blocks * T + 1) for b in buffers)
    assert buffers[0].capacity > (blocks + 1) * T                   # not one block at a time: it took room
    for b in buffers:
        b.close()


def test_a_failed_allocation_gives_the_budget_its_bytes_back(monkeypatch):
    budget = BufferBudget(1 << 20)
    buffer = KVBuffer(LAYOUT.fields[0].shape, torch.float32, "cpu", budget)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")
    monkeypatch.setattr(torch, "empty", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        buffer.reserve(3 * T)
    assert budget.used == budget.holders == 0 and buffer.capacity == 0


@pytest.mark.model
def test_the_engine_decodes_the_same_tokens_with_some_layers_buffered(smollm2):
    ids = passkey_prompt(smollm2.tokenizer, 1200).ids
    spec = smollm2.spec
    layout = BlockLayout.kv(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, 128)
    layer_bytes = 1300 * spec.kv_bytes_per_token // spec.num_layers
    tokens = {}
    for buffer in (0, 7 * layer_bytes):             # none; 7 of 30 layers, the rest read blocks
        config = TierConfig(layout.block_bytes, gpu="64MiB", cpu=0)
        with BlockingTierManager.from_config(config, namespace=layout.name) as manager:
            engine = Engine(smollm2, manager, EngineConfig(block_tokens=128, chunk_tokens=512, buffer=buffer))
            seq = engine.new_sequence()
            logits, _ = engine.prefill(seq, ids)
            out = []
            for _ in range(6):
                out.append(int(logits.argmax()))
                logits = engine.decode(seq, out[-1])
            buffered = sum(not state.reads_blocks for state in seq.layers)
            tokens[buffer] = (out, buffered)
            seq.release(keep=False)
            assert engine.buffers.used == 0
    assert tokens[0][1] == 0 and 5 <= tokens[7 * layer_bytes][1] <= 7
    assert tokens[0][0] == tokens[7 * layer_bytes][0]


def test_a_chunk_seals_its_whole_blocks_in_one_put_and_a_failed_put_leaves_the_layer_as_it_was(manager, monkeypatch):
    """78 tokens in one append over a 5-token tail: 5 whole blocks go into the tiers in one put, the
    3 left over stay in the tail. When that put fails, the layer keeps what it had (its 5 tail tokens),
    and the same append then succeeds."""
    layer = LayerKV(manager, LAYOUT, 0)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, HKV, 83, D, generator=g), torch.randn(1, HKV, 83, D, generator=g)
    layer.append(k[:, :, :5], v[:, :, :5], keys_for(3), persist=False)
    puts, real = [], BlockingTierManager.put_many

    def failing(self, keys, rows, **kw):
        puts.append(len(keys))
        raise OSError("the tier refused the write")
    monkeypatch.setattr(BlockingTierManager, "put_many", failing)
    with pytest.raises(OSError, match="refused"):
        layer.append(k[:, :, 5:], v[:, :, 5:], keys_for(3), persist=False)
    assert layer.length == 5 and not layer.blocks and torch.equal(layer.tail()[0], k[:, :, :5])
    monkeypatch.setattr(BlockingTierManager, "put_many", lambda self, keys, rows, **kw: (puts.append(len(keys)),
                                                                                       real(self, keys, rows, **kw))[1])
    layer.append(k[:, :, 5:], v[:, :, 5:], keys_for(3), persist=False)
    assert puts == [5, 5] and len(layer.blocks) == 5 and layer.tail_len == 3
    got_k, got_v = by_blocks(layer)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    layer.release(keep=False)


def test_a_crop_into_a_lossy_block_keeps_the_tokens_it_keeps_exact():
    """A rejected draft that sealed an int8 block: the tokens kept become the tail again as they were
    computed, not decoded (and then quantized a second time, on scales the draft set)."""
    from tierkv.codec import block_codec
    lossy = BlockLayout.kv(1, HKV, D, torch.float32, T, codec=block_codec("int8", T))
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, HKV, 2 * T, D, generator=g), torch.randn(1, HKV, 2 * T, D, generator=g)
    draft = torch.randn(1, HKV, 6, D, generator=g) * 10
    with BlockingTierManager.from_config(TierConfig(lossy.block_bytes, gpu=64 * lossy.block_bytes, cpu=0)) as mgr:
        layer, direct = LayerKV(mgr, lossy, 0), LayerKV(mgr, lossy, 0)
        layer.append(k[:, :, :T - 4], v[:, :, :T - 4], keys_for(1), persist=False)
        layer.append(torch.cat([k[:, :, T - 4:T - 2], draft], 2), torch.cat([v[:, :, T - 4:T - 2], draft], 2),
                     keys_for(1), persist=False)                  # seals block 0 with 2 draft tokens in it
        layer.crop(6, keep=False)
        assert layer.tail_len == T - 2 and not layer.blocks
        assert torch.equal(layer.tail()[0], k[:, :, :T - 2]) and torch.equal(layer.tail()[1], v[:, :, :T - 2])
        layer.append(k[:, :, T - 2:], v[:, :, T - 2:], keys_for(1), persist=False)
        direct.append(k, v, keys_for(2), persist=False)
        with mgr.blocks(layer.blocks) as again, mgr.blocks(direct.blocks) as once:
            assert all(torch.equal(a, b) for a, b in zip(again, once))      # stored as if never drafted
