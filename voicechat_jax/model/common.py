"""Small numeric building blocks shared by the sub-networks (norms, dense layers, init helpers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from voicechat_jax.precision import ProductPrecision


def dense(
    x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, precision: ProductPrecision = None
) -> jax.Array:
    """``x @ w (+ b)`` with ``w`` stored [in, out] (a torch Linear [out, in] transposed);
    ``precision`` (static) as ``jnp.einsum``'s, None for the scope's
    (``Precision.scope()``)."""
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype), precision=precision)
    if b is not None:
        y = y + b.astype(y.dtype)
    return y


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
