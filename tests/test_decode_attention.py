"""Decode attention: the Pallas kernel against its jnp reference, and ``attention.attend``.

The kernel (``pallas_kernels.decode_attention``) runs in interpret mode on the CPU over a sweep of
shapes (G = 1 and G > 1, H = 72 and 128 as at 11B, S not a multiple of the block), cache dtypes,
lengths (0, 1, block and split edges, a full cache, past the cache), sliding windows shorter and
longer than the length, and rows it must not read (filled with NaN). ``attend(impl='xla')`` is
checked bit for bit against copies of the model's own jnp attention (``nano._attend`` and the
attention of ``gemma.forward``, as they are at the time of writing) at T = 1, jitted and eager
(chex variants). Errors are relative: max|a - b| / max|b|.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import (
    DecodeAttentionBlocks,
    decode_attention,
    decode_attention_reference,
)
from tests import shared
from voicechat_jax import step as step_lib
from voicechat_jax.config import tiny, voicechat_11b
from voicechat_jax.model import attention
from voicechat_jax.model.attention import AttentionImpl, attend

F32, BF16 = jnp.float32, jnp.bfloat16
# Kernel vs reference, by (q dtype, cache dtype). Both read the same cache values and compute in
# fp32, so with an fp32 output only the summation order differs. A bf16 output is rounded once
# (2^-9 relative) and, on the matrix-unit path (G > 1, bf16 q and cache), the probabilities are
# rounded to bf16 for the value product as the model's jnp path rounds them.
TOL = {(F32, F32): 2e-6, (F32, BF16): 2e-6, (BF16, BF16): 1.5e-2}
KERNEL = jax.jit(
    decode_attention,
    static_argnames=(
        "window",
        "scale",
        "interpret",
        "block_s",
        "split_s",
        "num_warps",
        "num_stages",
        "dot",
    ),
)
REFERENCE = jax.jit(decode_attention_reference, static_argnames=("window", "scale"))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def inputs(Bsz, K, G, H, S, *, q_dtype=F32, kv_dtype=F32, seed=0):
    """Random q [B, K, G, H] and cache k, v [B, K, S, H]; scores of order a few units."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((Bsz, K, G, H)), q_dtype)
    k = jnp.asarray(rng.standard_normal((Bsz, K, S, H)), kv_dtype)
    v = jnp.asarray(rng.standard_normal((Bsz, K, S, H)), kv_dtype)
    return q, k, v


def edge_lengths(S: int, block_s: int, split_s: int) -> np.ndarray:
    """[8] int32: 0, 1, a block edge and one past it, a split edge, S - 1, S (full), past S."""
    return np.array([0, 1, block_s, block_s + 1, min(split_s, S), S - 1, S, S + 3], np.int32)


def poison_unseen(k, v, lengths, window):
    """NaN in every cache row the slot does not attend to (the kernel must never load them)."""
    S = k.shape[2]
    row = np.arange(S)[None, :]
    hi = np.minimum(lengths, S)[:, None]
    lo = np.zeros_like(hi) if window is None else np.clip(lengths - window, 0, S)[:, None]
    unseen = jnp.asarray(~((row >= lo) & (row < hi)))[:, None, :, None]  # [B, 1, S, 1]
    return jnp.where(unseen, jnp.nan, k), jnp.where(unseen, jnp.nan, v)


