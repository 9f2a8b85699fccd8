"""Trace replay: textbook hit rates, the time model, prefetch, and fidelity to the manager it replays."""
from __future__ import annotations

import asyncio
import math
import sys

import pytest
import torch

from policies import make_policy
from tierkv.config import TierConfig
from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.manager import BlockingTierManager
from tierkv.manager.manager import TierManager
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_trace import AccessTrace, OpKind, TierSpec, TraceMeta
from tierkv.profile.link_stats import link_bytes
from tierkv.tune.prefetchers import Prefetch, dense_prefetch
from tierkv.tune.replay import ReplayConfig, compute_gaps, replay
from tierkv.tune.tier_model import Link, TierModel
from tierkv.tiers.base import Medium
from tierkv.tiers.memory import MemoryTier

BLOCK = 4096
FAST = TierModel({"*->*": Link(10.0)})
POLICIES = ["lru", "fifo", "lfu", "arc", "s3fifo"]


def key(i: int) -> BlockKey:
    return BlockKey.of("replay", i)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Script:
    """Writes a trace by hand: steps of puts and gets, ``tick`` seconds of compute after each call."""

    def __init__(self, gpu: int = 8, store: int | None = 10_000, tick: float = 0.0) -> None:
        self.clock = Clock()
        self.rec = AccessRecorder(clock=self.clock)
        tiers = [TierSpec("gpu", "gpu", gpu)] + ([TierSpec("nvme", "nvme", store)] if store else [])
        self.meta = TraceMeta(BLOCK, tuple(tiers))
        self.tick = tick

    def step(self, kind: str = "decode") -> Script:
        self.rec.begin_step(kind, 1)
        return self

    def put(self, *ids: int, layer: int = 0) -> Script:
        for i in ids:
            self.rec.on_put(key(i), layer)
            self.clock.t += self.tick
        return self

    def get(self, *groups: list[int] | int, layer: int = 0) -> Script:
        for group in groups:
            self.rec.on_acquire([key(i) for i in (group if isinstance(group, list) else [group])], layer)
            self.clock.t += self.tick
        return self

    def trace(self) -> AccessTrace:
        return self.rec.trace(meta=self.meta)


def gpu_hits(result, trace: AccessTrace, blocks: set[int] | None = None, from_step: int = 0) -> float:
    """Share of the gets' blocks (ids in ``blocks``, steps >= ``from_step``) that the replay found in the gpu tier."""
    seen, start = result.trace, trace.op_start()
    found = [int(seen.where[j]) == 0 for i in range(trace.n_ops)
             if trace.op_kind[i] == OpKind.GET and trace.op_step[i] >= from_step
             for j in range(start[i], start[i + 1]) if blocks is None or int(trace.block[j]) in blocks]
    return sum(found) / len(found)


def play(trace: AccessTrace, policy: str, model: TierModel = FAST, prefetch: str = "none"):
    return replay(trace, model, ReplayConfig({"gpu": policy}, prefetch=prefetch))


# -- textbook access patterns -----------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_a_scan_never_hits(policy: str) -> None:
    script = Script(gpu=8).step("prefill").put(*range(40)).step()
    trace = script.get(*range(8, 40)).trace()  # blocks the gpu never held, each once
    result = play(trace, policy)
    assert gpu_hits(result, trace, from_step=1) == 0.0
    assert result.bytes_by_link["nvme->gpu"] == 32 * BLOCK


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_a_loop_one_larger_than_the_cache_never_hits_under_recency_policies(policy: str) -> None:
    script = Script(gpu=8).step("prefill").put(*range(9))
    for _ in range(10):
        script.step().get(*range(9))
    trace = script.trace()
    result = play(trace, policy)
    assert gpu_hits(result, trace, from_step=2) == 0.0
    assert result.hit_rates["nvme"] == 1.0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_loop_that_fits_always_hits(policy: str) -> None:
    script = Script(gpu=8).step("prefill").put(*range(8))
    for _ in range(10):
        script.step().get(*range(8))
    trace = script.trace()
    result = play(trace, policy)
    assert gpu_hits(result, trace, from_step=1) == 1.0
    assert result.moved_bytes == 0


HOT = set(range(16))


def hot_set_with_scans(rounds: int = 10, scan: int = 60) -> AccessTrace:
    """Three warm-up passes over a hot set of 16 blocks, then rounds of (the hot set once, a one-time
    scan longer than the gpu tier's 40 blocks). Steps 5 on are the rounds after the first."""
    hot = len(HOT)
    script = Script(gpu=40).step("prefill").put(*range(hot + rounds * scan))
    for _ in range(3):
        script.step().get(*range(hot))
    for r in range(rounds):
        script.step().get(*range(hot)).get(*range(hot + r * scan, hot + (r + 1) * scan))
    return script.trace()


