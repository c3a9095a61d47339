"""One Pallas (Triton) kernel with two roles: a memory-bound stream and a full-fp32 product.

The probe behind issue 33's step 4 (``README.md``): the faithful tick runs its memory-bound parts
(the speech decoder's attention over its fp32 cache) and its compute-bound ones (the codec's
full-fp32 products) one kernel after another, and XLA's second stream hid nothing of one behind
the other (``experiments/stream_overlap``). One kernel whose programs take either role lets the
GPU's block scheduler put both on every SM at once. How much that hides is what this measures,
on stand-ins of the two parts' shapes, before any of the tick is rewritten for it.

Roles (``P = n_read + n_prod`` programs on a one-axis grid):

- **read**: program i streams rows ``[i * read_steps * block_n, (i + 1) * read_steps *
  block_n)`` of ``cache`` [N, C] in [block_n, C] tiles and writes their elementwise sum, one
  [block_n, C] tile of ``sums`` [n_read * block_n, C]: every byte read once, nothing reused (as
  the attention's read of its cache).
- **product**: program j owns output tile (j // f_tiles, j % f_tiles) of ``y = x @ w``, x [M, K],
  w [K, F], and runs its K loop in ``block_k`` steps with ``dot(..., precision=HIGHEST)``:
  Triton's IEEE fp32 path on the FMA units (as ``pallas_kernels.matmul`` with 'float32').

``order`` says which program takes which role: ``'blocked'`` (the read programs first, then the
products: one launch, the roles one after another as the scheduler hands out programs in order)
or ``'interleaved'`` (the read programs spread evenly over the grid: program p reads iff
``(p + 1) * n_read // P > p * n_read // P``). Either role may have no program (``n_read = 0``
or no product): the kernel then is that role alone, which is how the parts are timed alone.

Every shape must be a multiple of its block (checked; the experiment picks them so): no masks.
Axis letters are this file's own: ``N`` streamed rows, ``C`` their columns, ``M`` product rows,
``K`` contracted, ``F`` product columns. ``reference`` is the same in plain jnp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
ORDERS = ("blocked", "interleaved")


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tiles of both roles, and the launch. ``read_steps``: tiles one read program streams."""

    block_n: int = 32
    read_steps: int = 32
    block_m: int = 128
    block_f: int = 32
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 3


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _layout(cache, x, w, blocks: Blocks) -> tuple[int, int, int]:
    """(n_read, n_prod, f_tiles) for these operands; either operand pair may be None."""
    n_read = n_prod = f_tiles = 0
    if cache is not None:
        N, _ = cache.shape
        per = blocks.block_n * blocks.read_steps
        _check(N % per == 0, f"cache rows {N} must be a multiple of block_n * read_steps = {per}")
        n_read = N // per
    if x is not None:
        (M, K), (K2, F) = x.shape, w.shape
        _check(K == K2, f"x [M, K] and w [K, F] disagree: {x.shape} @ {w.shape}")
        for name, n, b in (("M", M, blocks.block_m), ("K", K, blocks.block_k),
                           ("F", F, blocks.block_f)):  # fmt: skip
            _check(n % b == 0, f"{name}={n} must be a multiple of its block {b}")
        f_tiles = F // blocks.block_f
        n_prod = (M // blocks.block_m) * f_tiles
    return n_read, n_prod, f_tiles


def _kernel(*refs, n_read, n_prod, f_tiles, order, blocks: Blocks):
    b = blocks
    has_read, has_prod = n_read > 0, n_prod > 0
    refs = list(refs)
    cache_ref = refs.pop(0) if has_read else None
    x_ref, w_ref = (refs.pop(0), refs.pop(0)) if has_prod else (None, None)
    sums_ref = refs.pop(0) if has_read else None
    y_ref = refs.pop(0) if has_prod else None
    p = pl.program_id(0)
    P = n_read + n_prod
    if not has_prod:
        is_read, read_i, prod_i = True, p, 0
    elif not has_read:
        is_read, read_i, prod_i = False, 0, p
    elif order == "blocked":
        is_read, read_i, prod_i = p < n_read, p, p - n_read
    else:
        before, through = (p * n_read) // P, ((p + 1) * n_read) // P
        is_read, read_i, prod_i = through > before, before, p - through

    def read():
        C = cache_ref.shape[1]
        first = read_i * b.read_steps

        def body(i, acc):
            rows = pl.ds(pl.multiple_of((first + i) * b.block_n, b.block_n), b.block_n)
            return acc + pltriton.load(cache_ref.at[rows, :])

        acc = jax.lax.fori_loop(0, b.read_steps, body, jnp.zeros((b.block_n, C), F32))
        out = pl.ds(pl.multiple_of(read_i * b.block_n, b.block_n), b.block_n)
        pltriton.store(sums_ref.at[out, :], acc)

    def product():
        mi, fi = prod_i // f_tiles, prod_i % f_tiles
        rows = pl.ds(pl.multiple_of(mi * b.block_m, b.block_m), b.block_m)
        cols = pl.ds(pl.multiple_of(fi * b.block_f, b.block_f), b.block_f)

        def body(k, acc):
            ks = pl.ds(pl.multiple_of(k * b.block_k, b.block_k), b.block_k)
            xb = pltriton.load(x_ref.at[rows, ks])
            wb = pltriton.load(w_ref.at[ks, cols])
            return acc + jax.lax.dot(xb, wb, precision=_HIGHEST, preferred_element_type=F32)

        steps = x_ref.shape[1] // b.block_k
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((b.block_m, b.block_f), F32))
        pltriton.store(y_ref.at[rows, cols], acc)

    if has_read and has_prod:
        pl.when(is_read)(read)
        pl.when(jnp.logical_not(is_read))(product)
    elif has_read:
        read()
    else:
        product()


