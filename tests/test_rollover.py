"""Rolling a session over to a fresh context that remembers the conversation (``step.reseed``).

The LLM context restarts from the system prompt plus the capsule's tokens, the speech decoder's
from its prompt with the session's last codes; the encoder, RNNT and codec streams, the previous
tokens and the frame counter go on; every other slot is untouched; no recompile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import shared
from voicechat_jax import step as step_lib
from voicechat_jax.config import PAD_ID, ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.model import nano
from voicechat_jax.precision import Precision

CFG = tiny()
PREC = Precision.fp32()
SERVE = ServeConfig(
    slots=3,
    frames_per_tick=2,
    context_frames=24,
    capsule_tokens=8,
    system_prompt=(5, 6, 7),
    precision=PREC,
)


@pytest.fixture(scope="module")
def engine():
    params = shared.params(PREC)
    return Engine(params, CFG, SERVE)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _run(engine, beats):
    """Serves the given beats on a fresh state; returns the outputs (NumPy)."""
    engine.reset()
    return [jax.device_get(engine.tick(b)) for b in beats]


def _speech_beats(engine, n, *, reseed_at=None, capsule=(), rows=(1,)):
    rng = np.random.default_rng(3)
    beats = []
    for k in range(n):
        b = engine.empty_beat()
        b.audio[:] = 0.1 * rng.standard_normal(b.audio.shape)
        if k == 0:
            b.admit[:] = True
            b.key[:] = np.arange(6, dtype=np.uint32).reshape(3, 2)
        if k == reseed_at:
            for r in rows:
                b.reseed[r] = True
                b.capsule[r, : len(capsule)] = capsule
                b.capsule_len[r] = len(capsule)
        beats.append(b)
    return beats


def test_reseed_state(engine):
    """The re-seeded slot's state is exactly what the rule says; the others are untouched."""
    params = engine.params
    outs = _run(engine, _speech_beats(engine, 3))
    assert all(o.ran.all() for o in outs)
    before = jax.device_get(engine.state.model)
    capsule = np.zeros((3, SERVE.capsule_tokens), np.int32)
    capsule[1, :4] = [9, 10, 11, 12]
    mask = jnp.asarray([False, True, False])
    fn = jax.jit(functools.partial(step_lib.reseed, cfg=CFG))
    after = jax.device_get(
        fn(params, engine.state.model, engine.template, mask, capsule, jnp.asarray([0, 4, 0]))
    )
    for x, y in zip(_leaves(before), _leaves(after), strict=True):
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[2], y[2])

    # Slot 1: the LLM is the template followed by the capsule's 4 tokens.
    @jax.jit
    def prefill(p, state, ids):  # one program, not ~300 operations compiled one by one
        pads = jnp.full(ids.shape, PAD_ID, jnp.int32)
        e = nano.input_embedding(p, pads, pads, nano.embed(p, ids), cfg=CFG.llm)
        return nano.prefill(p, state, e, cfg=CFG.llm)[0]

    want = prefill(params.llm, engine.template.llm, jnp.asarray([[9, 10, 11, 12]]))
    got = _leaves(jax.tree_util.tree_map(lambda a: a[1:2], after.llm))
    for x, y in zip(_leaves(want), got, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
    assert int(after.llm.length[1]) == len(SERVE.system_prompt) + 4
    # The speech decoder restarts from its prompt, with the session's last codes, not skipping.
    template_tts = jax.device_get(engine.template.tts)
    for x, y in zip(_leaves(template_tts.k), _leaves(after.tts.k), strict=True):
        np.testing.assert_array_equal(x[0], y[1])
    assert int(after.tts.pos[1]) == int(template_tts.pos[0])
    np.testing.assert_array_equal(after.tts.prev_codes[1], before.tts.prev_codes[1])
    assert int(after.tts.frame[1]) == 1
    # The streams go on.
    for part in ("encoder", "rnnt", "codec"):
        for x, y in zip(_leaves(getattr(before, part)), _leaves(getattr(after, part)), strict=True):
            np.testing.assert_array_equal(x[1], y[1])
    assert int(after.frame[1]) == int(before.frame[1]) == 6


def test_reseed_beat_in_the_tick(engine):
    """A roll-over inside the tick: reported, the slot runs its beat, the others are unchanged."""
    plain = _run(engine, _speech_beats(engine, 5))
    rolled = _run(engine, _speech_beats(engine, 5, reseed_at=3, capsule=(9, 10, 11)))
    assert [bool(o.reseeded[1]) for o in rolled] == [False, False, False, True, False]
    assert not any(o.reseeded[0] or o.reseeded[2] for o in rolled)
    for a, b in zip(plain, rolled, strict=True):
        assert b.ran.all()
        for row in (0, 2):  # the neighbours' outputs are bit-identical
            np.testing.assert_array_equal(a.frames.codes[row], b.frames.codes[row])
            np.testing.assert_array_equal(a.frames.wav[row], b.frames.wav[row])
    for a, b in zip(plain[:3], rolled[:3], strict=True):  # before the roll-over, identical
        np.testing.assert_array_equal(a.frames.wav[1], b.frames.wav[1])
    assert np.all(np.isfinite(rolled[3].frames.wav[1]))
    assert int(rolled[-1].frame[1]) == 10  # no frame lost or repeated


def test_full_capsule_and_cap(engine):
    """A capsule of U tokens fits; the session keeps U fewer frames of room after it."""
    U = SERVE.capsule_tokens
    outs = _run(engine, _speech_beats(engine, 2, reseed_at=1, capsule=tuple(range(20, 20 + U))))
    assert outs[1].reseeded[1]
    assert outs[1].ran[1]
    assert int(jax.device_get(engine.state.model.llm.length[1])) == 3 + U + 2