def textbook_hits(policy: str, accesses: list[int], capacity: int) -> list[bool]:
    """The textbook cache: a hit touches the key; a miss evicts one victim when full, then inserts."""
    chosen, resident, hits = make_policy(policy, capacity=capacity), set(), []
    for k in accesses:
        hits.append(k in resident)
        if hits[-1]:
            chosen.touch(k)
            continue
        if len(resident) >= capacity:
            resident.difference_update(chosen.evict(1, frozenset()))
        chosen.insert(k)
        resident.add(k)
    return hits


def test_lru_loses_a_hot_set_to_scans() -> None:
    trace = hot_set_with_scans()
    assert gpu_hits(play(trace, "lru"), trace, blocks=HOT, from_step=5) == 0.0


def test_lfu_keeps_a_hot_set_through_scans() -> None:
    trace = hot_set_with_scans()
    assert gpu_hits(play(trace, "lfu"), trace, blocks=HOT, from_step=5) == 1.0


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "arc", "s3fifo"])
def test_a_hot_set_under_scans_hits_exactly_as_the_textbook_cache(policy: str) -> None:
    trace = hot_set_with_scans()
    seen, start = play(trace, policy).trace, trace.op_start()
    gets = [i for i in range(trace.n_ops) if trace.op_kind[i] == OpKind.GET]
    replayed = [int(seen.where[start[i]]) == 0 for i in gets]
    first_in_gpu = trace.block[:40].tolist()  # the puts that found a free gpu slot
    expected = textbook_hits(policy, first_in_gpu + [int(trace.block[start[i]]) for i in gets], 40)[40:]
    assert replayed == expected


# -- the time model ---------------------------------------------------------------------------
def test_a_load_takes_bytes_over_bandwidth_plus_latency_per_round_plus_overhead() -> None:
    trace = Script(gpu=8).step().get([0, 1, 2, 3, 4]).trace()  # read before stored: they start in the store
    model = TierModel({"nvme->*": Link(gbps=0.5, latency_us=100, queue_depth=2)}, overhead_us=30)
    result = play(trace, "lru", model)
    expected = 5 * BLOCK / 0.5e9 + 3 * 100e-6 + 30e-6
    assert result.stall_s == pytest.approx(expected)
    assert result.trace.op_blocked.tolist() == pytest.approx([expected])
    assert result.bytes_by_link == {"nvme->gpu": 5 * BLOCK}


def test_transfers_on_one_channel_queue_behind_each_other() -> None:
    script = Script(gpu=8, tick=1.0).step()
    trace = script.get(0, 1).trace()
    one = BLOCK / 1e6  # seconds per block at 0.001 GB/s
    model = TierModel({"nvme->*": Link(gbps=0.001)})
    # the next group's prefetch (block 1) is issued before block 0's load and holds the channel first
    result = replay(trace, model, ReplayConfig(prefetch="next-layer"))
    assert result.trace.op_blocked.tolist() == pytest.approx([2 * one, 0.0])
    assert play(trace, "lru", model).trace.op_blocked.tolist() == pytest.approx([one, one])


def layer_by_layer() -> tuple[AccessTrace, TierModel]:
    """A decode step reading 4 layers of 2 blocks from the store, 10 ms of compute before each; ~1 ms a load."""
    script = Script(gpu=8, tick=0.01).step()
    for layer in range(4):
        script.get([2 * layer, 2 * layer + 1], layer=layer)
    return script.trace(), TierModel({"nvme->*": Link(gbps=1.0, latency_us=1000, queue_depth=2)})


def test_prefetch_hides_a_load_behind_the_compute_before_it() -> None:
    trace, model = layer_by_layer()
    load = 2 * BLOCK / 1e9 + 1e-3
    none, engine = play(trace, "lru", model, "none"), play(trace, "lru", model, "next-layer")
    assert none.trace.op_blocked.tolist() == pytest.approx([load] * 4)
    # layer 0 waits for its own load queued behind layer 1's prefetch; layers 1..3 arrive during compute
    assert engine.trace.op_blocked.tolist() == pytest.approx([2 * load, 0.0, 0.0, 0.0])
    assert engine.compute_s == pytest.approx(0.03) and engine.total_s == pytest.approx(0.03 + engine.stall_s)


