"""The runner over real tiers (NVMe in a temp dir), real threads and a tiny random Llama."""
import threading

import pytest
import torch

from tierkv.errors import ConfigError
from tierkv.schedule.engine import BatchEngine, EngineLimits
from tierkv.schedule.policy import Placement, Policy

from schedmodels import hf_greedy, loaded_tiny, random_prompts

NEW = 12
MIXED = Policy(2, 3, weights=Placement(0.2, 0.4, 0.4), kv=Placement(0.25, 0.25, 0.5), overlap=True)
POLICIES = {
    "resident-serial": Policy(8, 1, overlap=False),
    "mixed-overlap": MIXED,
    "all-disk-serial": Policy(1, 5, weights=Placement(0, 0, 1), kv=Placement(0, 0, 1), overlap=False),
    "cpu-one-batch": Policy(5, 1, weights=Placement(0, 1, 0), kv=Placement(0, 1, 0)),
}


@pytest.fixture(scope="module")
def reference():
    loaded = loaded_tiny()
    prompts = random_prompts(5, 5, 40)
    return prompts, [hf_greedy(loaded.model, p, NEW) for p in prompts]


@pytest.mark.parametrize("name", list(POLICIES))
def test_batch_equals_unbatched_greedy(name, reference, tmp_path):
    prompts, expected = reference
    loaded = loaded_tiny()
    with BatchEngine(loaded, POLICIES[name], EngineLimits(40, NEW), nvme_dir=tmp_path) as engine:
        got = engine.generate(prompts, ignore_eos=True)
    assert got == expected


class Recorder:
    def __init__(self):
        self.events, self.lock = [], threading.Lock()

    def __call__(self, what, step, phase):
        with self.lock:
            self.events.append((what, step.step, step.layer, step.batch, phase, threading.current_thread().name))


def test_instrumented_run_loads_before_use_and_stores_before_evict(tmp_path):
    loaded = loaded_tiny()
    prompts = random_prompts(5, 30, 60, seed=2)
    expected = [hf_greedy(loaded.model, p, NEW) for p in prompts]
    trace = Recorder()
    engine = BatchEngine(loaded, MIXED, EngineLimits(60, NEW), nvme_dir=tmp_path, trace=trace)
    try:
        assert engine.generate(prompts, ignore_eos=True) == expected
    finally:
        engine.close()
    seen = set()
    for what, t, layer, b, phase, _ in trace.events:
        if what == "compute" and phase == "start":
            assert ("load_weights", t, layer, None, "done") in seen, f"compute t{t} L{layer} before its weights"
            if t > 0:
                assert ("load_kv", t, layer, b, "done") in seen, f"compute t{t} L{layer} b{b} before its KV"
        if what == "load_kv" and phase == "start":
            assert ("store_kv", t - 1, layer, b, "done") in seen, f"load t{t} L{layer} b{b} before its store"
            assert ("evict_kv", t - 1, layer, b, "done") in seen
        if what == "evict_kv":
            assert ("store_kv", t, layer, b, "start") in seen and ("compute", t, layer, b, "done") in seen
        if what == "free_weights" and phase == "start":
            assert all(("compute", t, layer, k, "done") in seen for k in range(3))
        seen.add((what, t, layer, b, phase))
    threads = {name for *_, name in trace.events}
    assert {"tierkv-wload", "tierkv-kvload", "tierkv-kvstore"} <= {n.rsplit("_", 1)[0] for n in threads}
    assert engine.runner.stats.weight_bytes > 0
    assert engine.last_kv.bytes_read["disk"] > 0 and engine.last_kv.bytes_written["gpu"] > 0


def test_a_compute_without_its_weights_fails_loudly(reference, tmp_path):
    prompts, _ = reference
    engine = BatchEngine(loaded_tiny(), Policy(5, 1, weights=Placement(0, 1, 0)), EngineLimits(40, 2))
    try:
        engine.weights.unbind(0)
        layer = engine.runner.layers[0]
        assert layer.mlp.up_proj.weight.numel() == 0       # streamed tensors are empty between uses
    finally:
        engine.close(restore=True)
    assert layer.mlp.up_proj.weight.numel() > 0          # restore gives the model its weights back


def test_compressed_kv_runs_and_stores_a_quarter_of_the_bytes(reference, tmp_path):
    prompts, expected = reference
    plain = BatchEngine(loaded_tiny(), Policy(5, 1, kv=Placement(0, 1, 0)), EngineLimits(40, NEW))
    packed = BatchEngine(loaded_tiny(), Policy(5, 1, kv=Placement(0, 1, 0), compress_kv=True), EngineLimits(40, NEW))
    try:
        plain.generate(prompts, ignore_eos=True)
        got = packed.generate(prompts, ignore_eos=True)
    finally:
        plain.close()
        packed.close()
    assert all(len(row) == NEW for row in got)
    assert got[0][0] == expected[0][0]                     # the first token comes from the exact prefill
    assert packed.kv_layout.block_bytes * 3 < plain.kv_layout.block_bytes


def test_stop_ends_the_block_between_steps(reference, tmp_path):
    prompts, expected = reference
    eos = expected[0][3]
    with BatchEngine(loaded_tiny(), Policy(5, 1), EngineLimits(40, NEW)) as engine:
        got = engine.generate(prompts[:1], eos_ids=[eos])
        assert got == [expected[0][:4]]
        assert engine.runner.stats.steps == 4


