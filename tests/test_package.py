"""The package's face: the names a user starts from resolve to the library's own objects."""

from __future__ import annotations

import pytest

import voicechat_jax
from voicechat_jax import config, engine, precision, state, step
from voicechat_jax.serving import server


def test_exports_resolve():
    assert voicechat_jax.Engine is engine.Engine
    assert voicechat_jax.Server is server.Server
    assert voicechat_jax.ServeConfig is config.ServeConfig
    assert voicechat_jax.voicechat_11b is config.voicechat_11b
    assert voicechat_jax.Precision is precision.Precision
    assert voicechat_jax.SessionState is state.SessionState
    assert voicechat_jax.tick is step.tick
    assert set(voicechat_jax.__all__) >= {"Engine", "Server", "ServeConfig", "tick"}
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = voicechat_jax.Nope
