"""voicechat_jax: a resident, slot-batched JAX serving engine for Nemotron VoiceChat 11B."""

__version__ = "0.1.0"
