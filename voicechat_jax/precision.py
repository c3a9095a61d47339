"""The dtype policy: which precision each part of the model runs in.

NeMo's ``NemotronVoiceChat`` casts the LLM, its embedding and its heads to bf16 and keeps the
perception encoder, the speech decoder and the codec in fp32 (NVIDIA notes that a bf16 speech
decoder hallucinates); the Mamba-2 SSM state is kept in fp32 (``mamba_ssm_cache_dtype=float32``).
``Precision.reference()`` is that policy; ``Precision.fp32()`` runs everything in fp32, which is
what the parity tests against the torch references use.

Matrix products of fp32 inputs: torch computes them in full fp32 by default
(``torch.backends.cuda.matmul.allow_tf32 = False``), while XLA on a GPU rounds their inputs to
TF32 unless told otherwise. ``matmul`` pins the choice for every program the engine traces
(``scope()``): 'float32' in the faithful policies, 'tensorfloat32' in ``tf32()``. It changes nothing
on the CPU (always fp32) and nothing for bf16 products (the LLM).

Policies beside the faithful default, for capacity (each measured for its deviation and speed):
``tf32()`` (TF32 products in the encoder and the speech decoder; the codec's and the SSM's
products keep their explicit ``HIGHEST``), ``bf16_tts_kv()`` (the speech
decoder's KV cache, the largest per-session state, stored in bf16: half its bytes),
``tf32_bf16_tts_kv()`` (both), ``tf32_codec()`` (TF32 products in the codec's decoder only),
``tf32x3_codec()`` (the codec's decoder products as three TF32 passes, about fp32's accuracy),
``bf16_tts_kv_tf32_codec()``, and ``tf32x3_tts_codec()`` / ``bf16_tts_kv_tf32x3_tts_codec()``
(the speech decoder's weight products as three TF32 passes too: ``tts_matmul``).

The codec's decoder turns the sampled codes into the waveform and nothing else: nothing the rest
of the model reads depends on it (its own state is the decoder's conv and overlap-add tails), so
TF32 there moves the audio only (about 1e-3 relative on an H200 with TF32 in the whole codec,
``model.codec``) and can never change what the model says. Its products are the tick's
largest compute: 5.9 GFLOP per session-frame at the release's sizes (the pointwise products of
its nine ConvNeXt blocks, at 9, 63 and 441 steps a frame), run in full fp32 on the GPU's vector
units: 3.2 ms a frame-step at 16 sessions and 5.7 at 32 on an H200 (``experiments/beat_profile``),
about 33 TFLOP/s. The codec's encoder, whose nearest-neighbour search flips codes under TF32,
keeps ``HIGHEST`` in every policy.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

MATMUL = ("float32", "tensorfloat32")
# The codec decoder's products may also run as several tensor-core passes that together keep
# about fp32's accuracy (``jax.lax.DotAlgorithmPreset``): 'tf32_x3' (three TF32 products),
# 'bf16_x6' (six bf16 products). On a platform without them (the CPU) they are full fp32.
# 'pallas_tf32x3' (2026-12-07, an experiment): three TF32 passes in our own kernel, which sums
# only one short step of the contraction on the matrix units and adds the steps on the FMA units
# by a compensated sum (``pallas_kernels.matmul``, precision 'tf32x3'); XLA's preset was less
# exact than full fp32 on the codec's long contractions (an H100, 2026-12-06).
# Measured on an H100 (2026-12-07, b42282b): more exact than full fp32 on every fp32 product of
# the 96-slot tick, but 0.24-0.66x its speed on all but one, and the 40-slot tick 33 % slower
# (``experiments/fp32_products``); it stays outside the faithful policy.
# 'tf32_x3_steps' (2026-12-07, an experiment): the same arithmetic through XLA's dots: the
# contraction in steps of ``common.STEP_ROWS`` rows, each step's product under the three-pass
# preset, the steps added by a compensated sum (``common.dense_in_steps``); not yet measured on a
# GPU (``experiments/fp32_products``, ``<algorithm>_c<N>``).
CODEC_MATMUL = (*MATMUL, "tf32_x3", "bf16_x6", "pallas_tf32x3", "tf32_x3_steps")
_PRESETS = {"tf32_x3": "TF32_TF32_F32_X3", "bf16_x6": "BF16_BF16_F32_X6"}
# The speech decoder's weight products (its backbone's and the MoG trunk's): None follows
# ``matmul``; 'tf32_x3' runs them as three TF32 passes on a GPU (``experiments/fp32_products``:
# less error than cuBLAS's full-fp32 product at these shapes, 2026-12-05), full fp32 elsewhere;
# 'tf32_pair' lays their weights out as TF32 pairs when the params are laid out for serving
# (``voicechat.serving_layout``) and runs each as one TF32 product of the split input by the
# pair (``common.dense_tf32_pair``: four partial products, each exact), full fp32 of the same
# split operands off a GPU.
# 'pallas_tf32x3' and 'tf32_x3_steps' as for the codec.
TTS_MATMUL = (None, "tf32_x3", "tf32_pair", "pallas_tf32x3", "tf32_x3_steps")
# The Conformer layers' weight products (feed-forward, attention projections, conv pointwise):
# None follows ``matmul``; 'pallas_tf32x3' and 'tf32_x3_steps' as for the codec.
ENCODER_MATMUL = (None, "pallas_tf32x3", "tf32_x3_steps")


class KernelProduct(enum.Enum):
    """A weight product run by one of our kernels instead of XLA's dot (``common.dense``)."""

    TF32X3 = "tf32x3"  # pallas_kernels.matmul(precision='tf32x3')
    TF32X3_STEPS = "tf32x3_steps"  # XLA's three-pass preset by steps (common.dense_in_steps)


