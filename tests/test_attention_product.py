"""``pallas_kernels.attention_product``: one launch computes the G = 1 attention and an fp32
product exactly as the two kernels alone do, in either order of its programs, and close to the
jnp reference (Pallas interpreter); shapes off the product's tiles are refused; at the 11B shapes
it lowers to one Triton call; and the speech decoder's step carries products in its attention
launches (``model.beside``) without changing a bit of its own outputs."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_product as ap
from pallas_kernels.mha_decode_attention import MHABlocks, mha_decode_attention
from voicechat_jax.config import tiny, voicechat_11b
from voicechat_jax.model import beside, gemma
from voicechat_jax.precision import Precision

F32, BF16 = jnp.float32, jnp.bfloat16
PRODUCT = ap.ProductBlocks(block_m=16, block_f=16, block_k=16)
SCALE = 0.3


def operands(kv_dtype, M: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    Bsz, K, S, H = 3, 2, 40, 12
    q = jnp.asarray(rng.standard_normal((Bsz, K, 1, H)), F32)
    k = jnp.asarray(rng.standard_normal((Bsz, K, S, H)), kv_dtype)
    v = jnp.asarray(rng.standard_normal((Bsz, K, S, H)), kv_dtype)
    lengths = jnp.asarray([0, 17, S], jnp.int32)  # nothing seen, part of a block, every row
    x = jnp.asarray(rng.standard_normal((M, 48)), F32)  # 3 contraction steps
    w = jnp.asarray(rng.standard_normal((48, 32)), F32)  # 2 column tiles
    return q, k, v, lengths, x, w


@pytest.mark.parametrize(
    ("order", "kv_dtype", "window", "min_programs", "M"),
    [
        ("interleaved", F32, None, 1, 32),  # one split: the program writes the output itself
        ("blocked", F32, 5, 64, 32),  # several splits and a window: the combine after the launch
        ("interleaved", BF16, None, 64, 37),  # a bf16 cache; rows past M masked in the last tile
    ],
)
def test_one_launch_equals_the_two_kernels(order, kv_dtype, window, min_programs, M):
    q, k, v, lengths, x, w = operands(kv_dtype, M)
    blocks = MHABlocks(block_s=8, piece=4, min_programs=min_programs)
    attn, y = ap.attention_and_product(
        q, k, v, lengths, x, w, window=window, scale=SCALE, blocks=blocks, product=PRODUCT,
        order=order, interpret=True,
    )  # fmt: skip
    alone = mha_decode_attention(
        q, k, v, lengths, window=window, scale=SCALE, blocks=blocks, interpret=True
    )
    chex.assert_trees_all_equal(
        (attn, y), (alone, ap.fp32_product(x, w, product=PRODUCT, interpret=True))
    )
    ref_attn, ref_y = ap.reference(q, k, v, lengths, x, w, window=window, scale=SCALE)
    np.testing.assert_array_equal(np.asarray(attn[0]), 0.0)  # a row that sees nothing
    np.testing.assert_allclose(attn, ref_attn, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "dtype", "message"),
    [
        ((32, 40), (40, 32), F32, "C=40 must be a multiple of block_k"),
        ((32, 48), (48, 24), F32, "F=24 must be a multiple of block_f"),
        ((32, 48), (32, 32), F32, "disagree"),
        ((32, 48), (48, 32), BF16, "fp32 operands"),
    ],
)
def test_products_off_the_tiles_are_refused(x_shape, w_shape, dtype, message):
    q, k, v, lengths, _, _ = operands(F32, 32)
    x, w = jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype)
    with pytest.raises(ValueError, match=message):
        ap.attention_and_product(q, k, v, lengths, x, w, scale=SCALE, product=PRODUCT)
    with pytest.raises(ValueError, match="order must be one of"):
        ap.attention_and_product(q, k, v, lengths, *operands(F32, 32)[4:], scale=SCALE,
                                 product=PRODUCT, order="random")  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        ap.ProductBlocks(block_m=48)


def test_gpu_lowering_is_one_triton_call():
    """At 96 sessions (192 speech-decoder rows, the fp32 cache at the two-minute cap) beside the
    codec's last-stage ConvNeXt product of one frame: one Triton call. Lowering only."""
    tts = voicechat_11b().tts
    Bsz, K, H, S = 192, tts.n_kv_heads, tts.head_dim, 1537
    args = (
        jax.ShapeDtypeStruct((Bsz, K, 1, H), F32),
        jax.ShapeDtypeStruct((Bsz, K, S, H), F32),
        jax.ShapeDtypeStruct((Bsz, K, S, H), F32),
        jax.ShapeDtypeStruct((Bsz,), jnp.int32),
        jax.ShapeDtypeStruct((96 * 441, 384), F32),
        jax.ShapeDtypeStruct((384, 1536), F32),
    )
    fn = functools.partial(ap.attention_and_product, scale=0.0625)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1


def test_speech_decoder_step_carries_products_in_its_attention_launches():
    """One T = 1 step of the tiny speech decoder (4 layers) with 'pallas_mha' attention and a
    ``model.beside.Beside`` of three products: the three ride in the first three layers'
    launches, a fourth that does not tile runs by XLA, and the step's cache and hidden states are
    those of the step alone, bit for bit; each product equals the product role's alone."""
    cfg = tiny().tts
    params = gemma.init(jax.random.key(0), cfg, Precision.fp32())
    B, S = 4, 20
    rng = np.random.default_rng(6)
    shape = (B, cfg.n_kv_heads, S, cfg.head_dim)
    kv = [jnp.asarray(rng.standard_normal(shape), F32) for _ in range(2 * cfg.n_layers)]
    pos = jnp.asarray([0, 3, 9, 12], jnp.int32)  # the window is 8: rows before and past it
    cache = gemma.GemmaCache(k=tuple(kv[: cfg.n_layers]), v=tuple(kv[cfg.n_layers :]), pos=pos)
    x = jnp.asarray(rng.standard_normal((B, 1, cfg.d_model)), F32)
    shapes = [(70, 32, 48), (20, 48, 16), (16, 16, 64), (8, 8, 24)]  # M, C, F; the last: no tile
    xs = [jnp.asarray(rng.standard_normal((m, c)), F32) for m, c, _ in shapes]
    ws = [jnp.asarray(rng.standard_normal((c, f)), F32) for _, c, f in shapes]

    def products():
        ys = []
        for a, w in zip(xs, ws, strict=True):
            ys.append((yield a, w))
        return ys

    fused = []

    @jax.jit
    def step(params, cache, x):
        carry = beside.Beside(products())
        out = gemma.forward(params, cache, x, cfg=cfg, attention="pallas_mha", beside=carry)
        ys = carry.finish()
        fused.append(carry.fused)  # counted while tracing
        return out, ys

    (new, h), ys = step(params, cache, x)
    assert fused == [3]
    alone = jax.jit(functools.partial(gemma.forward, cfg=cfg, attention="pallas_mha"))
    chex.assert_trees_all_equal((new, h), alone(params, cache, x))
    for a, w, y in zip(xs[:3], ws[:3], ys[:3], strict=True):
        blocks = beside.product_blocks(*w.shape)
        chex.assert_trees_all_equal(y, ap.fp32_product(a, w, product=blocks, interpret=True))
    np.testing.assert_allclose(ys[3], beside.xla_product(xs[3], ws[3]), rtol=1e-5, atol=1e-5)