def test_less_compute_leaves_prefetch_less_time_to_hide_loads() -> None:
    trace, model = layer_by_layer()
    normal = replay(trace, model, ReplayConfig(prefetch="next-layer"))
    faster = replay(trace, model, ReplayConfig(prefetch="next-layer", compute_scale=0.01))  # 0.1 ms between layers
    assert faster.compute_s == pytest.approx(0.0003)
    assert faster.stall_s > normal.stall_s and faster.trace.op_blocked[2] > 0  # layer 1 came during layer 0's wait
    with pytest.raises(ConfigError, match="compute_scale=0: a factor > 0, or one per step kind"):
        ReplayConfig(compute_scale=0)


def test_engine_is_the_old_name_of_next_layer() -> None:
    trace, model = layer_by_layer()
    old, new = (replay(trace, model, ReplayConfig(prefetch=name)) for name in ("engine", "next-layer"))
    assert old.prefetch == new.prefetch == "next-layer" and old.as_dict() == new.as_dict()
    assert replay(trace, model).prefetch == "next-layer"    # a dense trace: the dense engine's default


def test_compute_gaps_are_the_time_between_calls_minus_the_time_blocked_in_them() -> None:
    trace = Script(tick=0.5).step().get(0, 1, 2).trace()
    object.__setattr__(trace, "op_blocked", trace.op_blocked + [0.2, 0.0, 0.0])
    assert compute_gaps(trace).tolist() == pytest.approx([0.0, 0.3, 0.5])


# -- prefetchers -------------------------------------------------------------------------------
def test_next_layer_prefetch_fetches_the_next_group_and_the_next_layers_first_group() -> None:
    script = Script().step("prefill").put(0, 1, layer=0).put(2, 3, layer=1).step()
    script.get([0], [1], layer=0).get([2], [3], layer=1)
    trace = script.trace()
    # ops: 0..3 puts, 4,5 gets of layer 0 (blocks 0, 1), 6,7 gets of layer 1 (blocks 2, 3)
    assert sorted(dense_prefetch(trace, "next-layer"), key=lambda p: (p.at, p.target)) == [
        Prefetch(4, 0.0, 5), Prefetch(4, 0.0, 6, (2,)), Prefetch(6, 0.0, 7)]
    # the other policies.prefetch strategies pick layer l+1's blocks their way; the groups stay
    assert Prefetch(4, 0.0, 6, (2, 3)) in dense_prefetch(trace, "next-layer-all")
    assert dense_prefetch(trace, "none") == []


def test_next_layer_prefetch_issues_the_next_layer_when_this_layer_began() -> None:
    script = Script(tick=1.0).step().get([0], layer=0).get([1], layer=1)
    trace = script.trace()
    meta = TraceMeta(BLOCK, trace.meta.tiers, layers=2)
    timed = AccessTrace(meta, **{n: getattr(trace, n) for n in ("step_kind", "step_tokens", "step_time", "op_kind",
                                                                "op_step", "op_layer", "op_count", "op_time",
                                                                "op_blocked", "block", "where")},
                        layer_start=[-0.25, 0.75])
    assert dense_prefetch(timed) == [Prefetch(0, 0.25, 1, (1,))]


# -- configuration ------------------------------------------------------------------------------
def test_links_match_exactly_then_by_source_then_by_destination_then_anything() -> None:
    model = TierModel({"nvme->gpu": Link(1.0), "nvme->*": Link(2.0), "*->nvme": Link(3.0), "*->*": Link(4.0)})
    assert [model.link(s, d).gbps for s, d in [("nvme", "gpu"), ("nvme", "cpu"), ("gpu", "nvme"), ("new", "gpu")]] \
        == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ConfigError, match=r"no link model for cpu->gpu; the model has nvme->\*"):
        TierModel({"nvme->*": Link(1.0)}).link("cpu", "gpu")


def test_a_tier_model_reads_from_a_dict_and_from_the_probe() -> None:
    raw = {"links": {"nvme->*": {"gbps": 2.0, "latency_us": 80.0, "queue_depth": 4, "channel": "nvme"}},
           "overhead_us": 50.0}
    assert TierModel.from_dict(raw).as_dict() == raw
    probe = {"links": {"cpu->cpu": {"gbps": 13.0, "latency_us": 0.4, "queue_depth": 1},
                       "nvme->cpu": {"gbps": 2.2, "latency_us": 90.0, "queue_depth": 4}}}
    model = TierModel.from_probe(probe)
    assert model.link("nvme", "gpu") == Link(2.2, 90.0, 4, "nvme")
    assert model.link("gpu", "cpu").gbps == 13.0


