"""The G = 1 decode-attention kernel against its jnp reference, the XLA path, and the model.

``pallas_kernels.mha_decode_attention`` runs in interpret mode on the CPU over head dims cut into
several pieces (H = 72 as at 11B, 40, 12 as in the tiny model, 13 in width-1 pieces), one piece
(H = 128) and the padded layout; fp32 and bf16 caches; lengths at 0, 1, block and split edges,
a full cache and past it; sliding windows shorter and longer than the length; programs of one
head, of several heads of one row, and of a cond/uncond row pair; one split and several. Rows a
slot does not attend to hold NaN (the kernel must never read them). ``attend(impl='pallas_mha')``
is checked against ``attend(impl='xla')`` jitted and eager (chex variants), and one T = 1 step of
``gemma.forward`` (the speech decoder) with it against the same step with 'xla'. Errors are
relative: max|a - b| / max|b|.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mha_decode_attention import (
    MHABlocks,
    default_blocks,
    head_pieces,
    mha_decode_attention,
    mha_decode_attention_reference,
    plan,
)
from voicechat_jax.config import tiny, voicechat_11b
from voicechat_jax.model import gemma
from voicechat_jax.model.attention import attend
from voicechat_jax.precision import Precision

F32, BF16 = jnp.float32, jnp.bfloat16
# By (q dtype, cache dtype). The kernel and the reference read the same cache values and compute
# in fp32: with an fp32 output only the summation order (and the base-2 softmax) differs. A bf16
# output is rounded once (2^-9 relative).
TOL = {(F32, F32): 2e-6, (F32, BF16): 2e-6, (BF16, BF16): 1e-2}
KERNEL = jax.jit(mha_decode_attention, static_argnames=("window", "scale", "interpret", "blocks"))
REFERENCE = jax.jit(mha_decode_attention_reference, static_argnames=("window", "scale"))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def inputs(Bsz, K, H, S, *, q_dtype=F32, kv_dtype=F32, seed=0):
    """Random q [B, K, 1, H] and cache k, v [B, K, S, H]; scores of order a few units."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((Bsz, K, 1, H)), q_dtype)
    k = jnp.asarray(rng.standard_normal((Bsz, K, S, H)), kv_dtype)
    v = jnp.asarray(rng.standard_normal((Bsz, K, S, H)), kv_dtype)
    return q, k, v


def edge_lengths(S: int, block_s: int, split_s: int | None) -> np.ndarray:
    """[8] int32: 0, 1, a block edge and one past it, a split edge, S - 1, S (full), past S."""
    edge = S // 2 if split_s is None else min(split_s, S)
    return np.array([0, 1, block_s, block_s + 1, edge, S - 1, S, S + 3], np.int32)


def poison_unseen(k, v, lengths, window):
    """NaN in every cache row the slot does not attend to (the kernel must never load them)."""
    S = k.shape[2]
    row = np.arange(S)[None, :]
    hi = np.minimum(lengths, S)[:, None]
    lo = np.zeros_like(hi) if window is None else np.clip(lengths - window, 0, S)[:, None]
    unseen = jnp.asarray(~((row >= lo) & (row < hi)))[:, None, :, None]  # [B, 1, S, 1]
    return jnp.where(unseen, jnp.nan, k), jnp.where(unseen, jnp.nan, v)


# (K, H, S, blocks, window, (q dtype, cache dtype)); S is never a multiple of block_s.
CASES = [
    # 11B speech-decoder head (9 pieces of 8 lanes), global layer, three splits
    (2, 72, 77, MHABlocks(block_s=16, split_s=32), None, (F32, F32)),
    # ... bf16 cache, a sliding window shorter than most lengths
    (2, 72, 77, MHABlocks(block_s=16, split_s=32), 20, (F32, BF16)),
    # ... one split (the program normalises; no combine), a window longer than the cache
    (2, 72, 77, MHABlocks(block_s=16, min_programs=1), 500, (F32, BF16)),
    # ... the padded layout (H to 128 masked lanes), two heads of a row per program
    (2, 72, 50, MHABlocks(block_s=16, heads=2, piece=128), 7, (F32, BF16)),
    # ... 5 pieces of 16 lanes, the last one half past H
    (2, 72, 50, MHABlocks(block_s=16, piece=16), None, (F32, F32)),
    # tiny speech decoder (H 12: 3 pieces of 4, window 8); a program spans two rows of
    # different lengths (heads = 2K), so the rows are masked per head
    (4, 12, 23, MHABlocks(block_s=8, heads=8, split_s=16), 8, (F32, F32)),
    # 5 pieces of 8, window 1 (only the query's own row)
    (2, 40, 33, MHABlocks(block_s=8, heads=2, split_s=16), 1, (F32, F32)),
    # one piece (H 128), bf16 q and cache (bf16 output), window 1
    (2, 128, 100, MHABlocks(block_s=32, heads=2), 1, (BF16, BF16)),
]


