"""Multi-head (G = 1) decode attention over a per-slot-length KV cache, as a Pallas kernel.

The speech decoder's attention at T = 1 (``gemma.forward``: 28 layers, one query head per
key/value head, H = 72 at 11B, an fp32 cache under the faithful policy or a bf16 one under
``bf16_tts_kv``, cond and uncond CFG rows as rows ``2b`` and ``2b + 1``). The grouped-query
kernel of ``decode_attention.py`` serves it poorly: at G = 1 it has one query row per program,
pads H = 72 to 128 lanes, and reduces the value product across warps (through shared memory,
with a barrier) on every block; compiled for sm_90a on the CPU
(``experiments/decode_attention/ptx_check.py``) its G = 1 build takes 255 registers a thread.
At G = 1 attention is a memory-bound matrix-vector product per head, and this kernel is laid
out for that:

- **Heads are rows.** q [B, K, 1, H] and the caches [B, K, S, H] are viewed (free reshapes) as
  ``B * K`` independent heads, [BK, H] and [BK, S, H]; a program takes ``heads`` consecutive ones
  (P <= K: heads of one row; P = 2K: a slot's cond and uncond rows, which share a length) and one
  split of the sequence.
- **H is not padded to 128.** The head dim is cut into equal power-of-two pieces, each loaded
  as its own [P, R, piece] tile at its static lane offset; by default the widest piece that
  divides H (72 = 9 x 8 lanes, 12 = 3 x 4), so every lane loaded is a lane of the cache and the
  pieces of a row together read its H contiguous values. Equal pieces share one Triton layout,
  so their products, scores and accumulators combine element-wise (pieces of unequal widths,
  64 + 8, get two layouts and a shared-memory conversion of a whole tile on every step). The
  trade: a narrow piece is a short run of bytes per row (8 lanes: 32 bytes fp32, 16 bf16), so
  one warp's load touches many cache lines. ``piece`` sets a wider piece, the last one masked
  past H (16: 5 pieces, 80 lanes; 128: one piece, H padded as the grouped-query kernel pads it).
- **One softmax per tile row: nothing crosses warps inside the loop.** Each of the R rows of the
  tile keeps its own running max m, sum l and [H] accumulator over the cache rows it visits
  (rows ``r``, ``r + R``, ...), so a step of the loop is the loads, the score reduction over H
  (within a warp) and element-wise updates; the R partial softmaxes of a head are merged once,
  after the loop. Products are taken on the vector units in fp32 (at G = 1 there is no matrix
  for the tensor cores); a bf16 cache is loaded as bf16 and upcast in registers (no converted
  copy of the cache).
- **Only the rows a slot attends to are loaded.** Each program clips its split to its heads'
  rows ``[lo, hi)`` (causal length and sliding window) and loops over only the R-row blocks that
  meet them; inside a visited block, rows past ``hi`` or before ``lo`` are masked (a masked lane
  is not fetched). A program whose range is empty loads no K or V.
- **Split-K when there are few heads.** With ``split_s=None`` S is split only when there are
  fewer head groups than ``min_programs``, into about that many programs; then a small jnp
  combine merges the splits' partial softmaxes. With one split the program writes the
  normalised output itself (no combine pass).

Axis letters are those of ``voicechat_jax.model``: ``B`` rows (CFG rows count as rows), ``K``
key/value heads, ``S`` cache rows, ``H`` head dim; local: ``R`` rows of one tile (``block_s``),
``P`` heads of one program.

Arguments (both functions), the contract of ``decode_attention.decode_attention`` at G = 1:

- ``q``: [B, K, 1, H] the step's query (after RoPE and norm), any float dtype.
- ``k``, ``v``: [B, K, S, H] the layer's cache as the engine stores it (position p at row p),
  fp32 or bf16 (any float dtype), read as stored and upcast inside.
- ``lengths``: [B] int32 rows written per slot, the query's own included. Key row j of row b is
  attended iff ``j < lengths[b]`` (and ``j < S``) and, with a ``window``,
  ``lengths[b] - 1 - window < j``. A row that sees nothing (length <= 0, or a window past the
  cache) gets exactly zero.
- ``window``: static int >= 1 or None; ``scale``: static float multiplying q . k.

Returns [B, K, 1, H] in q's dtype.

Math: scores ``scale * q . k`` in fp32 (``scale * log2(e)`` is folded into q once and the
softmax runs in base 2, ``exp2``, which is the same function), softmax and value product in fp32,
one rounding to q's dtype at the end. It differs from the reference (and from the model's jnp
path with an fp32 q) by fp32 rounding only.

Lowering: Triton (``jax.experimental.pallas.triton``), chosen explicitly through its
``CompilerParams``; ``interpret=True`` runs the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.decode_attention import decode_attention_reference

F32 = jnp.float32
_LOG2E = math.log2(math.e)
# The running max before any row is seen: finite, so that max(m, -inf) - m is 0, never NaN.
_NEG = -1e30
_HAS_COST_ESTIMATE = hasattr(pl, "CostEstimate") and (
    "cost_estimate" in inspect.signature(pl.pallas_call).parameters
)


_DEFAULT_MIN_PROGRAMS = 4096
_DEFAULT_STAGES = 2


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class MHABlocks:
    """The kernel's tiling, validated on construction.

    Attributes:
      block_s: R, cache rows per head per step of a program's loop (a power of two); also the
        granularity at which rows past a slot's length are skipped. 64 rows of H = 72 is 18 KiB
        of k and v per step in fp32, 9 KiB in bf16.
      heads: P, heads per program (a power of two); reduced to the largest power of two that
        divides B * K if it does not. P and R trade against each other (a program's tile is
        P x R rows); P > 1 groups a row's heads (P <= K) or a slot's cond and uncond rows
        (P = 2K, the same length) into one program.
      split_s: cache rows per program, a multiple of block_s; None picks from the shapes (the
        module docstring).
      min_programs: with ``split_s=None``, split S when there are fewer head groups than this:
        about 30 programs per SM of an H200 (132 SMs), so that the last wave of programs is a
        small part of the whole.
      num_warps: Triton warps per program (a power of two).
      num_stages: Triton software-pipelining stages of the row loop.
      piece: lanes per head-dim piece (a power of two), H covered by ``cdiv(H, piece)`` pieces
        and lanes past H masked; None: the widest power of two dividing H (no masked lane).
    """

    block_s: int = 64
    heads: int = 1
    split_s: int | None = None
    min_programs: int = _DEFAULT_MIN_PROGRAMS
    num_warps: int = 4
    num_stages: int = _DEFAULT_STAGES
    piece: int | None = None

    def __post_init__(self):
        if not _pow2(self.block_s):
            raise ValueError(f"block_s must be a power of two: {self.block_s}")
        if not _pow2(self.heads):
            raise ValueError(f"heads must be a power of two: {self.heads}")
        if self.split_s is not None and (self.split_s < 1 or self.split_s % self.block_s):
            raise ValueError(
                f"split_s={self.split_s} must be a positive multiple of block_s={self.block_s}"
            )
        if self.min_programs < 1:
            raise ValueError(f"min_programs must be >= 1: {self.min_programs}")
        if not _pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two: {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1: {self.num_stages}")
        if self.piece is not None and not _pow2(self.piece):
            raise ValueError(f"piece must be a power of two: {self.piece}")

    def label(self) -> str:
        """A short name, ``block_s:heads:split:num_warps[:sN][:wN]`` (what ``parse`` reads).

        ``split`` is ``auto`` (split_s None, the default min_programs), ``one`` (split_s None,
        min_programs 1: never split), ``autoN`` (min_programs N) or split_s; ``sN`` is
        num_stages when not the default 2, ``wN`` a set ``piece``.
        """
        if self.split_s is not None:
            split = str(self.split_s)
        elif self.min_programs == _DEFAULT_MIN_PROGRAMS:
            split = "auto"
        else:
            split = "one" if self.min_programs == 1 else f"auto{self.min_programs}"
        parts = [str(self.block_s), str(self.heads), split, str(self.num_warps)]
        if self.num_stages != _DEFAULT_STAGES:
            parts.append(f"s{self.num_stages}")
        if self.piece is not None:
            parts.append(f"w{self.piece}")
        return ":".join(parts)

    @classmethod
    def parse(cls, spec: str) -> MHABlocks:
        """The tiling a ``label`` names (experiment flags)."""
        parts = spec.split(":")
        if len(parts) < 4:
            raise ValueError(f"want block_s:heads:split:num_warps[:sN][:wN]: {spec!r}")
        block_s, heads, split, num_warps, *extra = parts
        kw: dict = {"block_s": int(block_s), "heads": int(heads), "num_warps": int(num_warps)}
        if split == "one":
            kw["min_programs"] = 1
        elif split.startswith("auto"):
            kw["min_programs"] = int(split[4:] or _DEFAULT_MIN_PROGRAMS)
        else:
            kw["split_s"] = int(split)
        for token in extra:
            if token[:1] in ("s", "w") and token[1:].isdigit():
                kw["num_stages" if token[0] == "s" else "piece"] = int(token[1:])
            else:
                raise ValueError(f"unknown tiling option {token!r} in {spec!r}")
        return cls(**kw)


_MAX_PIECES = 16


def head_pieces(H: int, piece: int | None = None) -> tuple[tuple[int, int], ...]:
    """(lane offset, width) of the equal power-of-two pieces that cover H lanes.

    ``piece=None``: the widest power of two dividing H, so the pieces tile H exactly:
    ``head_pieces(72)`` is nine pieces of 8 lanes, ``head_pieces(12)`` three of 4,
    ``head_pieces(128)`` one of 128; where that would take more than 16 pieces, one piece of
    ``next_pow2(H)``. A set ``piece`` (capped at ``next_pow2(H)``) covers ``cdiv(H, piece)``
    pieces, the lanes past H masked: ``head_pieces(72, 16)`` is five pieces of 16 (80 lanes).
    """
    if piece is None:
        piece = H & -H
        if H // piece > _MAX_PIECES:
            piece = pl.next_power_of_2(H)
    piece = min(piece, pl.next_power_of_2(H))
    return tuple((off, piece) for off in range(0, H, piece))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static sizes of one call: heads per program, rows per step, the split."""

    P: int  # heads per program
    R: int  # rows per step
    split_s: int  # rows per program, a multiple of R (>= S when n_splits == 1)
    n_splits: int


