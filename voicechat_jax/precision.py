"""The dtype policy: which precision each part of the model runs in.

NeMo's ``NemotronVoiceChat`` casts the LLM, its embedding and its heads to bf16 and keeps the
perception encoder, the speech decoder and the codec in fp32 (NVIDIA notes that a bf16 speech
decoder hallucinates); the Mamba-2 SSM state is kept in fp32 (``mamba_ssm_cache_dtype=float32``).
``Precision.reference()`` is that policy; ``Precision.fp32()`` runs everything in fp32, which is
what the parity tests against the torch references use.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes for weights, activations and carried state, per sub-network."""

    encoder: jnp.dtype = jnp.float32  # mel, FastConformer, perception.proj
    llm: jnp.dtype = jnp.bfloat16  # Nano weights, embedding, text/function heads, activations
    llm_kv: jnp.dtype = jnp.bfloat16  # Nano attention KV cache
    ssm_state: jnp.dtype = jnp.float32  # Mamba-2 SSM and conv state
    rnnt: jnp.dtype = jnp.float32  # transcript head
    tts: jnp.dtype = jnp.float32  # EarTTS backbone, text side, MoG head
    tts_kv: jnp.dtype = jnp.float32  # EarTTS backbone KV cache (the largest per-session state)
    codec: jnp.dtype = jnp.float32  # RVQ-VAE codec

    @classmethod
    def reference(cls) -> Precision:
        """The precision NeMo serves the release in."""
        return cls()

    @classmethod
    def fp32(cls) -> Precision:
        """Everything in fp32: the setting of the parity tests."""
        f = jnp.float32
        return cls(encoder=f, llm=f, llm_kv=f, ssm_state=f, rnnt=f, tts=f, tts_kv=f, codec=f)
