"""The Mamba-2 single-step SSM kernel (``pallas_kernels.ssm_step``) against its jnp reference.

Interpret mode on the CPU: a sweep of shapes, block sizes and input dtypes; edge cases (dt = 0,
huge dt, zero state, a zero-input slot); the in-place contract (aliasing declared to the GPU
lowering, donation honoured under jit); and the whole LLM step through ``ServeConfig``'s switch.
Errors are relative: max|a - b| / max|b|.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ssm_step import ssm_step, ssm_step_reference
from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ServeConfig, tiny, voicechat_11b
from voicechat_jax.model import nano, voicechat
from voicechat_jax.precision import Precision

# Kernel vs reference, per dtype of x, B, C. Both upcast the inputs to fp32 the same way, so the
# only difference is fp32 rounding (the order of the sum over P): the same bound for both.
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-6}
LLM_TOL = 1e-5  # nano.step, 'pallas' vs 'xla', fp32, over STEPS frames
STEPS = 6
KERNEL = jax.jit(
    ssm_step, static_argnames=("layer", "interpret", "block_heads", "block_rows", "num_warps")
)
REFERENCE = jax.jit(ssm_step_reference, static_argnames=("layer",))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def inputs(Bsz, N, K, H, P, *, L=None, dtype=jnp.float32, seed=0):
    """Random kernel inputs: state [B, (L,) N, H, P] fp32, dt = softplus(.) as the model has it."""
    rng = np.random.default_rng(seed)

    def f(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    state = f(Bsz, *((L,) if L else ()), N, H, P)
    x = f(Bsz, N, H).astype(dtype)
    dt = jax.nn.softplus(f(Bsz, N) - 1.0)
    A = -jnp.exp(f(N, scale=0.5))
    Bm = f(Bsz, K, P).astype(dtype)
    Cm = f(Bsz, K, P).astype(dtype)
    D = 1.0 + 0.1 * f(N)
    return state, x, dt, A, Bm, Cm, D


# (B, N heads, K groups, H head dim, P state, block_heads, block_rows, stacked L or None)
SHAPES = [
    (1, 8, 2, 8, 16, 1, None, None),
    (3, 8, 2, 8, 16, 2, 4, 3),
    (8, 8, 2, 8, 16, 4, None, 3),
    (3, 8, 2, 12, 16, None, None, None),  # H not a power of two: rows tiled by 4
    (3, 128, 8, 8, 16, 16, 8, None),
    (8, 128, 8, 8, 16, None, None, 2),
    (1, 128, 8, 80, 128, 4, None, None),  # the 11B layer: rows tiled by 16
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: "B{}_N{}_K{}_H{}_P{}_bh{}_r{}_L{}".format(*s)
)
def test_kernel_equals_reference(shape, dtype):
    Bsz, N, K, H, P, bh, rows, L = shape
    layer = None if L is None else L - 1
    args = inputs(Bsz, N, K, H, P, L=L, dtype=dtype)
    want_s, want_y = REFERENCE(*args, layer=layer)
    got_s, got_y = KERNEL(*args, layer=layer, interpret=True, block_heads=bh, block_rows=rows)
    assert got_s.shape == args[0].shape
    assert got_s.dtype == jnp.float32
    assert got_y.shape == (Bsz, N, H)
    assert got_y.dtype == jnp.float32
    assert rel_err(got_s, want_s) < TOL[dtype]
    assert rel_err(got_y, want_y) < TOL[dtype]
    if L is not None:  # only the chosen layer moves
        others = [i for i in range(L) if i != layer]
        np.testing.assert_array_equal(got_s[:, others], args[0][:, others])


def test_dt_zero_leaves_the_state_bit_identical():
    """dt = 0 (an idle slot): decay 1 and no update, exactly; y reads the unchanged state."""
    state, x, dt, A, Bm, Cm, D = inputs(3, 8, 2, 8, 16, L=2)
    dt = dt.at[1].set(0.0)
    got_s, got_y = KERNEL(state, x, dt, A, Bm, Cm, D, layer=1, interpret=True)
    want_s, want_y = REFERENCE(state, x, dt, A, Bm, Cm, D, layer=1)
    np.testing.assert_array_equal(got_s[1], state[1])
    np.testing.assert_array_equal(want_s[1], state[1])
    assert rel_err(got_y, want_y) < TOL[jnp.float32]
    assert rel_err(got_s, want_s) < TOL[jnp.float32]


def test_tiny_and_huge_dt():
    """dt -> 0 changes the state by ~dt; dt = 1e4 decays it to exactly 0 (only dt x B is left)."""
    state, x, dt, A, Bm, Cm, D = inputs(2, 8, 2, 8, 16)
    for value in (1e-30, 1e-6, 1e4):
        d = jnp.full_like(dt, value)
        got_s, got_y = KERNEL(state, x, d, A, Bm, Cm, D, interpret=True)
        want_s, want_y = REFERENCE(state, x, d, A, Bm, Cm, D)
        assert np.all(np.isfinite(got_s))
        assert np.all(np.isfinite(got_y))
        assert rel_err(got_s, want_s) < TOL[jnp.float32]
        assert rel_err(got_y, want_y) < TOL[jnp.float32]
    # dt = 1e4, A <= -exp(-1.5): exp(dt A) underflows to 0, the old state is gone
    outer = 1e4 * x[..., None] * jnp.repeat(Bm, 4, axis=1)[:, :, None, :]
    assert rel_err(got_s, outer) < TOL[jnp.float32]


def test_zero_state():
    state, x, dt, A, Bm, Cm, D = inputs(3, 8, 2, 8, 16)
    state = jnp.zeros_like(state)
    got_s, got_y = KERNEL(state, x, dt, A, Bm, Cm, D, interpret=True)
    want_s, want_y = REFERENCE(state, x, dt, A, Bm, Cm, D)
    assert rel_err(got_s, want_s) < TOL[jnp.float32]
    assert rel_err(got_y, want_y) < TOL[jnp.float32]


def test_zero_input_slot_only_decays():
    """x = B = C = 0 in one slot: its state is exactly decayed (as the reference) and y is 0."""
    state, x, dt, A, Bm, Cm, D = inputs(3, 8, 2, 8, 16, L=2)
    x, Bm, Cm = x.at[2].set(0.0), Bm.at[2].set(0.0), Cm.at[2].set(0.0)
    got_s, got_y = KERNEL(state, x, dt, A, Bm, Cm, D, layer=0, interpret=True)
    want_s, _ = REFERENCE(state, x, dt, A, Bm, Cm, D, layer=0)
    np.testing.assert_array_equal(got_s[2], want_s[2])
    decayed = state[2, 0] * jnp.exp(dt[2] * A)[:, None, None]
    np.testing.assert_array_equal(got_s[2, 0], decayed)
    np.testing.assert_array_equal(got_y[2], 0.0)
    assert float(jnp.max(jnp.abs(got_s[2, 0] - state[2, 0]))) > 0  # it did decay


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_heads": 3}, "must divide the heads per group G=4"),
        ({"block_heads": 8}, "must divide the heads per group G=4"),
        ({"block_rows": 3}, "must divide the head dim H=8"),
        ({"layer": 2}, "layer must be a static int"),
        ({"layer": None}, "without layer"),
    ],
)
def test_bad_blocks_and_layers_are_refused(kwargs, message):
    args = inputs(2, 8, 2, 8, 16, L=2)
    kw = {"layer": 1, "interpret": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        ssm_step(*args, **kw)


def test_bad_shapes_are_refused():
    state, x, dt, A, Bm, Cm, D = inputs(2, 8, 2, 8, 16)
    with pytest.raises(ValueError, match="x must have shape"):
        ssm_step(state, x[:, :4], dt, A, Bm, Cm, D, interpret=True)
    with pytest.raises(ValueError, match="c_mat must have shape"):
        ssm_step(state, x, dt, A, Bm, Cm[..., :8], D, interpret=True)


def test_donated_state_is_aliased_and_correct():
    """Under jit with the state donated, XLA reuses its buffer for the new state."""
    args = inputs(3, 8, 2, 8, 16, L=3)
    want_s, want_y = REFERENCE(*args, layer=2)
    fn = jax.jit(functools.partial(ssm_step, layer=2, interpret=True), donate_argnums=0)
    stats = fn.lower(*args).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= args[0].nbytes
    state = jnp.array(args[0], copy=True)
    got_s, got_y = fn(state, *args[1:])
    assert state.is_deleted()
    assert got_s.shape == args[0].shape
    assert got_s.dtype == args[0].dtype
    assert rel_err(got_s, want_s) < TOL[jnp.float32]
    assert rel_err(got_y, want_y) < TOL[jnp.float32]


@pytest.mark.parametrize("block_heads", [1, 2, 4, 8, 16])
def test_gpu_lowering_is_triton_and_in_place(block_heads):
    """At the 11B layer shape (64 slots: > 4 GiB, 64-bit offsets) the kernel lowers to one Triton
    call whose output 0 is input 0's buffer. Lowering only: nothing runs, nothing is allocated."""
    cfg = voicechat_11b().llm  # N 128, H 80, P 128, K 8
    L = len(cfg.layers_of("M"))
    N, H, P, K = cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state, cfg.n_groups
    f32 = jnp.float32
    args = [
        jax.ShapeDtypeStruct((64, L, N, H, P), f32),
        jax.ShapeDtypeStruct((64, N, H), f32),
        jax.ShapeDtypeStruct((64, N), f32),
        jax.ShapeDtypeStruct((N,), f32),
        jax.ShapeDtypeStruct((64, K, P), f32),
        jax.ShapeDtypeStruct((64, K, P), f32),
        jax.ShapeDtypeStruct((N,), f32),
    ]
    fn = jax.jit(functools.partial(ssm_step, layer=L - 1, block_heads=block_heads))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "output_operand_alias<output_tuple_indices = [0], operand_index = 0" in text


