"""Cost model and policy search: the LP's optimum is what the cost model says, more memory never hurts."""
from dataclasses import replace

import pytest

from tierkv.errors import ConfigError
from tierkv.schedule.calibrate import cache_path, calibrate
from tierkv.schedule.cost import Budgets, Machine, ModelShape, Workload, predict
from tierkv.schedule.policy import Placement, Policy
from tierkv.schedule.search import candidates, search

GiB, MiB = 1024**3, 1024**2
# A 7B-like shape and a machine with CPU-like rates: fixed numbers, so the test measures nothing.
SHAPE = ModelShape(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, itemsize=2,
                   layer_weight_bytes=405 * MiB, other_weight_bytes=500 * MiB, intermediate=11008)
MACHINE = Machine(memcpy=12e9, disk_read=2e9, disk_write=2e9,
                  layer_s=lambda m: 2e-3 + m * 4e-4, attention_s=lambda r, q, k: r * q * k * 2e-8,
                  head_s=lambda m: 5e-3 + m * 1e-4)
WORK = Workload(prompt_len=256, gen_len=32, num_sequences=512)


def test_predicted_throughput_never_drops_with_more_memory():
    gpus, cpus = (2, 4, 16), (4, 8, 64)
    grid = {(g, c): search(SHAPE, WORK, MACHINE, Budgets(g * GiB, c * GiB, 200 * GiB)).estimate.tokens_per_s
            for g in gpus for c in cpus}
    for (g, c), value in grid.items():
        for smaller in ((gpus[gpus.index(g) - 1], c) if g != gpus[0] else None,
                        (g, cpus[cpus.index(c) - 1]) if c != cpus[0] else None):
            if smaller is not None:
                assert value >= grid[smaller] * (1 - 1e-7), f"{(g, c)} GiB predicts less than {smaller}"
    assert grid[(16, 64)] > grid[(2, 4)]


def test_search_result_is_what_the_cost_model_predicts_and_fits():
    budgets = Budgets(4 * GiB, 16 * GiB, 200 * GiB)
    choice = search(SHAPE, WORK, MACHINE, budgets)
    again = predict(choice.policy, SHAPE, WORK, MACHINE)
    assert again.tokens_per_s == pytest.approx(choice.estimate.tokens_per_s, rel=1e-6)
    assert again.fits(budgets)
    assert choice.policy.weights.gpu < 0.5       # 13 GB of weights cannot sit in 4 GiB


def test_search_beats_every_hand_picked_policy_that_fits():
    budgets = Budgets(8 * GiB, 32 * GiB, 200 * GiB)
    best = search(SHAPE, WORK, MACHINE, budgets).estimate.tokens_per_s
    for bs, nb in ((1, 1), (8, 4), (32, 8), (64, 4)):
        for w in (Placement(0, 1, 0), Placement(0.2, 0.8, 0), Placement(0, 0.5, 0.5)):
            for kv in (Placement(0, 1, 0), Placement(0, 0.5, 0.5), Placement(0, 0, 1)):
                e = predict(Policy(bs, nb, weights=w, kv=kv), SHAPE, WORK, MACHINE)
                if e.fits(budgets):
                    assert e.tokens_per_s <= best * (1 + 1e-9)


def test_no_disk_keeps_everything_in_memory_or_fails_clearly():
    choice = search(SHAPE, WORK, MACHINE, Budgets(4 * GiB, 64 * GiB, 0))
    assert choice.policy.weights.disk == 0 and choice.policy.kv.disk == 0
    with pytest.raises(ConfigError, match="no policy fits the budgets gpu 256.0 MiB, cpu 1.0 GiB, disk 0 B: .* "
                                          "or give --nvme-dir"):
        search(SHAPE, WORK, MACHINE, Budgets(256 * MiB, 1 * GiB, 0))
    with pytest.raises(ConfigError, match="or raise --nvme-budget"):        # not "give --nvme-dir": it was given
        search(SHAPE, WORK, MACHINE, Budgets(64 * MiB, 64 * MiB, 64 * MiB))


