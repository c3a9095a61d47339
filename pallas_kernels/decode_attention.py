"""Decode attention (one query per slot) over a per-slot-length KV cache, as a Pallas kernel.

One decoding step of a causal self-attention layer: each slot b has written ``lengths[b]`` rows
of its cache (the query's own key and value included) and attends from its newest position,
``lengths[b] - 1``, to those rows. Both of the model's decode attentions have this form: the
speech decoder's multi-head attention (``gemma.forward`` at T = 1: G = 1, fp32 or bf16 KV,
sliding-window and global layers; RoPE is already in q and k) and the LLM's grouped-query
attention (``nano._attn`` at T = 1: G = 5 at 11B, bf16 KV, NoPE, global). Why a kernel: at the
two-minute cap the speech decoder reads 774 MB of fp32 KV per session per frame-step, the largest
item of a beat; XLA reads the whole cache whatever the slot's length and reached 1.9-2.2 TB/s on
the H200 (``experiments/beat_profile``). The kernel reads the cache as stored (no copy, no
transpose, no upcast pass), reads only the blocks a slot needs, and splits S across programs so
that a few slots still fill the GPU.

Axis letters are those of ``voicechat_jax.model``: ``B`` slots (CFG rows count as slots), ``K``
key/value heads, ``G`` query heads per kv head (query head ``n = k * G + g``), ``S`` cache rows,
``H`` head dim.

Arguments (both functions):

- ``q``: [B, K, G, H] the step's query (after any RoPE and norm), any float dtype. G = 1 is plain
  multi-head attention.
- ``k``, ``v``: [B, K, S, H] the layer's cache exactly as the engine stores it: position p of slot
  b at row p, each (b, k) one contiguous [S, H] block (``GemmaCache`` / ``NanoState`` leaves).
  fp32 or bf16 (any float dtype), read as stored and upcast inside.
- ``lengths``: [B] int32, rows valid per slot. Key row j of slot b attends iff
  ``j < lengths[b]`` (and ``j < S``: a length past S reads the whole cache, as the model's mask
  does when its position overflows) and, with a ``window``, ``lengths[b] - 1 - window < j``, i.e.
  the last ``window`` rows including the query's own (``gemma.forward``'s ``distance < window``
  with distance = query position - key position). A slot with no row to attend (length <= 0)
  gets an output of exactly zero: defined here, since a softmax over nothing has no value (the
  model never asks for it: at T = 1 the query's own row is always written).
- ``window``: static int >= 1 or None (global attention).
- ``scale``: static float multiplying q . k (``1 / sqrt(H)`` for the LLM,
  ``query_pre_attn_scalar ** -0.5`` for the speech decoder).

Returns [B, K, G, H] in q's dtype.

Math: scores ``scale * q . k`` in fp32, softmax in fp32, value product accumulated in fp32, one
rounding to q's dtype at the end. The reference upcasts q, k and v to fp32 and contracts at
``Precision.HIGHEST``. The kernel's one-pass (online) softmax rescales its running sums per block
and per split (flash-decoding); it differs from the reference by fp32 rounding only, except on its
matrix-unit path (``dot``, below) with a bf16 q and bf16 cache, where the probabilities are
rounded to bf16 for the value product, as the model's own jnp path rounds them to the activation
dtype.

Kernel layout (Triton lowering, chosen explicitly through
``jax.experimental.pallas.triton.CompilerParams``): grid ``(B, K, n_splits)`` with ``n_splits =
cdiv(S, split_s)``; program (b, k, j) owns cache rows ``[j * split_s, (j + 1) * split_s)`` of slot
b, head k. It clips that range to the slot's rows ``[lo, hi)`` (``hi = min(lengths[b], S)``,
``lo = max(lengths[b] - window, 0)``) and loops over the ``block_s``-row blocks that intersect it,
so blocks past a slot's length or before its window start are never loaded; a program whose range
is empty loads no K or V at all. Every program writes its partial softmax state (running max m,
sum l, unnormalised output o; m = -inf, l = 0, o = 0 when empty) to small fp32 arrays
[B, K, n_splits, G(, H)], and a jnp combine outside the kernel rescales and sums them. Every load
and store is masked, so S need not be a multiple of anything; H and G are padded to the next
power of two inside the kernel (Triton's tiles are powers of two: H = 72 is read as 128 masked
lanes). Scores and the value product are computed either as broadcast multiply-and-sum on the
vector units (default for G = 1: a [block_s, H] tile per step), or with ``pl.dot`` on the matrix
units with G and H padded to at least 16 (default for G > 1; Triton's smallest dot tile; fp32
operands are multiplied in full fp32, never TF32). ``interpret=True`` runs the kernel through
the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_DOT_MIN = 16  # Triton's smallest dot tile (M, N and K)
# pallas_call's cost_estimate (present in jax 0.10.2 and 0.11.x; guarded for other versions).
_HAS_COST_ESTIMATE = hasattr(pl, "CostEstimate") and (
    "cost_estimate" in inspect.signature(pl.pallas_call).parameters
)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class DecodeAttentionBlocks:
    """The kernel's tiling, validated on construction.

    Attributes:
      block_s: cache rows loaded per step of a program's loop; a power of two (>= 16 with
        ``dot``). Also the granularity at which rows past a slot's length are skipped.
      split_s: cache rows per program (the split-K unit): a multiple of ``block_s``. Smaller
        splits mean more programs (parallelism at few slots) and more partial results to combine.
      num_warps: Triton warps per program (GPU only); a power of two.
      num_stages: Triton software-pipelining stages of the block loop (GPU only).
      dot: compute scores and the value product on the matrix units (``pl.dot``, G padded to 16)
        rather than as multiply-and-sum on the vector units; None picks ``G > 1``.
    """

    block_s: int = 64
    split_s: int = 256
    num_warps: int = 4
    num_stages: int = 2
    dot: bool | None = None

    def __post_init__(self):
        if not _pow2(self.block_s):
            raise ValueError(f"block_s must be a power of two: {self.block_s}")
        if self.dot and self.block_s < _DOT_MIN:
            raise ValueError(f"block_s must be >= {_DOT_MIN} with dot: {self.block_s}")
        if self.split_s < self.block_s or self.split_s % self.block_s:
            raise ValueError(
                f"split_s={self.split_s} must be a positive multiple of block_s={self.block_s}"
            )
        if not _pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two: {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1: {self.num_stages}")

    def use_dot(self, G: int) -> bool:
        """Whether the matrix-unit path runs for G query heads per kv head."""
        return G > 1 if self.dot is None else self.dot


def _rows(lengths: jax.Array, S: int, window: int | None) -> tuple[jax.Array, jax.Array]:
    """[lo, hi): the cache rows each slot attends to (the module docstring's rule)."""
    hi = jnp.clip(lengths, 0, S)
    lo = jnp.zeros_like(hi) if window is None else jnp.clip(lengths - window, 0, S)
    return lo, hi


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    scale: float,
) -> jax.Array:
    """Decode attention in plain jnp, fp32 throughout (the module docstring states the contract)."""
    S = k.shape[2]
    lo, hi = _rows(lengths.astype(jnp.int32), S, window)
    row = jnp.arange(S)
    seen = (row[None, :] >= lo[:, None]) & (row[None, :] < hi[:, None])  # [B, S]
    scores = scale * jnp.einsum("bkgh,bksh->bkgs", q.astype(F32), k.astype(F32), precision=_HIGHEST)
    scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # a slot that sees nothing: all scores -inf
    weights = jnp.exp(scores - top)  # exactly 0 where unseen
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)  # all zero for a slot that sees nothing
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v.astype(F32), precision=_HIGHEST)
    return out.astype(q.dtype)


