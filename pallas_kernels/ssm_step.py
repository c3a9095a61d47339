"""Mamba-2 single-step (decode) SSM update as a Pallas kernel that updates the state in place.

The recurrent update of one frame of one Mamba-2 layer (``mamba_ssm``'s
``selective_state_update``, as transformers' ``NemotronHMamba2Mixer`` calls it on a cached step;
``voicechat_jax.model.nano._mamba_step`` is the jnp path of the model). Per slot b and head n,
with its group ``k = n // G``:

    decay       = exp(dt[b, n] * A[n])                                  (dt already softplus'ed)
    state[b, n] = decay * state[b, n] + dt[b, n] * outer(x[b, n], b_mat[b, k])       [H, P]
    y[b, n]     = state[b, n] @ c_mat[b, k] + D[n] * x[b, n]                         [H]

with the NEW state in ``y``. Why a kernel: the state is fp32 [B, L_m, N, H, P] (283 MB per
session at 11B) and must be read and written once per frame; XLA's path gathers layer j into a new
array and scatters it back (copies). Here the stacked state goes in and comes out as the same
buffer (``input_output_aliases``): under ``jit`` with the state donated (or carried through a loop)
only layer j's bytes are read and written, once.

Axis letters are those of ``voicechat_jax.model`` inside the Mamba mixer: ``B`` slots, ``L_m``
Mamba layers, ``N`` Mamba heads, ``H`` Mamba head dim, ``P`` SSM state size, ``K`` groups
sharing ``b_mat``/``c_mat`` (``n_groups``), ``G = N // K`` heads per group (heads
``k*G .. k*G + G - 1`` read group k).

Arguments (both functions):

- ``state``: [B, L_m, N, H, P] the stacked state of every Mamba layer with ``layer`` the static
  index of the layer to update (others are returned untouched), or [B, N, H, P] one layer's state
  with ``layer=None``. Any float dtype (fp32 under every ``Precision`` policy); read into fp32,
  written back in its own dtype. Row-major, P fastest (``NanoState.ssm``'s layout).
- ``x``: [B, N, H] the post-conv SSM input, any float dtype (fp32 or bf16); upcast to fp32.
- ``dt``: [B, N] the step AFTER ``softplus(dt_raw + dt_bias)`` (not clamped: the release's
  ``time_step_limit`` is (0, inf)); upcast to fp32. The softplus stays outside so that both paths
  see bit-identical dt (it is [B, N] elementwise work XLA fuses for free).
- ``A``: [N] = ``-exp(A_log)``, fp32.
- ``b_mat``, ``c_mat``: [B, K, P] Mamba's B and C, the input and output projections of each
  group, any float dtype.
- ``D``: [N] the skip, fp32.

Returns ``(new_state, y)``: ``new_state`` of ``state``'s shape and dtype (the same buffer in the
kernel), ``y`` [B, N, H] fp32, the skip ``D x`` included (before the gated norm).

All math is fp32: the kernel's products are elementwise fp32 and ``y``'s contraction over P is
an fp32 sum (never TF32); the reference contracts with ``Precision.HIGHEST``. The two differ
only in summation order (about 1e-7 relative in fp32).

Kernel layout: grid ``(B, N / block_heads, H / block_rows)``; one program reads and writes one
[block_heads, block_rows, P] tile of the state (and y's [block_heads, block_rows] tile), with the
tile's dt, A, D and its group's ``b_mat`` and ``c_mat`` row. ``block_heads`` must divide G (a
tile reads a single group's ``b_mat`` and ``c_mat``), ``block_rows`` must divide H (no padding: a
padded tile cannot alias). On the GPU (Triton lowering) every tile dimension must be a power of
two (``block_heads``, ``block_rows``, P); at 11B H = 80, so rows are tiled by 16. The Triton
backend is chosen explicitly through ``jax.experimental.pallas.triton.CompilerParams`` (jax's
default GPU lowering of ``pallas_call`` is Mosaic GPU in some versions). ``interpret=True`` runs
the kernel through the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_MAX_BLOCK_ROWS = 16  # head-dim rows per tile: the largest power of two dividing 80 (11B H)
_MAX_TILE = 4096  # default tile size in state elements (16 KiB fp32): a few registers per thread


def ssm_step_reference(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    b_mat: jax.Array,
    c_mat: jax.Array,
    D: jax.Array,
    *,
    layer: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The single-step SSM update in plain jnp, fp32 (the module docstring states the contract).

    The same operations as ``nano._mamba_step``'s jnp path: heads grouped as [K, G] so that
    ``b_mat`` and ``c_mat`` broadcast over the heads of their group.
    """
    one = state[:, layer] if layer is not None else state  # [B, N, H, P]
    B, N, H, P = one.shape
    K = b_mat.shape[1]
    G = N // K
    s = one.astype(F32).reshape(B, K, G, H, P)
    x = x.astype(F32).reshape(B, K, G, H)
    dt = dt.astype(F32).reshape(B, K, G)
    A = A.astype(F32).reshape(K, G)
    b, c = b_mat.astype(F32), c_mat.astype(F32)  # [B, K, P]
    s = s * jnp.exp(dt * A)[..., None, None] + jnp.einsum(
        "bkg,bkgh,bkp->bkghp", dt, x, b, precision=_HIGHEST
    )
    y = jnp.einsum("bkghp,bkp->bkgh", s, c, precision=_HIGHEST)
    y = y + D.astype(F32).reshape(K, G)[..., None] * x
    new = s.reshape(one.shape).astype(state.dtype)
    if layer is not None:
        new = state.at[:, layer].set(new)
    return new, y.reshape(B, N, H)


