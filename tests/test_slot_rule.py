"""The slot rule (``slot_rule.SlotRule``): the host decides, the device applies.

Random beat sequences of admissions, releases, held slots, roll-overs with capsules of every
length (empty ones included) and capsules asked a beat ahead, on a 3-slot engine whose 8-frame cap
is reached within a few beats: after every beat the rule's copy of each slot (live flag, both
caches' fills, the speech decoder's frame count) must be the device's own, on the staged engine
and on the one-program tick, under both ways of meeting the cap; and the beat's outputs must echo
the masks the rule decided.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import shared
from tests.test_staged_tick import mirror_agrees
from voicechat_jax.config import ServeConfig
from voicechat_jax.engine import Engine
from voicechat_jax.precision import Precision
from voicechat_jax.slot_rule import SlotRule

PREC = Precision.fp32()
SLOTS = 3


def serve(at_cap: str) -> ServeConfig:
    """The configuration of ``tests/test_staged_tick.py``'s engine pair (shared programs)."""
    return ServeConfig(slots=SLOTS, frames_per_tick=2, context_frames=8, precision=PREC,
                       at_cap=at_cap)  # fmt: skip


# One slot's request in one beat: admit, release, run, reseed, prefill, capsule length.
_slot = st.tuples(
    st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
    st.integers(0, 3),
)  # fmt: skip
_beats = st.lists(st.lists(_slot, min_size=SLOTS, max_size=SLOTS), min_size=1, max_size=10)


def _beat(engine: Engine, requests, k: int):
    beat = engine.empty_beat()
    rng = np.random.default_rng(k)
    beat.audio[:] = (0.2 * rng.standard_normal(beat.audio.shape)).astype(np.float32)
    for b, (admit, release, run, reseed, prefill, n) in enumerate(requests):
        beat.admit[b], beat.release[b], beat.run[b] = admit, release, run
        beat.reseed[b], beat.prefill[b] = reseed, prefill
        beat.key[b] = [k, b]
        beat.capsule[b, :n] = np.arange(1, n + 1)
        beat.capsule_len[b] = n
    return beat


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "one_program"])
@pytest.mark.parametrize("at_cap", ["rollover", "end"])
def test_the_rules_copy_is_the_devices_after_every_beat(at_cap, staged):
    engine = shared.engine(serve(at_cap), staged=staged)
    assert engine.staged == staged

    @settings(
        max_examples=12,
        deadline=None,
        derandomize=True,  # the same sequences on every run
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(_beats)
    def check(sequence):
        engine.reset()
        for k, requests in enumerate(sequence):
            beat = _beat(engine, requests, k)
            expected = SlotRule.read(engine.state, engine.template).decide(beat, engine.serve)
            out = jax.device_get(engine.tick(beat))
            mirror_agrees(engine)
            for name in ("ran", "active", "at_cap"):
                np.testing.assert_array_equal(getattr(out, name), getattr(expected, name))
            np.testing.assert_array_equal(out.reseeded, expected.rolled)
            assert not np.any(out.ran & ~out.active)
            device = SlotRule.read(engine.state, engine.template)  # no cache written past its end
            assert np.all(device.llm_length <= device.llm_rows)
            assert np.all(device.tts_pos <= device.tts_rows)

    check()


def test_move_follows_a_bucket_resize():
    """``SlotRule.move``: each new slot takes its source's fills; the others are free and fresh."""
    template = shared.template(serve("rollover"))
    rule = SlotRule.fresh(template, 4)
    rule.active[:] = [True, False, True, True]
    rule.llm_length[:] = [10, 11, 12, 13]
    rule.tts_frame[:] = [4, 5, 6, 7]
    rule.move(np.array([3, -1, 0, -1]))
    assert list(rule.active) == [True, False, True, False]
    assert list(rule.llm_length) == [13, rule.fresh_llm, 10, rule.fresh_llm]
    assert list(rule.tts_frame) == [7, rule.fresh_frame, 4, rule.fresh_frame]
