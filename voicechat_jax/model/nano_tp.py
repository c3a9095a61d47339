"""The LLM's tensor-parallel layout (``llm_shard``'s docstring says what each device holds): the
params and decode state rearranged into m consecutive blocks, block r what device r holds
(``to_tensor_parallel``, ``state_to_tensor_parallel`` and back), and the ``PartitionSpec``s that
give each device its block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from voicechat_jax.config import LLMConfig
from voicechat_jax.model.llm_shard import shard_config
from voicechat_jax.model.nano import AttnParams, MambaParams, MLPParams, NanoParams, NanoState


def _owned(count: int, m: int, r: int) -> np.ndarray:
    """Which of ``count`` heads (or groups) device ``r`` of ``m`` holds (see ``_local_count``)."""
    if count % m == 0:
        n = count // m
        return np.arange(r * n, (r + 1) * n)
    return np.asarray([r // (m // count)])


def _rows(heads: np.ndarray, width: int, offset: int = 0) -> np.ndarray:
    """Channel indices of ``heads``, each a run of ``width`` channels, after ``offset``."""
    return offset + (heads[:, None] * width + np.arange(width)).reshape(-1)


def tensor_parallel_index(cfg: LLMConfig, m: int) -> dict[str, np.ndarray]:
    """For each rearranged axis, which one-device index each tensor-parallel position holds.

    ``'in_proj'`` (in_proj's columns), ``'conv'`` (the conv channels: ``conv_w``, ``conv_b``, conv
    state) and ``'kv'`` (k, v columns; KV caches' heads): m blocks, block r device r's share in
    its local one-device order (z | x | B | C | dt; x | B | C; KV heads).
    """
    shard_config(cfg, m)  # the sizes must split
    NH, H, P_, K = cfg.d_inner, cfg.mamba_head_dim, cfg.ssm_state, cfg.n_groups
    in_proj, conv, kv = [], [], []
    for r in range(m):
        heads, groups = _owned(cfg.mamba_heads, m, r), _owned(K, m, r)
        z = _rows(heads, H)
        b, c = _rows(groups, P_, NH), _rows(groups, P_, NH + K * P_)
        conv.append(np.concatenate([z, b, c]))
        in_proj.append(np.concatenate([z, NH + z, NH + b, NH + c, 2 * NH + 2 * K * P_ + heads]))
        kv.append(_owned(cfg.n_kv_heads, m, r))
    return {"in_proj": np.concatenate(in_proj), "conv": np.concatenate(conv), "kv": np.stack(kv)}


def _kv_columns(kv_heads: np.ndarray, head_dim: int) -> np.ndarray:
    return np.concatenate([_rows(row, head_dim) for row in kv_heads])


def to_tensor_parallel(params: NanoParams, cfg: LLMConfig, m: int) -> NanoParams:
    """The params in the tensor-parallel layout of an ``m``-way model axis (same for m = 1), in
    either the stored or the serving layout (``voicechat.serving_layout``).

    Only ``in_proj``, ``conv_w``, ``conv_b``, ``k`` and ``v`` are rearranged (and grow where a
    group or KV head is replicated); every other leaf's share is already a contiguous block.
    """
    if m == 1:
        return params
    idx = tensor_parallel_index(cfg, m)
    kv = _kv_columns(idx["kv"], cfg.head_dim)

    def take(w, columns):  # the last axis, one array or one per layer (the serving layout)
        return jax.tree_util.tree_map(lambda x: jnp.take(x, columns, axis=-1), w)

    mamba = params.mamba.replace(
        in_proj=take(params.mamba.in_proj, idx["in_proj"]),
        conv_w=take(params.mamba.conv_w, idx["conv"]),
        conv_b=take(params.mamba.conv_b, idx["conv"]),
    )
    attn = params.attn.replace(k=take(params.attn.k, kv), v=take(params.attn.v, kv))
    return params.replace(mamba=mamba, attn=attn)


def state_to_tensor_parallel(state: NanoState, cfg: LLMConfig, m: int) -> NanoState:
    """The decode state in the tensor-parallel layout (conv channels, KV heads rearranged)."""
    if m == 1:
        return state
    idx = tensor_parallel_index(cfg, m)
    kv = idx["kv"].reshape(-1)
    return state.replace(
        conv=tuple(jnp.take(x, idx["conv"], axis=2) for x in state.conv),
        k=tuple(jnp.take(x, kv, axis=1) for x in state.k),
        v=tuple(jnp.take(x, kv, axis=1) for x in state.v),
    )


def state_from_tensor_parallel(state: NanoState, cfg: LLMConfig, m: int) -> NanoState:
    """``state_to_tensor_parallel`` undone: each channel and KV head from its first holder."""
    if m == 1:
        return state
    idx = tensor_parallel_index(cfg, m)

    def first(index: np.ndarray, n: int) -> np.ndarray:
        _, pos = np.unique(index, return_index=True)
        assert len(pos) == n, "every one-device index has a holder"
        return pos

    conv = first(idx["conv"], cfg.conv_dim)
    kv = first(idx["kv"].reshape(-1), cfg.n_kv_heads)
    return state.replace(
        conv=tuple(jnp.take(x, conv, axis=2) for x in state.conv),
        k=tuple(jnp.take(x, kv, axis=1) for x in state.k),
        v=tuple(jnp.take(x, kv, axis=1) for x in state.v),
    )


def partition_specs(axis: str = "model") -> NanoParams:
    """How the tensor-parallel params split over ``axis``: a ``NanoParams`` of ``PartitionSpec``.

    Named after the HF / NeMo modules they mirror: column-parallel ``in_proj``, ``conv1d``,
    ``A_log``, ``D``, ``dt_bias``, gated ``norm`` and q / k / v / ``up`` (split on their output
    axis), row-parallel ``out_proj``, ``o_proj``, ``down_proj`` (split on their input axis);
    embeddings, norms and heads replicated (``P()``).
    """
    column, row, per_head, rep = P(None, None, axis), P(None, axis, None), P(None, axis), P()
    return NanoParams(
        embed=rep,
        lm_head=rep,
        function_head=rep,
        norm_f=rep,
        mamba=MambaParams(
            norm=rep,
            in_proj=column,
            conv_w=column,
            conv_b=per_head,
            A_log=per_head,
            D=per_head,
            dt_bias=per_head,
            gate_norm=per_head,
            out_proj=row,
        ),
        mlp=MLPParams(norm=rep, up=column, down=row),
        attn=AttnParams(norm=rep, q=column, k=column, v=column, o=row),
    )


def state_partition_specs(cfg: LLMConfig, axis: str = "model", batch=None) -> NanoState:
    """How the tensor-parallel decode state splits: heads (SSM, KV) and conv channels over
    ``axis``; the slot axis over ``batch`` (a mesh axis name, or None for a template)."""
    heads = P(batch, axis)
    return NanoState(
        ssm=tuple(heads for _ in cfg.layers_of("M")),
        conv=tuple(P(batch, None, axis) for _ in cfg.layers_of("M")),
        k=tuple(heads for _ in cfg.layers_of("*")),
        v=tuple(heads for _ in cfg.layers_of("*")),
        length=P(batch),
    )
