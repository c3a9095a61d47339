"""Small numeric building blocks shared by the sub-networks (norms, dense layers, init helpers)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from pallas_kernels.matmul import matmul
from voicechat_jax.precision import KernelProduct, ProductPrecision

F32 = jnp.float32


@struct.dataclass
class TF32Pair:
    """A weight [D, F] served as its TF32 pair (``tf32_pair``), which ``dense`` multiplies by in
    one TF32 product (``dense_tf32_pair``); ``Precision.tts_matmul='tf32_pair'`` lays the speech
    decoder's weight products out so (``tf32_pairs``)."""

    pair: jax.Array  # [D, 2F] fp32: [hi | lo]


def dense(
    x: jax.Array,
    w: jax.Array | TF32Pair,
    b: jax.Array | None = None,
    *,
    precision: ProductPrecision = None,
) -> jax.Array:
    """``x @ w (+ b)`` with ``w`` stored [in, out] (a torch Linear [out, in] transposed);
    ``precision`` (static) as ``jnp.einsum``'s, None for the scope's
    (``Precision.scope()``), or ``KernelProduct.TF32X3`` (``pallas_kernels.matmul``'s three TF32
    passes a step; the Pallas interpreter on the CPU), or ``KernelProduct.TF32X3_STEPS``
    (``dense_in_steps``). A ``TF32Pair`` weight is multiplied by
    its pair (``dense_tf32_pair``; ``precision`` does not apply)."""
    if isinstance(w, TF32Pair):
        y = dense_tf32_pair(x, w.pair).astype(x.dtype)
    elif precision is KernelProduct.TF32X3:
        interpret = jax.default_backend() == "cpu"
        y = matmul(x, w, precision="tf32x3", out_dtype=F32, interpret=interpret).astype(x.dtype)
    elif precision is KernelProduct.TF32X3_STEPS:
        y = dense_in_steps(x, w).astype(x.dtype)
    else:
        y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype), precision=precision)
    if b is not None:
        y = y + b.astype(y.dtype)
    return y


# The rows of the contraction a step of ``dense_in_steps`` takes at most (its step is the
# largest common divisor of this and the contraction, so that the weight splits without a copy).
STEP_ROWS = 256


