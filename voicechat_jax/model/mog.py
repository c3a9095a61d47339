"""The EarTTS mixture-of-Gaussians head: its MLP trunk, its projections, and component sampling.

Mirrors NeMo 3.0 ``speechlm2/modules/ear_tts_model.py``:

- ``trunk``: ``MoGHead.mlp_stack``: ``L`` x ``MLPLayer`` (pre-norm, GeGLU ``down(gelu_tanh(gate x)
  * up x)``, post-norm, residual) then a final ``RMSNorm``; every norm is Gemma's ``(1 + w)``.
- ``guide``: the classifier-free guidance ``MoGHead.infer`` applies to the trunk's output,
  ``x = cond + g (cond - uncond)``.
- ``logits`` / ``log_std`` / ``component_mean``: ``proj_logits``, ``proj_logs`` clamped at
  ``min_log_std``, and the chosen component's low-rank mean
  ``low_mat[k] @ (proj_mus[k] @ x) * exp(logs) + proj_else(x)`` (``MoGHead.infer``'s ``mu``).
- ``top_p_filter``: ``transformers.TopPLogitsWarper`` (the released ``top_p_or_k`` is 0.95).
- ``choose``: the Gumbel-max draw ``argmax(log_softmax(logits) + gumbel)`` of ``MoGHead.infer``.

The RVQ refinement loop that calls the head (``RVQEARTTSModel.generate_step``) lives in
``ear_tts``.

Axes (see ``voicechat_jax.model``): ``B`` rows, ``D`` model dim, ``F`` the trunk's MLP dim, ``L``
trunk layers, ``E`` mixture components; local to this module: ``R`` the low rank of the component
means (``mog_rank``), ``Z`` the codec latent size (``latent_size``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from voicechat_jax.config import SpeechDecoderConfig
from voicechat_jax.model import common
from voicechat_jax.model.common import dense, fan_in_normal, normal, rms_norm
from voicechat_jax.precision import Precision, ProductPrecision


@struct.dataclass
class MoGParams:
    """``MoGHead`` with ``low_rank`` set (the release's 64). In the serving layout (``per_layer``)
    ``gate`` and ``up`` are None and ``gate_up`` holds them fused, ``down`` a tuple of L layers."""

    pre_norm: jax.Array  # [L, D]  mlp_stack.{l}.pre_norm
    gate: jax.Array  # [L, D, F]  mlp_stack.{l}.mlp.gate_proj
    up: jax.Array  # [L, D, F]  mlp_stack.{l}.mlp.up_proj
    down: jax.Array  # [L, F, D]  mlp_stack.{l}.mlp.down_proj
    post_norm: jax.Array  # [L, D]  mlp_stack.{l}.post_norm
    final_norm: jax.Array  # [D]  mlp_stack.{L}
    proj_logits: jax.Array  # [D, E]
    proj_mus: jax.Array  # [E * R, D]  torch layout, read as [E, R, D] (row block k = component k)
    low_mat: jax.Array  # [E, Z, R]
    proj_else: jax.Array  # [D, Z]
    proj_logs: jax.Array  # [D, 1]
    gate_up: tuple[jax.Array, ...] | None = None  # L x [D, 2F]  gate | up (serving)


def init(key: jax.Array, cfg: SpeechDecoderConfig, precision: Precision) -> MoGParams:
    """Random weights: norm weights near 0 (scale 1 + w near 1), unit-scale activations."""
    dt = precision.tts
    D, F, L = cfg.d_model, cfg.mlp_dim, cfg.mog_mlp_layers
    E, R, Z = cfg.mog_components, cfg.mog_rank, cfg.latent_size
    k = jax.random.split(key, 11)
    return MoGParams(
        pre_norm=normal(k[0], (L, D), dt, std=0.1),
        gate=fan_in_normal(k[1], (L, D, F), dt, D),
        up=fan_in_normal(k[2], (L, D, F), dt, D),
        down=fan_in_normal(k[3], (L, F, D), dt, F),
        post_norm=normal(k[4], (L, D), dt, std=0.1),
        final_norm=normal(k[5], (D,), dt, std=0.1),
        proj_logits=fan_in_normal(k[6], (D, E), dt, D),
        proj_mus=fan_in_normal(k[7], (E * R, D), dt, D),
        low_mat=fan_in_normal(k[8], (E, Z, R), dt, R),
        proj_else=fan_in_normal(k[9], (D, Z), dt, D),
        proj_logs=normal(k[10], (D, 1), dt, std=0.02),
    )


def trunk(
    params: MoGParams, x: jax.Array, *, cfg: SpeechDecoderConfig, product: ProductPrecision = None
) -> jax.Array:
    """``MoGHead.mlp_stack``: x [..., D] -> [..., D], its layers unrolled (each reads its own
    weights: no slice of a stacked one in the serving layout, ``per_layer``). ``product``: the
    products' ``precision=`` (static; ``Precision.tts_product``), None for the scope's."""
    for l in range(cfg.mog_mlp_layers):
        y = rms_norm(x, params.pre_norm[l], cfg.norm_eps, offset=1.0)
        if params.gate_up is not None:  # the serving layout: one product, its columns split
            gate, up = jnp.split(dense(y, params.gate_up[l], precision=product), 2, axis=-1)
        else:
            gate = dense(y, params.gate[l], precision=product)
            up = dense(y, params.up[l], precision=product)
        y = dense(jax.nn.gelu(gate, approximate=True) * up, params.down[l], precision=product)
        x = x + rms_norm(y, params.post_norm[l], cfg.norm_eps, offset=1.0)
    return rms_norm(x, params.final_norm, cfg.norm_eps, offset=1.0)


def per_layer(params: MoGParams) -> MoGParams:
    """The serving layout (``common.per_layer``): the trunk's gate and up fused, one per layer
    (``gate_up``), ``down`` one leaf per layer."""
    return common.per_layer(params, ("down",), fused={"gate_up": ("gate", "up")})


def guide(cond: jax.Array, uncond: jax.Array, scale: float) -> jax.Array:
    """Classifier-free guidance on the trunk's output, as ``MoGHead.infer`` applies it."""
    if scale <= 0.0:
        return cond  # NeMo skips guidance (and the uncond rows) when the scale is 0
    return cond + scale * (cond - uncond)


def logits(params: MoGParams, x: jax.Array) -> jax.Array:
    """Mixture logits: x [B, D] -> [B, E]."""
    return dense(x, params.proj_logits)


def log_std(params: MoGParams, x: jax.Array, *, cfg: SpeechDecoderConfig) -> jax.Array:
    """The shared log standard deviation, clamped below: x [B, D] -> [B, 1]."""
    return jnp.maximum(dense(x, params.proj_logs), cfg.mog_min_log_std)


def component_mean(
    params: MoGParams, x: jax.Array, k: jax.Array, logs: jax.Array, *, cfg: SpeechDecoderConfig
) -> jax.Array:
    """The chosen component's mean in latent space (``MoGHead.infer``'s returned ``mu``).

    x [B, D], k [B] int, logs [B, 1] -> [B, Z]:
    ``low_mat[k] (proj_mus[k] x) e^logs + proj_else x``.
    """
    E, R = cfg.mog_components, cfg.mog_rank
    mus = params.proj_mus.reshape(E, R, -1)[k]  # [B, R, D]: only the chosen component's rows
    low = jnp.einsum("brd,bd->br", mus.astype(x.dtype), x)
    mu = jnp.einsum("bzr,br->bz", params.low_mat[k].astype(x.dtype), low)
    return mu * jnp.exp(logs.astype(jnp.float32)).astype(x.dtype) + dense(x, params.proj_else)


def top_p_filter(x: jax.Array, top_p: float) -> jax.Array:
    """``transformers.TopPLogitsWarper(top_p)``: x [B, E] -> x with dropped entries at -inf.

    Sorted ascending, a logit is dropped when the probability mass at and below it is
    ``<= 1 - top_p``; the largest logit is always kept.
    """
    order = jnp.argsort(x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_x.astype(jnp.float32), axis=-1), axis=-1)
    drop_sorted = (cum <= 1.0 - top_p).at[..., -1].set(False)
    rows = jnp.arange(x.shape[0])[:, None]
    drop = jnp.zeros_like(drop_sorted).at[rows, order].set(drop_sorted)
    return jnp.where(drop, -jnp.inf, x)


