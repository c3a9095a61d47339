"""The fused Mamba-2 decode step: conv update, SSM update and gated RMSNorm in one Pallas kernel.

Everything of one frame of one Mamba-2 layer between its two projections
(``voicechat_jax.model.nano._mamba_step`` between ``in_proj`` and ``out_proj``; transformers'
``NemotronHMamba2Mixer`` on a cached step: ``causal_conv1d_update``, ``selective_state_update``
and ``Zamba2RMSNormGated``), with the conv state and the SSM state updated in place
(``input_output_aliases``) and the slots that do not run skipped (their state is neither read nor
written). Why a kernel: the XLA path launches one fusion per stage and, without in-place aliasing,
copies the layer's state (``pallas_kernels.ssm_step``'s docstring; 283 MB per session at 11B);
the SSM update alone as a kernel ran at 3.2-3.3 TB/s on the H200 but was 0.63x XLA at one slot,
where launches dominate. Fusing the stages leaves one launch per layer for all of them.

Axis letters (``voicechat_jax.model``, inside the Mamba mixer): ``B`` slots, ``L`` stacked Mamba
layers (``L_m``), ``N`` heads, ``H`` head dim, ``P`` SSM state size, ``K`` groups (``n_groups``)
sharing ``b_mat``/``c_mat`` and normalised together, ``G = N // K`` heads per group, ``C`` conv
channels ``N*H + 2*K*P`` (``[x | b_mat | c_mat]``), ``k`` the conv kernel width (a number, not an
axis of the alphabet).

Arguments (both functions):

- ``zxbcdt``: [B, N*H + C + N] the ``in_proj`` output ``[z | xBC | dt_raw]``, activation dtype
  (bf16 under the reference policy, fp32 in the parity tests).
- ``conv``: [B, L, k-1, C] the stacked conv states (the last k-1 raw xBC inputs), any float dtype
  (``precision.ssm_state``); layer ``layer`` is updated, the others are returned untouched.
- ``ssm``: [B, N, H, P] this layer's SSM state, any float dtype (read into fp32, written back in
  its own dtype).
- ``conv_w`` [L, k, C], ``conv_b`` [L, C], ``gate_norm`` [L, N*H]: the stacked weights (activation
  dtype), ``dt_bias``, ``A_log``, ``D`` [L, N] (fp32): all read at ``layer`` in place.
- ``run``: [B] bool, the slots that advance.
- ``layer``: static index into the L axes; ``n_groups`` K (static); ``eps`` the norm epsilon.

Returns ``(conv, ssm, y)``: the new conv states (same shape and dtype; the same buffer in the
kernel), the new SSM state, and ``y`` [B, N*H] in the activation dtype, the gated norm's output
(``out_proj``'s input). A slot with ``run`` False keeps its conv and SSM state bit-identical and
gets ``y = 0`` (defined here: the model discards that row).

Math, as ``nano._mamba_step`` computes it (all fp32, with the model's two roundings to the
activation dtype): ``window = [conv | xBC]`` [k, C]; ``xBC = silu(sum_i window[i] * conv_w[i] +
conv_b)`` rounded to the activation dtype, split into x [N, H], ``b_mat``, ``c_mat`` [K, P];
``dt = softplus(dt_raw + dt_bias)`` (not clamped), ``A = -exp(A_log)``; the SSM update of
``ssm_step``; ``y`` rounded to the activation dtype, ``g = y * silu(z)``, normalised over each
group's G*H channels (``g * rsqrt(mean(g^2) + eps)``), rounded, times ``gate_norm``, rounded. The
new conv state is ``window[1:]``. The kernel sums in its own order (the conv taps in order, the
group's square sum from per-tile partials in a fixed order), so it matches the reference to fp32
rounding, and an activation-dtype rounding can land one ulp apart where the fp32 value is near a
tie.

Kernel layout (Triton lowering, ``jax.experimental.pallas.triton.CompilerParams``): grid
``(B, N, H / block_rows)``; program (b, n, r) owns rows ``[r * block_rows, (r+1) * block_rows)``
of head n of slot b: it computes the conv of its x channels (``n*H + rows``) and of its group's
``b_mat`` and ``c_mat`` channels (recomputed by each of the group's programs: 2P channels, a few
KB read from L2), updates its [block_rows, P] state tile and its x channels' conv state in place,
and writes ``g`` for its channels plus its partial square sum to small fp32 scratch outputs.

The norm needs the whole group's square sum, which no single tile has. Each program therefore
increments its group's counter (``atomic_add``, acquire-release, after a CTA barrier so that
every thread's stores are ordered before it), and the program that arrives last (the add returns
``n_sub - 1``, ``n_sub`` the group's programs) sums the group's partials in a fixed order,
normalises the group's G*H channels of ``g`` (read back with volatile loads, never from a stale
L1 line) into ``y``, and writes the group's ``b_mat``/``c_mat`` conv state: only then, since
every program of the group has read the old one before counting in. Deterministic: the counter
picks who finishes, never the order of a sum. The counters are a zeroed [B, K] int32 input
aliased to an output (one memset per call). ``block_rows`` must divide H and be a power of two
(the tile is [block_rows, P], P a power of two on the GPU); at 11B H = 80 gives 16, and 5 x 128
programs per slot. ``interpret=True`` runs the kernel through the Pallas interpreter (CPU tests),
where programs run one after another (the counter then simply reaches the group's last tile).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ssm_step import ssm_step_reference

F32 = jnp.float32
_MAX_BLOCK_ROWS = 16  # head-dim rows per tile: the largest power of two dividing 80 (11B H)
_MAX_NORM_CHUNK = 1024  # channels of g normalised per step by a group's last program
_HAS_COST_ESTIMATE = hasattr(pl, "CostEstimate") and (
    "cost_estimate" in inspect.signature(pl.pallas_call).parameters
)


def _split(zxbcdt: jax.Array, NH: int, C: int):
    return zxbcdt[..., :NH], zxbcdt[..., NH : NH + C], zxbcdt[..., NH + C :]


def mamba_step_reference(
    zxbcdt: jax.Array,
    conv: jax.Array,
    ssm: jax.Array,
    conv_w: jax.Array,
    conv_b: jax.Array,
    dt_bias: jax.Array,
    A_log: jax.Array,
    D: jax.Array,
    gate_norm: jax.Array,
    run: jax.Array,
    *,
    layer: int,
    n_groups: int,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused step in plain jnp (the module docstring states the contract).

    The operations of ``nano._mamba_step`` between the projections, with idle slots' y zeroed.
    """
    Bsz, N, H, P = ssm.shape
    K = n_groups
    G = N // K
    NH = N * H
    act = zxbcdt.dtype
    z, xbc, dt_raw = _split(zxbcdt, NH, conv.shape[-1])
    old = conv[:, layer].astype(F32)  # [B, k-1, C]
    window = jnp.concatenate([old, xbc[:, None].astype(F32)], axis=1)  # [B, k, C]
    w = conv_w[layer].astype(F32)  # [k, C]
    xbc = sum(window[:, i] * w[i] for i in range(w.shape[0])) + conv_b[layer].astype(F32)
    xbc = jax.nn.silu(xbc).astype(act).astype(F32)
    x = xbc[:, :NH].reshape(Bsz, N, H)
    b_mat = xbc[:, NH : NH + K * P].reshape(Bsz, K, P)
    c_mat = xbc[:, NH + K * P :].reshape(Bsz, K, P)
    dt = jax.nn.softplus(dt_raw.astype(F32) + dt_bias[layer].astype(F32))
    dt = jnp.where(run[:, None], dt, 0.0)
    A = -jnp.exp(A_log[layer].astype(F32))
    new_ssm, y = ssm_step_reference(ssm, x, dt, A, b_mat, c_mat, D[layer].astype(F32))
    g = y.reshape(Bsz, NH).astype(act).astype(F32) * jax.nn.silu(z.astype(F32))
    g = g.reshape(Bsz, K, G * H)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    y = gate_norm[layer].astype(act) * g.reshape(Bsz, NH).astype(act)
    y = jnp.where(run[:, None], y, jnp.zeros((), act))
    new_conv = jnp.where(run[:, None, None], window[:, 1:], old).astype(conv.dtype)
    new_ssm = jnp.where(run[:, None, None, None], new_ssm.astype(ssm.dtype), ssm)
    return conv.at[:, layer].set(new_conv), new_ssm, y


