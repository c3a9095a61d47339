"""The weight-streaming matmul kernel (``pallas_kernels.matmul``) against its jnp reference.

Interpret mode on the CPU: a sweep of row counts (1 to past one 128-row block), sizes that are not
multiples of the tiles, D splits, stacked weights and dtypes; the precision rule; the refusals;
the GPU lowering at the 11B shapes (one Triton call reading the stacked weight in place); and the
model's switch (``model.projection``, ``nano.step``, the tick through ``ServeConfig``). Errors are
relative: max|a - b| / max|b|.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import MatmulBlocks, default_blocks, matmul, matmul_reference
from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ServeConfig, tiny, voicechat_11b
from voicechat_jax.model import nano, projection, voicechat
from voicechat_jax.model.common import dense
from voicechat_jax.precision import Precision

# fp32 results: the kernel and the reference differ only in fp32 summation order.
TOL_F32 = 2e-6
# Results rounded to bf16: the two fp32 sums can round to neighbouring bf16 values (2^-8).
TOL_BF16 = 2**-7
LLM_TOL = 1e-5  # nano.step, projection 'pallas' vs 'xla', fp32, over a few frames
KERNEL = jax.jit(matmul, static_argnames=("layer", "out_dtype", "precision", "interpret", "blocks"))
REFERENCE = jax.jit(matmul_reference, static_argnames=("layer", "out_dtype"))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def operands(R, D, F, *, L=None, x_dtype=jnp.float32, w_dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, D)), x_dtype)
    w = jnp.asarray(rng.standard_normal(((L,) if L else ()) + (D, F)) * D**-0.5, w_dtype)
    return x, w


BF, F32 = jnp.bfloat16, jnp.float32
# (R, D, F, x dtype, w dtype, blocks (block_f, block_d, split_d) or None, stacked L or None)
CASES = [
    (1, 64, 128, BF, BF, None, None),  # the default tiling; R = 1 in a 16-row block
    (1, 100, 70, F32, F32, (32, 16, 3), None),  # D and F off the tiles, three D splits
    (16, 96, 64, BF, BF, (16, 32, 2), 3),  # stacked weight, last layer, two splits
    (17, 96, 40, F32, BF, (16, 32, 4), 2),  # fp32 rows, bf16 weight (upcast to fp32)
    (56, 80, 48, BF, F32, (16, 16, 1), None),  # bf16 rows, fp32 weight rounded to bf16
    (112, 64, 32, BF, BF, (32, 16, 5), None),  # more splits asked than D has chunks
    (130, 48, 33, F32, F32, (16, 16, None), None),  # two row blocks (128 + 2)
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: "R{}_D{}_F{}_{}x{}_b{}_L{}".format(
        *c[:3], *(jnp.dtype(d).name for d in c[3:5]), c[5], c[6]
    ),
)
def test_kernel_equals_reference(case):
    R, D, F, xd, wd, b, L = case
    blocks = None if b is None else MatmulBlocks(block_f=b[0], block_d=b[1], split_d=b[2])
    layer = None if L is None else L - 1
    x, w = operands(R, D, F, L=L, x_dtype=xd, w_dtype=wd)
    got32 = KERNEL(x, w, layer=layer, out_dtype=F32, interpret=True, blocks=blocks)
    want32 = REFERENCE(x, w, layer=layer, out_dtype=F32)
    assert got32.shape == (R, F)
    assert got32.dtype == F32
    assert rel_err(got32, want32) < TOL_F32
    got = KERNEL(x, w, layer=layer, interpret=True, blocks=blocks)  # x's dtype, as dense
    assert got.dtype == xd
    want = REFERENCE(x, w, layer=layer)
    assert rel_err(got, want) < (TOL_BF16 if xd == BF else TOL_F32)


@pytest.mark.parametrize("precision", ["float32", "tf32x3"])
def test_row_blocks_of_a_given_height(precision):
    """``block_r`` splits the rows over more programs (70 rows: five blocks of 16, the last
    padded, instead of one of 128); each row's product is the reference's, whatever block it
    falls in."""
    x, w = operands(70, 48, 40)
    blocks = MatmulBlocks(block_f=16, block_d=16, split_d=2, block_r=16)
    got = KERNEL(x, w, out_dtype=F32, precision=precision, interpret=True, blocks=blocks)
    assert got.shape == (70, 40)
    assert rel_err(got, REFERENCE(x, w, out_dtype=F32)) < TOL_F32
    one_block = dataclasses.replace(blocks, block_r=None)
    base = KERNEL(x, w, out_dtype=F32, precision=precision, interpret=True, blocks=one_block)
    assert rel_err(got, base) < TOL_F32


def test_leading_axes_and_zero_rows():
    x, w = operands(6, 32, 48)
    got = KERNEL(x.reshape(2, 3, 32), w, interpret=True)
    assert got.shape == (2, 3, 48)
    np.testing.assert_array_equal(got.reshape(6, 48), KERNEL(x, w, interpret=True))
    empty = matmul(x[:0], w, interpret=True)
    assert empty.shape == (0, 48)


def test_stacked_layers_pick_their_own_weight():
    """Each static layer index reads its own [D, F] block of the stacked weight."""
    x, w = operands(4, 32, 48, L=3)
    for j in range(3):
        got = KERNEL(x, w, layer=j, out_dtype=F32, interpret=True)
        assert rel_err(got, REFERENCE(x, w[j], out_dtype=F32)) < TOL_F32


def test_precision_follows_the_matmul_scope():
    """fp32 products: 'float32' is Triton's IEEE path (HIGHEST), 'tensorfloat32' TF32 (HIGH); the
    default follows ``jax_default_matmul_precision`` as ``Precision.scope()`` sets it; bf16
    operands take the matrix units' native product whatever is asked."""
    x, w = operands(2, 32, 32)

    def kernel_jaxpr(x, w, **kw):
        return str(jax.make_jaxpr(functools.partial(matmul, interpret=True, **kw))(x, w))

    assert "Precision.HIGHEST" in kernel_jaxpr(x, w, precision="float32")
    assert "Precision.HIGH," in kernel_jaxpr(x, w, precision="tensorfloat32")
    with Precision.reference().scope():
        assert "Precision.HIGHEST" in kernel_jaxpr(x, w)
    with Precision.tf32().scope():
        assert "Precision.HIGH," in kernel_jaxpr(x, w)
    text = kernel_jaxpr(x.astype(BF), w.astype(BF), precision="float32")
    assert "Precision.HIGH" not in text


