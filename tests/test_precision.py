"""The precision policies: named, checked, and reaching every program the engine traces."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.model import voicechat
from voicechat_jax.precision import POLICIES, Precision, policy

CFG = tiny()
SERVE = ServeConfig(slots=2, frames_per_tick=2, context_frames=16)


def test_policies_by_name():
    assert set(POLICIES) == {"reference", "fp32", "tf32", "bf16_tts_kv", "tf32_bf16_tts_kv"}
    assert policy("reference") == Precision.reference()
    assert policy("tf32").matmul == "tensorfloat32"
    assert policy("bf16_tts_kv").tts_kv == jnp.bfloat16
    assert policy("reference").matmul == "float32"  # faithful: fp32 products, as torch's default
    with pytest.raises(ValueError, match="precision must be one of reference, fp32"):
        policy("fp8")
    with pytest.raises(ValueError, match="matmul must be one of"):
        Precision(matmul="bfloat16")


def test_the_policy_lives_in_serve_config():
    """``ServeConfig.precision``: faithful by default, a policy name or a ``Precision``."""
    assert ServeConfig().precision == Precision.reference()
    assert ServeConfig(precision="bf16_tts_kv").precision == Precision.bf16_tts_kv()
    assert ServeConfig(precision=Precision.tf32()).precision.matmul == "tensorfloat32"
    with pytest.raises(ValueError, match="precision must be one of"):
        ServeConfig(precision="fp8")


def _lowered_tick(precision: Precision) -> str:
    params = jax.eval_shape(lambda: voicechat.init(jax.random.key(0), CFG, precision))
    template = jax.eval_shape(
        lambda p: voicechat.initial_state(p, cfg=CFG, precision=precision, max_len=16), params
    )
    state = jax.eval_shape(lambda t: state_lib.from_template(t, SERVE.slots), template)
    beat = state_lib.empty_beat(SERVE.slots, 2 * 1280)
    return (
        step_lib.make_tick(CFG, dataclasses.replace(SERVE, precision=precision))
        .lower(params, state, template, beat)
        .as_text()
    )


def test_the_policy_reaches_the_tick():
    """Faithful: every fp32 product is lowered at HIGHEST; TF32: only the explicit ones stay."""
    faithful = _lowered_tick(Precision.reference())
    fast = _lowered_tick(Precision.tf32())
    n_faithful, n_fast = faithful.count("HIGHEST"), fast.count("HIGHEST")
    assert n_fast > 0  # the codec's and the SSM's explicit HIGHEST products
    assert n_faithful > n_fast
    assert "HIGH," in fast or "HIGH]" in fast


def test_bf16_speech_decoder_kv_serves():
    params = voicechat.init(jax.random.key(0), CFG, Precision.bf16_tts_kv())
    engine = Engine(params, CFG, dataclasses.replace(SERVE, precision="bf16_tts_kv"))
    assert {a.dtype for a in (*engine.state.model.tts.k, *engine.state.model.tts.v)} == {
        jnp.dtype(jnp.bfloat16)
    }
    beat = engine.empty_beat()
    beat.admit[:] = True
    beat.key[:] = np.arange(4, dtype=np.uint32).reshape(2, 2)
    beat.audio[:] = 0.1 * np.sin(np.arange(beat.audio.shape[1]) / 9.0)
    for _ in range(3):
        out = jax.device_get(engine.tick(beat))
        beat.admit[:] = False
    assert out.ran.all()
    assert np.all(np.isfinite(out.frames.wav))