def choose(x: jax.Array, u: jax.Array | None, *, top_p: float, deterministic: bool) -> jax.Array:
    """Pick one mixture component per row: x [B, E] logits, u [B, E] uniform [0, 1) -> [B] int32.

    Faithful: top-p filter, then ``argmax(log_softmax + gumbel(u))`` with NeMo's ``gumbel_like``
    (``-log(-log(u + 1e-8) + 1e-8)``). Deterministic: the most likely component (NeMo with
    ``top_p_or_k=1``, an int, which keeps only the top logit); ``u`` is not read.
    """
    if deterministic:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    gumbel = -jnp.log(-jnp.log(u + 1e-8) + 1e-8)
    scores = jax.nn.log_softmax(top_p_filter(x, top_p).astype(jnp.float32), axis=-1) + gumbel
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def sample_latent(
    params: MoGParams,
    x: jax.Array,
    k: jax.Array,
    eps: jax.Array | None,
    *,
    noise_scale: float,
    cfg: SpeechDecoderConfig,
) -> jax.Array:
    """``z = mu + e^logs eps noise_scale`` (``generate_step``): x [B, D], component k [B] -> [B, Z].

    ``eps`` [B, Z] standard normal; ``None`` means no noise (``noise_scale = 0``).
    """
    logs = log_std(params, x, cfg=cfg)
    mu = component_mean(params, x, k, logs, cfg=cfg)
    if eps is None:
        return mu
    return mu + jnp.exp(logs) * eps.astype(mu.dtype) * noise_scale