def _case_id(case) -> str:
    K, H, S, b, w, (qd, kvd) = case
    dt = {F32: "32", BF16: "16"}
    return f"K{K}_H{H}_S{S}_{b.label()}_w{w}_q{dt[qd]}_kv{dt[kvd]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_equals_reference(case):
    K, H, S, blocks, window, (q_dtype, kv_dtype) = case
    lengths = edge_lengths(S, blocks.block_s, blocks.split_s)
    q, k, v = inputs(len(lengths), K, H, S, q_dtype=q_dtype, kv_dtype=kv_dtype, seed=H)
    scale = H**-0.5
    n = jnp.asarray(lengths)
    want = REFERENCE(q, k, v, n, window=window, scale=scale)
    k_bad, v_bad = poison_unseen(k, v, lengths, window)
    got = KERNEL(q, k_bad, v_bad, n, window=window, scale=scale, interpret=True, blocks=blocks)
    assert got.shape == q.shape
    assert got.dtype == q_dtype
    assert np.all(np.isfinite(np.asarray(got, np.float32)))  # no unseen (NaN) row was read
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), 0.0)  # length 0
    np.testing.assert_array_equal(np.asarray(got[-1], np.float32) == 0.0, window == 1)
    assert rel_err(got, want) < TOL[(q_dtype, kv_dtype)]
    if window == 1:  # the query's own row: its value, or nothing when it is past the cache
        for b, length in enumerate(lengths[1:], start=1):
            own = np.asarray(v[b, :, length - 1], np.float32) if length <= S else np.zeros((K, H))
            np.testing.assert_allclose(
                np.asarray(got[b, :, 0], np.float32), own, rtol=TOL[(q_dtype, kv_dtype)]
            )


def test_cond_uncond_pairs_and_inactive_slots():
    """Rows 2b and 2b + 1 (cond, uncond) share a length, as ``ear_tts`` lays them out; programs
    of one row (heads = K) and of the pair (heads = 2K). An inactive slot (length
    0) whose cache is all NaN gets zeros."""
    K, H, S = 2, 72, 45
    slot_lengths = np.array([45, 0, 17, 1, 30], np.int32)
    lengths = np.repeat(slot_lengths, 2)
    q, k, v = inputs(len(lengths), K, H, S, kv_dtype=BF16, seed=1)
    n = jnp.asarray(lengths)
    want = REFERENCE(q, k, v, n, window=16, scale=0.125)
    k_bad, v_bad = poison_unseen(k, v, lengths, 16)
    for heads in (K, 2 * K):
        blocks = MHABlocks(block_s=8, heads=heads, split_s=16)
        got = KERNEL(q, k_bad, v_bad, n, window=16, scale=0.125, interpret=True, blocks=blocks)
        np.testing.assert_array_equal(np.asarray(got[2:4]), 0.0)
        assert rel_err(got, want) < TOL[(F32, BF16)], heads


def test_at_the_11b_speech_decoder_length():
    """S = 1537 (the cap's cache), H = 72, bf16 cache, the default tiling (here 25 splits: few
    heads); lengths at the cap, past a split edge, and 1; two of the 16 heads to keep it quick."""
    S, H = 1537, 72
    lengths = jnp.asarray([1537, 577, 1500, 1], jnp.int32)
    q, k, v = inputs(4, 2, H, S, kv_dtype=BF16, seed=2)
    want = REFERENCE(q, k, v, lengths, scale=256.0**-0.5)
    got = KERNEL(q, k, v, lengths, scale=256.0**-0.5, interpret=True, blocks=MHABlocks())
    assert rel_err(got, want) < TOL[(F32, BF16)]