# (K, G, H, S, block_s, split_s, dot, window): 11B-like heads (G 1 and 5, H 72 and 128) at small
# K and S, S never a multiple of block_s, and the tiny model's heads (H 12 and 16).
SHAPES = [
    (2, 1, 72, 77, 16, 32, None, None),  # speech decoder head, global layer
    (2, 1, 72, 77, 16, 32, None, 20),  # speech decoder head, sliding layer
    (2, 1, 72, 40, 32, 32, None, 500),  # window longer than the cache: global
    (2, 1, 128, 100, 16, 64, None, 1),  # window 1: only the query's own row
    (2, 5, 128, 90, 16, 32, None, None),  # LLM GQA head (matrix-unit path)
    (2, 5, 128, 90, 16, 32, False, None),  # ... on the vector path
    (2, 1, 72, 50, 16, 16, True, 7),  # G = 1 on the matrix-unit path
    (4, 1, 12, 23, 8, 16, None, 8),  # tiny speech decoder (H 12, window 8)
    (2, 2, 16, 23, 16, 16, None, None),  # tiny LLM (G 2, H 16)
]
# (q, cache) dtypes as the model pairs them: the speech decoder runs fp32 with an fp32 or bf16
# cache, the LLM bf16 with a bf16 cache, and fp32 throughout under ``Precision.fp32()``.
SPEECH = [(F32, F32), (F32, BF16)]
LLM = [(BF16, BF16), (F32, F32)]
CASES = [(s, d) for s in SHAPES for d in (SPEECH if s[1] == 1 else LLM)] + [
    (SHAPES[0], (BF16, BF16))
]


def _case_id(case) -> str:
    (K, G, H, S, bs, ss, dot, w), (qd, kvd) = case
    dt = {F32: "32", BF16: "16"}
    return f"K{K}_G{G}_H{H}_S{S}_bs{bs}_ss{ss}_dot{dot}_w{w}_q{dt[qd]}_kv{dt[kvd]}"


@pytest.mark.parametrize(("shape", "dtypes"), CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_equals_reference(shape, dtypes):
    K, G, H, S, block_s, split_s, dot, window = shape
    q_dtype, kv_dtype = dtypes
    lengths = edge_lengths(S, block_s, split_s)
    q, k, v = inputs(len(lengths), K, G, H, S, q_dtype=q_dtype, kv_dtype=kv_dtype)
    scale = H**-0.5
    want = REFERENCE(q, k, v, jnp.asarray(lengths), window=window, scale=scale)
    k_bad, v_bad = poison_unseen(k, v, lengths, window)
    got = KERNEL(
        q,
        k_bad,
        v_bad,
        jnp.asarray(lengths),
        window=window,
        scale=scale,
        interpret=True,
        block_s=block_s,
        split_s=split_s,
        dot=dot,
    )
    assert got.shape == q.shape
    assert got.dtype == q_dtype
    assert np.all(np.isfinite(np.asarray(got, np.float32)))  # no unseen (NaN) row was read
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), 0.0)  # length 0
    assert rel_err(got, want) < TOL[dtypes]
    if window == 1:  # only the query's own row: its value, or nothing if it is past the cache
        for b, n in enumerate(lengths[1:], start=1):
            own = np.asarray(v[b, :, n - 1], np.float32) if n <= S else np.zeros((K, H))
            np.testing.assert_allclose(
                np.asarray(got[b], np.float32), np.broadcast_to(own[:, None], (K, G, H))
            )


def test_reference_matches_a_direct_softmax():
    """The reference against a masked softmax written out per slot in numpy (float64)."""
    K, G, H, S, window = 2, 3, 16, 30, 9
    lengths = np.array([0, 1, 5, 9, 10, 30, 33], np.int32)
    q, k, v = inputs(len(lengths), K, G, H, S)
    got = np.asarray(REFERENCE(q, k, v, jnp.asarray(lengths), window=window, scale=0.3))
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    for b, n in enumerate(lengths):
        rows = [j for j in range(S) if j < n and n - 1 - j < window]
        if not rows:
            np.testing.assert_array_equal(got[b], 0.0)
            continue
        s = 0.3 * np.einsum("kgh,ksh->kgs", qn[b], kn[b][:, rows])
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.einsum("kgs,ksh->kgh", p, vn[b][:, rows])
        # fp32 against float64: outputs are O(1), so an element near zero needs the atol
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6)