def test_tf32x3_sums_its_tiles_with_compensation():
    """'tf32x3': each D step's product (three TF32 passes on a GPU, full fp32 on the CPU) starts
    from zero and joins the running sum by a compensated add. With one large early tile and many
    small later ones, a plain fp32 running sum loses the small tiles' low bits and the compensated
    one keeps them: against float64 its error is a small fraction of the plain kernel's. On the
    GPU the lowering asks Triton for its tf32x3 dot."""
    R, D, F = 8, 4096, 32
    x, w = operands(R, D, F)
    x = x.at[:, :16].multiply(4096.0)  # the first 16-row step's products dwarf the rest's
    blocks = MatmulBlocks(block_f=32, block_d=16, split_d=1)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)

    def err(y):
        return float(np.abs(np.asarray(y, np.float64) - exact).max() / np.abs(exact).max())

    plain = KERNEL(x, w, precision="float32", interpret=True, blocks=blocks)
    compensated = KERNEL(x, w, precision="tf32x3", interpret=True, blocks=blocks)
    assert rel_err(compensated, REFERENCE(x, w)) < TOL_F32
    assert err(compensated) < err(plain) / 4, (err(compensated), err(plain))
    from experiments.ptx import triton_module

    f32 = jax.ShapeDtypeStruct
    module = triton_module(
        functools.partial(matmul, precision="tf32x3"), f32((192, 1024), F32), f32((1024, 3072), F32)
    )
    assert module.count("inputPrecision = tf32x3") == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer": 0}, "w must be \\[L, D, F\\] with layer"),
        ({"precision": "bf16"}, "precision must be one of"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    x, w = operands(2, 32, 48)
    with pytest.raises(ValueError, match=message):
        matmul(x, w, interpret=True, **kwargs)


def test_bad_shapes_and_blocks_are_refused():
    x, w = operands(2, 32, 48, L=2)
    with pytest.raises(ValueError, match="layer must be a static int"):
        matmul(x, w, layer=2, interpret=True)
    with pytest.raises(ValueError, match="without layer"):
        matmul(x, w, interpret=True)
    with pytest.raises(ValueError, match="x must be"):
        matmul(x[:, :16], w, layer=0, interpret=True)
    with pytest.raises(ValueError, match="block_f must be a power of two >= 16"):
        MatmulBlocks(block_f=48)
    with pytest.raises(ValueError, match="block_d must be a power of two >= 16"):
        MatmulBlocks(block_d=8)
    with pytest.raises(ValueError, match="split_d must be"):
        MatmulBlocks(split_d=0)
    with pytest.raises(ValueError, match="block_r must be a power of two >= 16"):
        MatmulBlocks(block_r=48)


def test_default_tiling_fills_the_gpu():
    """At the 11B LLM projections the default tiling gives at least one program per H200 SM
    (132), and splits D only while its fp32 partials stay under 1/8 of the weight's bytes."""
    cfg = voicechat_11b().llm
    shapes = [
        (cfg.d_model, cfg.mlp_dim),
        (cfg.mlp_dim, cfg.d_model),
        (cfg.d_model, cfg.in_proj_dim),
        (cfg.d_inner, cfg.d_model),
    ]
    for D, F in shapes:
        for R in (1, 16, 32, 56, 112):
            b = default_blocks(R, D, F, BF)
            programs = -(-F // b.block_f) * b.split_d
            assert programs >= 132, (D, F, R, b)
            assert 2 * b.split_d * R * F * 4 <= D * F * 2 / 8 or b.split_d == 1, (D, F, R, b)


@pytest.mark.parametrize("R", [1, 112])
def test_gpu_lowering_is_one_triton_call_on_the_stacked_weight(R):
    """At the 11B MLP up projection (25 stacked layers, 3.5 GB bf16) the product lowers to one
    Triton call whose weight operand is the stacked parameter itself: no slice of it is
    materialised. Lowering only: nothing runs, nothing is allocated."""
    cfg = voicechat_11b().llm
    L = len(cfg.layers_of("-"))
    x = jax.ShapeDtypeStruct((R, cfg.d_model), BF)
    w = jax.ShapeDtypeStruct((L, cfg.d_model, cfg.mlp_dim), BF)
    fn = jax.jit(functools.partial(matmul, layer=L - 1))
    text = fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "slice" not in text  # the stacked weight goes into the call whole
    assert f"tensor<{L}x{cfg.d_model}x{cfg.mlp_dim}xbf16>" in text


# ----------------------------------------------------------------------------- the model switch


def test_projection_switch():
    x, w = operands(3, 32, 48, L=2)
    np.testing.assert_array_equal(projection.matmul(x, w, layer=1), dense(x, w[1]))
    got = projection.matmul(x, w, layer=1, impl="pallas")
    assert rel_err(got, dense(x, w[1])) < TOL_F32
    with pytest.raises(ValueError, match="not a valid ProjectionImpl"):
        projection.matmul(x, w, layer=1, impl="cublas")
    with pytest.raises(ValueError, match="projection must be xla\\|pallas"):
        ServeConfig(projection="cublas")


def test_nano_step_pallas_projection_equals_xla():
    """Three frames of the tiny LLM, fp32, 3 slots one of them idle: 'pallas' projections match
    'xla' on the running rows, and the idle row's state stays bit-identical."""
    cfg, prec = tiny(), Precision.fp32()
    params = nano.init(jax.random.key(3), cfg.llm, prec)
    rng = np.random.default_rng(1)
    embeds = jnp.asarray(rng.standard_normal((3, 3, cfg.llm.d_model)), jnp.float32)
    run = jnp.array([True, False, True])
    runs = {}
    for impl in ("xla", "pallas"):
        fn = jax.jit(functools.partial(nano.step, cfg=cfg.llm, projection=impl))
        st, hs = nano.init_state(cfg.llm, 3, 8, prec), []
        for t in range(3):
            st, h = fn(params, st, embeds[t], run)
            hs.append(h)
        runs[impl] = (st, jnp.stack(hs))
    (st_x, h_x), (st_p, h_p) = runs["xla"], runs["pallas"]
    assert rel_err(h_p[:, run], h_x[:, run]) < LLM_TOL
    assert rel_err(st_p.ssm, st_x.ssm) < LLM_TOL
    assert rel_err(st_p.conv, st_x.conv) < LLM_TOL
    fresh = nano.init_state(cfg.llm, 3, 8, prec)
    for a, b in zip(jax.tree_util.tree_leaves(st_p), jax.tree_util.tree_leaves(fresh), strict=True):
        if a.shape and a.shape[0] == 3:
            np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="projection must be one of"):
        nano.step(params, fresh, embeds[0], cfg=cfg.llm, projection="cublas")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_tick_reaches_the_kernel_through_serve_config(impl):
    """The tick traced with ``ServeConfig(projection=...)``: two kernels per Mamba layer and two
    per MLP layer with 'pallas', none with 'xla' (abstract values, nothing runs)."""
    cfg, prec = tiny(), Precision.fp32()
    serve = ServeConfig(
        slots=2, frames_per_tick=2, context_frames=8, projection=impl, precision=prec
    )
    params = voicechat.abstract(cfg, prec)
    template = jax.eval_shape(
        lambda p: voicechat.initial_state(p, cfg=cfg, precision=prec, max_len=8), params
    )
    state = jax.eval_shape(lambda t: state_lib.from_template(t, serve.slots), template)
    beat, masks = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
        (state_lib.empty_beat(2, 2 * 1280), state_lib.masks_of(state_lib.empty_beat(2, 2 * 1280))),
    )
    tick = functools.partial(step_lib.tick, cfg=cfg, serve=serve)
    text = str(jax.make_jaxpr(tick)(params, state, template, beat, masks))
    per_frame = 2 * len(cfg.llm.layers_of("M")) + 2 * len(cfg.llm.layers_of("-"))
    assert text.count("pallas_call[") == (per_frame if impl == "pallas" else 0)
