"""The speech decoder's G = 1 attention and one full-fp32 product in one Pallas (Triton) launch.

Issue 33's overlap route. At the faithful precision the tick runs its memory-bound parts (the
speech decoder's attention over its fp32 cache, ``mha_decode_attention``) and its compute-bound
ones (the codec's and the backbone's fp32 products on the FMA units) one kernel after another,
and XLA's second stream hid nothing of one behind the other (``experiments/stream_overlap``). In
one launch whose programs take either kind of work, the GPU's block scheduler keeps both on
every SM at once: on stand-ins (``experiments/role_split``, an H100) that hid 60 % of the
shorter part when the two kinds were interleaved over the grid, and nothing when one came
after the other.

``attention_and_product(q, k, v, lengths, x, w)`` returns ``mha_decode_attention(q, k, v,
lengths)`` and ``x @ w`` from one launch on a one-axis grid of ``A + M`` programs:

- **attention** programs are ``mha_decode_attention``'s (p, j) programs, the same body
  (``attend_program``) on the same blocks, so their output equals that kernel's bit for bit
  (the splits' combine, when S is split, is the same jnp pass after the launch);
- **product** programs each own one [block_m, block_f] tile of ``y = x @ w`` (x [M, C], w
  [C, F], fp32) and run its C loop in ``block_k`` steps of ``dot`` at ``HIGHEST`` (Triton's IEEE
  fp32 path on the FMA units, the faithful policy's products, ``pallas_kernels.matmul`` with
  'float32'); rows past M are masked.

``order`` places the two kinds on the grid: ``'interleaved'`` (attention programs spread evenly:
program i attends iff ``(i + 1) * A // (A + M) > i * A // (A + M)``) or ``'blocked'`` (the
attention programs first). ``fp32_product(x, w)`` is the product role alone, for timing it
beside XLA's.

Axis letters: those of ``mha_decode_attention`` (B, K, S, H) and, for the product, ``M`` rows,
``C`` contracted, ``F`` output columns (this file's own). ``reference`` is both in plain jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mha_decode_attention import (
    MHABlocks,
    attend_program,
    attention_launch,
    cost_estimate,
    default_blocks,
    mha_decode_attention_reference,
)

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
ORDERS = ("interleaved", "blocked")
# Triton's pipelining stages for one launch. Compiled for sm_90a on the CPU (2026-12-06,
# experiments/attention_product/ptx_check.py; structure, not speed): at 96 sessions beside a
# 64 x 64 x 32 product tile with 4 warps, 2 stages (the attention's own) take 188 registers a
# thread, two programs an SM where the attention alone (134) fits three; 3 stages stage the
# product's loads through shared memory (32 KiB a program) and take 130, so the attention keeps
# its programs in flight. Not yet timed on a GPU.
LAUNCH_STAGES = 3


@dataclasses.dataclass(frozen=True)
class ProductBlocks:
    """The product role's tile: ``block_m`` x ``block_f`` outputs, ``block_k`` contracted a step.

    64 x 64 with 4 warps (the attention's) ran the codec's largest fp32 product at 0.96x XLA's
    on an H100 with the same bits (``experiments/role_split``, 2026-12-06).
    """

    block_m: int = 64
    block_f: int = 64
    block_k: int = 32

    def __post_init__(self):
        for name in ("block_m", "block_f", "block_k"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (a dot tile): {n}")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _product_tiles(x: jax.Array, w: jax.Array, blocks: ProductBlocks) -> tuple[int, int]:
    """(row tiles, column tiles) of ``x @ w``; C and F must be whole blocks, M need not."""
    _check(x.ndim == 2 and w.ndim == 2, f"x [M, C] and w [C, F]: {x.shape}, {w.shape}")
    (M, C), (C2, F) = x.shape, w.shape
    _check(C == C2, f"x [M, C] and w [C, F] disagree: {x.shape} @ {w.shape}")
    _check(x.dtype == F32 and w.dtype == F32, f"fp32 operands: {x.dtype}, {w.dtype}")
    _check(C % blocks.block_k == 0, f"C={C} must be a multiple of block_k={blocks.block_k}")
    _check(F % blocks.block_f == 0, f"F={F} must be a multiple of block_f={blocks.block_f}")
    return pl.cdiv(M, blocks.block_m), F // blocks.block_f


def _product_program(mi, x_ref, w_ref, y_ref, *, M: int, blocks: ProductBlocks):
    """One output tile: x block [block_m, C] of row tile ``mi``, w block [C, block_f]."""
    b = blocks
    rows_ok = mi * b.block_m + jnp.arange(b.block_m) < M  # [block_m]

    def body(s, acc):
        ks = pl.ds(pl.multiple_of(s * b.block_k, b.block_k), b.block_k)
        mask = jnp.broadcast_to(rows_ok[:, None], (b.block_m, b.block_k))
        xb = pltriton.load(x_ref.at[:, ks], mask=mask, other=0.0)
        wb = pltriton.load(w_ref.at[ks, :])
        return acc + jax.lax.dot(xb, wb, precision=_HIGHEST, preferred_element_type=F32)

    steps = x_ref.shape[1] // b.block_k
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((b.block_m, b.block_f), F32))
    mask = jnp.broadcast_to(rows_ok[:, None], (b.block_m, b.block_f))
    pltriton.store(y_ref, acc, mask=mask)


def _roles(i, n_attn: int, n_prod: int, order: str):
    """(attends, attention program, product program) of grid index ``i`` (traced ints).

    The index of the kind a program does not take is clamped into range, so that index maps
    name a real block (which that program never loads).
    """
    total = n_attn + n_prod
    if order == "blocked":
        attends, a, b = i < n_attn, i, i - n_attn
    else:
        before, through = (i * n_attn) // total, ((i + 1) * n_attn) // total
        attends, a, b = through > before, before, i - through
    return attends, jnp.clip(a, 0, n_attn - 1), jnp.clip(b, 0, n_prod - 1)


def _product_specs(x, w, blocks: ProductBlocks, f_tiles: int, tile_of):
    """Blocks of x, w and y for a grid whose indices ``tile_of(*indices)`` maps to a tile."""
    C = x.shape[1]

    def mf(*g):
        t = tile_of(*g)
        return t // f_tiles, t % f_tiles

    x_spec = pl.BlockSpec((blocks.block_m, C), lambda *g: (mf(*g)[0], 0))
    w_spec = pl.BlockSpec((C, blocks.block_f), lambda *g: (0, mf(*g)[1]))
    y_spec = pl.BlockSpec((blocks.block_m, blocks.block_f), mf)
    return x_spec, w_spec, y_spec


def _fused_kernel(*refs, n_attn, n_prod, n_splits, f_tiles, order, M, product, attend):
    lo, hi, q, k, v, x, w, *outs = refs
    attn_outs, y = outs[:-1], outs[-1]
    attends, a, b = _roles(pl.program_id(0), n_attn, n_prod, order)

    @pl.when(attends)
    def _():
        attend_program(a % n_splits, lo, hi, q, k, v, *attn_outs, **attend)

    @pl.when(jnp.logical_not(attends))
    def _():
        _product_program(b // f_tiles, x, w, y, M=M, blocks=product)


def attention_and_product(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    x: jax.Array,
    w: jax.Array,
    *,
    window: int | None = None,
    scale: float,
    blocks: MHABlocks | None = None,
    product: ProductBlocks = ProductBlocks(),
    order: str = "interleaved",
    num_stages: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(``mha_decode_attention(q, k, v, lengths)``, ``x @ w`` in fp32) from one launch.

    The attention's arguments and tiling are ``mha_decode_attention``'s; x [M, C] and w [C, F]
    fp32 (C a multiple of ``product.block_k``, F of ``product.block_f``). The launch takes the
    attention's ``num_warps``; ``num_stages`` (Triton's pipelining of both roles' loops) defaults
    to ``LAUNCH_STAGES``. ``interpret``: the Pallas interpreter (CPU).

    Raises:
      ValueError: on the attention's bad arguments, or a product that does not tile.
    """
    _check(order in ORDERS, f"order must be one of {ORDERS}: {order!r}")
    blocks = blocks or default_blocks(k.dtype)
    at = attention_launch(q, k, v, lengths, window=window, scale=scale, blocks=blocks)
    m_tiles, f_tiles = _product_tiles(x, w, product)
    n_attn, n_prod = at.groups * at.n_splits, m_tiles * f_tiles
    roles = functools.partial(_roles, n_attn=n_attn, n_prod=n_prod, order=order)

    def pj(i):
        a = roles(i)[1]
        return a // at.n_splits, a % at.n_splits

    x_spec, w_spec, y_spec = _product_specs(x, w, product, f_tiles, lambda i: roles(i)[2])
    M, C = x.shape
    F = w.shape[1]
    flops, transcendentals, nbytes = at.cost
    outs = pl.pallas_call(
        functools.partial(
            _fused_kernel,
            n_attn=n_attn,
            n_prod=n_prod,
            n_splits=at.n_splits,
            f_tiles=f_tiles,
            order=order,
            M=M,
            product=product,
            attend=at.static,
        ),
        out_shape=(*at.out_shape(), jax.ShapeDtypeStruct((M, F), F32)),
        grid=(n_attn + n_prod,),
        in_specs=[*at.in_specs(pj), x_spec, w_spec],
        out_specs=[*at.out_specs(pj), y_spec],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(
            num_warps=blocks.num_warps, num_stages=num_stages or LAUNCH_STAGES
        ),
        name="attention_and_product",
        **cost_estimate(
            flops + 2 * M * C * F, transcendentals, nbytes + (M * C + C * F + M * F) * 4
        ),
    )(*at.operands, x, w)
    return at.finish(outs[:-1]), outs[-1]


def fp32_product(
    x: jax.Array,
    w: jax.Array,
    *,
    product: ProductBlocks = ProductBlocks(),
    num_warps: int = 4,
    num_stages: int = LAUNCH_STAGES,
    interpret: bool = False,
) -> jax.Array:
    """``x @ w`` in full fp32 by the product role alone (one program per output tile). The
    defaults are the launch the role ran at 0.96x XLA's on an H100 in ``experiments/role_split``
    (64 x 64 x 32 tiles, 4 warps, 3 stages)."""
    m_tiles, f_tiles = _product_tiles(x, w, product)
    x_spec, w_spec, y_spec = _product_specs(x, w, product, f_tiles, lambda t: t)
    M = x.shape[0]

    def kernel(x_ref, w_ref, y_ref):
        _product_program(pl.program_id(0) // f_tiles, x_ref, w_ref, y_ref, M=M, blocks=product)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, w.shape[1]), F32),
        grid=(m_tiles * f_tiles,),
        in_specs=[x_spec, w_spec],
        out_specs=y_spec,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="fp32_product",
        **cost_estimate(2 * M * x.shape[1] * w.shape[1], 0, (x.size + w.size + M * w.shape[1]) * 4),
    )(x, w)


def reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    x: jax.Array,
    w: jax.Array,
    *,
    window: int | None = None,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """``attention_and_product`` in plain jnp: the attention's reference and ``x @ w`` at
    ``HIGHEST``."""
    attn = mha_decode_attention_reference(q, k, v, lengths, window=window, scale=scale)
    return attn, jnp.dot(x, w, precision=_HIGHEST, preferred_element_type=F32)