def dense_in_steps(x: jax.Array, w: jax.Array, platform: str | None = None) -> jax.Array:
    """``x @ w`` in fp32 with the contraction in steps: x [..., D], w [D, F] -> [..., F].

    Each step of ``gcd(D, STEP_ROWS)`` rows is one product under XLA's three-pass TF32 preset
    (``TF32_TF32_F32_X3``; full fp32 off a GPU), all steps in one batched dot, and the steps'
    fp32 partials are added by a compensated (Kahan) sum. A multi-pass product keeps its running
    sum in the matrix units, whose adds round, so on a long contraction it gathers more error
    than full fp32 (the codec's products, an H100, 2026-12-06); summed a short step at a time
    there and the steps here, our kernel's version of this arithmetic was more exact than full
    fp32 on every fp32 product of the tick (2026-12-07, ``experiments/fp32_products``). The
    partials cost one write and one read of D / step outputs."""
    on_gpu = (platform or jax.default_backend()) == "gpu"
    algorithm = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if on_gpu else jax.lax.Precision.HIGHEST
    D, F = w.shape
    step = math.gcd(D, STEP_ROWS)
    return dense_steps(x, w.reshape(D // step, step, F), algorithm)


def dense_steps(x: jax.Array, w_steps: jax.Array, precision: ProductPrecision) -> jax.Array:
    """``x @ w`` in fp32 from w laid out in steps of its contraction: x [..., D], w_steps
    [n, s, F] with n * s >= D (rows past D zero) -> [..., F]. Every step's product under
    ``precision`` in one batched dot, the steps' fp32 partials added by ``kahan_sum``: the
    arithmetic of ``dense_in_steps``, and of ``experiments/fp32_products``' ``<algorithm>_c<N>``
    at any step and algorithm."""
    n, s, F = w_steps.shape
    lead, D = x.shape[:-1], x.shape[-1]
    xs = jnp.pad(x.astype(F32).reshape(-1, D), ((0, 0), (0, n * s - D))).reshape(-1, n, s)
    parts = jnp.einsum(
        "mnd,ndf->nmf", xs, w_steps.astype(F32), precision=precision, preferred_element_type=F32
    )
    return kahan_sum(parts).reshape(*lead, F)


def kahan_sum(parts: jax.Array) -> jax.Array:
    """``parts`` [n, ...] summed over its first axis by a compensated (Kahan) sum, in order:
    each add's rounding error is carried into the next. Unrolled (n is a product's step count,
    at most a few dozen), so that XLA fuses the n adds into one pass over the parts."""
    total, carry = parts[0], jnp.zeros_like(parts[0])
    for i in range(1, parts.shape[0]):  # ``carry`` holds what the last add rounded away
        y = parts[i] - carry
        t = total + y
        carry = (t - total) - y
        total = t
    return total


def tf32_pair(w: jax.Array) -> jax.Array:
    """An fp32 weight [..., D, F] as the pair ``[hi | lo]`` [..., D, 2F] that
    ``dense_tf32_pair`` multiplies by: ``hi`` is w rounded to TF32 (10 mantissa bits), ``lo`` the
    rest, rounded to TF32 too, so that ``hi + lo`` is w to about 2^-22 of its size and both halves
    enter a TF32 product exactly. Made once, when the params are laid out for serving."""
    hi = jax.lax.reduce_precision(w.astype(F32), exponent_bits=8, mantissa_bits=10)
    lo = jax.lax.reduce_precision(w.astype(F32) - hi, exponent_bits=8, mantissa_bits=10)
    return jnp.concatenate([hi, lo], axis=-1)


def dense_tf32_pair(x: jax.Array, pair: jax.Array, platform: str | None = None) -> jax.Array:
    """``x @ w`` in fp32 through one TF32 product, from w's ``tf32_pair`` [D, 2F]: x [..., D] ->
    [..., F] in fp32.

    x is split the same way into its TF32 part and rest, stacked on the rows ([2R, D]), and one
    product by ``[hi | lo]`` gives all four partial products (x_hi w_hi, x_hi w_lo, x_lo w_hi,
    x_lo w_lo), summed smallest first. Every input is exact in TF32 and every partial product
    exact in fp32, so on the CPU (full fp32 of the same operands) the error is a full-fp32
    product's plus the 2^-22 of the split. On the GPU the product runs on the tensor cores, and
    there it measured 2.5-6.3e-6 of the largest value against full fp32's 5e-7 to 1.2e-6, at
    0.95-1.51x its speed (an H100, 80 rows, 2026-12-06, ``experiments/fp32_products``): the
    TF32 product's accumulation loses what the split keeps. XLA's ``TF32_TF32_F32_X3`` preset
    splits the weight at every call instead.
    ``platform``: the backend traced for (default JAX's); off a GPU the product is full fp32 of
    the same split operands.
    """
    lead, D = x.shape[:-1], x.shape[-1]
    F = pair.shape[-1] // 2
    x = x.reshape(-1, D).astype(F32)
    x_hi = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)
    x_lo = jax.lax.reduce_precision(x - x_hi, exponent_bits=8, mantissa_bits=10)
    if (platform or jax.default_backend()) == "gpu":
        precision = jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    else:
        precision = jax.lax.Precision.HIGHEST
    rows = x.shape[0]
    p = jnp.dot(
        jnp.concatenate([x_hi, x_lo]), pair, precision=precision, preferred_element_type=F32
    )  # [2R, 2F]: [[hi hi, hi lo], [lo hi, lo lo]]
    y = p[:rows, :F] + ((p[:rows, F:] + p[rows:, :F]) + p[rows:, F:])
    return y.reshape(*lead, F)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, *, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in fp32; ``offset=1.0`` gives Gemma's ``(1 + w)`` scale.

    The result is cast back to ``x.dtype`` (as both the HF Nemotron-H and Gemma-3 norms do).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, computed in fp32."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype)


def normal(key: jax.Array, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    """A random-normal weight, for ``init`` of random test models."""
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def fan_in_normal(key: jax.Array, shape: tuple[int, ...], dtype, fan_in: int) -> jax.Array:
    """A random-normal weight scaled by ``1/sqrt(fan_in)``, so random models keep unit scale."""
    return normal(key, shape, dtype, std=fan_in**-0.5)


def count_params(tree) -> int:
    """Total element count of a parameter pytree (concrete or ``jax.eval_shape`` abstract)."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))


def keep_rows(run: jax.Array, new, old):
    """``new`` where ``run`` [B] is set, ``old`` elsewhere, over a small pytree (slot axis first).

    Only for the small leaves (the encoder's mel tail and position, RNNT, codec, tokens): each
    select reads both and writes one leaf-sized array. The caches (the encoder's, the LLM's, the
    speech decoder's) mask their own updates instead.
    """

    def sel(n, o):
        return jnp.where(run.reshape(run.shape + (1,) * (o.ndim - 1)), n, o)

    return jax.tree_util.tree_map(sel, new, old)


def per_layer(params, fields: Sequence[str], fused: Mapping[str, Sequence[str]] | None = None):
    """``params`` (a dataclass of weights stacked on a leading L axis) in the serving layout of
    the weights a decode step streams: each of ``fields`` as a tuple of its L layers, and each
    ``fused`` field (``{"qkv": ("q", "k", "v")}``) set to L products that share their input, the
    stacked fields side by side on their last axis (L x [D, sum F_i]), those fields set to None.

    A layer loop reads ``params.field[j]`` (static j) the same way in either layout, and the
    split fields give the same bits. What differs is the GPU: a static slice of a stacked
    parameter is copied out before each product, ~21.7 ms of every faithful 11B tick on an H200
    (2026-12-04, ``experiments/tick_profile``), while a per-layer leaf is read where it lies. A
    fused product is one launch where there were several, with more column tiles for the few
    rows (two per session) a beat has; on the CPU its columns equal the separate products' bit
    for bit. Fields already in the layout are kept as they are.
    """
    split = {f: _layers(getattr(params, f)) for f in fields}
    for name, sources in (fused or {}).items():
        if getattr(params, name) is None:
            split |= {name: _layers(*(getattr(params, f) for f in sources))}
            split |= {f: None for f in sources}
    return params.replace(**split)


def per_layer_specs(specs, fields: Sequence[str], n_layers: int):
    """The ``PartitionSpec`` tree of ``per_layer(params, fields)`` from that of ``params``: each
    split field's spec without its leading (layer) entry, once per layer."""
    return specs.replace(**{f: (P(*getattr(specs, f)[1:]),) * n_layers for f in fields})


def tf32_pairs(params, fields: Sequence[str]):
    """``params`` with each of ``fields`` (a tuple of per-layer [D, F] weights, ``per_layer``'s
    layout) as a tuple of ``TF32Pair``; fields already paired, or None, are kept."""
    out = {}
    for f in fields:
        ws = getattr(params, f)
        if ws is not None and not isinstance(ws[0], TF32Pair):
            out[f] = tuple(TF32Pair(pair=p) for p in _pairs_program(*ws))
    return params.replace(**out)


@jax.jit
def _pairs_program(*ws: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(tf32_pair(w) for w in ws)


def _layers(*stacked):
    """The L layers of ``stacked`` side by side (one array: its layers); a tuple is kept."""
    if isinstance(stacked[0], tuple):
        return stacked[0]
    return _layers_program(*stacked)  # one small program per shape, not one per layer index


@jax.jit
def _layers_program(*stacked: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(
        jnp.concatenate([w[i] for w in stacked], axis=-1) for i in range(stacked[0].shape[0])
    )
