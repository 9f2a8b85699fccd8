import itertools

import pytest

from tierkv.errors import ConfigError
from tierkv.schedule.plan import Op, PlanShape, format_plan, plan

EXPECTED_2_LAYERS_2_BATCHES_2_STEPS = """\
load_weights t0 L0
load_weights t0 L1
compute      t0 L0 b0
compute      t0 L0 b1
store_kv     t0 L0 b0
free_weights t0 L0
load_weights t1 L0
compute      t0 L1 b0
store_kv     t0 L0 b1
load_kv      t1 L0 b0
compute      t0 L1 b1
store_kv     t0 L1 b0
free_weights t0 L1
load_weights t1 L1
load_kv      t1 L0 b1
compute      t1 L0 b0
store_kv     t0 L1 b1
load_kv      t1 L1 b0
compute      t1 L0 b1
store_kv     t1 L0 b0
free_weights t1 L0
load_kv      t1 L1 b1
compute      t1 L1 b0
store_kv     t1 L0 b1
compute      t1 L1 b1
store_kv     t1 L1 b0
store_kv     t1 L1 b1
free_weights t1 L1"""


def test_small_plan_matches_the_hand_written_order():
    assert format_plan(plan(PlanShape(2, 2, 2))) == EXPECTED_2_LAYERS_2_BATCHES_2_STEPS


def test_resident_weights_leave_only_kv_steps():
    steps = list(plan(PlanShape(1, 2, 2, stream_weights=False)))
    assert [str(s) for s in steps] == [
        "compute      t0 L0 b0", "compute      t0 L0 b1", "store_kv     t0 L0 b0", "load_kv      t1 L0 b0",
        "compute      t1 L0 b0", "store_kv     t0 L0 b1", "load_kv      t1 L0 b1", "compute      t1 L0 b1",
        "store_kv     t1 L0 b0", "store_kv     t1 L0 b1"]


def test_one_cell_per_step_stores_before_the_next_load():
    assert [str(s) for s in plan(PlanShape(1, 1, 3, stream_weights=False))] == [
        "compute      t0 L0 b0", "store_kv     t0 L0 b0", "load_kv      t1 L0 b0",
        "compute      t1 L0 b0", "store_kv     t1 L0 b0", "load_kv      t2 L0 b0",
        "compute      t2 L0 b0", "store_kv     t2 L0 b0"]


@pytest.mark.parametrize("layers,batches,steps", list(itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3))))
def test_every_plan_loads_before_use_and_stores_before_reload(layers, batches, steps):
    loaded_w, in_slots, loaded_kv, stored, computed = set(), 0, set(), set(), []
    for s in plan(PlanShape(layers, batches, steps)):
        if s.op is Op.LOAD_WEIGHTS:
            loaded_w.add((s.step, s.layer))
            in_slots += 1
            assert in_slots <= 2, "more than two layers' weights in the staging slots"
        elif s.op is Op.FREE_WEIGHTS:
            assert all((s.step, s.layer, b) in computed for b in range(batches))
            in_slots -= 1
        elif s.op is Op.LOAD_KV:
            assert (s.step - 1, s.layer, s.batch) in stored, f"{s} before the store it reads"
            loaded_kv.add((s.step, s.layer, s.batch))
        elif s.op is Op.COMPUTE:
            assert (s.step, s.layer) in loaded_w
            assert s.step == 0 or (s.step, s.layer, s.batch) in loaded_kv
            computed.append((s.step, s.layer, s.batch))
        elif s.op is Op.STORE_KV:
            assert (s.step, s.layer, s.batch) in computed
            stored.add((s.step, s.layer, s.batch))
    assert computed == sorted(computed) and len(computed) == layers * batches * steps
    assert len(stored) == len(computed) and in_slots == 0


def test_each_layer_is_loaded_once_per_step_for_all_batches():
    loads = [s for s in plan(PlanShape(4, 8, 3)) if s.op is Op.LOAD_WEIGHTS]
    assert len(loads) == 4 * 3


def test_shape_is_validated():
    with pytest.raises(ConfigError, match="num_steps=0"):
        PlanShape(2, 2, 0)