# A product's explicit ``precision=`` (static): None for the scope's (``Precision.scope()``).
ProductPrecision = jax.lax.Precision | jax.lax.DotAlgorithmPreset | KernelProduct | None


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
    matmul: str = "float32"  # fp32 products: 'float32' (as torch) | 'tensorfloat32' (TF32 on GPUs)
    codec_matmul: str = "float32"  # the codec decoder's products (the waveform only): CODEC_MATMUL
    tts_matmul: str | None = None  # the speech decoder's weight products: TTS_MATMUL
    encoder_matmul: str | None = None  # the Conformer layers' weight products: ENCODER_MATMUL

    def __post_init__(self):
        for field, choices in (("matmul", MATMUL), ("codec_matmul", CODEC_MATMUL)):
            if getattr(self, field) not in choices:
                raise ValueError(f"{field} must be one of {choices}: {getattr(self, field)!r}")
        if self.tts_matmul not in TTS_MATMUL:
            raise ValueError(f"tts_matmul must be one of {TTS_MATMUL}: {self.tts_matmul!r}")
        if self.encoder_matmul not in ENCODER_MATMUL:
            raise ValueError(
                f"encoder_matmul must be one of {ENCODER_MATMUL}: {self.encoder_matmul!r}"
            )

    def scope(self):
        """The context in which the engine traces its programs (``jax.default_matmul_precision``).

        Explicit ``precision=`` arguments (the codec's and the SSM's ``HIGHEST``) still win.
        """
        return jax.default_matmul_precision(self.matmul)

    def tts_product(self, platform: str | None = None) -> ProductPrecision:
        """The explicit ``precision=`` of the speech decoder's weight products (static): None
        (the scope's, ``matmul``) unless ``tts_matmul`` names an algorithm (``lax_precision``).
        Under 'tf32_pair' the weights are ``TF32Pair`` s, which carry their own product."""
        if self.tts_matmul in (None, "tf32_pair"):
            return None
        return lax_precision(self.tts_matmul, platform)

    def encoder_product(self, platform: str | None = None) -> ProductPrecision:
        """The explicit ``precision=`` of the Conformer layers' weight products (static): None
        (the scope's) unless ``encoder_matmul`` names one (``lax_precision``)."""
        if self.encoder_matmul is None:
            return None
        return lax_precision(self.encoder_matmul, platform)

    @classmethod
    def reference(cls) -> Precision:
        """The precision NeMo serves the release in."""
        return cls()

    @classmethod
    def fp32(cls) -> Precision:
        """Everything in fp32: the setting of the parity tests."""
        f = jnp.float32
        return cls(encoder=f, llm=f, llm_kv=f, ssm_state=f, rnnt=f, tts=f, tts_kv=f, codec=f)

    @classmethod
    def tf32(cls) -> Precision:
        """The reference dtypes with TF32 products for fp32 inputs (encoder, speech decoder).

        Not a safe speed-up for the tokens: the encoder's rounding reaches the LLM's input. On an
        H200, 11B preset with random weights, 2.5 % of the text tokens over 120 frames equal the
        faithful policy's (``experiments/precision_policies``).
        """
        return cls(matmul="tensorfloat32")

    @classmethod
    def bf16_tts_kv(cls) -> Precision:
        """The reference policy with the speech decoder's KV cache in bf16."""
        return cls(tts_kv=jnp.bfloat16)

    @classmethod
    def tf32_bf16_tts_kv(cls) -> Precision:
        """TF32 products and a bf16 speech-decoder KV cache."""
        return cls(matmul="tensorfloat32", tts_kv=jnp.bfloat16)

    @classmethod
    def tf32_codec(cls) -> Precision:
        """The reference policy with TF32 products in the codec's decoder (the waveform only)."""
        return cls(codec_matmul="tensorfloat32")

    @classmethod
    def tf32x3_codec(cls) -> Precision:
        """The reference policy with the codec decoder's products as three TF32 passes.

        About fp32's accuracy on tensor cores: on an H200 the waveform is 1.4e-5 relative to
        full fp32's at 64 sessions and the decode 1.25x faster (``experiments/codec_precision``);
        tokens and codes cannot change. Full fp32 off the GPU.
        """
        return cls(codec_matmul="tf32_x3")

    @classmethod
    def bf16_tts_kv_tf32x3_codec(cls) -> Precision:
        """A bf16 speech-decoder KV cache and the codec decoder's products as three TF32 passes.

        The configuration of the most sessions held at the cap on an H200 (96, every cache full;
        ``experiments/capacity``). Not faithful: the cache is rounded to bf16. The text tokens
        are unchanged (the speech decoder does not feed the LLM); on an H200, 11B preset with
        random weights, 41 % of the speech codes over 120 frames equal the faithful policy's
        (``experiments/precision_policies``).
        """
        return cls(tts_kv=jnp.bfloat16, codec_matmul="tf32_x3")

    @classmethod
    def tf32x3_tts_codec(cls) -> Precision:
        """The reference dtypes with the speech decoder's weight products (backbone, MoG trunk)
        and the codec decoder's products as three TF32 passes on a GPU.

        A candidate for a faithful stand-in, not yet one: on an H100 those products had less error
        than the full-fp32 ones at 0.84-1.89x their speed (``experiments/fp32_products``,
        2026-12-05), but the 40-slot tick gained only the codec's share (92.00 against 93.33 ms,
        the same tokens and codes; ``experiments/tick_profile``). A served run's codes are not
        measured. Identical to ``reference`` off the GPU.
        """
        return cls(tts_matmul="tf32_x3", codec_matmul="tf32_x3")

    @classmethod
    def tf32pair_tts(cls) -> Precision:
        """The reference policy with the speech decoder's weight products (backbone, MoG trunk)
        as one TF32 product each by TF32 pairs of their weights (``tts_matmul='tf32_pair'``).

        Not a faithful stand-in: on the CPU its error against float64 is a full-fp32
        product's, but on an H100 (2026-12-06, ``experiments/fp32_products``, 40 slots) the
        GPU's TF32 product left 2.5-6.3e-6 of the largest value against cuBLAS's full
        fp32 at 5e-7 to 1.2e-6, for 1.1-1.5x its speed; the 40-slot full-cache tick went from
        95.87 to 94.08 ms with the same tokens and codes (``experiments/tick_profile``). The
        paired weights take 2.4 GiB more than the fp32 ones.
        """
        return cls(tts_matmul="tf32_pair")

    @classmethod
    def pallas_tf32x3_tts_codec(cls) -> Precision:
        """The reference policy with the speech decoder's weight products (backbone, MoG trunk)
        and the codec decoder's products in ``pallas_kernels.matmul`` as three TF32 passes a
        contraction step, the steps added by a compensated sum (``'pallas_tf32x3'``). Not a
        stand-in for the faithful fp32 products: on an H100 (2026-12-07,
        ``experiments/fp32_products``, 96 slots) its error against float64 was below full
        fp32's on every shape (rms 1.3-2.0e-7 against 2.7-8.6e-7), but it ran at 0.24-0.66x
        XLA's full-fp32 product on all shapes but one (1.04x). Full fp32 off a GPU.
        """
        return cls(tts_matmul="pallas_tf32x3", codec_matmul="pallas_tf32x3")

    @classmethod
    def pallas_tf32x3(cls) -> Precision:
        """``pallas_tf32x3_tts_codec`` with the Conformer layers' weight products in the same
        kernel: every fp32 weight product of the tick but the encoder's subsampling and
        projection, the LLM's bf16 ones untouched. On an H100 at 40 slots, every cache full
        (2026-12-07, ``experiments/tick_profile``), the tick took 137.6 ms against the
        reference's 103.5."""
        return cls(
            encoder_matmul="pallas_tf32x3", tts_matmul="pallas_tf32x3", codec_matmul="pallas_tf32x3"
        )

    @classmethod
    def tf32x3_steps(cls) -> Precision:
        """The reference policy with the encoder's, the speech decoder's and the codec's fp32
        weight products as XLA's three-pass TF32 preset by steps of the contraction, the steps
        added by a compensated sum (``'tf32_x3_steps'``, ``common.dense_in_steps``). A
        candidate stand-in for the faithful products, not yet one: our compensated kernel
        showed that this arithmetic is more exact than full fp32 on every product of the tick,
        but ran slowly (``pallas_tf32x3``); whether XLA's dots keep the accuracy at the preset's
        speed is ``experiments/fp32_products``'s question (``TF32_TF32_F32_X3_c<N>``), then
        the tick's. Full fp32 off a GPU.
        """
        s = "tf32_x3_steps"
        return cls(encoder_matmul=s, tts_matmul=s, codec_matmul=s)

    @classmethod
    def bf16_tts_kv_tf32x3_tts_codec(cls) -> Precision:
        """``bf16_tts_kv_tf32x3_codec`` with the speech decoder's weight products as three TF32
        passes too (``tf32x3_tts_codec``). Not faithful: the KV cache is rounded to bf16."""
        return cls(tts_kv=jnp.bfloat16, tts_matmul="tf32_x3", codec_matmul="tf32_x3")

    @classmethod
    def bf16_tts_kv_tf32_codec(cls) -> Precision:
        """A bf16 speech-decoder KV cache and TF32 products in the codec's decoder."""
        return cls(tts_kv=jnp.bfloat16, codec_matmul="tensorfloat32")