def default_blocks(kv_dtype) -> MHABlocks:
    """The tiling the kernel runs when none is given: the fastest measured for the cache's dtype.

    On one H200 at the 11B shapes (56 and 112 sessions, every cache full;
    ``experiments/decode_attention``, rows ``results/h200_mha.jsonl``):

    - a 4-byte cache (fp32, faithful): 64 rows a step, 32-lane pieces (H = 72 as 3 x 32, 24
      lanes masked), 0.520 ms a layer at 56 sessions against XLA's 0.620 (3.05 TB/s; 1.19x), and
      0.966 against 1.158 at 112 (1.20x);
    - a 2-byte cache (bf16): 32 rows a step, 16-lane pieces, 0.277 ms against XLA's 0.503 at 56
      (2.87 TB/s; 1.82x) and 0.482 against 0.924 at 112 (1.92x).

    The unmasked 8-lane pieces of ``MHABlocks()`` came out slower in both (a warp's load of an
    8-lane piece touches 16 cache lines).
    """
    if jnp.dtype(kv_dtype).itemsize >= 4:
        return MHABlocks(block_s=64, piece=32)
    return MHABlocks(block_s=32, piece=16)


def plan(BK: int, S: int, blocks: MHABlocks) -> _Plan:
    """The program grid for ``BK`` heads of ``S`` rows under ``blocks`` (static)."""
    P = blocks.heads
    while BK % P:
        P //= 2
    R = blocks.block_s
    if blocks.split_s is not None:
        split_s = blocks.split_s
    else:
        groups = BK // P
        n = 1 if groups >= blocks.min_programs else pl.cdiv(blocks.min_programs, groups)
        n = max(1, min(n, pl.cdiv(S, R)))
        split_s = pl.cdiv(pl.cdiv(S, n), R) * R
    n_splits = pl.cdiv(S, split_s)
    if n_splits == 1:
        split_s = pl.cdiv(S, R) * R  # one block along S (past S: masked, never read)
    return _Plan(P=P, R=R, split_s=split_s, n_splits=n_splits)


