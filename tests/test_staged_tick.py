"""The staged dispatch tick (``Engine(staged=True)``, the default on one device).

Admissions and roll-overs run as their own one-slot programs, chosen by the beat's masks
(``slot_rule.SlotRule``), before a tick with no loop whose trip count the device decides. The
outputs and the state must be those of the one-program tick (which admits and rolls over in its
own masked loops) bit for bit, the rule's copy of the slots must agree with the device after every
beat, and the compiled programs must have only loops of known trip count.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import numpy as np
import pytest

from tests import shared
from voicechat_jax import step as step_lib
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.precision import Precision
from voicechat_jax.slot_rule import SlotRule

CFG = tiny()
PREC = Precision.fp32()


@pytest.fixture(scope="module")
def params():
    return shared.params(PREC)


def _beats(engine: Engine, n: int) -> list:
    """Joins, a held slot, roll-overs with a capsule (asked a beat ahead, and once with another
    capsule than the one prefilled) and with none, a leave and a re-join, past the cap."""
    rng = np.random.default_rng(3)
    beats = []
    for k in range(n):
        beat = engine.empty_beat()
        beat.audio[:] = (0.2 * rng.standard_normal(beat.audio.shape)).astype(np.float32)
        if k == 0:
            beat.admit[:2] = True
            beat.key[:2] = [[1, 2], [3, 4]]
        if k in (1, 2):  # prefilled after tick 1 (a staged engine's lane), applied at tick 2
            (beat.prefill if k == 1 else beat.reseed)[1] = True
            beat.capsule[1, :3] = [5, 6, 7]
            beat.capsule_len[1] = 3
        if k == 8:
            beat.prefill[1] = True
            beat.capsule[1, :2] = [1, 2]
            beat.capsule_len[1] = 2
        if k == 9:  # another capsule than the lane's: prefilled in the beat (``reseed``)
            beat.reseed[1] = True
            beat.capsule[1, :1] = [1]
            beat.capsule_len[1] = 1
        if k == 3:
            beat.release[0] = True
            beat.admit[2] = True
            beat.key[2] = [5, 6]
        if k == 4:
            beat.reseed[2] = True  # an empty capsule: the staged engine's ``restart``
        if k == 5:
            beat.run[1] = False
        if k == 7:
            beat.admit[0] = True
            beat.key[0] = [7, 8]
        beats.append(beat)
    return beats


def mirror_agrees(engine: Engine) -> None:
    """The slot rule's copy of the engine's slots is the device's."""
    device = SlotRule.read(engine.state, engine.template)
    mirror = engine.rule
    np.testing.assert_array_equal(mirror.active, device.active)
    np.testing.assert_array_equal(mirror.llm_length, device.llm_length)
    np.testing.assert_array_equal(mirror.tts_pos, device.tts_pos)
    np.testing.assert_array_equal(mirror.tts_frame, device.tts_frame)


def _pair(params, at_cap: str) -> tuple[Engine, Engine]:
    """(one-program engine, staged engine) of one configuration, sharing the template (the
    suite's shared engines: ``tests/test_slot_rule.py`` drives the same ones)."""
    serve = ServeConfig(
        slots=3, frames_per_tick=2, context_frames=8, precision=PREC, at_cap=at_cap
    )  # fmt: skip
    one = shared.engine(serve, staged=False)
    staged = shared.engine(serve, staged=True)
    assert one.params.llm.embed is params.llm.embed  # leaves not split are shared
    assert one.template is staged.template
    return one, staged


@pytest.fixture(scope="module")
def rollover_pair(params):
    return _pair(params, "rollover")


