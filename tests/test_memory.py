"""The tick updates the state in place: measured from the compiled tiny program, and refused early.

At the two-minute cap (1,500 frames) and 16 slots the tiny state is ~84 MiB. A tick that selects
between two whole states needs a second copy as scratch (the first engine asked for 97.5 MiB of
scratch for a 78.3 MiB state); in place, the state is aliased from input to output and the scratch
is the beat's activations only.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests import shared
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import Engine, MemoryPlanError, build_template, plan_memory
from voicechat_jax.precision import Precision

CFG = tiny()
PREC = Precision.fp32()
SERVE = ServeConfig(slots=16, frames_per_tick=2, context_frames=1500, precision=PREC)


@pytest.fixture(scope="module")
def engine():
    params = shared.params(PREC)
    return Engine(params, CFG, SERVE)


def _state_bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(state))


def _check_in_place(compiled, state) -> None:
    m = compiled.memory_analysis()
    state_bytes = _state_bytes(state)
    # Every byte of the state is an argument aliased to an output: no second copy.
    assert m.alias_size_in_bytes >= state_bytes, (m.alias_size_in_bytes, state_bytes)
    assert m.temp_size_in_bytes <= state_bytes / 4, (m.temp_size_in_bytes, state_bytes)


def test_dispatch_tick_is_in_place(engine):
    assert _state_bytes(engine.state) > 64 * 2**20  # the cap makes the state large
    _check_in_place(engine.compile_tick(), engine.state)
    # The staged admission and roll-over programs update the state where it lies too.
    _check_in_place(engine.stages.admit, engine.state)
    _check_in_place(engine.stages.reseed, engine.state)
    _check_in_place(engine.stages.restart, engine.state)


def test_resident_loop_is_in_place(engine):
    beat = engine.empty_beat()

    def next_beat(k):
        return beat, np.asarray(True)

    compiled = engine.compile_resident(next_beat, lambda k, out: None)
    _check_in_place(compiled, engine.state)


def test_tick_donates_the_state(engine):
    engine.reset()
    before = engine.state
    engine.tick(engine.empty_beat())
    jax.block_until_ready(engine.state)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(before))


def test_plan_refuses_slots_that_do_not_fit(engine):
    template = engine.template
    slot = plan_memory(template, 1, limit_bytes=2**40, in_use_bytes=0).slot_bytes
    assert slot == pytest.approx(_state_bytes(engine.state) / SERVE.slots, rel=1e-6)
    # The fixed scratch keeps room for the autotuner's copy of the largest weight.
    params = engine.params
    bare = plan_memory(template, 1, limit_bytes=2**40, in_use_bytes=0)
    one = plan_memory(template, 1, limit_bytes=2**40, in_use_bytes=0, params=params)
    largest = max(x.nbytes for x in jax.tree_util.tree_leaves(params))
    assert one.scratch_fixed_bytes - bare.scratch_fixed_bytes == largest
    # A budget for about 5 slots (after the fixed scratch, one capsule's LLM state and each
    # slot's share of scratch) refuses 16 and names what fits.
    limit = one.scratch_fixed_bytes + int(5.5 * (slot + one.scratch_slot_bytes))
    plan = plan_memory(template, 16, limit_bytes=limit, in_use_bytes=0, params=params)
    assert not plan.fits
    assert plan.max_slots == 5
    with pytest.raises(MemoryPlanError, match=r"16 slots x .* at most 5 slots fit"):
        Engine(params, CFG, SERVE, template=template, memory_limit_bytes=limit)
    ok = plan_memory(template, 5, limit_bytes=limit, in_use_bytes=0, params=params)
    assert ok.fits


def test_shared_template_equals_a_fresh_one(engine):
    again = build_template(engine.params, CFG, SERVE)
    leaves = zip(
        jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(engine.template), strict=True
    )
    for a, b in leaves:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
