"""A weight-streaming matrix product for small batches, as a Pallas (Triton) kernel.

``x @ w`` where x has few rows (the slots of a decode step: B rows in the LLM, 2B with the speech
decoder's CFG rows) and w is a large weight read once per step. At such sizes the product is
bound by reading w: at 11B the LLM's MLP and Mamba projections are 92-203 MB of bf16 each, 2-4
bytes per multiply-add per row. XLA reached 1.3-2.3 TB/s on them on the H200 (``docs/serving.md``
§6, ``experiments/beat_profile``) against about 3.7 TB/s for a device copy. This kernel splits the
columns of w (and, when there are few column blocks, its rows) over enough programs that every SM
streams its share of w once, with the loads software-pipelined by Triton.

Axis letters: ``R`` rows of x (any count; one row block of up to 128 rows covers the decode
batches), ``D`` the contracted dimension, ``F`` the output columns, ``L`` stacked layers.

Arguments (both functions):

- ``x``: [..., D] any float dtype; the leading axes are flattened into R rows.
- ``w``: [D, F], or [L, D, F] stacked layers with ``layer`` the static index of the one to use
  (the stacked array is read in place: no slice of it is materialised). Any float dtype.
- ``out_dtype``: the result's dtype, default x's.

Math (as ``voicechat_jax.model.common.dense``): w is rounded to x's dtype (a no-op when they
match), the products accumulate in fp32, the result is rounded once to ``out_dtype``. With bf16
operands the matrix units multiply bf16 exactly into fp32. With fp32 operands ``precision`` says
how: ``'float32'`` (full fp32, as torch and the faithful policies: Triton's IEEE path) or
``'tensorfloat32'`` (TF32 inputs); None follows ``jax_default_matmul_precision`` as XLA does
(``Precision.scope()`` sets it; unset or 'default' means TF32 on a GPU, as XLA's DEFAULT). The
reference contracts upcast operands at ``Precision.HIGHEST``; the two differ by fp32 summation
order (and by TF32 rounding when asked for).

``'tf32x3'`` (fp32 operands; the opt-in policies ``pallas_tf32x3*``): each ``block_d`` step's
product is Triton's three-pass TF32 dot (each operand split into a TF32 head and its remainder, the
remainders' product dropped) on the matrix units, begun from zero, and the steps' products are
added on the FMA units by a compensated (Kahan) sum. XLA's ``TF32_TF32_F32_X3`` preset was up to
50x less exact than full fp32 on the codec's long contractions on an H100 (2026-12-06,
``experiments/fp32_products``), its error growing with the contracted length, as it would if
the matrix units round what they sum (a reading, not checked): here they sum one step of
``block_d`` only. Whether this is as exact as full fp32 is for a GPU to say. On the CPU
(interpret mode) the steps are full-fp32 products, summed the same way.

Kernel layout (Triton lowering, chosen through ``jax.experimental.pallas.triton.CompilerParams``):
grid ``(R / block_r, F / block_f, n_split)``. Program (r, f, s) owns output columns
``[f * block_f, (f + 1) * block_f)`` of row block r and the rows ``[s * chunk, (s + 1) * chunk)``
of w (``chunk`` a multiple of ``block_d``, ``n_split = cdiv(D, chunk)``); it loops over its chunk
in ``block_d``-row steps, loading a [block_r, block_d] tile of x and a [block_d, block_f] tile of
w per step and accumulating ``dot`` in fp32 registers. With one split the program writes the
result in ``out_dtype``; with several it writes an fp32 partial [n_split, R, F] and a jnp sum
adds the splits in a fixed order (deterministic: no atomics). Every load and store is masked
where a tile passes R, D or F, so no size must be a multiple of anything; the row block is a
power of two of at least 16 (Triton's smallest dot tile), padded rows are masked.
``interpret=True`` runs the kernel through the Pallas interpreter (CPU tests).
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

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_DOT_MIN = 16  # Triton's smallest dot tile (M, N and K)
_MAX_BLOCK_R = 128  # rows per program: one row block covers every decode batch up to 128
PRECISIONS = ("float32", "tensorfloat32", "tf32x3")
_TF32X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
# Splitting D is worth it only while the fp32 partials stay small next to the weight: at most
# 1/8 of the weight's bytes written (and as much read back by the sum; mostly from L2).
_MAX_PARTIAL_FRACTION = 1 / 8
_SMS = 132  # streaming multiprocessors of an H200 (the GPU this is tuned for)
_TARGET_PROGRAMS = 4 * _SMS  # waves short enough that the last one's tail costs little
_MIN_SPLIT_STEPS = 4  # a split streams at least this many block_d steps
_HAS_COST_ESTIMATE = hasattr(pl, "CostEstimate") and (
    "cost_estimate" in inspect.signature(pl.pallas_call).parameters
)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """The kernel's tiling, validated on construction.

    Attributes:
      block_f: output columns per program; a power of two >= 16.
      block_d: rows of w loaded per step of a program's loop; a power of two >= 16.
      split_d: how many programs share the D axis of one column block (their fp32 partials are
        added outside the kernel); None picks it from the shapes (``default_blocks``).
      num_warps: Triton warps per program; a power of two.
      num_stages: Triton software-pipelining stages of the D loop.
      block_r: rows of x per program; a power of two >= 16, or None: the rows rounded up to a
        power of two, at most 128 (``_block_r``). Each row block streams the whole weight
        again: 192 rows (96 slots, two frames) are two blocks of 128 by default, the second
        half padding, or three of 64 with none.
    """

    block_f: int = 128
    block_d: int = 64
    split_d: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    block_r: int | None = None

    def __post_init__(self):
        for name in ("block_f", "block_d", "block_r"):
            v = getattr(self, name)
            if name == "block_r" and v is None:
                continue
            if not _pow2(v) or v < _DOT_MIN:
                raise ValueError(f"{name} must be a power of two >= {_DOT_MIN}: {v}")
        if self.split_d is not None and self.split_d < 1:
            raise ValueError(f"split_d must be >= 1 or None: {self.split_d}")
        if not _pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two: {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1: {self.num_stages}")

    def rows_per_block(self, R: int) -> int:
        """The row block this tiling gives a product of ``R`` rows: ``block_r``, or its default."""
        return self.block_r or _block_r(R)


def default_split(R: int, D: int, F: int, w_itemsize: int, blocks: MatmulBlocks) -> int:
    """How many programs share D: enough for ``_TARGET_PROGRAMS`` in all, within the budget.

    One split when the column blocks alone fill the GPU. Otherwise the count nearest the wanted
    one that keeps each split at least ``_MIN_SPLIT_STEPS`` loop steps long and the fp32 partials
    (written once, read once by the sum: ``2 * n_split * R * F * 4`` bytes) under
    ``_MAX_PARTIAL_FRACTION`` of the weight; among those, a count that divides D's blocks evenly
    is preferred (then no load is masked along D), if one is within a factor of two of it.
    """
    n_cols = pl.cdiv(F, blocks.block_f) * pl.cdiv(R, blocks.rows_per_block(R))
    if n_cols >= _TARGET_PROGRAMS:
        return 1
    n_d = pl.cdiv(D, blocks.block_d)
    want = pl.cdiv(_TARGET_PROGRAMS, n_cols)
    by_steps = max(1, n_d // _MIN_SPLIT_STEPS)
    by_bytes = max(1, int(_MAX_PARTIAL_FRACTION * D * w_itemsize / (8 * R)))
    split = max(1, min(want, by_steps, by_bytes))
    if D % blocks.block_d == 0:
        even = [s for s in range(1, min(by_steps, by_bytes) + 1) if n_d % s == 0]
        best = min(even, key=lambda s: abs(math.log(s / split)))
        if 2 * best >= split:
            return best
    return split


def _block_r(R: int) -> int:
    return max(_DOT_MIN, min(_MAX_BLOCK_R, pl.next_power_of_2(R)))


def default_blocks(R: int, D: int, F: int, w_dtype, *, fma: bool = False) -> MatmulBlocks:
    """The tiling used when none is given.

    A weight tile of 16 KiB per pipeline stage ([64, 128] bf16, [32, 128] fp32), 64 columns wide
    (and twice as deep) when 128-wide column blocks would not give every SM one; half as deep
    when that divides D and the full depth does not (no masked loads along D); D split by
    ``default_split``. 8 warps once the fp32 accumulator would take more than 32 registers per
    thread of 4 warps (spills otherwise: ptxas for sm_90 on the 11B shapes). ``fma``: full-fp32
    products, which Triton runs on the FMA units with the operands in registers: 32 columns at 64
    rows or more, to stay clear of spills.
    """
    itemsize = jnp.dtype(w_dtype).itemsize
    bR = _block_r(R)
    block_f = 128 if pl.cdiv(F, 128) * pl.cdiv(R, bR) >= _SMS else 64
    block_d = (64 if itemsize <= 2 else 32) * 128 // block_f
    if fma and bR >= 64:
        block_f, block_d = 32, 32
    if D % block_d and D % (block_d // 2) == 0:
        block_d //= 2
    num_warps = 8 if bR * block_f >= 4096 else 4
    base = MatmulBlocks(block_f=block_f, block_d=block_d, num_warps=num_warps)
    return dataclasses.replace(base, split_d=default_split(R, D, F, itemsize, base))


def _dot_precision(precision: str | None, dtype) -> jax.lax.Precision | None:
    """The ``dot`` precision of the kernel for operands of ``dtype`` (module docstring)."""
    if jnp.dtype(dtype) != jnp.dtype(F32):
        return None  # bf16 / fp16: the matrix units' native product, fp32 accumulation
    if precision is None:
        config = jax.config.jax_default_matmul_precision
        precision = "float32" if config in ("float32", "highest") else "tensorfloat32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None: {precision!r}")
    if precision == "tf32x3":
        return _TF32X3
    return _HIGHEST if precision == "float32" else jax.lax.Precision.HIGH


def _weight_shape(shape: tuple[int, ...], layer: int | None) -> tuple[int, int]:
    """(D, F) of a [D, F] weight, or of layer ``layer`` of an [L, D, F] one (validated)."""
    if layer is None:
        _check(len(shape) == 2, f"w must be [D, F] without layer: {shape}")
        return shape
    _check(len(shape) == 3, f"w must be [L, D, F] with layer: {shape}")
    _check(
        isinstance(layer, int) and 0 <= layer < shape[0],
        f"layer must be a static int in [0, {shape[0]}): {layer!r}",
    )
    return shape[1:]


def matmul_reference(
    x: jax.Array, w: jax.Array, *, layer: int | None = None, out_dtype=None
) -> jax.Array:
    """``x @ w`` in plain jnp, fp32 (the module docstring states the contract)."""
    _weight_shape(w.shape, layer)
    wj = w if layer is None else w[layer]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = jnp.einsum(
        "...d,df->...f",
        x.astype(F32),
        wj.astype(x.dtype).astype(F32),
        precision=_HIGHEST,
    )
    return y.astype(out_dtype)


def _kernel(
    x_ref,
    w_ref,
    o_ref,
    *,
    R: int,
    D: int,
    F: int,
    block_d: int,
    steps: int,
    precision,
    tile_sum: bool,
):
    """Program (r, f, s): rows [r*bR, ..) x columns [f*bF, ..) over this split's D chunk.

    Refs: x [bR, chunk], w [chunk, bF] (the chunk is ``steps * block_d`` rows of D), o [bR, bF]
    (one split: the result) or its fp32 partial. Tiles past R, D or F are masked to 0.
    """
    bR, bF = o_ref.shape
    r, f, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    chunk = steps * block_d
    # Masks only where a tile can pass the array's edge (static): unmasked loads vectorise.
    rows = (r * bR + jnp.arange(bR) < R)[:, None] if R % bR else None  # [bR, 1]
    cols = (f * bF + jnp.arange(bF) < F)[None, :] if F % bF else None  # [1, bF]
    mask_d = D % chunk != 0  # some split's chunk passes D
    # The number of steps this split really has (the last one may be short).
    n = jnp.minimum(steps, pl.cdiv(D - s * chunk, block_d)) if mask_d else steps
    cdt = x_ref.dtype

    def both(a, b, shape):
        if a is None and b is None:
            return None
        m = a if b is None else b if a is None else a & b
        return jnp.broadcast_to(m, shape)

    def step(i):
        tile = pl.ds(pl.multiple_of(i * block_d, block_d), block_d)
        d_ok = s * chunk + i * block_d + jnp.arange(block_d) < D if mask_d else None
        x_mask = both(rows, None if d_ok is None else d_ok[None, :], (bR, block_d))
        w_mask = both(None if d_ok is None else d_ok[:, None], cols, (block_d, bF))
        xb = pltriton.load(x_ref.at[:, tile], mask=x_mask, other=None if x_mask is None else 0.0)
        wb = pltriton.load(w_ref.at[tile, :], mask=w_mask, other=None if w_mask is None else 0.0)
        return jax.lax.dot_general(
            xb,
            wb.astype(cdt),
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=F32,
        )

    zeros = jnp.zeros((bR, bF), F32)
    if tile_sum:
        # Each step's product starts from zero and is added to the running sum by a compensated
        # (Kahan) add on the FMA units: the matrix units accumulate one block_d-long tile only.
        def body(i, carry):
            acc, comp = carry
            y = step(i) - comp
            t = acc + y
            return t, (t - acc) - y

        acc, _ = jax.lax.fori_loop(0, n, body, (zeros, zeros))
    else:
        acc = jax.lax.fori_loop(0, n, lambda i, acc: acc + step(i), zeros)
    pltriton.store(o_ref, acc.astype(o_ref.dtype), mask=both(rows, cols, (bR, bF)))


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    layer: int | None = None,
    out_dtype=None,
    precision: str | None = None,
    interpret: bool = False,
    blocks: MatmulBlocks | None = None,
) -> jax.Array:
    """``x @ w`` as a weight-streaming Pallas kernel (contract in the module docstring).

    Args:
      x: [..., D] activations.
      w: [D, F], or [L, D, F] with ``layer``.
      layer: static index into a stacked weight's L axis; None for a [D, F] weight.
      out_dtype: the result's dtype (default x's).
      precision: fp32 products: 'float32' | 'tensorfloat32' | 'tf32x3' | None (follow
        ``jax_default_matmul_precision``). Ignored for bf16 / fp16 operands.
      interpret: run through the Pallas interpreter (needed on the CPU).
      blocks: the tiling; None picks ``default_blocks``.

    Returns:
      [..., F] in ``out_dtype``.

    Raises:
      ValueError: on inconsistent shapes, a bad ``layer`` or ``precision``.
    """
    D, F = _weight_shape(w.shape, layer)
    _check(x.ndim >= 1 and x.shape[-1] == D, f"x must be [..., D={D}]: {x.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, D)
    R = x2.shape[0]
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if R == 0:
        return jnp.zeros((*lead, F), out_dtype)
    dot_precision = _dot_precision(precision, x.dtype)
    if blocks is None:
        blocks = default_blocks(R, D, F, w.dtype, fma=dot_precision == _HIGHEST)
    bR = blocks.rows_per_block(R)
    split = blocks.split_d or default_split(R, D, F, jnp.dtype(w.dtype).itemsize, blocks)
    steps = pl.cdiv(pl.cdiv(D, blocks.block_d), split)
    chunk = steps * blocks.block_d
    n_split = pl.cdiv(D, chunk)  # a requested split may leave the last chunks empty: drop them
    grid = (pl.cdiv(R, bR), pl.cdiv(F, blocks.block_f), n_split)

    w3 = w if layer is not None else w[None]
    j = 0 if layer is None else layer
    partial = n_split > 1
    tile_sum = dot_precision == _TF32X3
    if tile_sum and interpret:
        dot_precision = _HIGHEST  # the CPU has no TF32: full fp32 products, the same sum
    kernel = functools.partial(
        _kernel,
        R=R,
        D=D,
        F=F,
        block_d=blocks.block_d,
        steps=steps,
        precision=dot_precision,
        tile_sum=tile_sum,
    )
    if partial:
        out_shape = jax.ShapeDtypeStruct((n_split, R, F), F32)
        out_spec = pl.BlockSpec((None, bR, blocks.block_f), lambda r, f, s: (s, r, f))
    else:
        out_shape = jax.ShapeDtypeStruct((R, F), out_dtype)
        out_spec = pl.BlockSpec((bR, blocks.block_f), lambda r, f, s: (r, f))
    cost = {}
    if _HAS_COST_ESTIMATE:
        out_bytes = out_shape.size * jnp.dtype(out_shape.dtype).itemsize
        cost["cost_estimate"] = pl.CostEstimate(
            flops=2 * R * D * F,
            transcendentals=0,
            bytes_accessed=D * F * jnp.dtype(w.dtype).itemsize + x2.nbytes * grid[1] + out_bytes,
        )
    y = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[
            pl.BlockSpec((bR, chunk), lambda r, f, s: (r, s)),  # x
            pl.BlockSpec((None, chunk, blocks.block_f), lambda r, f, s: (j, s, f)),  # w
        ],
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        name="matmul",
        **cost,
    )(x2, w3)
    if partial:
        y = jnp.sum(y, axis=0).astype(out_dtype)
    return y.reshape(*lead, F)