def test_kernel_at_11b_speech_decoder_length():
    """S = 1537 (the 11B speech decoder at the cap), default blocks, lengths at the cap and
    half of it, fp32 cache; two heads of the real 16 to keep interpret mode quick."""
    S, H = 1537, 72
    lengths = np.array([1537, 768, 1500, 1], np.int32)
    q, k, v = inputs(len(lengths), 2, 1, H, S)
    want = REFERENCE(q, k, v, jnp.asarray(lengths), scale=256.0**-0.5)
    got = KERNEL(q, k, v, jnp.asarray(lengths), scale=256.0**-0.5, interpret=True)
    assert rel_err(got, want) < TOL[(F32, F32)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_s": 48}, "block_s must be a power of two"),
        ({"block_s": 8, "split_s": 32, "dot": True}, "block_s must be >= 16 with dot"),
        ({"block_s": 64, "split_s": 96}, "must be a positive multiple of block_s"),
        ({"block_s": 64, "split_s": 32}, "must be a positive multiple of block_s"),
        ({"num_warps": 3}, "num_warps must be a power of two"),
        ({"num_stages": 0}, "num_stages must be >= 1"),
    ],
)
def test_bad_blocks_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeAttentionBlocks(**kwargs)
    q, k, v = inputs(2, 1, 1, 8, 16)
    with pytest.raises(ValueError, match=message):
        decode_attention(q, k, v, jnp.ones((2,), jnp.int32), scale=1.0, interpret=True, **kwargs)


def test_auto_dot_needs_a_dot_sized_block():
    """G > 1 picks the matrix-unit path by default, which needs block_s >= 16."""
    q, k, v = inputs(2, 1, 2, 8, 16)
    with pytest.raises(ValueError, match="block_s must be >= 16 with dot"):
        decode_attention(q, k, v, jnp.ones((2,), jnp.int32), scale=1.0, interpret=True, block_s=8)


def test_bad_shapes_and_windows_are_refused():
    q, k, v = inputs(2, 2, 1, 8, 16)
    n = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="k must be"):
        decode_attention(q, k[:, :1], v[:, :1], n, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="v must have k's shape"):
        decode_attention(q, k, v[:, :, :8], n, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="lengths must be"):
        decode_attention(q, k, v, n[:1], scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="window must be"):
        decode_attention(q, k, v, n, window=0, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="window must be"):
        attend(q, k, v, n, window=0, scale=1.0)
    with pytest.raises(ValueError, match="is not a valid AttentionImpl"):
        attend(q, k, v, n, window=None, scale=1.0, impl="triton")


def test_cudnn_refuses_an_fp32_cache():
    q, k, v = inputs(2, 2, 1, 8, 16)
    with pytest.raises(ValueError, match="'cudnn' needs a bf16 or fp16 cache"):
        attend(q, k, v, jnp.ones((2,), jnp.int32), window=None, scale=1.0, impl="cudnn")


@pytest.mark.parametrize("window", [None, 5])
def test_dot_product_attention_plumbing(window):
    """The 'cudnn' path's layout, lengths and window mask, run with jax's 'xla' implementation
    (cuDNN itself needs the GPU): against the reference on the same bf16 values."""
    K, G, H, S = 2, 3, 16, 24
    lengths = np.array([0, 1, 7, 24, 26], np.int32)
    q, k, v = inputs(len(lengths), K, G, H, S, q_dtype=BF16, kv_dtype=BF16)
    n = jnp.asarray(lengths)
    got = attention._attend_dpa(q, k, v, n, window, 0.25, "xla")
    got = jnp.where((n > 0)[:, None, None, None], got, 0)
    want = REFERENCE(q, k, v, n, window=window, scale=0.25)
    assert got.shape == q.shape
    assert rel_err(got[1:], want[1:]) < TOL[(BF16, BF16)]