def _conv(window, w_ref, b_ref, chan, act):
    """silu(sum_i window[i] w[i] + b) rounded to ``act``, for the channels ``chan``: fp32 [len].

    ``window`` is the k fp32 rows of those channels, oldest first (the conv state, then xBC).
    """
    acc = b_ref[chan].astype(F32)
    for i, row in enumerate(window):
        acc = acc + row * w_ref[i, chan].astype(F32)
    return jax.nn.silu(acc).astype(act).astype(F32)


def _kernel(
    run_ref,
    zxbcdt_ref,
    conv_ref,
    ssm_ref,
    conv_w_ref,
    conv_b_ref,
    dt_bias_ref,
    a_log_ref,
    d_ref,
    gate_ref,
    count_ref,
    new_conv_ref,
    new_ssm_ref,
    y_ref,
    g_ref,
    ss_ref,
    new_count_ref,
    *,
    N: int,
    H: int,
    P: int,
    K: int,
    eps: float,
    rows: int,
    interpret: bool,
):
    """Program (b, n, r); refs are slot b's rows of every array, layer j's of the stacked ones.

    Refs: run []; zxbcdt [N*H + C + N]; conv and new_conv [k-1, C]; ssm and new_ssm [rows, P];
    conv_w [k, C]; conv_b [C]; dt_bias, A_log, D [N]; gate [N*H]; count and new_count [K]
    (aliased); y and g [G*H] (this group's channels); ss [n_sub] (this group's partials).
    """
    del count_ref  # the same buffer as new_count_ref (aliased); only the output is used
    b, n, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    del b
    G = N // K
    NH = N * H
    kgrp = n // G  # this head's group
    n_rows = H // rows  # row tiles per head
    n_sub = G * n_rows  # programs per group
    sub = (n % G) * n_rows + r  # this program's index within its group
    act = zxbcdt_ref.dtype
    km1, C = conv_ref.shape
    own = pl.ds(n * H + r * rows, rows)  # this tile's x channels (conv, z and y)
    local = pl.ds((n % G) * H + r * rows, rows)  # the same channels within the group's G*H
    b_chan = pl.ds(NH + kgrp * P, P)
    c_chan = pl.ds(NH + K * P + kgrp * P, P)
    running = run_ref[()] != 0

    @pl.when(jnp.logical_not(running))
    def _():
        y_ref[local] = jnp.zeros((rows,), y_ref.dtype)

    @pl.when(running)
    def _():
        # --- conv of this tile's x channels and of its group's B and C channels
        def window(chan):  # [k] rows of fp32 [len]: the conv state, then this frame's xBC
            xbc = zxbcdt_ref[pl.ds(NH + chan.start, chan.size)].astype(F32)
            return [*(conv_ref[i, chan].astype(F32) for i in range(km1)), xbc]

        x_win, b_win, c_win = window(own), window(b_chan), window(c_chan)
        x = _conv(x_win, conv_w_ref, conv_b_ref, own, act)  # [rows]
        b_mat = _conv(b_win, conv_w_ref, conv_b_ref, b_chan, act)  # [P]
        c_mat = _conv(c_win, conv_w_ref, conv_b_ref, c_chan, act)  # [P]
        for i in range(km1):  # this tile's x channels: only this program reads or writes them
            new_conv_ref[i, own] = x_win[i + 1].astype(new_conv_ref.dtype)

        # --- the SSM update of this [rows, P] tile (``ssm_step``'s math)
        dt = jax.nn.softplus(zxbcdt_ref[NH + C + n].astype(F32) + dt_bias_ref[n])
        decay = jnp.exp(dt * -jnp.exp(a_log_ref[n]))
        dtx = dt * x  # [rows]
        s = ssm_ref[...].astype(F32) * decay + dtx[:, None] * b_mat[None, :]
        new_ssm_ref[...] = s.astype(new_ssm_ref.dtype)
        y = jnp.sum(s * c_mat[None, :], axis=-1) + d_ref[n] * x  # [rows] fp32

        # --- gate, and this tile's share of the group's square sum
        z = zxbcdt_ref[own].astype(F32)
        g = y.astype(act).astype(F32) * jax.nn.silu(z)
        g_ref[local] = g
        ss_ref[sub] = jnp.sum(g * g)
        if not interpret:
            pltriton.debug_barrier()  # every thread's g and ss stores precede the count
        arrived = pltriton.atomic_add(new_count_ref, kgrp, jnp.ones((), jnp.int32))

        @pl.when(arrived == n_sub - 1)
        def _():
            # The group's last program: all of its tiles' g and partials are written, and all
            # of them have read the group's old B and C conv state.
            sub_p = pl.next_power_of_2(n_sub)
            parts = pltriton.load(
                ss_ref.at[pl.ds(0, sub_p)],
                mask=jnp.arange(sub_p) < n_sub,
                other=0.0,
                volatile=not interpret,
            )
            scale = jax.lax.rsqrt(jnp.sum(parts) / (G * H) + eps)
            chunk = min(_MAX_NORM_CHUNK, (G * H) & -(G * H))

            def norm(i, carry):
                at = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
                gi = pltriton.load(g_ref.at[at], volatile=not interpret)
                w = gate_ref[pl.ds(kgrp * G * H + i * chunk, chunk)].astype(act).astype(F32)
                y_ref[at] = (w * (gi * scale).astype(act).astype(F32)).astype(y_ref.dtype)
                return carry

            jax.lax.fori_loop(0, (G * H) // chunk, norm, 0)
            for i in range(km1):
                new_conv_ref[i, b_chan] = b_win[i + 1].astype(new_conv_ref.dtype)
                new_conv_ref[i, c_chan] = c_win[i + 1].astype(new_conv_ref.dtype)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def mamba_step(
    zxbcdt: jax.Array,
    conv: jax.Array,
    ssm: jax.Array,
    conv_w: jax.Array,
    conv_b: jax.Array,
    dt_bias: jax.Array,
    A_log: jax.Array,
    D: jax.Array,
    gate_norm: jax.Array,
    run: jax.Array,
    *,
    layer: int,
    n_groups: int,
    eps: float,
    interpret: bool = False,
    block_rows: int | None = None,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused decode step of one Mamba-2 layer as one Pallas kernel, states in place.

    Shapes, dtypes and the rules are in the module docstring (same contract as
    ``mamba_step_reference``).

    Args:
      layer: static index into the stacked L axes (conv state and weights).
      n_groups: K, the groups of heads sharing B and C and normalised together (static).
      eps: the gated norm's epsilon (static).
      interpret: run through the Pallas interpreter (needed on the CPU).
      block_rows: head-dim rows per program; a power of two dividing H. Default: the largest
        power of two dividing H, at most 16.
      num_warps: Triton warps per program (GPU only).

    Raises:
      ValueError: on inconsistent shapes, a bad ``layer`` or ``block_rows``.
    """
    _check(ssm.ndim == 4, f"ssm must be [B, N, H, P]: {ssm.shape}")
    Bsz, N, H, P = ssm.shape
    K = n_groups
    _check(K >= 1 and N % K == 0, f"heads N={N} must be a multiple of the groups K={K}")
    G = N // K
    NH = N * H
    _check(conv.ndim == 4 and conv.shape[0] == Bsz, f"conv must be [B, L, k-1, C]: {conv.shape}")
    L, km1, C = conv.shape[1:]
    _check(C == NH + 2 * K * P, f"conv channels must be N*H + 2*K*P = {NH + 2 * K * P}: {C}")
    _check(
        isinstance(layer, int) and 0 <= layer < L,
        f"layer must be a static int in [0, {L}): {layer!r}",
    )
    for name, arr, shape in (
        ("zxbcdt", zxbcdt, (Bsz, NH + C + N)),
        ("conv_w", conv_w, (L, km1 + 1, C)),
        ("conv_b", conv_b, (L, C)),
        ("dt_bias", dt_bias, (L, N)),
        ("A_log", A_log, (L, N)),
        ("D", D, (L, N)),
        ("gate_norm", gate_norm, (L, NH)),
        ("run", run, (Bsz,)),
    ):
        _check(arr.shape == shape, f"{name} must have shape {shape}: {arr.shape}")
    R = min(_MAX_BLOCK_ROWS, H & -H) if block_rows is None else block_rows
    _check(
        R >= 1 and H % R == 0 and R & (R - 1) == 0,
        f"block_rows={R} must be a power of two dividing the head dim H={H}",
    )
    n_sub = G * (H // R)
    j = layer
    act = zxbcdt.dtype

    kernel = functools.partial(
        _kernel, N=N, H=H, P=P, K=K, eps=float(eps), rows=R, interpret=interpret
    )
    slot = lambda b, n, r: (b, 0)  # noqa: E731 - a whole row of slot b
    weight = lambda b, n, r: (j, 0)  # noqa: E731 - layer j's row of a stacked [L, X] weight
    group = lambda b, n, r: (b, n // G, 0)  # noqa: E731 - slot b, head n's group
    conv_spec = pl.BlockSpec((None, None, km1, C), lambda b, n, r: (b, j, 0, 0))
    ssm_spec = pl.BlockSpec((None, None, R, P), lambda b, n, r: (b, n, r, 0))
    count_spec = pl.BlockSpec((None, K), slot)
    cost = {}
    if _HAS_COST_ESTIMATE:
        state = 2 * Bsz * N * H * P * ssm.dtype.itemsize
        cost["cost_estimate"] = pl.CostEstimate(
            flops=Bsz * N * H * P * 6 + Bsz * C * 2 * (km1 + 1) * (1 + n_sub),
            transcendentals=Bsz * (C + 2 * NH + 2 * N),
            bytes_accessed=state
            + 2 * Bsz * km1 * C * conv.dtype.itemsize
            + zxbcdt.nbytes
            + Bsz * NH * 14,
        )
    new_conv, new_ssm, y, _, _, _ = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(conv.shape, conv.dtype),
            jax.ShapeDtypeStruct(ssm.shape, ssm.dtype),
            jax.ShapeDtypeStruct((Bsz, K, G * H), act),  # y
            jax.ShapeDtypeStruct((Bsz, K, G * H), F32),  # g (scratch)
            jax.ShapeDtypeStruct((Bsz, K, n_sub), F32),  # square-sum partials (scratch)
            jax.ShapeDtypeStruct((Bsz, K), jnp.int32),  # counters
        ),
        grid=(Bsz, N, H // R),
        in_specs=[
            pl.BlockSpec((None,), lambda b, n, r: (b,)),  # run
            pl.BlockSpec((None, NH + C + N), slot),  # zxbcdt
            conv_spec,
            ssm_spec,
            pl.BlockSpec((None, km1 + 1, C), lambda b, n, r: (j, 0, 0)),  # conv_w
            pl.BlockSpec((None, C), weight),  # conv_b
            pl.BlockSpec((None, N), weight),  # dt_bias
            pl.BlockSpec((None, N), weight),  # A_log
            pl.BlockSpec((None, N), weight),  # D
            pl.BlockSpec((None, NH), weight),  # gate_norm
            count_spec,
        ],
        out_specs=(
            conv_spec,
            ssm_spec,
            pl.BlockSpec((None, None, G * H), group),
            pl.BlockSpec((None, None, G * H), group),
            pl.BlockSpec((None, None, n_sub), group),
            count_spec,
        ),
        input_output_aliases={2: 0, 3: 1, 10: 5},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps),
        name="mamba_step",
        **cost,
    )(
        run.astype(jnp.int32),
        zxbcdt,
        conv,
        ssm,
        conv_w,
        conv_b,
        dt_bias.astype(F32),
        A_log.astype(F32),
        D.astype(F32),
        gate_norm,
        jnp.zeros((Bsz, K), jnp.int32),
    )
    return new_conv, new_ssm, y.reshape(Bsz, NH)