def two_roles(
    cache: jax.Array | None,
    x: jax.Array | None,
    w: jax.Array | None,
    *,
    order: str = "interleaved",
    blocks: Blocks = Blocks(),
    interpret: bool = False,
) -> tuple[jax.Array | None, jax.Array | None]:
    """(sums [n_read * block_n, C] or None, y [M, F] or None): both roles in one launch.

    ``cache`` [N, C] fp32, or None for the product alone; ``x`` [M, K] and ``w`` [K, F] fp32, or
    both None for the read alone. ``interpret``: the Pallas interpreter (the CPU's tests).
    """
    _check(order in ORDERS, f"order must be one of {ORDERS}: {order!r}")
    _check((x is None) == (w is None), "x and w come together")
    _check(cache is not None or x is not None, "nothing to do: no cache and no product")
    n_read, n_prod, f_tiles = _layout(cache, x, w, blocks)
    args, out_shape = [], []
    if n_read:
        args.append(cache)
        out_shape.append(jax.ShapeDtypeStruct((n_read * blocks.block_n, cache.shape[1]), F32))
    if n_prod:
        args += [x, w]
        out_shape.append(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), F32))
    kernel = functools.partial(
        _kernel, n_read=n_read, n_prod=n_prod, f_tiles=f_tiles, order=order, blocks=blocks
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(n_read + n_prod,),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        name="two_roles",
    )(*args)
    outs = list(outs)
    sums = outs.pop(0) if n_read else None
    y = outs.pop(0) if n_prod else None
    return sums, y


def reference(
    cache: jax.Array | None, x: jax.Array | None, w: jax.Array | None, *, blocks: Blocks = Blocks()
) -> tuple[jax.Array | None, jax.Array | None]:
    """``two_roles`` in plain jnp: each read program's tile sum, and ``x @ w`` at HIGHEST."""
    sums = y = None
    if cache is not None:
        N, C = cache.shape
        tiles = cache.reshape(N // (blocks.read_steps * blocks.block_n), blocks.read_steps,
                              blocks.block_n, C)  # fmt: skip
        sums = tiles.sum(axis=1).reshape(-1, C)
    if x is not None:
        y = jnp.dot(x, w, precision=_HIGHEST, preferred_element_type=F32)
    return sums, y