# ----------------------------------------------------------------------------- the model switch


@pytest.fixture(scope="module")
def llm():
    cfg = tiny()
    prec = Precision.fp32()
    return cfg, prec, nano.init(jax.random.key(3), cfg.llm, prec)


def test_nano_step_pallas_equals_xla(llm):
    """STEPS frames of the whole LLM, 'pallas' vs 'xla', fp32, 3 slots; donated like the tick."""
    cfg, prec, params = llm
    rng = np.random.default_rng(1)
    embeds = jnp.asarray(rng.standard_normal((STEPS, 3, cfg.llm.d_model)), jnp.float32)
    runs = {}
    for kernel in ("xla", "pallas"):
        fn = jax.jit(
            functools.partial(nano.step, cfg=cfg.llm, ssm_kernel=kernel), donate_argnums=(1,)
        )
        st, hs = nano.init_state(cfg.llm, 3, 8, prec), []
        for t in range(STEPS):
            st, h = fn(params, st, embeds[t])
            hs.append(h)
        runs[kernel] = (st, jnp.stack(hs))
    (st_x, h_x), (st_p, h_p) = runs["xla"], runs["pallas"]
    assert rel_err(h_p, h_x) < LLM_TOL
    assert rel_err(st_p.ssm, st_x.ssm) < LLM_TOL
    np.testing.assert_array_equal(st_p.length, st_x.length)
    assert {a.dtype for a in (*st_p.ssm, *st_x.ssm)} == {jnp.dtype(jnp.float32)}


def test_switch_is_validated(llm):
    cfg, prec, params = llm
    with pytest.raises(ValueError, match="ssm_kernel must be auto\\|xla\\|pallas"):
        ServeConfig(ssm_kernel="triton")
    st = nano.init_state(cfg.llm, 1, 4, prec)
    with pytest.raises(ValueError, match="ssm_kernel must be one of"):
        nano.step(params, st, jnp.zeros((1, cfg.llm.d_model)), cfg=cfg.llm, ssm_kernel="cuda")


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_tick_reaches_the_kernel_through_serve_config(kernel):
    """The tick traced with ``ServeConfig(ssm_kernel=...)``: one kernel per Mamba layer per
    frame of the frame scan with 'pallas', none with 'xla' (abstract values, nothing runs)."""
    cfg, prec = tiny(), Precision.fp32()
    serve = ServeConfig(
        slots=2, frames_per_tick=2, context_frames=8, ssm_kernel=kernel, precision=prec
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
    n_mamba = len(cfg.llm.layers_of("M"))
    assert text.count("pallas_call[") == (n_mamba if kernel == "pallas" else 0)