def mha_decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    scale: float,
) -> jax.Array:
    """The kernel's contract in plain jnp, fp32 throughout: ``decode_attention_reference``
    (``pallas_kernels.decode_attention``) at G = 1, with the same rows and the same zero for a
    row that sees nothing."""
    if q.ndim != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, K, 1, H] (G = 1): {q.shape}")
    return decode_attention_reference(q, k, v, lengths, window=window, scale=scale)


def _kernel(*refs, **static):
    """Program (p, j) of ``mha_decode_attention``'s grid: ``attend_program`` for split j."""
    attend_program(pl.program_id(1), *refs, **static)


def attend_program(
    j,
    lo_ref,
    hi_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    H: int,
    pieces: tuple[tuple[int, int], ...],
    R: int,
    split_s: int,
    single: bool,
    qk_scale: float,
):
    """One program: heads [p * P, (p + 1) * P) over rows [j * split_s, (j + 1) * split_s).

    The program's body, for this kernel's grid and for a launch that runs it beside other work
    (``pallas_kernels.attention_product``); ``j`` (a traced int) is its split. Refs, as blocks
    of head group p: lo, hi [P] int32 (each head's attended rows), q [P, H], k and v
    [P, split_s, H] (this split's rows; lanes past H only where the last piece runs past H,
    masked). Outputs: with one split, o [P, H] in q's dtype, normalised; else o [P, H], m and l
    [P], fp32 partials (m in base-2 units, as the kernel's softmax).
    """
    P = q_ref.shape[0]
    # The cache is read once per call: a hint to evict its lines first.
    stream = functools.partial(pltriton.load, other=0.0, eviction_policy="evict_first")
    start = j * split_s
    lo = pltriton.load(lo_ref)  # [P]
    hi = pltriton.load(hi_ref)
    first_row = jnp.maximum(jnp.min(lo), start)  # this program's rows: [first_row, last_row)
    last_row = jnp.minimum(jnp.max(hi), start + split_s)
    first = (first_row - start) // R  # non-negative: plain integer division
    count = jnp.where(last_row > first_row, pl.cdiv(last_row - start, R) - first, 0)

    def lanes(width: int, off: int) -> jax.Array | None:
        """[width] bool lanes inside H, or None when the piece lies wholly inside."""
        return None if off + width <= H else (off + jnp.arange(width)) < H

    qs = []
    for off, width in pieces:
        ok = lanes(width, off)
        tile = (slice(None), pl.ds(off, width))
        mask = None if ok is None else jnp.broadcast_to(ok[None, :], (P, width))
        qp = pltriton.load(q_ref.at[tile], mask=mask, other=None if ok is None else 0.0)
        qs.append(qp.astype(F32) * qk_scale)  # [P, width]

    def body(i, carry):
        m, l, accs = carry  # m, l [P, R]; accs [P, R, width] per piece
        row = start + (first + i) * R + jnp.arange(R)  # [R]
        seen = (row[None, :] >= lo[:, None]) & (row[None, :] < hi[:, None])  # [P, R]
        rows = pl.ds((first + i) * R, R)  # rows of this split's block
        ks, vs = [], []
        for off, width in pieces:
            ok = lanes(width, off)
            mask = seen[:, :, None] if ok is None else seen[:, :, None] & ok[None, None, :]
            mask = jnp.broadcast_to(mask, (P, R, width))
            tile = (slice(None), rows, pl.ds(off, width))
            ks.append(stream(k_ref.at[tile], mask=mask))
            vs.append(stream(v_ref.at[tile], mask=mask))
        # Products summed over the pieces element-wise, then one reduction over the lanes.
        prod = sum(qp[:, None, :] * kp.astype(F32) for qp, kp in zip(qs, ks, strict=True))
        s = jnp.sum(prod, axis=-1)  # [P, R], base-2 logits
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, s)  # finite: m starts at _NEG
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new)  # 0 where unseen
        accs = tuple(
            alpha[:, :, None] * acc + p[:, :, None] * vp.astype(F32)
            for acc, vp in zip(accs, vs, strict=True)
        )
        return m_new, alpha * l + p, accs

    init = (
        jnp.full((P, R), _NEG, F32),
        jnp.zeros((P, R), F32),
        tuple(jnp.zeros((P, R, width), F32) for _, width in pieces),
    )
    m, l, accs = jax.lax.fori_loop(0, count, body, init)
    # Merge the R row-softmaxes of each head (once per program).
    top = jnp.max(m, axis=1)  # [P]
    w = jnp.exp2(m - top[:, None])  # [P, R]; rows that saw nothing have l = 0, acc = 0
    total = jnp.sum(w * l, axis=1)  # [P]
    outs = [jnp.sum(w[:, :, None] * acc, axis=1) for acc in accs]  # [P, width] per piece
    o_ref = out_refs[0]
    if single:
        inv = 1.0 / jnp.where(total > 0, total, 1.0)  # a head that saw nothing: 0 / 1
        outs = [(o * inv[:, None]).astype(o_ref.dtype) for o in outs]
    for (off, width), o in zip(pieces, outs, strict=True):
        ok = lanes(width, off)
        mask = None if ok is None else jnp.broadcast_to(ok[None, :], (P, width))
        pltriton.store(o_ref.at[:, pl.ds(off, width)], o, mask=mask)
    if not single:
        pltriton.store(out_refs[1], top)
        pltriton.store(out_refs[2], total)


