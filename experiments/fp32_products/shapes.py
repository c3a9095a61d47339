"""The faithful tick's fp32 products of one frame, by shape (``run.py`` times them; no flags here,
so that tests can import it)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.matmul import MatmulBlocks, default_blocks, default_split
from voicechat_jax import config as config_lib
from voicechat_jax.model import codec as codec_lib
from voicechat_jax.model import ear_tts


def shapes(cfg: config_lib.ModelConfig) -> list[tuple[str, int, int, int, int]]:
    """(name, rows per slot, D, F, products per frame) of each fp32 product of a frame, in the
    serving layout (``voicechat.serving_layout``: q|k|v and gate|up fused). The speech decoder
    and MoG trunk count cond and uncond rows (2 a slot); the codec decoder's rows grow by each
    stage's rate (``codec._decoder_trunk``: one code frame, then 9, 63 and 441 rows at the
    release's rates), and its ConvNeXt blocks' products are C -> 4C -> C."""
    t, e = cfg.tts, cfg.encoder
    q, kv = t.n_heads * t.head_dim, t.n_kv_heads * t.head_dim
    mog_rounds = len(ear_tts.schedule(t))  # the MoG head's rounds a frame (5 at the release's)
    rows = [
        ("tts_qkv", 2, t.d_model, q + 2 * kv, t.n_layers),
        ("tts_o", 2, q, t.d_model, t.n_layers),
        ("tts_gate_up", 2, t.d_model, 2 * t.mlp_dim, t.n_layers),
        ("tts_down", 2, t.mlp_dim, t.d_model, t.n_layers),
        ("mog_gate_up", 2, t.d_model, 2 * t.mlp_dim, t.mog_mlp_layers * mog_rounds),
        ("mog_down", 2, t.mlp_dim, t.d_model, t.mog_mlp_layers * mog_rounds),
        ("enc_ff_up", 1, e.d_model, e.ff_dim, 2 * e.n_layers),
        ("enc_ff_down", 1, e.ff_dim, e.d_model, 2 * e.n_layers),
    ]
    c, n = cfg.codec, 1
    for s, (c_in, C, r) in enumerate(codec_lib._decoder_dims(c), start=1):
        rows.append((f"codec_up{s}", n, c_in, r * C, 1))
        n *= r
        rows.append((f"codec_pw1_{s}", n, C, 4 * C, c.num_blocks))
        rows.append((f"codec_pw2_{s}", n, 4 * C, C, c.num_blocks))
    return rows


def selected(all_shapes, names) -> list:
    """The shapes named in ``names`` (a full name or a prefix such as ``codec``)."""
    return [row for row in all_shapes if any(row[0] == k or row[0].startswith(k) for k in names)]


def kernel_blocks(
    R: int, D: int, F: int, dtype, *, precision: str, block_d=None, block_r=None
) -> MatmulBlocks:
    """``pallas_kernels.matmul``'s tiling of an [R, D] x [D, F] product under ``precision``: its
    default, with the D step ``block_d`` and the row block ``block_r`` where given (and the D
    split chosen again for them). What ``run.py`` times and ``ptx_check.py`` compiles."""
    blocks = default_blocks(R, D, F, dtype, fma=precision == "float32")
    if block_d is None and block_r is None:
        return blocks
    blocks = dataclasses.replace(
        blocks, block_d=block_d or blocks.block_d, block_r=block_r, split_d=None
    )
    split = default_split(R, D, F, jnp.dtype(dtype).itemsize, blocks)
    return dataclasses.replace(blocks, split_d=split)
