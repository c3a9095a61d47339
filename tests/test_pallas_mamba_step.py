"""The fused Mamba-2 decode step (``pallas_kernels.mamba_step``) against its jnp reference.

Interpret mode on the CPU: a sweep of shapes (one group, one head per group, rows tiled or not),
activation dtypes and state dtypes; the run mask (idle slots' conv and SSM state bit-identical,
their output zero; the other layers' conv state untouched); the refusals; the in-place contract
(aliasing declared to the GPU lowering, donation honoured under jit); and the model's switch
(``nano.step`` with ``ssm_kernel='fused'``, the tick through ``ServeConfig``). Errors are
relative: max|a - b| / max|b|.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mamba_step import mamba_step, mamba_step_reference
from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ServeConfig, tiny, voicechat_11b
from voicechat_jax.model import nano, voicechat
from voicechat_jax.precision import Precision

F32, BF = jnp.float32, jnp.bfloat16
# fp32 activations: fp32 summation order only. bf16 activations: the kernel rounds the same fp32
# values to bf16 as the reference, except where a summation-order difference crosses a rounding
# boundary (one bf16 ulp, 2^-8 relative, on a few channels).
TOL = {F32: 2e-6, BF: 2**-7}
LLM_TOL = {F32: 1e-5, BF: 3e-2}  # nano.step 'fused' vs 'xla' over a few frames
EPS = 1e-5
STATIC = ("layer", "n_groups", "eps", "interpret", "block_rows")
KERNEL = jax.jit(mamba_step, static_argnames=STATIC)
REFERENCE = jax.jit(mamba_step_reference, static_argnames=("layer", "n_groups", "eps"))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def inputs(Bsz, N, K, H, P, *, L=3, k=4, act=F32, state=F32, seed=0):
    """Random kernel inputs (the 11B conv width k = 4), a near-one gate weight, dt_bias < 0."""
    rng = np.random.default_rng(seed)

    def f(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, F32)

    NH = N * H
    C = NH + 2 * K * P
    return {
        "zxbcdt": f(Bsz, NH + C + N).astype(act),
        "conv": f(Bsz, L, k - 1, C).astype(state),
        "ssm": f(Bsz, N, H, P).astype(state),
        "conv_w": f(L, k, C, scale=0.5).astype(act),
        "conv_b": f(L, C, scale=0.1).astype(act),
        "dt_bias": f(L, N) - 1.0,
        "A_log": f(L, N, scale=0.5),
        "D": 1.0 + 0.1 * f(L, N),
        "gate_norm": (1.0 + 0.1 * f(L, NH)).astype(act),
    }


# (B, N heads, K groups, H head dim, P state, block_rows, layer of L=3, activation, state dtype)
CASES = [
    (1, 8, 2, 8, 16, None, 0, F32, F32),  # one slot
    (1, 8, 2, 8, 16, None, 0, BF, F32),  # one slot, the reference policy's dtypes
    (3, 8, 2, 12, 16, None, 2, BF, F32),  # H not a power of two: rows tiled by 4, 3 tiles/head
    (2, 4, 1, 8, 16, 2, 1, F32, F32),  # one group over all heads; 4 row tiles per head
    (2, 4, 4, 8, 16, None, 1, BF, BF),  # one head per group; a bf16 state, read and written so
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: "B{}_N{}_K{}_H{}_P{}_r{}_j{}_{}_{}".format(
        *c[:7], jnp.dtype(c[7]).name, jnp.dtype(c[8]).name
    ),
)
def test_kernel_equals_reference(case):
    Bsz, N, K, H, P, rows, j, act, state = case
    args = inputs(Bsz, N, K, H, P, act=act, state=state)
    run = jnp.ones((Bsz,), bool)
    kw = {"layer": j, "n_groups": K, "eps": EPS}
    got = KERNEL(**args, run=run, interpret=True, block_rows=rows, **kw)
    want = REFERENCE(**args, run=run, **kw)
    for g, w, a in zip(got, want, ("conv", "ssm", "zxbcdt"), strict=True):
        assert g.shape == w.shape
        assert g.dtype == args[a].dtype
    conv, ssm, y = got
    tol = max(TOL[act], TOL[state])
    assert rel_err(conv, want[0]) < tol
    assert rel_err(ssm, want[1]) < tol
    assert rel_err(y, want[2]) < tol
    others = [i for i in range(3) if i != j]  # only layer j's conv state moves
    np.testing.assert_array_equal(conv[:, others], args["conv"][:, others])
    # the new conv state is the window shifted by one: the old rows 1.. then this frame's xBC
    NH, C = N * H, args["conv"].shape[-1]
    np.testing.assert_array_equal(conv[:, j, :-1], args["conv"][:, j, 1:])
    np.testing.assert_array_equal(conv[:, j, -1], args["zxbcdt"][:, NH : NH + C].astype(state))


def test_idle_slots_are_untouched_and_output_zero():
    """Slots 0 and 2 of 4 idle: their conv state (every layer) and SSM state come back
    bit-identical and their y is exactly 0; the running slots match the reference."""
    args = inputs(4, 8, 2, 8, 16)
    run = jnp.array([False, True, False, True])
    kw = {"layer": 1, "n_groups": 2, "eps": EPS}
    conv, ssm, y = KERNEL(**args, run=run, interpret=True, **kw)
    want = REFERENCE(**args, run=run, **kw)
    for b in (0, 2):
        np.testing.assert_array_equal(conv[b], args["conv"][b])
        np.testing.assert_array_equal(ssm[b], args["ssm"][b])
        np.testing.assert_array_equal(y[b], 0.0)
        np.testing.assert_array_equal(want[1][b], args["ssm"][b])
    for got, ref in zip((conv, ssm, y), want, strict=True):
        assert rel_err(got[1::2], ref[1::2]) < TOL[F32]
    # all idle: nothing moves
    none = jnp.zeros((4,), bool)
    conv, ssm, y = KERNEL(**args, run=none, interpret=True, **kw)
    np.testing.assert_array_equal(conv, args["conv"])
    np.testing.assert_array_equal(ssm, args["ssm"])
    np.testing.assert_array_equal(y, 0.0)


def test_group_norm_is_per_group():
    """Scaling one group's z rows changes only that group's norm input: the gated norm's output
    of the other group is unchanged (exactly), that of the scaled one is not."""
    args = inputs(1, 8, 2, 8, 16)
    run = jnp.ones((1,), bool)
    kw = {"layer": 0, "n_groups": 2, "eps": EPS, "interpret": True}
    _, _, y0 = KERNEL(**args, run=run, **kw)
    z_group1 = slice(32, 64)  # heads 4..7 (group 1) x H 8: channels 32..63 of z
    args["zxbcdt"] = args["zxbcdt"].at[:, z_group1].multiply(3.0)
    _, _, y1 = KERNEL(**args, run=run, **kw)
    np.testing.assert_array_equal(y1[:, :32], y0[:, :32])
    assert float(jnp.max(jnp.abs(y1[:, 32:64] - y0[:, 32:64]))) > 1e-3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_rows": 3}, "must be a power of two dividing the head dim H=8"),
        ({"block_rows": 16}, "must be a power of two dividing the head dim H=8"),
        ({"layer": 3}, "layer must be a static int"),
        ({"n_groups": 3}, "must be a multiple of the groups K=3"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    args = inputs(2, 8, 2, 8, 16)
    kw = {"layer": 1, "n_groups": 2, "eps": EPS, "interpret": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        mamba_step(**args, run=jnp.ones((2,), bool), **kw)


def test_bad_shapes_are_refused():
    args = inputs(2, 8, 2, 8, 16)
    kw = {"layer": 1, "n_groups": 2, "eps": EPS, "interpret": True}
    bad = dict(args, gate_norm=args["gate_norm"][:, :32])
    with pytest.raises(ValueError, match="gate_norm must have shape"):
        mamba_step(**bad, run=jnp.ones((2,), bool), **kw)
    with pytest.raises(ValueError, match="run must have shape"):
        mamba_step(**args, run=jnp.ones((3,), bool), **kw)
    bad = dict(args, conv=args["conv"][..., :-1])
    with pytest.raises(ValueError, match="conv channels must be"):
        mamba_step(**bad, run=jnp.ones((2,), bool), **kw)


def test_donated_states_are_aliased_and_correct():
    """Under jit with both states donated, XLA reuses their buffers for the new states."""
    args = inputs(2, 8, 2, 8, 16)
    run = jnp.array([True, False])
    kw = {"layer": 2, "n_groups": 2, "eps": EPS}
    want = REFERENCE(**args, run=run, **kw)
    order = ("zxbcdt", "conv", "ssm", "conv_w", "conv_b", "dt_bias", "A_log", "D", "gate_norm")
    fn = jax.jit(functools.partial(mamba_step, interpret=True, **kw), donate_argnums=(1, 2))
    pos = [args[a] for a in order] + [run]
    stats = fn.lower(*pos).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= args["conv"].nbytes + args["ssm"].nbytes
    conv_in, ssm_in = jnp.array(args["conv"], copy=True), jnp.array(args["ssm"], copy=True)
    pos[1], pos[2] = conv_in, ssm_in
    got = fn(*pos)
    assert conv_in.is_deleted()
    assert ssm_in.is_deleted()
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < TOL[F32]


def test_gpu_lowering_is_triton_and_in_place():
    """At the 11B Mamba shapes (64 slots, 27 stacked conv states) the step lowers to one Triton
    call with both states aliased to their outputs. Lowering only: nothing runs."""
    cfg = voicechat_11b().llm
    L = len(cfg.layers_of("M"))
    N, H, P, K = cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state, cfg.n_groups
    NH, C, k = cfg.d_inner, cfg.conv_dim, cfg.conv_kernel
    S = jax.ShapeDtypeStruct
    args = [
        S((64, NH + C + N), BF),
        S((64, L, k - 1, C), F32),
        S((64, N, H, P), F32),
        S((L, k, C), BF),
        S((L, C), BF),
        S((L, N), F32),
        S((L, N), F32),
        S((L, N), F32),
        S((L, NH), BF),
        S((64,), jnp.bool_),
    ]
    fn = jax.jit(functools.partial(mamba_step, layer=L - 1, n_groups=K, eps=cfg.norm_eps))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "output_operand_alias<output_tuple_indices = [0], operand_index = 2" in text
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 3" in text


# ----------------------------------------------------------------------------- the model switch


@pytest.mark.parametrize("policy", ["fp32", "reference"])
def test_nano_step_fused_equals_xla(policy):
    """Three frames of the tiny LLM, 3 slots, slot 1 idle: 'fused' matches 'xla' on the running
    rows and leaves the idle slot's state bit-identical (fresh)."""
    cfg = tiny()
    prec = Precision.fp32() if policy == "fp32" else Precision.reference()
    act = F32 if policy == "fp32" else BF
    params = nano.init(jax.random.key(3), cfg.llm, prec)
    rng = np.random.default_rng(1)
    embeds = jnp.asarray(rng.standard_normal((3, 3, cfg.llm.d_model)), F32)
    run = jnp.array([True, False, True])
    runs = {}
    for kernel in ("xla", "fused"):
        fn = jax.jit(
            functools.partial(nano.step, cfg=cfg.llm, ssm_kernel=kernel), donate_argnums=(1,)
        )
        st, hs = nano.init_state(cfg.llm, 3, 8, prec), []
        for t in range(3):
            st, h = fn(params, st, embeds[t], run)
            hs.append(h)
        runs[kernel] = (st, jnp.stack(hs))
    (st_x, h_x), (st_f, h_f) = runs["xla"], runs["fused"]
    assert rel_err(h_f[:, run], h_x[:, run]) < LLM_TOL[act]
    assert rel_err(st_f.ssm, st_x.ssm) < LLM_TOL[act]
    assert rel_err(st_f.conv, st_x.conv) < LLM_TOL[act]
    np.testing.assert_array_equal(st_f.length, st_x.length)
    fresh = nano.init_state(cfg.llm, 3, 8, prec)
    for a, b in zip(jax.tree_util.tree_leaves(st_f), jax.tree_util.tree_leaves(fresh), strict=True):
        if a.shape and a.shape[0] == 3:
            np.testing.assert_array_equal(a[1], b[1])


def test_switch_is_validated():
    assert ServeConfig(ssm_kernel="fused").ssm_kernel == "fused"
    cfg = tiny().llm
    p = nano.init(jax.random.key(0), cfg, Precision.fp32()).mamba
    st = nano.init_state(cfg, 1, 4, Precision.fp32())
    with pytest.raises(ValueError, match="fused: _mamba_step_fused"):
        nano._mamba_step(
            p,
            0,
            jnp.zeros((1, cfg.d_model)),
            st.conv[0],
            st.ssm[0],
            jnp.ones(1, bool),
            cfg,
            "fused",
        )


def test_tick_reaches_the_kernel_through_serve_config():
    """The tick traced with ``ServeConfig(ssm_kernel='fused')``: one kernel per Mamba layer per
    frame of the frame scan, and no separate SSM kernel (abstract values, nothing runs)."""
    cfg, prec = tiny(), Precision.fp32()
    serve = ServeConfig(
        slots=2, frames_per_tick=2, context_frames=8, ssm_kernel="fused", precision=prec
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
    assert text.count("pallas_call[") == len(cfg.llm.layers_of("M"))
    assert text.count("name=mamba_step") == len(cfg.llm.layers_of("M"))