def _combine(o: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Merge the splits' partials: o [BK, n, H], m and l [BK, n] (base 2) -> [BK, H].

    A split that saw nothing has l = 0 and o = 0 (m = its start value) and adds nothing; a head
    whose splits all saw nothing gets 0.
    """
    top = jnp.max(m, axis=1, keepdims=True)  # [BK, 1]
    w = jnp.exp2(m - top)  # [BK, n]
    total = jnp.sum(w * l, axis=1)  # [BK]
    out = jnp.sum(w[..., None] * o, axis=1) / jnp.where(total > 0, total, 1.0)[:, None]
    return out.astype(dtype)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class AttentionLaunch:
    """One call's attention as a launch lays it out: this kernel's, or a launch that also runs
    other work (``pallas_kernels.attention_product``), whose grid maps onto ``(p, j)``.

    Attributes:
      operands: lo, hi [BK] int32, q [BK, H], k and v [BK, S, H] (free reshapes of the call's).
      static: ``attend_program``'s keywords.
      groups: head groups (BK / P); n_splits: splits of S (a program is one (p, j) of both).
      shape: (B, K, H) and q's dtype, for ``finish``.
    """

    operands: tuple[jax.Array, ...]
    static: dict
    P: int
    split_s: int
    Hb: int
    groups: int
    n_splits: int
    shape: tuple[int, int, int]
    dtype: jnp.dtype
    cost: tuple[int, int, int]  # flops, transcendentals, bytes: an upper bound (every row read)

    def in_specs(self, pj) -> list[pl.BlockSpec]:
        """Blocks of the operands for a grid whose indices ``pj(*indices)`` maps to (p, j)."""
        P, Hb = self.P, self.Hb
        heads = pl.BlockSpec((P,), lambda *g: (pj(*g)[0],))
        kv = pl.BlockSpec((P, self.split_s, Hb), lambda *g: (*pj(*g), 0))
        return [heads, heads, pl.BlockSpec((P, Hb), lambda *g: (pj(*g)[0], 0)), kv, kv]

    def out_shape(self):
        BK, n = self.groups * self.P, self.n_splits
        H = self.shape[2]
        if n == 1:
            return (jax.ShapeDtypeStruct((BK, H), self.dtype),)
        return (
            jax.ShapeDtypeStruct((BK, n, H), F32),
            jax.ShapeDtypeStruct((BK, n), F32),
            jax.ShapeDtypeStruct((BK, n), F32),
        )

    def out_specs(self, pj) -> list[pl.BlockSpec]:
        P, Hb = self.P, self.Hb
        if self.n_splits == 1:
            return [pl.BlockSpec((P, Hb), lambda *g: (pj(*g)[0], 0))]
        return [
            pl.BlockSpec((P, None, Hb), lambda *g: (*pj(*g), 0)),
            pl.BlockSpec((P, None), lambda *g: pj(*g)),
            pl.BlockSpec((P, None), lambda *g: pj(*g)),
        ]

    def finish(self, outs) -> jax.Array:
        """[B, K, 1, H] from the launch's attention outputs (the splits merged, if several)."""
        out = outs[0] if self.n_splits == 1 else _combine(*outs, self.dtype)
        Bsz, K, H = self.shape
        return out.reshape(Bsz, K, 1, H)


def attention_launch(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None,
    scale: float,
    blocks: MHABlocks | None,
) -> AttentionLaunch:
    """The checked layout of one call (``mha_decode_attention``'s arguments)."""
    _check(q.ndim == 4 and q.shape[2] == 1, f"q must be [B, K, 1, H] (G = 1): {q.shape}")
    Bsz, K, _, H = q.shape
    _check(
        k.ndim == 4 and k.shape[:2] == (Bsz, K) and k.shape[3] == H and v.shape == k.shape,
        f"k and v must be [B={Bsz}, K={K}, S, H={H}]: {k.shape}, {v.shape}",
    )
    _check(lengths.shape == (Bsz,), f"lengths must be [B={Bsz}]: {lengths.shape}")
    _check(
        window is None or (isinstance(window, int) and window >= 1),
        f"window must be None or a static int >= 1: {window!r}",
    )
    blocks = blocks or default_blocks(k.dtype)
    S = k.shape[2]
    BK = Bsz * K
    pl_ = plan(BK, S, blocks)
    n = pl_.n_splits
    pieces = head_pieces(H, blocks.piece)
    lengths = lengths.astype(jnp.int32)
    hi = jnp.clip(lengths, 0, S)
    lo = jnp.zeros_like(hi) if window is None else jnp.clip(lengths - window, 0, S)
    hi = jnp.repeat(hi, K)  # [BK]: head (b, k) is row b * K + k
    lo = jnp.repeat(lo, K)
    partial = 0 if n == 1 else BK * n * (H + 2) * 4
    return AttentionLaunch(
        operands=(lo, hi, q.reshape(BK, H), k.reshape(BK, S, H), v.reshape(BK, S, H)),
        static=dict(
            H=H,
            pieces=pieces,
            R=pl_.R,
            split_s=pl_.split_s,
            single=n == 1,
            qk_scale=float(scale) * _LOG2E,
        ),
        P=pl_.P,
        split_s=pl_.split_s,
        Hb=pieces[-1][0] + pieces[-1][1],  # block lanes: H, or H rounded up to whole pieces
        groups=BK // pl_.P,
        n_splits=n,
        shape=(Bsz, K, H),
        dtype=q.dtype,
        cost=(
            4 * BK * S * H,
            2 * BK * S,
            k.nbytes + v.nbytes + 2 * q.nbytes + partial + 8 * BK,
        ),
    )


def cost_estimate(flops: int, transcendentals: int, bytes_accessed: int) -> dict:
    """``pallas_call``'s ``cost_estimate`` keyword where this JAX has it (else nothing)."""
    if not _HAS_COST_ESTIMATE:
        return {}
    return {
        "cost_estimate": pl.CostEstimate(
            flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed
        )
    }


def mha_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    scale: float,
    interpret: bool = False,
    blocks: MHABlocks | None = None,
) -> jax.Array:
    """G = 1 decode attention as a Pallas (Triton) kernel that reads the cache as stored.

    Shapes, dtypes and the masking rule are in the module docstring (the contract of
    ``mha_decode_attention_reference``).

    Args:
      window: static sliding window (the last ``window`` rows), or None for global attention.
      scale: static multiplier of q . k.
      interpret: run through the Pallas interpreter (needed on the CPU).
      blocks: the tiling (``MHABlocks``); default ``default_blocks(k.dtype)``.

    Raises:
      ValueError: on inconsistent shapes, G != 1, a bad window, or invalid block sizes.
    """
    blocks = blocks or default_blocks(k.dtype)
    at = attention_launch(q, k, v, lengths, window=window, scale=scale, blocks=blocks)
    pj = lambda p, j: (p, j)  # noqa: E731
    outs = pl.pallas_call(
        functools.partial(_kernel, **at.static),
        out_shape=at.out_shape(),
        grid=(at.groups, at.n_splits),
        in_specs=at.in_specs(pj),
        out_specs=at.out_specs(pj),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        name="mha_decode_attention",
        **cost_estimate(*at.cost),
    )(*at.operands)
    return at.finish(outs)