def test_engine_rejects_what_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="give --nvme-dir"):
        BatchEngine(loaded_tiny(), Policy(1, 1, kv=Placement(0, 0, 1)), EngineLimits(8, 2))
    with pytest.raises(ConfigError, match="act gpu=1"):
        BatchEngine(loaded_tiny(), Policy(1, 1, act=Placement(0, 1, 0)), EngineLimits(8, 2))
    with BatchEngine(loaded_tiny(), Policy(2, 1), EngineLimits(8, 2)) as engine:
        with pytest.raises(ConfigError, match="a block holds 1 to 2"):
            engine.generate([[1], [2], [3]])
        with pytest.raises(ConfigError, match="sized for 8 \\+ 2"):
            engine.generate([[1] * 9])


def bf16_checkpoint():
    """A tiny fp32 model whose weights are bf16 values: storing them in bf16 loses nothing."""
    loaded = loaded_tiny()
    for p in loaded.model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    return loaded


@pytest.mark.parametrize("policy", [
    Policy(2, 3, weights=Placement(0.2, 0.4, 0.4), kv=Placement(0.25, 0.25, 0.5), weight_dtype="bfloat16"),
    Policy(5, 1, weights=Placement(0, 1, 0), kv=Placement(0, 1, 0), overlap=False, weight_dtype="bfloat16"),
], ids=["mixed-overlap", "cpu-serial"])
def test_bf16_stored_weights_equal_unbatched_greedy_and_halve_the_stored_bytes(policy, tmp_path):
    loaded = bf16_checkpoint()
    prompts = random_prompts(5, 5, 40)
    expected = [hf_greedy(loaded.model, p, NEW) for p in prompts]
    before = {n: p.clone() for n, p in loaded.model.named_parameters()}
    wide = Policy(policy.gpu_batch_size, policy.num_gpu_batches, weights=policy.weights, kv=policy.kv)
    with BatchEngine(bf16_checkpoint(), wide, EngineLimits(40, NEW), nvme_dir=tmp_path) as engine:
        fp32_bytes = dict(engine.weights.bytes)
    engine = BatchEngine(loaded, policy, EngineLimits(40, NEW), nvme_dir=tmp_path)
    try:
        assert engine.weights.converts
        assert engine.generate(prompts, ignore_eos=True) == expected
        assert engine.weights.bytes["gpu"] == fp32_bytes["gpu"]          # resident weights stay fp32
        for tier in ("cpu", "disk"):
            assert engine.weights.bytes[tier] * 2 == fp32_bytes[tier]
        assert engine.weights.bytes["cpu"] > 0
    finally:
        engine.close(restore=True)
    after = dict(loaded.model.named_parameters())
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], p) for n, p in before.items())


def test_weights_stored_in_the_compute_dtype_do_not_convert(tmp_path):
    loaded = loaded_tiny(dtype=torch.bfloat16)
    policy = Policy(5, 1, weights=Placement(0, 1, 0), weight_dtype="bfloat16")
    with BatchEngine(loaded, policy, EngineLimits(8, 2)) as engine:
        assert not engine.weights.converts
        assert len(engine.generate([[5, 6, 7]], ignore_eos=True)[0]) == 2


def test_a_search_made_while_an_engine_streams_the_weights_keeps_to_the_budgets(tmp_path):
    """An engine empties the parameters it streams between their uses: a job that searched again after
    its first block (its speed off the calibration) saw a model of almost no weights, and chose to keep
    them all in a gpu budget they overflow. It measures the model once, before any engine runs."""
    from tierkv.model.arch import decoder_layers
    from tierkv.schedule.cost import Budgets, Machine, Workload, predict
    from tierkv.schedule.job import JobConfig, _Measured, _replan
    from tierkv.schedule.search import search
    from tierkv.schedule.weights import parameter_sizes
    loaded, limits = loaded_tiny(), EngineLimits(40, NEW)
    model = _Measured.of(loaded, limits)
    machine = Machine(memcpy=12e9, disk_read=2e9, disk_write=2e9, layer_s=lambda m: 1e-3 + m * 1e-5,
                      attention_s=lambda r, q, k: r * q * k * 1e-8, head_s=lambda m: 1e-3 + m * 1e-5)
    work = Workload(prompt_len=30, gen_len=NEW, num_sequences=5)
    roomy = search(model.shape, work, machine, Budgets(1 << 30, 64 << 20, 0), place=model.place)
    assert roomy.policy.weights.gpu == 1
    short = roomy.estimate.memory["gpu"] - model.shape.num_layers * sum(model.sizes.values()) // 2
    config = JobConfig(tmp_path / "in.jsonl", tmp_path / "out.jsonl", gpu_budget=int(short), cpu_budget=64 << 20)
    streamed = Policy(5, 1, weights=Placement(0, 1, 0))
    live = [BatchEngine(loaded, streamed, limits, nvme_dir=tmp_path)]
    try:
        assert sum(parameter_sizes(decoder_layers(loaded.model)[0]).values()) < sum(model.sizes.values())
        found = _replan(config, model, work, machine, limits, streamed, live, None)
        placed = model.place(found)           # its memory on the model's real sizes: within the budget
        assert predict(placed, model.shape, work, machine).memory["gpu"] <= config.gpu_budget
    finally:
        for engine in live:
            engine.close(restore=True)