def _kernel(state_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, new_state_ref, y_ref):
    """One [bh, R, P] state tile: decay, rank-1 update, read-out (all fp32)."""
    dt = dt_ref[...].astype(F32)  # [bh]
    x = x_ref[...].astype(F32)  # [bh, R]
    b = b_ref[...].astype(F32)  # [P] this tile's group
    c = c_ref[...].astype(F32)  # [P]
    decay = jnp.exp(dt * a_ref[...].astype(F32))  # [bh]
    dtx = dt[:, None] * x  # [bh, R]: dt x first, then b_mat, as the reference's einsum contracts
    s = state_ref[...].astype(F32) * decay[:, None, None] + dtx[:, :, None] * b[None, None, :]
    new_state_ref[...] = s.astype(new_state_ref.dtype)
    y = jnp.sum(s * c[None, None, :], axis=-1)  # [bh, R] fp32 sum over P
    y_ref[...] = y + d_ref[...].astype(F32)[:, None] * x


def _default_block_rows(H: int) -> int:
    """The largest power of two dividing H, at most ``_MAX_BLOCK_ROWS``."""
    return min(_MAX_BLOCK_ROWS, H & -H)


def _default_block_heads(G: int, rows: int, P: int) -> int:
    """The largest power of two dividing G whose tile stays within ``_MAX_TILE`` elements."""
    bh = 1
    while G % (2 * bh) == 0 and 2 * bh * rows * P <= _MAX_TILE:
        bh *= 2
    return bh


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def ssm_step(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    b_mat: jax.Array,
    c_mat: jax.Array,
    D: jax.Array,
    *,
    layer: int | None = None,
    interpret: bool = False,
    block_heads: int | None = None,
    block_rows: int | None = None,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """The single-step SSM update as a Pallas kernel, state updated in place.

    Shapes, dtypes and the rule are in the module docstring (same contract as
    ``ssm_step_reference``).

    Args:
      layer: static index into the L_m axis of a stacked [B, L_m, N, H, P] state; None for a
        one-layer [B, N, H, P] state.
      interpret: run through the Pallas interpreter (needed on the CPU).
      block_heads: heads per tile; must divide G. Default: the largest power of two dividing G
        with a tile of at most 4096 elements.
      block_rows: head-dim rows per tile; must divide H. Default: the largest power of two
        dividing H, at most 16.
      num_warps: Triton warps per program (GPU only).

    Raises:
      ValueError: on inconsistent shapes, a bad ``layer``, or block sizes that do not divide.
    """
    stacked = layer is not None
    if stacked:
        _check(state.ndim == 5, f"state must be [B, L_m, N, H, P] with layer: {state.shape}")
        _check(
            isinstance(layer, int) and 0 <= layer < state.shape[1],
            f"layer must be a static int in [0, {state.shape[1]}): {layer!r}",
        )
        s5 = state
    else:
        _check(state.ndim == 4, f"state must be [B, N, H, P] without layer: {state.shape}")
        s5, layer = state[:, None], 0  # a free reshape; keeps one kernel for both layouts
    B, _, N, H, P = s5.shape
    K = b_mat.shape[1]
    _check(N % K == 0, f"heads N={N} must be a multiple of the groups K={K}")
    G = N // K
    for name, arr, shape in (
        ("x", x, (B, N, H)),
        ("dt", dt, (B, N)),
        ("A", A, (N,)),
        ("b_mat", b_mat, (B, K, P)),
        ("c_mat", c_mat, (B, K, P)),
        ("D", D, (N,)),
    ):
        _check(arr.shape == shape, f"{name} must have shape {shape}: {arr.shape}")
    R = _default_block_rows(H) if block_rows is None else block_rows
    bh = _default_block_heads(G, R, P) if block_heads is None else block_heads
    _check(
        bh >= 1 and G % bh == 0,
        f"block_heads={bh} must divide the heads per group G={G} "
        "(a tile reads one group's b_mat, c_mat)",
    )
    _check(R >= 1 and H % R == 0, f"block_rows={R} must divide the head dim H={H}")

    j = layer
    tile = pl.BlockSpec((None, None, bh, R, P), lambda b, n, r: (b, j, n, r, 0))
    rows = pl.BlockSpec((None, bh, R), lambda b, n, r: (b, n, r))
    group = pl.BlockSpec((None, None, P), lambda b, n, r: (b, (n * bh) // G, 0))
    new5, y = pl.pallas_call(
        _kernel,
        out_shape=(
            jax.ShapeDtypeStruct(s5.shape, s5.dtype),
            jax.ShapeDtypeStruct((B, N, H), F32),
        ),
        grid=(B, N // bh, H // R),
        in_specs=[
            tile,  # state
            rows,  # x
            pl.BlockSpec((None, bh), lambda b, n, r: (b, n)),  # dt
            pl.BlockSpec((bh,), lambda b, n, r: (n,)),  # A
            group,  # b_mat
            group,  # c_mat
            pl.BlockSpec((bh,), lambda b, n, r: (n,)),  # D
        ],
        out_specs=(tile, rows),
        input_output_aliases={0: 0},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps),
        name="ssm_step",
    )(s5, x, dt, A, b_mat, c_mat, D)
    return (new5 if stacked else new5[:, 0]), y
