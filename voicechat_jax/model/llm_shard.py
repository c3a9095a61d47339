"""Tensor parallelism of the LLM: what one device of a ``model`` axis runs.

Megatron-style tensor parallelism over a mesh axis of m devices (``voicechat_jax.mesh`` runs the
tick in ``shard_map`` over it). Device r of the axis holds, of every layer:

- Mamba-2 (``NemotronHMamba2Mixer``): heads [r N/m, (r+1) N/m): their columns of ``in_proj``'s
  z, x and dt parts, their x channels of ``conv1d``, their ``A_log``, ``D``, ``dt_bias`` and
  gated-norm weights, their rows of ``out_proj``; and the B/C groups those heads read: groups
  [r K/m, (r+1) K/m) when m divides K, else (K divides m) the one group its heads belong to,
  held by each of the m/K devices that share it. The gated norm of a group split over devices
  sums its squares over them (one all-reduce per layer, only in that case).
- Attention (``NemotronHAttention``): query heads [r N/m, (r+1) N/m) (columns of q, rows of
  o) and the KV heads they read (columns of k and v), split like the B/C groups.
- MLP (``NemotronHMLP``): columns [r F/m, (r+1) F/m) of up, the same rows of down.
- replicated: the embedding, the block norms, ``norm_f``, ``lm_head``, ``function_head``.

Each row-parallel product (``out_proj``, ``o``, ``down``) gives a partial sum that is added over
the axis (``psum``, in fp32) before the residual add, so every device carries the whole residual
stream and computes the same logits. The decode state follows the heads: the SSM state [B, N, H,
P] and the KV caches [B, K, S, H] split on their head axis, the conv state on its channels.

The columns a device holds are not one contiguous block of the stored layout (``in_proj`` is
[z | x | B | C | dt]; a replicated group or KV head appears on several devices), so the sharded
leaves are first rearranged into the *tensor-parallel layout* (``to_tensor_parallel``): m
consecutive blocks, block r what device r holds, in the order of the one-device layout of a
model with N/m heads (an identity for m = 1, and for every leaf but ``in_proj``, the conv weights
and conv state when m divides the group and KV head counts). A ``PartitionSpec`` over the axis
then gives each device its block, and the device runs the unchanged layer code with the local
sizes of ``shard_config``.

This module holds the config one device runs (``LLMShard``, ``shard_config``) and the
collectives the layer code adds (``all_reduce``, ``group_mean_sq``); the layouts are
``nano_tp``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from voicechat_jax.config import LLMConfig

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LLMShard(LLMConfig):
    """What one device of a tensor-parallel model axis runs: the LLM with local head counts.

    The inherited sizes are the local ones (``n_heads / m``, ``mamba_heads / m``, ``mlp_dim / m``,
    and ``n_kv_heads`` and ``n_groups`` divided by m or 1 when replicated); the layer code reads
    them as a smaller model's and, seeing this class, adds each row-parallel product's partial sums
    over ``model_axis``. Built by ``shard_config`` only.
    """

    model_axis: str = "model"  # the shard_map axis name the partial sums are psummed over
    model_parallel: int = 1  # m: devices on that axis
    norm_ranks: int = 1  # devices sharing one Mamba group (m / n_groups when m > n_groups)


def _local_count(count: int, m: int, what: str) -> int:
    """``count / m``, or 1 when ``m`` is a multiple of ``count`` (each one replicated)."""
    if count % m == 0:
        return count // m
    if m % count == 0:
        return 1
    raise ValueError(f"model_parallel={m} and the LLM's {what}={count}: neither divides the other")


def shard_config(cfg: LLMConfig, model_parallel: int, axis: str = "model") -> LLMConfig:
    """The config one device of a ``model_parallel``-way model axis runs (``cfg`` itself for 1).

    Raises:
      ValueError: (one line, naming the dimension) a head count, the MLP width or the group
        count that the axis cannot split: query heads, Mamba heads and ``mlp_dim`` must divide by
        m; KV heads and Mamba groups must divide by m or divide m (then each is replicated).
    """
    m = model_parallel
    if m < 1:
        raise ValueError(f"model_parallel must be >= 1, got {m}")
    if m == 1:
        return cfg
    for what, count in (
        ("n_heads", cfg.n_heads),
        ("mamba_heads", cfg.mamba_heads),
        ("mlp_dim", cfg.mlp_dim),
    ):
        if count % m:
            raise ValueError(f"model_parallel={m} does not divide the LLM's {what}={count}")
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(LLMConfig)}
    base.update(
        n_heads=cfg.n_heads // m,
        n_kv_heads=_local_count(cfg.n_kv_heads, m, "n_kv_heads"),
        mlp_dim=cfg.mlp_dim // m,
        mamba_heads=cfg.mamba_heads // m,
        n_groups=_local_count(cfg.n_groups, m, "n_groups"),
    )
    norm_ranks = m // cfg.n_groups if m > cfg.n_groups else 1
    return LLMShard(**base, model_axis=axis, model_parallel=m, norm_ranks=norm_ranks)


def all_reduce(partial: jax.Array, cfg: LLMConfig | None) -> jax.Array:
    """A row-parallel product's partial sums added over the model axis (identity off it).

    The shares (each rounded to the activation dtype by its own product, as one device's whole
    product is) are added in fp32 and the sum rounded once more: under a bf16 policy the
    all-reduce adds no bf16 rounding per device.
    """
    if not isinstance(cfg, LLMShard):
        return partial
    return jax.lax.psum(partial.astype(F32), cfg.model_axis).astype(partial.dtype)


def group_mean_sq(g: jax.Array, cfg: LLMShard) -> jax.Array:
    """Mean square of a gated-norm group split over ``norm_ranks`` devices: g [..., 1, c] local.

    Each device puts its sum of squares in its own entry of an [..., m] vector; one psum gives
    every device all m, of which it adds those of its group's devices.
    """
    m, r = cfg.model_parallel, cfg.norm_ranks
    me = jax.lax.axis_index(cfg.model_axis)
    own = jnp.sum(g * g, axis=-1, keepdims=True)  # [..., 1, 1]
    every = jax.lax.psum(own * jax.nn.one_hot(me, m, dtype=F32), cfg.model_axis)  # [..., 1, m]
    mine = (jnp.arange(m) // r) == (me // r)
    return jnp.sum(jnp.where(mine, every, 0.0), axis=-1, keepdims=True) / (g.shape[-1] * r)