def test_a_tier_model_from_a_run_prices_links_by_their_busy_time() -> None:
    links = {"new->gpu": {"transfers": 4, "bytes": 4e6, "union_s": 0.002, "queued_s": 1e-4},
             "nvme->gpu": {"transfers": 6, "bytes": 8e6, "union_s": 0.010, "queued_s": 3e-4},
             "gpu->nvme": {"transfers": 2, "bytes": 1e6, "union_s": 0.002, "queued_s": 3e-4}}
    devices = {"nvme": {"transfers": 8, "bytes": 9e6, "union_s": 0.009, "queued_s": 3e-4}}
    model = TierModel.from_run(links, devices)
    assert model.link("nvme", "gpu") == model.link("gpu", "nvme")    # one channel: the device's
    assert (model.link("nvme", "gpu").gbps, model.link("nvme", "gpu").channel) == (pytest.approx(1.0), "nvme")
    assert model.link("new", "gpu").gbps == pytest.approx(2.0)
    assert model.link("gpu", "cpu").gbps == pytest.approx(2.0)       # unused memory link: the pooled rate
    assert model.overhead_us == pytest.approx((4 * 100 + 6 * 300 + 2 * 300) / 12, abs=0.1)  # per transfer
    with pytest.raises(ConfigError, match="no link statistics"):
        TierModel.from_trace(Script().step().get(0).trace())


@pytest.mark.parametrize("bad, message", [
    ({"links": {"nvme": {"gbps": 1.0}}}, "keys must look like 'src->dst'"),
    ({"links": {"a->b": {"gbps": 0}}}, "gbps=0: a link's bandwidth is 0.001 to 10000 GB/s"),
    ({"links": {"a->b": {"gbps": 1e-7}}}, "gbps=1e-07"),                # (a replay ran for ages)
    ({"links": {"a->b": {"gbps": float("inf")}}}, "gbps=inf"),
    ({"links": {"a->b": {"gbps": 1.0, "latency_us": 1e12}}}, r"latency_us=1000000000000.0: 0 to 1e\+07 us"),
    ({"links": {"a->b": {"gbps": 1.0}}, "overhead_us": float("nan")}, "overhead_us=nan"),
    ({"links": {"a->b": {"gbps": 1.0, "queue_depth": 0}}}, "queue_depth=0"),
    ({"links": {"a->b": {"gbit": 1.0}}}, "expected"),
    ({}, "expected"),
    ([1, 2, 3], "tier model \\[1, 2, 3\\]: expected"),
    (None, "tier model None: expected"),
])
def test_a_bad_tier_model_is_a_clear_error(bad, message) -> None:
    with pytest.raises(ConfigError, match=message):
        TierModel.from_dict(bad)


def test_a_link_the_model_lacks_fails_the_replay_by_name() -> None:
    """The missing link's error was lost inside the loop, and the replay said it stalled."""
    trace = Script().step().get(0).trace()
    with pytest.raises(ConfigError, match=r"no link model for nvme->gpu; the model has gpu->nvme"):
        replay(trace, TierModel.from_dict({"links": {"gpu->nvme": {"gbps": 1.0}}}))


def test_replay_settings_are_checked() -> None:
    trace = Script().step().get(0).trace()
    with pytest.raises(ConfigError, match=r"prefetch='magic': unknown; for a trace of the dense engine \(tierkv run "
                                          r"--prefetch\): next-layer, .*; for a trace of the sparse engine"):
        ReplayConfig(prefetch="magic")
    with pytest.raises(ConfigError, match=r"tiers \['ssd'\]: not in the trace; its tiers: gpu, nvme"):
        replay(trace, FAST, ReplayConfig({"ssd": "lru"}))
    with pytest.raises(ConfigError, match="policy='nope': unknown"):
        replay(trace, FAST, ReplayConfig({"gpu": "nope"}))
    for slots in (0, 2.5, "4"):
        with pytest.raises(ConfigError, match="a tier's budget must be at least 1 block"):
            ReplayConfig(slots={"gpu": slots})


def test_blocks_read_before_they_are_stored_need_a_store() -> None:
    trace = Script(store=None).step().get(0).trace()
    with pytest.raises(ConfigError, match="reads 1 blocks it never stored"):
        replay(trace, FAST)


def test_replay_under_other_budgets() -> None:
    script = Script(gpu=4).step("prefill").put(*range(8))
    for _ in range(3):
        script.step().get(*range(8))
    trace = script.trace()
    small, large = (replay(trace, FAST, ReplayConfig(slots={"gpu": n}, prefetch="none")) for n in (4, 8))
    assert large.moved_bytes == 0 < small.moved_bytes