def lax_precision(
    matmul: str, platform: str | None = None
) -> jax.lax.Precision | jax.lax.DotAlgorithmPreset:
    """The explicit ``precision=`` of a product under a ``CODEC_MATMUL`` choice (static).

    'float32' is ``HIGHEST`` (full fp32); 'tensorfloat32' ``HIGH`` (TF32 inputs on a GPU, fp32 on
    the CPU); 'tf32_x3' and 'bf16_x6' are ``DotAlgorithmPreset`` s on a GPU and ``HIGHEST``
    elsewhere; 'pallas_tf32x3' is ``KernelProduct.TF32X3`` on a GPU (``common.dense`` runs it)
    and ``HIGHEST`` elsewhere; 'tf32_x3_steps' likewise ``KernelProduct.TF32X3_STEPS``.
    ``platform``: the backend the product is traced for (default:
    JAX's default).
    """
    if matmul not in CODEC_MATMUL:
        raise ValueError(f"matmul must be one of {CODEC_MATMUL}: {matmul!r}")
    on_gpu = (platform or jax.default_backend()) == "gpu"
    if matmul == "pallas_tf32x3":
        return KernelProduct.TF32X3 if on_gpu else jax.lax.Precision.HIGHEST
    if matmul == "tf32_x3_steps":
        return KernelProduct.TF32X3_STEPS if on_gpu else jax.lax.Precision.HIGHEST
    if matmul in _PRESETS:
        if on_gpu:
            return getattr(jax.lax.DotAlgorithmPreset, _PRESETS[matmul])
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.HIGHEST if matmul == "float32" else jax.lax.Precision.HIGH


POLICIES = {
    "reference": Precision.reference,
    "fp32": Precision.fp32,
    "tf32": Precision.tf32,
    "bf16_tts_kv": Precision.bf16_tts_kv,
    "tf32_bf16_tts_kv": Precision.tf32_bf16_tts_kv,
    "tf32_codec": Precision.tf32_codec,
    "tf32x3_codec": Precision.tf32x3_codec,
    "bf16_tts_kv_tf32_codec": Precision.bf16_tts_kv_tf32_codec,
    "bf16_tts_kv_tf32x3_codec": Precision.bf16_tts_kv_tf32x3_codec,
    "tf32x3_tts_codec": Precision.tf32x3_tts_codec,
    "bf16_tts_kv_tf32x3_tts_codec": Precision.bf16_tts_kv_tf32x3_tts_codec,
    "tf32pair_tts": Precision.tf32pair_tts,
    "pallas_tf32x3_tts_codec": Precision.pallas_tf32x3_tts_codec,
    "pallas_tf32x3": Precision.pallas_tf32x3,
    "tf32x3_steps": Precision.tf32x3_steps,
}


def policy(name: str) -> Precision:
    """The named policy (``POLICIES``); a clear error for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(POLICIES)}: {name!r}") from None