@pytest.mark.parametrize("kv_dtype", [F32, BF16])
def test_default_tiling_follows_the_cache_dtype(kv_dtype):
    """With no tiling given, the kernel runs the one measured fastest for the cache's dtype
    (fp32: 64 rows, 32-lane pieces; bf16: 32 rows, 16-lane pieces; H = 72 leaves lanes masked),
    and its output is the reference's at the cap's length, past a block edge and at 1."""
    want_blocks = (
        MHABlocks(block_s=64, piece=32) if kv_dtype == F32 else MHABlocks(block_s=32, piece=16)
    )
    assert default_blocks(kv_dtype) == want_blocks
    assert sum(w for _, w in head_pieces(72, want_blocks.piece)) > 72  # lanes past H masked
    S, H = 1537, 72
    lengths = jnp.asarray([1537, 65, 1, 0], jnp.int32)
    q, k, v = inputs(4, 2, H, S, kv_dtype=kv_dtype, seed=3)
    want = REFERENCE(q, k, v, lengths, scale=256.0**-0.5)
    got = KERNEL(q, k, v, lengths, scale=256.0**-0.5, interpret=True)
    np.testing.assert_array_equal(np.asarray(got[3]), 0.0)
    assert rel_err(got, want) < TOL[(F32, kv_dtype)]


def test_plan_at_11b():
    """The split the default tiling picks at the 11B shapes (B * K heads, S = 1537)."""
    S = 1537
    # 56 slots: 1792 heads < 4096 programs wanted, 3 splits of 576 rows (9 blocks of 64)
    assert plan(112 * 16, S, MHABlocks()) == plan(1792, S, MHABlocks(split_s=576))
    p = plan(1792, S, MHABlocks())
    assert (p.P, p.R, p.split_s, p.n_splits) == (1, 64, 576, 3)
    p = plan(3584, S, MHABlocks())  # 112 slots: 2 splits
    assert (p.split_s, p.n_splits) == (832, 2)
    p = plan(3584, S, MHABlocks(min_programs=1))  # one split, padded to whole blocks
    assert (p.split_s, p.n_splits) == (1600, 1)
    assert plan(6, 40, MHABlocks(heads=4, block_s=8)).P == 2  # reduced to divide B * K


def test_head_pieces():
    assert head_pieces(72) == tuple((off, 8) for off in range(0, 72, 8))
    assert head_pieces(12) == ((0, 4), (4, 4), (8, 4))
    assert head_pieces(128) == ((0, 128),)
    assert head_pieces(72, 128) == head_pieces(72, 1024) == ((0, 128),)
    assert head_pieces(72, 16) == tuple((off, 16) for off in range(0, 80, 16))
    assert head_pieces(12, 8) == ((0, 8), (8, 8))
    assert head_pieces(13) == tuple((off, 1) for off in range(13))
    assert head_pieces(34) == ((0, 64),)  # 17 pieces of 2 would be too many: padded


@pytest.mark.parametrize(
    "spec", ["64:1:auto:4", "32:2:one:8", "16:4:96:4:s3", "64:1:auto512:4:w16", "8:1:one:2:s1:w128"]
)
def test_labels_round_trip(spec):
    assert MHABlocks.parse(spec).label() == spec
    assert MHABlocks.parse(spec) == MHABlocks.parse(MHABlocks.parse(spec).label())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_s": 48}, "block_s must be a power of two"),
        ({"heads": 3}, "heads must be a power of two"),
        ({"block_s": 64, "split_s": 96}, "must be a positive multiple of block_s"),
        ({"min_programs": 0}, "min_programs must be >= 1"),
        ({"num_warps": 3}, "num_warps must be a power of two"),
        ({"num_stages": 0}, "num_stages must be >= 1"),
        ({"piece": 24}, "piece must be a power of two"),
    ],
)
def test_bad_blocks_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MHABlocks(**kwargs)


def test_bad_shapes_are_refused():
    q, k, v = inputs(2, 2, 8, 16)
    n = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="G = 1"):
        mha_decode_attention(jnp.tile(q, (1, 1, 2, 1)), k, v, n, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="G = 1"):
        mha_decode_attention_reference(jnp.tile(q, (1, 1, 2, 1)), k, v, n, scale=1.0)
    with pytest.raises(ValueError, match="k and v must be"):
        mha_decode_attention(q, k[:, :1], v, n, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="lengths must be"):
        mha_decode_attention(q, k, v, n[:1], scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="window must be"):
        mha_decode_attention(q, k, v, n, window=0, scale=1.0, interpret=True)