@pytest.mark.parametrize("at_cap", ["rollover", "end"])
def test_staged_engine_matches_the_one_program_tick(params, rollover_pair, at_cap):
    """``hold_full``'s mirror is checked in ``test_engine``'s hold-full test."""
    one, staged = rollover_pair if at_cap == "rollover" else _pair(params, at_cap)
    one.reset()
    staged.reset()
    assert staged.staged
    assert not one.staged
    reported = {"reseeded": 0, "at_cap": 0}
    for k, beat in enumerate(_beats(one, 12)):
        a = jax.device_get(one.tick(beat))
        b = jax.device_get(staged.tick(beat))
        chex.assert_trees_all_equal(a, b)
        mirror_agrees(staged)
        assert staged.prefilled == ((1,) if k in (1, 8) else ())
        reported["reseeded"] += int(a.reseeded.sum())
        reported["at_cap"] += int(a.at_cap.sum())
        if k == 6:  # a state set from outside: the rule's copy is read back from the device
            staged.state = staged.state
    chex.assert_trees_all_equal(jax.device_get(one.state), jax.device_get(staged.state))
    # The script reached what it is for: the host's roll-over, and the cap (each mode's way).
    assert reported["reseeded"] >= (1 if at_cap == "end" else 3)
    assert reported["at_cap"] > 0 if at_cap == "end" else reported["at_cap"] == 0


def test_an_empty_capsule_leaves_the_templates_llm_state(params, rollover_pair):
    """Why a roll-over with an empty capsule skips the prefill (``restart_slot``, and the cond in
    ``step.reseed``): prefilling nothing is the template's LLM state, bit for bit."""
    _, staged = rollover_pair
    t = staged.template
    U = staged.serve.capsule_tokens
    ids = np.arange(U, dtype=np.int32)[None]
    capsule_llm = jax.jit(functools.partial(step_lib._capsule_llm, cfg=CFG))
    llm = capsule_llm(params, t, ids, np.zeros((1,), np.int32))
    chex.assert_trees_all_equal(jax.device_get(llm), jax.device_get(t.llm))


def _whiles(hlo: str) -> tuple[int, int]:
    """(while loops, those of known trip count) in a compiled program's HLO text."""
    lines = [line for line in hlo.splitlines() if re.search(r"\swhile\(", line)]
    return len(lines), sum("known_trip_count" in line for line in lines)


def test_staged_programs_have_no_loop_the_device_decides(rollover_pair):
    one, staged = rollover_pair
    stages = staged.stages
    for name in ("admit", "reseed", "restart", "swap", "lane", "tick"):
        n, known = _whiles(getattr(stages, name).as_text())
        assert n == known, (name, n, known)
    assert _whiles(stages.tick.as_text())[0] > 0  # the frame scan, the RNNT symbol loop
    # The one-program tick loops over the admitted and rolled-over slots as the device counts.
    n, known = _whiles(one.compile_tick().as_text())
    assert known < n


def test_packed_outputs_are_dispatched_ahead_of_the_lanes(rollover_pair, monkeypatch):
    """``tick_packed`` (the dispatch loop's call) packs the tick's outputs before it prefills the
    next beat's capsules into lanes, so the copy back does not queue behind a prefill; the
    outputs, the packed array and the lane are those of ``tick`` and ``pack``."""
    _, staged = rollover_pair
    beats = _beats(staged, 2)  # beat 1 asks slot 1's capsule prefilled behind its tick
    order = []
    pack, lanes = staged.pack, staged._prefill_lanes
    monkeypatch.setattr(staged, "pack", lambda out: order.append("pack") or pack(out))
    monkeypatch.setattr(
        staged, "_prefill_lanes", lambda *a: order.append("lanes") or lanes(*a)
    )  # fmt: skip
    staged.reset()
    got = [staged.tick_packed(b) for b in beats]
    assert order == ["pack", "lanes", "pack", "lanes"]
    assert staged.prefilled == (1,)
    monkeypatch.undo()
    staged.reset()
    want = [staged.tick(b) for b in beats]
    for (out, packed), ref in zip(got, want, strict=True):
        chex.assert_trees_all_equal(jax.device_get(out), jax.device_get(ref))
        np.testing.assert_array_equal(np.asarray(packed), np.asarray(staged.pack(ref)))
