"""voicechat_jax: a resident, slot-batched JAX serving engine for Nemotron VoiceChat 11B.

The names a user starts from::

    from voicechat_jax import Engine, Server, ServeConfig, voicechat_11b

    engine = Engine(params, voicechat_11b(), ServeConfig(slots=32))
    Server(engine).run(plans, n_ticks)

``ModelConfig`` / ``ServeConfig`` and the presets (``config``), the precision policies
(``precision``), the slot state and the beat's inputs, masks and outputs (``state``), the slot
rule that decides each beat's masks on the host (``slot_rule``), the tick (``step``), the
device-side ``Engine`` and the host-side ``Server``. The serving modules are imported on first
use, so ``import voicechat_jax.model`` stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "voicechat_jax.config",
    "ServeConfig": "voicechat_jax.config",
    "tiny": "voicechat_jax.config",
    "voicechat_11b": "voicechat_jax.config",
    "Precision": "voicechat_jax.precision",
    "SessionState": "voicechat_jax.state",
    "BeatInput": "voicechat_jax.state",
    "BeatOutput": "voicechat_jax.state",
    "SlotMasks": "voicechat_jax.state",
    "SlotRule": "voicechat_jax.slot_rule",
    "tick": "voicechat_jax.step",
    "Engine": "voicechat_jax.engine",
    "Server": "voicechat_jax.serving.server",
    "SessionPlan": "voicechat_jax.serving.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'voicechat_jax' has no attribute {name!r}")