def test_gpu_lowering_is_one_triton_call():
    """At the 11B speech-decoder shapes (112 slots x 2 CFG rows; fp32 cache, one split; bf16
    cache, a 512-row window, the default split) the kernel lowers to one Triton call. Lowering
    only: nothing runs."""
    tts = voicechat_11b().tts
    Bsz, K, H, S = 224, tts.n_kv_heads, tts.head_dim, 1537
    for kv_dtype, window, blocks in [(F32, None, MHABlocks(min_programs=1)), (BF16, 512, None)]:
        args = (
            jax.ShapeDtypeStruct((Bsz, K, 1, H), F32),
            jax.ShapeDtypeStruct((Bsz, K, S, H), kv_dtype),
            jax.ShapeDtypeStruct((Bsz, K, S, H), kv_dtype),
            jax.ShapeDtypeStruct((Bsz,), jnp.int32),
        )
        fn = functools.partial(mha_decode_attention, window=window, scale=0.0625, blocks=blocks)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1


class AttendWithTheKernel(chex.TestCase):
    """``attend(impl='pallas_mha')`` against ``attend(impl='xla')``, jitted and eager."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_close_to_xla(self):
        lengths = jnp.asarray([0, 1, 8, 9, 23, 30], jnp.int32)
        q, k, v = inputs(6, 2, 12, 23, kv_dtype=BF16, seed=4)
        outs = {}
        for impl in ("xla", "pallas_mha"):
            fn = functools.partial(attend, window=5, scale=0.25, impl=impl)
            outs[impl] = self.variant(fn)(q, k, v, lengths)
        np.testing.assert_array_equal(np.asarray(outs["pallas_mha"][0]), 0.0)
        assert rel_err(outs["pallas_mha"], outs["xla"]) < TOL[(F32, BF16)]


def test_grouped_query_runs_the_pallas_kernel():
    """At G > 1 'pallas_mha' is 'pallas' (the grouped-query kernel), bit for bit."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((3, 2, 2, 16)), F32)
    k, v = (jnp.asarray(rng.standard_normal((3, 2, 23, 16)), F32) for _ in range(2))
    lengths = jnp.asarray([0, 16, 23], jnp.int32)
    got = {}
    for impl in ("pallas", "pallas_mha"):
        fn = functools.partial(attend, window=None, scale=0.25, impl=impl)
        got[impl] = jax.jit(fn)(q, k, v, lengths)
    np.testing.assert_array_equal(np.asarray(got["pallas"]), np.asarray(got["pallas_mha"]))


def test_speech_decoder_step_with_the_kernel():
    """One T = 1 step of the tiny speech decoder (sliding and global layers, RoPE) under the
    ``bf16_tts_kv`` policy with ``attention='pallas_mha'``: the same positions and first-layer
    cache as with 'xla', and to rounding the same later layers' cache and hidden states; rows at
    positions 0 .. past the window. (An fp32 cache takes the same path; the kernel's fp32
    numerics are checked above.)"""
    kv_dtype = BF16
    cfg = tiny().tts
    prec = Precision(tts_kv=kv_dtype)
    params = gemma.init(jax.random.key(0), cfg, prec)
    B, S = 4, 20
    rng = np.random.default_rng(6)
    shape = (B, cfg.n_kv_heads, S, cfg.head_dim)
    kv = [jnp.asarray(rng.standard_normal(shape), kv_dtype) for _ in range(2 * cfg.n_layers)]
    # Rows at different positions (the window is 8); rows past a position are never read.
    pos = jnp.asarray([0, 3, 9, 12], jnp.int32)
    cache = gemma.GemmaCache(k=tuple(kv[: cfg.n_layers]), v=tuple(kv[cfg.n_layers :]), pos=pos)
    x = jnp.asarray(rng.standard_normal((B, 1, cfg.d_model)), F32)
    out = {}
    for impl in ("xla", "pallas_mha"):
        step = jax.jit(functools.partial(gemma.forward, cfg=cfg, attention=impl))
        out[impl] = step(params, cache, x)
    (cache_x, h_x), (cache_p, h_p) = out["xla"], out["pallas_mha"]
    np.testing.assert_array_equal(cache_p.pos, cache_x.pos)
    np.testing.assert_array_equal(cache_p.k[0], cache_x.k[0])  # written before any attention
    np.testing.assert_array_equal(cache_p.v[0], cache_x.v[0])
    # fp32 rounding of layer l's attention moves the rows written by layers > l; a bf16 cache
    # rounds those rows again, so one of them can move by a bf16 ulp (2^-8 relative).
    tol = 1e-5 if kv_dtype == F32 else 2.0**-8
    for a, b in zip(cache_p.k + cache_p.v, cache_x.k + cache_x.v, strict=True):
        assert rel_err(a, b) < tol
    assert rel_err(h_p, h_x) < tol
