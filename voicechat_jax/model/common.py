"""Small numeric building blocks shared by the sub-networks (norms, dense layers, init helpers)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w (+ b)`` with ``w`` stored [in, out] (a torch Linear [out, in] transposed)."""
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
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


def per_layer(params, fields: Sequence[str]):
    """``params`` (a dataclass of weights stacked on a leading L axis) with each of ``fields`` as a
    tuple of its L layers: the serving layout of the weights a decode step streams.

    A layer loop reads ``params.field[j]`` (static j) the same way in either layout, and the
    results are the same bit for bit. What differs is the GPU: a static slice of a stacked
    parameter is copied out before each product, ~21.7 ms of every faithful 11B tick on an H200
    (2026-12-04, ``experiments/tick_profile``), while a per-layer leaf is read where it lies.
    Fields already split are kept as they are.
    """
    return params.replace(**{f: _unstack(getattr(params, f)) for f in fields})


def per_layer_specs(specs, fields: Sequence[str], n_layers: int):
    """The ``PartitionSpec`` tree of ``per_layer(params, fields)`` from that of ``params``: each
    split field's spec without its leading (layer) entry, once per layer."""
    return specs.replace(**{f: (P(*getattr(specs, f)[1:]),) * n_layers for f in fields})


def fused_per_layer(*stacked) -> tuple[jax.Array, ...]:
    """Products that share their input, as one per layer: stacked weights [L, D, F_i] side by
    side on their last axis, L x [D, sum F_i] (the serving layout's ``qkv`` and ``gate_up``).

    One product with all the columns is one launch where there were several, and more column
    tiles for the few rows (two per session) a beat has. On the CPU its columns equal the
    separate products' bit for bit.
    """
    return _fuse_program(*stacked)


@jax.jit
def _fuse_program(*stacked: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(
        jnp.concatenate([w[i] for w in stacked], axis=-1) for i in range(stacked[0].shape[0])
    )


def _unstack(x):
    if isinstance(x, tuple):
        return x
    if isinstance(x, jax.Array):
        return _unstack_program(x)  # one small program per shape, not one per layer index
    return tuple(x[i] for i in range(x.shape[0]))


@jax.jit
def _unstack_program(x: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(x[i] for i in range(x.shape[0]))