def _kernel(
    lengths_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    S: int,
    G: int,
    H: int,
    window: int | None,
    scale: float,
    block_s: int,
    split_s: int,
    dot: bool,
):
    """Program (b, k, j): the partial softmax of rows [j * split_s, (j + 1) * split_s) of one head.

    Refs: lengths [] (slot b's), q [Gp, Hp], k and v [split_s, Hp] (this split's rows), outputs
    o [Gp, Hp], m and l [Gp], all fp32. Gp and Hp are G and H padded to powers of two (Gp >= 16
    with ``dot``); padded lanes are masked on every load and store.
    """
    Gp, Hp = q_ref.shape
    j = pl.program_id(2)
    start = j * split_s
    length = lengths_ref[()]
    hi = jnp.clip(length, 0, S)
    lo = jnp.int32(0) if window is None else jnp.clip(length - window, 0, S)
    first_row = jnp.maximum(lo, start)  # this program's rows: [first_row, last_row)
    last_row = jnp.minimum(hi, start + split_s)
    first = (first_row - start) // block_s  # non-negative: plain integer division
    # The blocks meeting [first_row, last_row), none if it is empty.
    count = jnp.where(last_row > first_row, pl.cdiv(last_row - start, block_s) - first, 0)

    head = jnp.arange(Hp) < H
    g_ok = jnp.arange(Gp) < G
    q = pltriton.load(q_ref, mask=g_ok[:, None] & head[None, :], other=0.0)
    cdt = jnp.promote_types(q.dtype, k_ref.dtype) if dot else F32
    q = q.astype(cdt)

    def body(i, carry):
        o, m, l = carry
        block = first + i
        row = start + block * block_s + jnp.arange(block_s)
        seen = (row >= lo) & (row < hi)  # [block_s]: at least one True in every block visited
        tile = pl.ds(block * block_s, block_s)
        kv_mask = seen[:, None] & head[None, :]
        kb = pltriton.load(k_ref.at[tile, :], mask=kv_mask, other=0.0).astype(cdt)
        if dot:
            s = pltriton.dot(q, kb, trans_b=True, allow_tf32=False)  # [Gp, block_s] fp32
        else:
            s = jnp.sum(q[:, None, :] * kb[None, :, :], axis=-1)  # [Gp, block_s] fp32
        s = jnp.where(seen[None, :], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # finite: the block has a seen row
        alpha = jnp.exp(m - m_new)  # 0 on the first visited block (m = -inf)
        p = jnp.exp(s - m_new[:, None])  # 0 on unseen rows
        vb = pltriton.load(v_ref.at[tile, :], mask=kv_mask, other=0.0).astype(cdt)
        if dot:
            pv = pltriton.dot(p.astype(cdt), vb, allow_tf32=False)  # [Gp, Hp] fp32
        else:
            pv = jnp.sum(p[:, :, None] * vb[None, :, :], axis=1)  # [Gp, Hp] fp32
        return alpha[:, None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=-1)

    init = (
        jnp.zeros((Gp, Hp), F32),
        jnp.full((Gp,), -jnp.inf, F32),
        jnp.zeros((Gp,), F32),
    )
    o, m, l = jax.lax.fori_loop(0, count, body, init)
    pltriton.store(o_ref, o, mask=g_ok[:, None] & head[None, :])
    pltriton.store(m_ref, m, mask=g_ok)
    pltriton.store(l_ref, l, mask=g_ok)


def _combine(o: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Merge the splits' partial softmaxes: o [B, K, n, G, H], m and l [B, K, n, G] -> [B, K, G, H].

    A split that saw nothing has m = -inf, l = 0, o = 0 and gets weight 0; a slot whose splits all
    saw nothing (length 0) gets 0.
    """
    top = jnp.max(m, axis=2)  # [B, K, G]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(m - top[:, :, None])  # [B, K, n, G], 0 for empty splits
    total = jnp.sum(w * l, axis=2)  # [B, K, G]
    out = jnp.sum(w[..., None] * o, axis=2)  # [B, K, G, H]
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(dtype)


def _cost(q, k, v, n_splits: int) -> pl.CostEstimate:
    """An upper bound: every cache row read (the static shape cannot know the lengths)."""
    Bsz, K, G, H = q.shape
    S = k.shape[2]
    partial = Bsz * K * n_splits * G * (H + 2) * 4
    return pl.CostEstimate(
        flops=4 * Bsz * K * G * S * H,
        transcendentals=Bsz * K * G * S,
        bytes_accessed=k.nbytes + v.nbytes + q.nbytes + partial + Bsz * 4,
    )


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    scale: float,
    interpret: bool = False,
    block_s: int = 64,
    split_s: int = 256,
    num_warps: int = 4,
    num_stages: int = 2,
    dot: bool | None = None,
) -> jax.Array:
    """Decode attention as a split-K Pallas kernel that skips rows a slot does not attend to.

    Shapes, dtypes and the masking rule are in the module docstring (same contract as
    ``decode_attention_reference``).

    Args:
      window: static sliding window (the last ``window`` rows), or None for global attention.
      scale: static multiplier of q . k.
      interpret: run through the Pallas interpreter (needed on the CPU).
      block_s, split_s, num_warps, num_stages, dot: the tiling, see ``DecodeAttentionBlocks``.

    Raises:
      ValueError: on inconsistent shapes, a bad window, or invalid block sizes.
    """
    _check(q.ndim == 4, f"q must be [B, K, G, H]: {q.shape}")
    Bsz, K, G, H = q.shape
    _check(
        k.ndim == 4 and k.shape[:2] == (Bsz, K) and k.shape[3] == H,
        f"k must be [B={Bsz}, K={K}, S, H={H}]: {k.shape}",
    )
    _check(v.shape == k.shape, f"v must have k's shape {k.shape}: {v.shape}")
    _check(lengths.shape == (Bsz,), f"lengths must be [B={Bsz}]: {lengths.shape}")
    _check(
        window is None or (isinstance(window, int) and window >= 1),
        f"window must be None or a static int >= 1: {window!r}",
    )
    S = k.shape[2]
    blocks = DecodeAttentionBlocks(block_s, split_s, num_warps, num_stages, dot)
    use_dot = blocks.use_dot(G)
    _check(
        not use_dot or block_s >= _DOT_MIN,
        f"block_s must be >= {_DOT_MIN} with dot (the default for G={G} > 1): {block_s}",
    )
    dot_min = _DOT_MIN if use_dot else 1
    Hp = max(pl.next_power_of_2(H), dot_min)
    Gp = max(pl.next_power_of_2(G), dot_min)
    n_splits = pl.cdiv(S, split_s)

    kernel = functools.partial(
        _kernel,
        S=S,
        G=G,
        H=H,
        window=window,
        scale=float(scale),
        block_s=block_s,
        split_s=split_s,
        dot=use_dot,
    )
    split = pl.BlockSpec((None, None, split_s, Hp), lambda b, h, j: (b, h, j, 0))
    partial = (Bsz, K, n_splits, G)
    cost = {"cost_estimate": _cost(q, k, v, n_splits)} if _HAS_COST_ESTIMATE else {}
    o, m, l = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((*partial, H), F32),
            jax.ShapeDtypeStruct(partial, F32),
            jax.ShapeDtypeStruct(partial, F32),
        ),
        grid=(Bsz, K, n_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, j: (b,)),  # lengths
            pl.BlockSpec((None, None, Gp, Hp), lambda b, h, j: (b, h, 0, 0)),  # q
            split,  # k
            split,  # v
        ],
        out_specs=(
            pl.BlockSpec((None, None, None, Gp, Hp), lambda b, h, j: (b, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, j: (b, h, j, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, j: (b, h, j, 0)),
        ),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="decode_attention",
        **cost,
    )(lengths.astype(jnp.int32), q, k, v)
    return _combine(o, m, l, q.dtype)