# -- fidelity to the manager that was recorded --------------------------------------------------------
async def test_a_recorded_manager_run_replays_to_the_same_bytes_per_link() -> None:
    gpu = MemoryTier("gpu", Medium.GPU, torch.device("cpu"), BLOCK, 4 * BLOCK)
    cpu = MemoryTier("cpu", Medium.CPU, torch.device("cpu"), BLOCK, 16 * BLOCK)
    async with TierManager([gpu, cpu]) as manager:
        rec = AccessRecorder(read_tier="gpu").attach(manager)
        rec.begin_step("prefill", 12)
        for i in range(12):
            await manager.put(key(i), torch.full((BLOCK,), i, dtype=torch.uint8), layer=i % 3)
        for step in range(4):
            rec.begin_step("decode", 1)
            for group in ([0, 1], [5, 6, 7], [2, 9], [11], [3, 4]):
                (await manager.acquire([key(i) for i in group], "gpu", layer=step % 3)).release()
        trace = rec.trace()
        measured = link_bytes(manager.events.events)
    result = await asyncio.to_thread(replay, trace, FAST, ReplayConfig(prefetch="none"))  # a loop of its own
    assert result.bytes_by_link == measured
    assert result.served == trace.served()


def tiny_engine_run(tmp_path, policy: str):
    """A 2-layer random Llama through the real Engine, its KV spilled over gpu / cpu / NVMe, recorded."""
    transformers = pytest.importorskip("transformers")
    from tierkv.model.arch import model_spec
    from tierkv.model.engine import Engine, EngineConfig
    from tierkv.model.loading import LoadedModel
    from tierkv.layout import BlockLayout

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=1024)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    loaded = LoadedModel(model, None, "tiny-llama", model_spec(model))
    spec = loaded.spec
    layout = BlockLayout.kv(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, 16)
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu=6 * layout.block_bytes, cpu=8 * layout.block_bytes,
                       nvme_dir=tmp_path / policy, gpu_policy=policy, cpu_policy=policy)
    with BlockingTierManager.from_config(tiers, namespace=layout.name) as manager:
        engine = Engine(loaded, manager, EngineConfig(16, 64, reuse=False))
        seq = engine.new_sequence()
        seq.read_tier = None  # read in place, as without CUDA
        rec = AccessRecorder(read_tier=seq.read_tier).attach(manager.manager)
        logits, _ = engine.prefill(seq, [i % 127 + 1 for i in range(299)])
        token = int(logits.argmax())
        for _ in range(6):
            token = int(engine.decode(seq, token).argmax())
        manager.flush()
        return rec.trace(), link_bytes(manager.manager.events.events)


@pytest.mark.slow
def test_an_engine_run_records_steps_layers_and_times(tmp_path) -> None:
    trace, measured = tiny_engine_run(tmp_path, "lru")
    assert trace.step_kind.tolist() == [0] * 5 + [1] * 6            # 299 tokens in 64-token chunks, 6 decodes
    assert trace.step_tokens.tolist() == [64, 64, 64, 64, 43] + [1] * 6
    assert trace.meta.layers == 2 and not any(math.isnan(t) for t in trace.layer_start)
    assert set(trace.op_layer.tolist()) == {0, 1} and trace.meta.persist
    assert trace.n_blocks == 2 * (305 // 16)                        # every sealed block of both layers
    assert trace.meta.info["links"]["nvme->gpu"]["bytes"] == measured["nvme->gpu"]
    path = tmp_path / "engine.trace"
    trace.write(path)
    assert AccessTrace.read(path) == trace


def test_a_replay_stopped_by_ctrl_c_leaves_no_task_pending(monkeypatch, caplog) -> None:
    """Ctrl-C mid-replay raised through the loop with the manager's tasks pending: each printed a
    "Task was destroyed but it is pending!" as the interpreter went on."""
    import gc

    from tierkv.tune import simulation
    script = Script(gpu=2, tick=0.001).step()
    for i in range(40):
        script.put(i)
    trace = script.step().get(*range(40)).trace()
    select, turns = simulation._VirtualSelector.select, []

    def interrupted(self, timeout=None):          # the signal arrives as the loop waits, as Ctrl-C does
        turns.append(1)
        if len(turns) == 50:
            raise KeyboardInterrupt
        return select(self, timeout)
    monkeypatch.setattr(simulation._VirtualSelector, "select", interrupted)
    ignored: list = []                            # ("Exception ignored in: <coroutine _replay>": GeneratorExit)
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    with pytest.raises(KeyboardInterrupt):
        replay(trace, TierModel({"*->*": Link(0.01, latency_us=100)}))
    gc.collect()
    assert not ignored
    assert not [r for r in caplog.records if "Task was destroyed but it is pending" in r.getMessage()]