def test_gpu_lowering_is_one_triton_call():
    """At the 11B shapes (speech decoder 112 slots x 2 CFG rows, fp32 and bf16 cache; LLM 112
    slots, bf16) each path lowers to one Triton call. Lowering only: nothing runs."""
    tts, llm = voicechat_11b().tts, voicechat_11b().llm
    cases = [
        (224, tts.n_kv_heads, 1, tts.head_dim, 1537, F32, F32, None),
        (224, tts.n_kv_heads, 1, tts.head_dim, 1537, F32, BF16, 512),
        (112, llm.n_kv_heads, llm.n_heads // llm.n_kv_heads, llm.head_dim, 1500, BF16, BF16, None),
    ]
    for Bsz, K, G, H, S, q_dtype, kv_dtype, window in cases:
        args = (
            jax.ShapeDtypeStruct((Bsz, K, G, H), q_dtype),
            jax.ShapeDtypeStruct((Bsz, K, S, H), kv_dtype),
            jax.ShapeDtypeStruct((Bsz, K, S, H), kv_dtype),
            jax.ShapeDtypeStruct((Bsz,), jnp.int32),
        )
        fn = jax.jit(functools.partial(decode_attention, window=window, scale=H**-0.5))
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1


# ------------------------------------------------------------------ attend against the model


def nano_attend_copy(q, keys, values, mask):
    """``nano._attend`` as it is in the model (copied verbatim)."""
    act = q.dtype
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("btkgh,bksh->bkgts", q, keys.astype(act), preferred_element_type=F32)
    scores = jnp.where(mask[:, None, None], scores * scale, jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(act)
    out = jnp.einsum("bkgts,bksh->bkgth", probs, values.astype(act), preferred_element_type=F32)
    return jnp.moveaxis(out, 3, 1).astype(act)


def nano_copy(q, k, v, pos):
    """``nano._attn``'s mask and attention at T = 1: q [B, K, G, H], pos [B] the query's row."""
    S = k.shape[2]
    rows = pos[:, None] + jnp.arange(1)[None]  # [B, T]
    mask = jnp.arange(S)[None, None] <= rows[..., None]  # [B, T, S] causal, NoPE
    return nano_attend_copy(q[:, None], k, v, mask)[:, 0]


def gemma_copy(q, k, v, pos, window, scale):
    """``gemma.forward``'s attention at T = 1 (copied verbatim; q [B, K, G, H] after RoPE)."""
    T = 1
    S = k.shape[2]
    positions = pos[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    key_pos = jnp.arange(S, dtype=jnp.int32)  # [S]
    causal = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    distance = positions[:, :, None] - key_pos[None, None, :]  # [B, T, S]
    mask = causal & (distance < window)
    qg = q[:, None]  # [B, T, K, G, H]
    logits = jnp.einsum(
        "btkgh,bksh->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32
    )
    logits = logits * scale
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)  # [B, K, G, T, S]
    a = jnp.einsum("bkgts,bksh->btkgh", probs, v.astype(q.dtype))
    return a[:, 0]


_GLOBAL = np.iinfo(np.int32).max  # gemma's window of a global layer


class AttendMatchesTheModel(chex.TestCase):
    """``attend(impl='xla')`` equals the model's jnp attention bit for bit, jitted and eager."""

    def _case(self, G, H, S, q_dtype, kv_dtype, seed):
        pos = np.array([0, 3, S // 2, S - 1, 7, S - 2], np.int32)
        q, k, v = inputs(len(pos), 2, G, H, S, q_dtype=q_dtype, kv_dtype=kv_dtype, seed=seed)
        return q, k, v, jnp.asarray(pos)

    @chex.variants(with_jit=True, without_jit=True)
    def test_nano(self):
        llm = tiny().llm
        for q_dtype, kv_dtype in [(F32, F32), (BF16, BF16)]:
            for G, H in [(llm.n_heads // llm.n_kv_heads, llm.head_dim), (5, 128)]:
                q, k, v, pos = self._case(G, H, 37, q_dtype, kv_dtype, seed=G)
                want = self.variant(nano_copy)(q, k, v, pos)
                fn = functools.partial(attend, window=None, scale=H**-0.5, impl="xla")
                got = self.variant(fn)(q, k, v, pos + 1)
                assert got.dtype == want.dtype == q_dtype
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    @chex.variants(with_jit=True, without_jit=True)
    def test_gemma(self):
        scale = 256.0**-0.5
        # fp32 decoder with an fp32 or bf16 cache; global layers, and windows inside the cache
        # (7500 is the 11B sliding window: wider than the cache, attend drops it)
        cases = [(F32, F32, None), (F32, F32, 5), (F32, BF16, 40), (F32, BF16, 7500)]
        for q_dtype, kv_dtype, window in cases:
            q, k, v, pos = self._case(1, 72, 41, q_dtype, kv_dtype, seed=3)
            gemma_window = _GLOBAL if window is None else window
            fn_want = functools.partial(gemma_copy, window=gemma_window, scale=scale)
            want = self.variant(fn_want)(q, k, v, pos)
            fn = functools.partial(attend, window=window, scale=scale, impl="xla")
            got = self.variant(fn)(q, k, v, pos + 1)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    @chex.variants(with_jit=True, without_jit=True)
    def test_pallas_close_to_xla_and_zero_at_length_0(self):
        lengths = jnp.asarray([0, 1, 16, 17, 23], jnp.int32)
        q, k, v = inputs(5, 2, 2, 16, 23)
        outs = {}
        for impl in AttentionImpl:
            if impl == AttentionImpl.CUDNN:
                continue  # GPU only; its plumbing is tested above
            fn = functools.partial(attend, window=8, scale=0.25, impl=impl)
            outs[impl] = self.variant(fn)(q, k, v, lengths)
            np.testing.assert_array_equal(np.asarray(outs[impl][0]), 0.0)
        assert rel_err(outs["pallas"], outs["xla"]) < TOL[(F32, F32)]
        want = REFERENCE(q, k, v, lengths, window=8, scale=0.25)
        assert rel_err(outs["pallas"], want) < TOL[(F32, F32)]


def _pallas_calls(jaxpr) -> int:
    """The ``pallas_call`` equations in a jaxpr and every jaxpr nested in it."""
    return sum(
        (eqn.primitive.name == "pallas_call")
        + sum(_pallas_calls(sub) for sub in shared.sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def test_tick_with_kernel_attention_matches_xla():
    """The served tick with the kernel for every attention (``attention='pallas'``): the same
    tokens and codes as 'xla' everywhere. With the kernel for the LLM only (``tts_attention='xla'``,
    the H200 choice) the traced tick calls the kernel for the LLM's attention layers alone (its
    parts are the two ticks run here)."""
    from voicechat_jax.config import ServeConfig, tiny
    from voicechat_jax.engine import Engine
    from voicechat_jax.precision import Precision

    cfg, prec = tiny(), Precision.fp32()
    params = shared.params(prec)
    outs, kernels = {}, {}
    for llm, tts in (("xla", None), ("pallas", None), ("pallas", "xla")):
        serve = ServeConfig(
            slots=2,
            frames_per_tick=2,
            context_frames=8,
            attention=llm,
            tts_attention=tts,
            speech_sampling="deterministic",
            precision=prec,
        )
        assert serve.tts_attention == (None if tts is None else AttentionImpl(tts))
        # One program per kernel choice (the staged admission programs are not under test).
        engine = Engine(params, cfg, serve, template=shared.template(serve), staged=False)
        tick = step_lib.make_tick(cfg, serve, engine.kernels)
        traced = jax.make_jaxpr(tick)(*engine._lowering_args(serve.slots))
        kernels[llm, tts] = _pallas_calls(traced.jaxpr)
        if tts is not None:
            continue  # traced only
        beat = engine.empty_beat()
        beat.admit[:] = True
        rng = np.random.default_rng(0)
        got = []
        for _ in range(3):
            beat.audio[:] = 0.1 * rng.standard_normal(beat.audio.shape)
            got.append(jax.device_get(engine.tick(beat)))
            beat.admit[:] = False
        outs[llm, tts] = got
    llm_layers = cfg.llm.pattern.count("*")
    assert kernels["xla", None] == 0
    assert kernels["pallas", "xla"] == llm_layers
    assert kernels["pallas", None] == llm_layers + cfg.tts.n_layers
    for a, b in zip(outs["xla", None], outs["pallas", None], strict=True):
        np.testing.assert_array_equal(a.frames.text, b.frames.text)
        np.testing.assert_array_equal(a.frames.codes, b.frames.codes)
        np.testing.assert_allclose(a.frames.wav, b.frames.wav, rtol=0, atol=1e-4)


def test_serve_config_checks_tts_attention():
    """``tts_attention`` is an ``AttentionImpl`` or None; anything else is a one-line error."""
    from voicechat_jax.config import ServeConfig

    assert ServeConfig().tts_attention is None
    assert ServeConfig(tts_attention="pallas").tts_attention is AttentionImpl.PALLAS
    with pytest.raises(
        ValueError, match=r"tts_attention must be auto\|xla\|cudnn\|pallas\|pallas_mha"
    ):
        ServeConfig(tts_attention="flash")


def test_auto_kernels_are_the_measured_best_per_platform_and_slots():
    """'auto' (the default) becomes XLA off the GPU and below each kernel's measured threshold,
    the kernel at and above it on a GPU; explicit choices stay; an engine makes the choice."""
    from voicechat_jax.config import AUTO_KERNELS, Kernels, ServeConfig, SSMKernel, tiny
    from voicechat_jax.engine import Engine
    from voicechat_jax.precision import Precision

    auto = ServeConfig(slots=4)
    assert (auto.attention, auto.tts_attention, auto.ssm_kernel) == ("auto", None, "auto")
    xla = {"ssm_kernel": "xla", "attention": "xla", "tts_attention": "xla", "projection": "xla"}
    # the codec on the main stream, by itself, unless asked
    codec = {"codec_stream": "False", "codec_in_attention": "False", "codec_frame_behind": "False"}
    xla |= codec
    assert auto.kernels("cpu", 112).row() == xla
    assert auto.kernels("gpu", 1).row() == xla
    best = {"ssm_kernel": "pallas", "attention": "pallas", "tts_attention": "pallas_mha"}
    assert auto.kernels("gpu", 112).row() == best | {"projection": "xla"} | codec
    for fields in (["codec_stream"], ["codec_in_attention"], list(codec)[1:]):
        asked = ServeConfig(slots=4, **dict.fromkeys(fields, True)).kernels("gpu", 112).row()
        assert asked == best | {"projection": "xla"} | codec | dict.fromkeys(fields, "True")
    with pytest.raises(ValueError, match="two places for one codec"):
        ServeConfig(slots=4, codec_stream=True, codec_in_attention=True).kernels("gpu", 112)
    with pytest.raises(ValueError, match="codec_in_attention runs the codec's products in full"):
        ServeConfig(slots=4, codec_in_attention=True, precision="tf32_codec")
    with pytest.raises(ValueError, match="codec_frame_behind places the codec in the attention"):
        ServeConfig(slots=4, codec_frame_behind=True)
    for field, (kernel, from_slots) in AUTO_KERNELS.items():
        assert auto.kernels("gpu", from_slots).row()[field] == kernel
        assert auto.kernels("gpu", from_slots - 1).row()[field] == "xla"
    # A choice made is kept; the speech decoder follows an explicit LLM choice as before.
    explicit = ServeConfig(slots=112, attention="pallas", ssm_kernel="pallas")
    assert explicit.resolved("gpu") is explicit
    assert explicit.kernels("cpu").row()["tts_attention"] == "pallas"
    # The fused Mamba step runs on the CPU (interpreted), never on a GPU (config._FUSED_ON_GPU).
    fused = ServeConfig(slots=112, ssm_kernel="fused")
    assert fused.kernels("cpu").row()["ssm_kernel"] == "fused"
    with pytest.raises(ValueError, match="ssm_kernel='fused' is not served on a GPU"):
        fused.kernels("gpu")
    mixed = ServeConfig(slots=64, attention="xla", tts_attention="auto", ssm_kernel="xla")
    assert mixed.kernels("gpu").row() == {**xla, "tts_attention": "pallas_mha"}
    assert ServeConfig(slots=8).resolved("gpu").ssm_kernel is SSMKernel.PALLAS

    cfg, prec = tiny(), Precision.fp32()
    serve = ServeConfig(slots=2, context_frames=8, precision=prec)
    engine = Engine(shared.params(prec), cfg, serve, template=shared.template(serve))
    assert engine.kernels.row() == xla  # this machine has no GPU
    assert engine.kernels == Kernels()  # every choice XLA, one value
    with pytest.raises(ValueError, match="'auto' must be resolved"):
        Kernels(attention="auto")