def test_overlap_and_compression_change_the_prediction_the_right_way():
    base = Policy(16, 4, weights=Placement(0, 1, 0), kv=Placement(0, 0, 1))
    serial = Policy(16, 4, weights=base.weights, kv=base.kv, overlap=False)
    packed = Policy(16, 4, weights=base.weights, kv=base.kv, compress_kv=True)
    t = {p: predict(p, SHAPE, WORK, MACHINE) for p in (base, serial, packed)}
    assert t[base].tokens_per_s > t[serial].tokens_per_s
    assert t[packed].memory["disk"] < t[base].memory["disk"] / 3


def test_candidates_cover_small_sets_exactly():
    assert (3, 1) in candidates(3) and all(bs * nb <= 3 for bs, nb in candidates(3))


def test_calibration_is_cached_and_recalibrated_on_request(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    machine = calibrate(tiny.model, max_rows=16)
    assert cache_path().is_file() and machine.memcpy > 1e8 and machine.layer_s(16) > 0
    stamp = cache_path().stat().st_mtime_ns
    calibrate(tiny.model, max_rows=16)
    assert cache_path().stat().st_mtime_ns == stamp              # read from the cache
    calibrate(tiny.model, max_rows=16, refresh=True)
    assert cache_path().stat().st_mtime_ns != stamp
    shape = ModelShape.of(tiny.model)
    estimate = predict(Policy(4, 2), shape, Workload(32, 8), machine)
    assert estimate.tokens_per_s > 0 and estimate.memory["gpu"] > shape.weight_bytes


def test_padding_of_mixed_lengths_is_priced_in_the_decode_not_the_prefill():
    mixed = Workload(prompt_len=300, gen_len=16, num_sequences=8, lengths=(1600, 100, 100, 100, 100, 100, 100, 100))
    assert mixed.padded_len(8) == 1600 and mixed.padded_len(1) == (1600 + 7 * 100) / 8
    even = Workload(prompt_len=288, gen_len=16, num_sequences=8, lengths=(288,) * 8)
    wide = Policy(8, 1, weights=Placement(0, 1, 0), kv=Placement(0, 1, 0))
    on_mixed, on_even = predict(wide, SHAPE, mixed, MACHINE), predict(wide, SHAPE, even, MACHINE)
    assert on_mixed.decode_layer_s > on_even.decode_layer_s          # every row's KV padded to 1600 columns
    padded = MACHINE.layer_s(8 * 1600) + MACHINE.attention_s(8, 1600, 1600)
    assert on_mixed.prefill_layer_s < padded / 2                     # 1600 + 7 x 100 tokens computed, not 8 x 1600


def test_calibration_interpolates_between_and_beyond_its_points():
    from tierkv.schedule.calibrate import _interpolate
    at = _interpolate([(1, 1.0), (4, 4.0), (4, 4.0), (16, 10.0)])
    assert at(2) == 2.0 and at(10) == 7.0 and at(28) == 16.0


def test_ties_in_time_go_to_memory_not_disk():
    """Compute-bound (slow layers): where weights sit does not change the time, so none go to disk."""
    slow = Machine(memcpy=12e9, disk_read=2e9, disk_write=2e9, layer_s=lambda m: 0.5 + m * 1e-2,
                   attention_s=lambda r, q, k: r * q * k * 2e-8, head_s=lambda m: 5e-3 + m * 1e-4)
    work = Workload(prompt_len=16, gen_len=8, num_sequences=64)
    budgets = Budgets(2 * GiB, 64 * GiB, 200 * GiB)
    choice = search(SHAPE, work, slow, budgets)
    assert choice.policy.weights.disk == pytest.approx(0, abs=1e-6)
    assert choice.policy.kv.disk == pytest.approx(0, abs=1e-6)
    assert choice.estimate.memory["disk"] < 1 * MiB
    # a cpu budget below the weights leaves on disk only what does not fit
    tight = search(SHAPE, work, slow, Budgets(2 * GiB, 8 * GiB, 200 * GiB))
    assert tight.estimate.memory["cpu"] == pytest.approx(8 * GiB, rel=1e-3)


def test_search_judges_each_candidate_as_placed():
    """``place`` rounds like the engine (whole tensors): the result is the placed policy, priced and fitting."""
    def halves(policy: Policy) -> Policy:      # weights in steps of a half: a coarse tensor granularity
        w = policy.weights
        gpu = round(w.gpu * 2) / 2
        cpu = min(1 - gpu, round(w.cpu * 2) / 2)
        return Policy(policy.gpu_batch_size, policy.num_gpu_batches, weights=Placement(gpu, cpu, 1 - gpu - cpu),
                      kv=policy.kv, overlap=policy.overlap)
    budgets = Budgets(8 * GiB, 10 * GiB, 200 * GiB)
    free = search(SHAPE, WORK, MACHINE, budgets)
    placed = search(SHAPE, WORK, MACHINE, budgets, place=halves)
    assert placed.policy == halves(placed.policy)
    again = predict(placed.policy, SHAPE, WORK, MACHINE)
    assert again.tokens_per_s == pytest.approx(placed.estimate.tokens_per_s, rel=1e-9)
    assert again.fits(budgets)
    assert placed.estimate.tokens_per_s <= free.estimate.tokens_per_s * (1 + 1e-9)
    # the unrounded optimum, rounded afterwards, either breaks a budget or is no faster
    rounded = predict(halves(free.policy), SHAPE, WORK, MACHINE)
    assert not rounded.fits(budgets) or rounded.tokens_per_s <= placed.estimate.tokens_per_s * (1 + 1e-9)


def test_calibration_of_an_older_version_is_measured_again(tiny, tmp_path, monkeypatch):
    import json

    from tierkv.schedule.calibrate import VERSION
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    calibrate(tiny.model, max_rows=16)
    data = json.loads(cache_path().read_text())
    for entry in data.values():
        entry |= {"version": VERSION - 1, "attention_prefill": 123.0}
    cache_path().write_text(json.dumps(data))
    machine = calibrate(tiny.model, max_rows=16)
    assert machine.attention_s(1, 4, 4) < 1.0                       # not the stale 123 s per key
    assert all(e["version"] == VERSION for e in json.loads(cache_path().read_text()).values())
    assert machine.attention_s(1, 64, 64) > 0 and machine.attention_s(4, 1, 64) > 0


def test_rounding_over_a_budget_is_solved_again_not_dropped():
    """A placement that rounds the gpu share up past its budget: the search cuts that budget and retries."""
    def up(policy: Policy) -> Policy:           # whole tensors of a tenth: the gpu share rounds up
        w = policy.weights
        gpu = min(1.0, -(-round(w.gpu * 1e6) // 100000) / 10)
        cpu = max(0.0, min(1 - gpu, w.cpu))
        return Policy(policy.gpu_batch_size, policy.num_gpu_batches, weights=Placement(gpu, cpu, 1 - gpu - cpu),
                      kv=policy.kv, overlap=policy.overlap)
    budgets = Budgets(3 * GiB, 64 * GiB, 200 * GiB)
    one = search(SHAPE, Workload(256, 32, 1), MACHINE, budgets, place=up)
    assert one.policy == up(one.policy) and predict(one.policy, SHAPE, Workload(256, 32, 1), MACHINE).fits(budgets)


def test_weights_stored_in_bf16_count_half_the_bytes_and_their_conversion():
    """fp32 compute, bf16 storage: the tiers hold and move half the bytes; the loads pay a conversion."""
    fp32 = replace(SHAPE, itemsize=4, layer_weight_bytes=2 * SHAPE.layer_weight_bytes, dtype="float32")
    machine = replace(MACHINE, convert={"bfloat16": 6e9, "float16": 3e9})
    wide = Policy(8, 4, weights=Placement(0, 0.5, 0.5), kv=Placement(1, 0, 0))
    narrow = replace(wide, weight_dtype="bfloat16")
    a, b = predict(wide, fp32, WORK, machine), predict(narrow, fp32, WORK, machine)
    W, S = fp32.layer_weight_bytes, fp32.layer_weight_bytes / 2
    assert b.memory["disk"] == pytest.approx(a.memory["disk"] / 2)
    assert b.memory["cpu"] == pytest.approx(a.memory["cpu"] / 2)
    assert b.memory["gpu"] == pytest.approx(a.memory["gpu"] + S)          # the raw buffer beside the slots
    cpu = replace(wide, weights=Placement(0, 1, 0))     # bound by compute + copies: the conversion shows
    t = {d: predict(replace(cpu, weight_dtype=d), fp32, WORK, machine).decode_layer_s for d in (None, "bfloat16", "float16")}
    assert t["bfloat16"] - t[None] == pytest.approx(S / 12e9 + S / 6e9 - W / 12e9)
    assert t["float16"] - t["bfloat16"] == pytest.approx(S / 3e9 - S / 6e9)
    # a cpu budget that holds the bf16 weights but not the fp32 ones: less goes to disk
    budgets = Budgets(4 * GiB, fp32.weight_bytes * 3 // 4, 200 * GiB)
    work = Workload(prompt_len=16, gen_len=8, num_sequences=16)
    on_disk = search(fp32, work, machine, budgets).policy.weights.disk
    chosen = search(fp32, work, machine, budgets, weight_dtype="bfloat16").policy
    assert chosen.weight_dtype == "bfloat16" and chosen.weights.disk < on_disk
    with pytest.raises(ConfigError, match="weight_dtype='int4': allowed"):
        search(fp32, work, machine, budgets, weight_dtype="int4")


def test_calibration_measures_the_weight_conversion(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    machine = calibrate(tiny.model, max_rows=16)
    assert set(machine.convert) == {"bfloat16", "float16"} and min(machine.convert.values()) > 1e7


def test_the_in_run_factor_scales_the_compute_the_run_found():
    from tierkv.schedule.calibrate import in_run_factor
    from tierkv.schedule.cost import compute_s, fractions, policy_terms, slowed
    work = Workload(prompt_len=16, gen_len=8, num_sequences=8)
    policy = Policy(8, 1, weights=Placement(0, 1, 0), kv=Placement(0, 1, 0))
    t, x = policy_terms(policy, SHAPE, work, MACHINE), fractions(policy)
    twice = [2 * compute_s(t, x, 1), 2 * (compute_s(t, x, 2) - compute_s(t, x, 1))] + [1.0] * 6
    assert in_run_factor(t, x, twice) == pytest.approx(2.0)
    assert in_run_factor(t, x, twice[:1] + [0.0] * 7) == pytest.approx(2.0)      # stopped after the prefill
    serial = policy_terms(replace(policy, overlap=False), SHAPE, work, MACHINE)
    assert compute_s(serial, x, 2) < compute_s(t, x, 2)     # overlapped on a CPU, the copies share the cores
    slow = slowed(MACHINE, 2.0)                                              # cores and host copies: all half as fast
    assert predict(policy, SHAPE, work, slow).tokens_per_s == pytest.approx(
        predict(policy, SHAPE, work, MACHINE).tokens_per_s / 2)


def test_a_job_of_fewer_documents_than_a_block_is_predicted_as_the_block_that_runs():
    """A --policy of 8 x 4 rows on 2 documents was predicted as a full block of 32 (16x the measured
    throughput, then more once the run's first steps calibrated it against 32 rows). The engine runs the
    one GPU batch they fill, computes their 2 rows, and keeps 8-row KV blocks and all 4 batches' memory."""
    w = Placement(0, 1, 0)
    two, full = Workload(512, 32, num_sequences=2), Workload(512, 32)
    big, one_batch = predict(Policy(8, 4, weights=w), SHAPE, two, MACHINE), predict(Policy(8, 1, weights=w), SHAPE,
                                                                                     two, MACHINE)
    assert big.tokens_per_s == one_batch.tokens_per_s and big.memory["gpu"] > one_batch.memory["gpu"]
    assert big.tokens_per_s < predict(Policy(8, 4, weights=w), SHAPE, full, MACHINE).tokens_per_s / 4
    three = Workload(512, 32, num_sequences=3)                  # batches of 2 and 1, as the engine cuts them
    assert predict(Policy(2, 4, weights=w), SHAPE, three, MACHINE).tokens_per_s == \
        predict(Policy(2, 2, weights=w), SHAPE, three, MACHINE).tokens_per_s
