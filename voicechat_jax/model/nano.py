"""The hybrid LLM: Nemotron-H (Nemotron-Nano-9B-v2 backbone) with the duplex input sum and heads.

Mirrors transformers ``models/nemotron_h/modeling_nemotron_h.py`` (``NemotronHModel``, its torch
path), and NVIDIA's own ``modeling_nemotron_h.py`` on the two points where they differ (the fp32
residual and the unclamped dt, noted below):

- ``NemotronHBlock``: ``x = x + mixer(RMSNorm(x))``, one mixer per layer, kind from ``cfg.pattern``
  ('M' ``NemotronHMamba2Mixer``, '-' ``NemotronHMLP``, '*' ``NemotronHAttention``); final
  ``norm_f``. The residual stream is kept in fp32 (NVIDIA's ``residual_in_fp32``), each norm reads
  it cast to the activation dtype first, as ``self.norm(hidden_states.to(self.norm.weight.dtype))``.
- ``NemotronHRMSNorm``: plain ``w * x̂`` computed in fp32.
- ``NemotronHMamba2Mixer``: ``in_proj`` -> ``[z | xBC | dt]``; causal depthwise conv (kernel k,
  bias) + SiLU on xBC; split x, B, C (``b_mat``, ``c_mat``); ``dt = softplus(dt + dt_bias)`` NOT
  clamped (the release's ``time_step_limit`` is (0, inf); transformers' native code clamps at
  ``time_step_min`` in its chunked path, so its reference configs must set ``time_step_min``
  tiny); ``A = -exp(A_log)``;
  ``h <- exp(dt A) h + dt x B``, ``y = C h + D x``; ``Zamba2RMSNormGated``: RMSNorm over groups of
  ``N*H / n_groups`` channels of ``y * silu(z)``, times its weight; ``out_proj``.
- ``NemotronHMLP``: ``down(relu(up(x))**2)``.
- ``NemotronHAttention``: GQA, no positional encoding (NoPE), scale ``1/sqrt(H)``, causal.

and the parts of NeMo's ``DuplexSTTModel`` around it: the input sum (``prepare_inputs`` /
``DuplexSTTStreamingInference._step_inference``, plus the release's function channel, weight 2.0)
and the ``lm_head`` / ``function_head`` projections of the same final hidden state.

Two paths share the params: ``prefill`` (a whole sequence: chunked SSD scan, the algorithm of
transformers' ``mamba2_chunk_scan``) and ``step`` (one frame: the recurrent update of
``mamba2_selective_state_update``). Both continue from a ``NanoState`` and return it updated.

Both also run as one device's share of a tensor-parallel model axis (the section at the end:
``shard_config`` gives the local sizes, ``to_tensor_parallel`` and ``partition_specs`` the
weights' layout and split, ``state_partition_specs`` the state's); with a plain ``LLMConfig``
they are the one-device model, unchanged.

Precision (``Precision``): weights and activations in ``precision.llm`` (bf16 as NeMo serves the
release), the residual stream fp32, the Mamba conv, SSM scan and gated norm computed in fp32 (as the
``causal_conv1d`` / ``mamba_ssm`` kernels do) with their outputs cast back to the activation dtype,
the SSM and conv state in ``precision.ssm_state`` and the KV cache in ``precision.llm_kv``.
``A_log``, ``D`` and ``dt_bias`` are kept in fp32 whatever the policy (docs/model.md §5).
The activation dtype is read from the params (``params.embed.dtype``), so the step functions take
no precision argument.

Shapes use the axis alphabet of ``voicechat_jax.model``. Inside the Mamba mixer the letters carry
their Mamba meaning: ``N`` Mamba heads, ``H`` Mamba head dim, ``K`` B/C groups (``n_groups``; B
and C are shared by a group of heads as keys are by a group of query heads), ``G = N // K`` heads
per group, ``P`` the SSM state size, ``C`` the conv channels ``N*H + 2*K*P``, ``X`` the SSD
chunk length of ``prefill``. Mamba's B and C matrices are arrays ``b_mat`` / ``c_mat``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.mamba_step import mamba_step
from pallas_kernels.ssm_step import ssm_step, ssm_step_reference
from voicechat_jax.config import LLMConfig
from voicechat_jax.model import common
from voicechat_jax.model.attention import attend, gqa
from voicechat_jax.model.common import dense, fan_in_normal, normal, rms_norm
from voicechat_jax.model.llm_shard import LLMShard, all_reduce, group_mean_sq
from voicechat_jax.model.projection import matmul
from voicechat_jax.precision import Precision

F32 = jnp.float32
# The SSM recurrence and its state are fp32 math: keep XLA from lowering those contractions to
# reduced-precision passes (TF32 / bf16) on accelerators.
_SSM_PRECISION = jax.lax.Precision.HIGHEST
DEFAULT_CHUNK = 64  # SSD chunk length of ``prefill`` (any value gives the same result)
SSM_KERNELS = ("xla", "pallas", "fused")  # implementations of ``step``'s Mamba update
PROJECTIONS = ("xla", "pallas")  # implementations of ``step``'s MLP and Mamba projections
# The products a decode step streams: one leaf per layer in the serving layout (``per_layer``).
_STREAMED = {"mamba": ("in_proj", "out_proj"), "mlp": ("up", "down"), "attn": ("q", "k", "v", "o")}
_KIND = {"mamba": "M", "mlp": "-", "attn": "*"}


@struct.dataclass
class MambaParams:
    """The Mamba-2 layers ('M'), stacked on L in pattern order (``in_proj`` and ``out_proj`` a
    tuple of L layers in the serving layout, ``per_layer``)."""

    norm: jax.Array  # [L, D] block RMSNorm
    in_proj: jax.Array  # [L, D, N*H + C + N]: [z | xBC | dt]
    conv_w: jax.Array  # [L, k, C] causal depthwise conv over xBC (torch conv1d [C, 1, k])
    conv_b: jax.Array  # [L, C]
    A_log: jax.Array  # [L, N] fp32; A = -exp(A_log)
    D: jax.Array  # [L, N] fp32 skip
    dt_bias: jax.Array  # [L, N] fp32
    gate_norm: jax.Array  # [L, N*H] gated grouped RMSNorm weight
    out_proj: jax.Array  # [L, N*H, D]


@struct.dataclass
class MLPParams:
    """The relu² MLP layers ('-'), stacked on L in pattern order (``up`` and ``down`` a tuple of
    L layers in the serving layout, ``per_layer``)."""

    norm: jax.Array  # [L, D] block RMSNorm
    up: jax.Array  # [L, D, F]
    down: jax.Array  # [L, F, D]


@struct.dataclass
class AttnParams:
    """The NoPE GQA attention layers ('*'), stacked on L in pattern order (the four products a
    tuple of L layers in the serving layout, ``per_layer``)."""

    norm: jax.Array  # [L, D] block RMSNorm
    q: jax.Array  # [L, D, N*H]
    k: jax.Array  # [L, D, K*H]
    v: jax.Array  # [L, D, K*H]
    o: jax.Array  # [L, N*H, D]


@struct.dataclass
class NanoParams:
    """The LLM backbone, its token embedding and its two vocabulary heads."""

    embed: jax.Array  # [V, D] shared by the text and function channels
    lm_head: jax.Array  # [D, V] text head
    function_head: jax.Array  # [D, V] function-call head
    norm_f: jax.Array  # [D] final RMSNorm
    mamba: MambaParams
    mlp: MLPParams
    attn: AttnParams


def per_layer(params: NanoParams) -> NanoParams:
    """The serving layout (``common.per_layer``): the Mamba, MLP and attention products one leaf
    per layer, so that no step copies a layer's weight out of its stack."""
    return params.replace(
        **{g: common.per_layer(getattr(params, g), f) for g, f in _STREAMED.items()}
    )


def per_layer_specs(specs: NanoParams, cfg: LLMConfig) -> NanoParams:
    """The ``PartitionSpec`` tree of ``per_layer(params)`` from that of the stacked params
    (``nano_tp.partition_specs``)."""
    return specs.replace(
        **{
            g: common.per_layer_specs(getattr(specs, g), f, len(cfg.layers_of(_KIND[g])))
            for g, f in _STREAMED.items()
        }
    )


@struct.dataclass
class NanoState:
    """Per-slot recurrent state of the LLM: arrays only, slot axis B first.

    Every state is one leaf per layer, each in the layout its decode update reads (a whole
    buffer per layer: no strided slab of a stacked array copied out and scattered back, one
    kernel compile for every layer).
    """

    ssm: tuple[jax.Array, ...]  # L_m x [B, N, H, P] Mamba SSM state, precision.ssm_state
    conv: tuple[jax.Array, ...]  # L_m x [B, k-1, C] last k-1 conv inputs (raw xBC), ssm_state
    k: tuple[jax.Array, ...]  # L_a x [B, K, S, H] attention keys, precision.llm_kv
    v: tuple[jax.Array, ...]  # L_a x [B, K, S, H] attention values, precision.llm_kv
    length: jax.Array  # [B] int32 positions consumed so far (= next cache row)


# ----------------------------------------------------------------------------- params and state


def init(key: jax.Array, cfg: LLMConfig, precision: Precision) -> NanoParams:
    """Random weights that keep activations at unit scale (norm weights near 1, biases non-zero)."""
    dt = precision.llm
    D, V = cfg.d_model, cfg.vocab_size
    L_m, L_f, L_a = (len(cfg.layers_of(c)) for c in "M-*")
    NH, C, N, k = cfg.d_inner, cfg.conv_dim, cfg.mamba_heads, cfg.conv_kernel
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    ks = iter(jax.random.split(key, 32))

    def near_one(shape):
        return (1.0 + 0.1 * jax.random.normal(next(ks), shape, F32)).astype(dt)

    # dt_bias: softplus^-1 of a log-uniform step in [1e-3, 1e-1] (the Mamba-2 initialisation).
    log_dt = jax.random.uniform(next(ks), (L_m, N), F32, jnp.log(1e-3), jnp.log(1e-1))
    step = jnp.exp(log_dt)
    mamba = MambaParams(
        norm=near_one((L_m, D)),
        in_proj=fan_in_normal(next(ks), (L_m, D, cfg.in_proj_dim), dt, D),
        conv_w=normal(next(ks), (L_m, k, C), dt, std=k**-0.5),
        conv_b=normal(next(ks), (L_m, C), dt, std=0.1),
        A_log=jnp.log(jax.random.uniform(next(ks), (L_m, N), F32, 1.0, 16.0)),
        D=1.0 + 0.1 * jax.random.normal(next(ks), (L_m, N), F32),
        dt_bias=step + jnp.log(-jnp.expm1(-step)),
        gate_norm=near_one((L_m, NH)),
        out_proj=fan_in_normal(next(ks), (L_m, NH, D), dt, NH),
    )
    mlp = MLPParams(
        norm=near_one((L_f, D)),
        up=fan_in_normal(next(ks), (L_f, D, cfg.mlp_dim), dt, D),
        down=fan_in_normal(next(ks), (L_f, cfg.mlp_dim, D), dt, cfg.mlp_dim),
    )
    attn = AttnParams(
        norm=near_one((L_a, D)),
        q=fan_in_normal(next(ks), (L_a, D, q_dim), dt, D),
        k=fan_in_normal(next(ks), (L_a, D, kv_dim), dt, D),
        v=fan_in_normal(next(ks), (L_a, D, kv_dim), dt, D),
        o=fan_in_normal(next(ks), (L_a, q_dim, D), dt, q_dim),
    )
    return NanoParams(
        embed=normal(next(ks), (V, D), dt, std=1.0),
        lm_head=fan_in_normal(next(ks), (D, V), dt, D),
        function_head=fan_in_normal(next(ks), (D, V), dt, D),
        norm_f=near_one((D,)),
        mamba=mamba,
        mlp=mlp,
        attn=attn,
    )


def abstract(cfg: LLMConfig, precision: Precision) -> NanoParams:
    """The params as ``jax.ShapeDtypeStruct`` leaves (allocates nothing)."""
    return jax.eval_shape(lambda key: init(key, cfg, precision), jax.random.key(0))


def init_state(cfg: LLMConfig, batch: int, max_len: int, precision: Precision) -> NanoState:
    """The fresh state of ``batch`` slots with room for ``max_len`` attention positions each."""
    L_m, L_a = len(cfg.layers_of("M")), len(cfg.layers_of("*"))
    ssm = (batch, cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state)
    kv = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    return NanoState(
        ssm=tuple(jnp.zeros(ssm, precision.ssm_state) for _ in range(L_m)),
        conv=tuple(
            jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), precision.ssm_state)
            for _ in range(L_m)
        ),
        k=tuple(jnp.zeros(kv, precision.llm_kv) for _ in range(L_a)),
        v=tuple(jnp.zeros(kv, precision.llm_kv) for _ in range(L_a)),
        length=jnp.zeros((batch,), jnp.int32),
    )


# ----------------------------------------------------------------------------- input and heads


def embed(params: NanoParams, ids: jax.Array) -> jax.Array:
    """Token embedding ``E[ids]``: ids [...] -> [..., D] in the params' dtype."""
    return jnp.take(params.embed, ids, axis=0)


def input_embedding(
    params: NanoParams,
    text_prev: jax.Array,
    func_prev: jax.Array,
    audio_proj: jax.Array,
    cfg: LLMConfig,
) -> jax.Array:
    """The duplex LLM input of one or more frames, fp32 [..., D].

    ``user_weight * audio + text_weight * E[text_prev] + function_weight * E[func_prev]``
    (NeMo ``DuplexSTTModel.prepare_inputs`` and ``DuplexSTTStreamingInference``: the perception
    output, fp32, is scaled and the bf16 embeddings are added into it; the release adds the function
    channel, weight 2.0, from the same table). Before the first frame both tokens are PAD.

    Args:
      text_prev: [...] int, the previous frame's text token.
      func_prev: [...] int, the previous frame's function-channel token.
      audio_proj: [..., D] the ``perception.proj`` output of this frame.
    """
    e = audio_proj.astype(F32) * cfg.user_weight
    e = e + embed(params, text_prev).astype(F32) * cfg.text_weight
    return e + embed(params, func_prev).astype(F32) * cfg.function_weight


def heads(params: NanoParams, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(lm_head(h), function_head(h))``: hidden [..., D] -> two fp32 [..., V] logits.

    The hidden state is cast to the heads' dtype (bf16 under the reference policy); the products
    accumulate and return in fp32 so that greedy choices are not decided by bf16 rounding of logits.
    """
    h = hidden.astype(params.lm_head.dtype)
    text = jnp.einsum("...d,dv->...v", h, params.lm_head, preferred_element_type=F32)
    func = jnp.einsum("...d,dv->...v", h, params.function_head, preferred_element_type=F32)
    return text, func


def greedy(params: NanoParams, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy ``(text_t, func_t)`` int32 [...] from hidden [..., D] (argmax of both heads)."""
    text, func = heads(params, hidden)
    return jnp.argmax(text, -1).astype(jnp.int32), jnp.argmax(func, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------- Mamba-2 mixer


def _split_in_proj(zxbcdt: jax.Array, cfg: LLMConfig):
    """[..., N*H + C + N] -> z [..., N*H], xBC [..., C], dt [..., N]."""
    NH, C = cfg.d_inner, cfg.conv_dim
    return zxbcdt[..., :NH], zxbcdt[..., NH : NH + C], zxbcdt[..., NH + C :]


def _split_xbc(xbc: jax.Array, cfg: LLMConfig):
    """Post-conv xBC [..., C] -> fp32 x [..., K, G, H], b_mat [..., K, P], c_mat [..., K, P]."""
    K, P, H = cfg.n_groups, cfg.ssm_state, cfg.mamba_head_dim
    G = cfg.mamba_heads // K
    NH = cfg.d_inner
    lead = xbc.shape[:-1]
    xbc = xbc.astype(F32)
    x = xbc[..., :NH].reshape(*lead, K, G, H)
    b_mat = xbc[..., NH : NH + K * P].reshape(*lead, K, P)
    c_mat = xbc[..., NH + K * P :].reshape(*lead, K, P)
    return x, b_mat, c_mat


def _ssm_coeffs(p: MambaParams, j: int, dt_raw: jax.Array, cfg: LLMConfig):
    """dt = softplus(dt_raw + dt_bias) [..., K, G] (no clamp) and A = -exp(A_log) [K, G], fp32."""
    K = cfg.n_groups
    G = cfg.mamba_heads // K
    dt = jax.nn.softplus(dt_raw.astype(F32) + p.dt_bias[j].astype(F32))
    A = -jnp.exp(p.A_log[j].astype(F32))
    return dt.reshape(*dt.shape[:-1], K, G), A.reshape(K, G)


def _gated_norm(y: jax.Array, z: jax.Array, w: jax.Array, cfg: LLMConfig) -> jax.Array:
    """``Zamba2RMSNormGated``: RMSNorm of ``y * silu(z)`` over groups of N*H/K channels, times w.

    y, z [..., N*H] in the activation dtype; the product and the norm run in fp32, the result is
    cast back before the weight multiplies it (as the torch module does).
    """
    act = y.dtype
    g = y.astype(F32) * jax.nn.silu(z.astype(F32))
    lead = g.shape[:-1]
    g = g.reshape(*lead, cfg.n_groups, -1)
    if isinstance(cfg, LLMShard) and cfg.norm_ranks > 1:
        mean_sq = group_mean_sq(g, cfg)  # the group spans devices: its mean is summed over them
    else:
        mean_sq = jnp.mean(g * g, axis=-1, keepdims=True)
    g = g * jax.lax.rsqrt(mean_sq + cfg.norm_eps)
    return w.astype(act) * g.reshape(*lead, -1).astype(act)


def _mamba_step(
    p: MambaParams,
    j: int,
    h,
    conv,
    ssm,
    run,
    cfg: LLMConfig,
    ssm_kernel: str = "xla",
    projection: str = "xla",
):
    """One frame of Mamba layer j (``mamba2_selective_state_update``), masked by ``run``.

    h [B, D] normed input; conv [B, k-1, C] and ssm [B, N, H, P] layer j's conv and SSM state;
    run [B] bool, the rows that advance. ``ssm_kernel`` picks the recurrent update: 'xla' (the
    jnp reference) or 'pallas' (``pallas_kernels.ssm_step``, the state updated in place); the
    fused kernel takes the stacked conv state instead (``_mamba_step_fused``). ``projection``
    picks in_proj's and out_proj's implementation (``model.projection``). A row
    that does not run gets dt = 0, so its SSM update is the identity (decay exp(0) = 1, input
    term 0) and its state comes back unchanged without a select over the state; its conv state is
    kept by a select (small). Returns (conv, ssm, out [B, D]).
    """
    if ssm_kernel not in ("xla", "pallas"):
        raise ValueError(
            f"_mamba_step runs 'xla' or 'pallas' (fused: _mamba_step_fused): {ssm_kernel!r}"
        )
    act = h.dtype
    B = h.shape[0]
    zxbcdt = matmul(h, p.in_proj, layer=j, impl=projection)
    z, xbc, dt_raw = _split_in_proj(zxbcdt, cfg)
    window = jnp.concatenate([conv.astype(F32), xbc[:, None].astype(F32)], axis=1)  # [B, k, C]
    xbc = jnp.einsum("bkc,kc->bc", window, p.conv_w[j].astype(F32)) + p.conv_b[j].astype(F32)
    xbc = jax.nn.silu(xbc).astype(act)
    x, b_mat, c_mat = _split_xbc(xbc, cfg)  # [B, K, G, H], [B, K, P], [B, K, P]
    dt, A = _ssm_coeffs(p, j, dt_raw, cfg)  # [B, K, G], [K, G]
    dt = jnp.where(run[:, None, None], dt, 0.0)
    K, G = A.shape
    H = x.shape[-1]
    args = (
        x.reshape(B, K * G, H),
        dt.reshape(B, K * G),
        A.reshape(K * G),
        b_mat,
        c_mat,
        p.D[j].astype(F32),
    )
    if ssm_kernel == "pallas":
        # No CPU lowering: the kernel runs in the Pallas interpreter there (decided at trace time),
        # and the CPU tests compare this path against the jnp one.
        ssm, y = ssm_step(ssm, *args, interpret=jax.default_backend() == "cpu")
    else:
        ssm, y = ssm_step_reference(ssm, *args)
    y = _gated_norm(y.reshape(B, -1).astype(act), z, p.gate_norm[j], cfg)
    out = all_reduce(matmul(y, p.out_proj, layer=j, impl=projection), cfg)
    new_conv = jnp.where(run[:, None, None], window[:, 1:], conv.astype(F32))
    return new_conv.astype(conv.dtype), ssm, out


def _mamba_step_fused(
    p: MambaParams, j: int, h, conv, ssm, run, cfg: LLMConfig, ssm_kernel: str, projection: str
):
    """``_mamba_step`` with conv, SSM update and gated norm in one kernel, states in place.

    ``pallas_kernels.mamba_step`` between the two projections, given layer j's conv state
    [B, k-1, C] as a one-layer stack (a reshape, no copy) and layer j's per-channel weights; a
    row that does not run is skipped by the kernel (state untouched, out meaningless).
    ``ssm_kernel`` is 'fused' (the signature is ``_mamba_step``'s). Returns (conv, ssm, out [B, D]).
    """
    if isinstance(cfg, LLMShard) and cfg.norm_ranks > 1:
        raise ValueError(
            f"ssm_kernel='fused' normalises whole Mamba groups on one device: n_groups must "
            f"divide by model_parallel={cfg.model_parallel} (use 'xla' or 'pallas')"
        )
    zxbcdt = matmul(h, p.in_proj, layer=j, impl=projection)

    def one(w):  # layer j's rows of a stacked per-channel weight, as a one-layer stack
        return w[j : j + 1]

    conv, ssm, y = mamba_step(
        zxbcdt,
        conv[:, None],
        ssm,
        one(p.conv_w),
        one(p.conv_b),
        one(p.dt_bias),
        one(p.A_log),
        one(p.D),
        one(p.gate_norm),
        run,
        layer=0,
        n_groups=cfg.n_groups,
        eps=cfg.norm_eps,
        # No CPU lowering: the kernel runs in the Pallas interpreter there (trace time).
        interpret=jax.default_backend() == "cpu",
    )
    return conv[:, 0], ssm, all_reduce(matmul(y, p.out_proj, layer=j, impl=projection), cfg)


def _segsum(a: jax.Array) -> jax.Array:
    """[..., X] -> [..., X, X]: out[l, s] = sum of a[s+1 .. l], -inf above the diagonal.

    Built from a masked cumulative sum (transformers' ``segment_sum``), not a difference of
    cumulative sums, so no cancellation.
    """
    X = a.shape[-1]
    x = jnp.broadcast_to(a[..., :, None], (*a.shape, X))  # [..., i, s] = a[i]
    x = jnp.where(jnp.tril(jnp.ones((X, X), bool), -1), x, 0.0)
    seg = jnp.cumsum(x, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((X, X), bool)), seg, -jnp.inf)


def _ssd_scan(x, dt, A, b_mat, c_mat, h0, chunk: int):
    """The Mamba-2 SSD scan over a sequence, chunk by chunk (transformers ``mamba2_chunk_scan``).

    All fp32. x [B, T, K, G, H]; dt [B, T, K, G] (0 where a position must not touch the state);
    A [K, G]; b_mat, c_mat [B, T, K, P]; h0 [B, K, G, H, P] the state before the sequence.
    Returns y [B, T, K, G, H] (without the D skip) and the final state [B, K, G, H, P].
    Within a chunk the output is a masked, decayed attention-like product; across chunks the state
    is carried by a scan (exact, and cheap: one step per chunk).
    """
    B, T = x.shape[:2]
    X = min(chunk, T)
    n = -(-T // X)
    pad = n * X - T

    def chunks(t):  # pad T with dt = 0 positions (identity updates), then [B, n, X, ...]
        t = jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        return t.reshape(B, n, X, *t.shape[2:])

    x, dt, b, c = (chunks(t) for t in (x, dt, b_mat, c_mat))
    a = jnp.moveaxis(dt * A, 2, -1)  # [B, n, K, G, X] log-decay per position
    acs = jnp.cumsum(a, axis=-1)
    xdt = x * dt[..., None]  # [B, n, X, K, G, H]
    hp = _SSM_PRECISION

    # intra-chunk: y[l] = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + .. + a_l) dt_s x_s
    decay = jnp.exp(_segsum(a))  # [B, n, K, G, X(l), X(s)]
    cb = jnp.einsum("bnlkp,bnskp->bnkls", c, b, precision=hp)
    y_diag = jnp.einsum("bnkls,bnkgls,bnskgh->bnlkgh", cb, decay, xdt, precision=hp)

    # each chunk's own contribution to the state at its end, then the carry across chunks
    to_end = jnp.exp(acs[..., -1:] - acs)  # [B, n, K, G, X]
    own = jnp.einsum("bnlkp,bnkgl,bnlkgh->bnkghp", b, to_end, xdt, precision=hp)
    whole = jnp.exp(acs[..., -1])  # [B, n, K, G] decay across a whole chunk

    def carry(h, inp):
        own_i, whole_i = inp
        return h * whole_i[..., None, None] + own_i, h

    h_last, starts = jax.lax.scan(carry, h0, (jnp.moveaxis(own, 1, 0), jnp.moveaxis(whole, 1, 0)))
    starts = jnp.moveaxis(starts, 0, 1)  # [B, n, K, G, H, P] state before each chunk

    # inter-chunk: the state entering the chunk, decayed to position l, read by C_l
    y_off = jnp.einsum("bnlkp,bnkghp,bnkgl->bnlkgh", c, starts, jnp.exp(acs), precision=hp)
    y = (y_diag + y_off).reshape(B, n * X, *x.shape[3:])[:, :T]
    return y, h_last


def _mamba_prefill(p: MambaParams, j: int, h, conv, ssm, valid, lengths, cfg, chunk: int):
    """A sequence through Mamba layer j (``NemotronHMamba2Mixer`` with a cache, chunked path).

    h [B, T, D] normed input; conv [B, k-1, C]; ssm [B, N, H, P]; valid [B, T] bool;
    lengths [B] valid positions per slot. Returns (conv, ssm, out [B, T, D]).
    """
    act = h.dtype
    B, T = h.shape[:2]
    k = cfg.conv_kernel
    z, xbc, dt_raw = _split_in_proj(dense(h, p.in_proj[j]), cfg)
    seq = jnp.concatenate([conv.astype(F32), xbc.astype(F32)], axis=1)  # [B, k-1+T, C]
    w = p.conv_w[j].astype(F32)
    xbc = sum(seq[:, i : i + T] * w[i] for i in range(k)) + p.conv_b[j].astype(F32)
    xbc = jax.nn.silu(xbc).astype(act)
    # the conv state is the last k-1 raw inputs up to each slot's own length
    new_conv = jax.vmap(lambda s, n: jax.lax.dynamic_slice_in_dim(s, n, k - 1, axis=0))(
        seq, lengths
    )
    x, b_mat, c_mat = _split_xbc(xbc, cfg)
    dt, A = _ssm_coeffs(p, j, dt_raw, cfg)
    dt = jnp.where(valid[..., None, None], dt, 0.0)  # padded positions leave the state alone
    K, G = A.shape
    h0 = ssm.astype(F32).reshape(B, K, G, cfg.mamba_head_dim, cfg.ssm_state)
    y, h_last = _ssd_scan(x, dt, A, b_mat, c_mat, h0, chunk)
    y = y + p.D[j].astype(F32).reshape(K, G)[..., None] * x
    y = _gated_norm(y.reshape(B, T, -1).astype(act), z, p.gate_norm[j], cfg)
    out = all_reduce(dense(y, p.out_proj[j]), cfg)
    return new_conv.astype(conv.dtype), h_last.reshape(ssm.shape).astype(ssm.dtype), out


# ----------------------------------------------------------------------------- MLP and attention


def _mlp(
    p: MLPParams, j: int, h: jax.Array, projection: str = "xla", cfg: LLMConfig | None = None
) -> jax.Array:
    """``NemotronHMLP``: down(relu(up(h))**2), h [..., D] -> [..., D] (``model.projection``).

    ``cfg``: an ``LLMShard`` adds the partial ``down`` products over the model axis.
    """
    up = matmul(h, p.up, layer=j, impl=projection)
    return all_reduce(matmul(jnp.square(jax.nn.relu(up)), p.down, layer=j, impl=projection), cfg)


def _attend(q, keys, values, mask):
    """Masked softmax attention (``attention.gqa``), scores and softmax in fp32.

    q [B, T, K, G, H]; keys, values [B, K, S, H]; mask [B, T, S] bool. Returns [B, T, K, G, H].
    """
    return gqa(q, keys, values, mask[:, None, None], scale=q.shape[-1] ** -0.5)


def _attn(
    p: AttnParams, j: int, h, k_cache, v_cache, pos, valid, cfg: LLMConfig, attention: str = "xla"
):
    """Attention layer j over new positions h [B, T, D], starting at cache row pos [B].

    Writes the new keys/values into rows ``pos + t`` of layer j's caches [B, K, S, H] in place
    (rows at or past S, and invalid positions, are dropped: a row that does not run leaves its
    cache bit-identical), then attends causally over the rows written so far.
    ``attention`` picks the decode-step implementation (``model.attention.attend``, T = 1 only;
    'xla' is bit-identical to ``_attend``). Returns (k_cache, v_cache, out [B, T, D]).
    """
    B, T = h.shape[:2]
    K, H = cfg.n_kv_heads, cfg.head_dim
    G = cfg.n_heads // K
    S = k_cache.shape[2]
    q = dense(h, p.q[j]).reshape(B, T, K, G, H)
    k = dense(h, p.k[j]).reshape(B, T, K, H)
    v = dense(h, p.v[j]).reshape(B, T, K, H)
    rows = pos[:, None] + jnp.arange(T)[None]  # [B, T]
    write = jnp.where(valid, rows, S)  # out of range: dropped
    slot = jnp.arange(B)[:, None]
    # Advanced indices on axes 0 and 2 around a slice: the update is [B, T, K, H].
    k_cache = k_cache.at[slot, :, write].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[slot, :, write].set(v.astype(v_cache.dtype), mode="drop")
    if T == 1:
        o = attend(q[:, 0], k_cache, v_cache, pos + 1, window=None, scale=H**-0.5, impl=attention)
    else:
        mask = jnp.arange(S)[None, None] <= rows[..., None]  # [B, T, S] causal, NoPE
        o = _attend(q, k_cache, v_cache, mask)
    return k_cache, v_cache, all_reduce(dense(o.reshape(B, T, -1), p.o[j]), cfg)


# ----------------------------------------------------------------------------- the backbone


def _layer_slots(cfg: LLMConfig) -> list[tuple[str, int]]:
    """(kind, index within that kind's stack) for each layer, in pattern order."""
    seen = {"M": 0, "-": 0, "*": 0}
    out = []
    for kind in cfg.pattern:
        out.append((kind, seen[kind]))
        seen[kind] += 1
    return out


def _block_norm(w: jax.Array, x: jax.Array, act, cfg: LLMConfig) -> jax.Array:
    """The block's RMSNorm of the fp32 residual, read in the activation dtype."""
    return rms_norm(x.astype(act), w, cfg.norm_eps)


def prefill(
    params: NanoParams,
    state: NanoState,
    embeds: jax.Array,
    lengths: jax.Array | None = None,
    *,
    cfg: LLMConfig,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[NanoState, jax.Array]:
    """Run a sequence of frames through the backbone, continuing from ``state``.

    Args:
      params: the LLM params.
      state: the slots' state before the sequence; each slot's attention cache must have room
        (``length + lengths <= S``): rows past the cache are not stored.
      embeds: [B, T, D] LLM inputs (``input_embedding``), any float dtype.
      lengths: [B] int, how many leading positions of each slot are real (default T). Positions
        past a slot's length change none of its state; their outputs are meaningless.
      cfg: the LLM config (static).
      chunk: the SSD chunk length (static; it does not change the result).

    Returns:
      The new state (``length`` advanced by ``lengths``) and the final hidden states
      (after ``norm_f``) [B, T, D] in fp32.
    """
    B, T = embeds.shape[:2]
    act = params.embed.dtype
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    valid = jnp.arange(T)[None] < lengths[:, None]  # [B, T]
    pos = state.length
    ssm, conv, kc, vc = list(state.ssm), list(state.conv), list(state.k), list(state.v)
    x = embeds.astype(F32)
    for kind, j in _layer_slots(cfg):
        if kind == "M":
            h = _block_norm(params.mamba.norm[j], x, act, cfg)
            conv[j], ssm[j], out = _mamba_prefill(
                params.mamba, j, h, conv[j], ssm[j], valid, lengths, cfg, chunk
            )
        elif kind == "-":
            out = _mlp(params.mlp, j, _block_norm(params.mlp.norm[j], x, act, cfg), cfg=cfg)
        else:
            h = _block_norm(params.attn.norm[j], x, act, cfg)
            kc[j], vc[j], out = _attn(params.attn, j, h, kc[j], vc[j], pos, valid, cfg)
        x = x + out.astype(F32)
    hidden = rms_norm(x, params.norm_f, cfg.norm_eps)
    new = NanoState(
        ssm=tuple(ssm), conv=tuple(conv), k=tuple(kc), v=tuple(vc), length=pos + lengths
    )
    return new, hidden


def step(
    params: NanoParams,
    state: NanoState,
    embeds: jax.Array,
    run: jax.Array | None = None,
    *,
    cfg: LLMConfig,
    ssm_kernel: str = "xla",
    attention: str = "xla",
    projection: str = "xla",
) -> tuple[NanoState, jax.Array]:
    """Advance the slots in ``run`` by one frame (the recurrent path), in place.

    Args:
      params: the LLM params.
      state: the slots' state; each slot's attention cache must have room (``length < S``): a row
        past the cache is not stored.
      embeds: [B, D] this frame's LLM input (``input_embedding``), any float dtype.
      run: [B] bool, the slots that advance (default all). The others keep every leaf of their
        state bit-identical (each update masks itself: dt = 0, dropped KV rows, selects on the
        small leaves); their hidden state is computed but meaningless.
      cfg: the LLM config (static).
      ssm_kernel: the Mamba recurrent update (static): 'xla' (jnp), 'pallas' (the
        ``pallas_kernels.ssm_step`` kernel, state updated in place) or 'fused' (conv, SSM update
        and gated norm in one ``pallas_kernels.mamba_step`` kernel per layer, conv and SSM state
        in place, idle slots skipped); the kernels are interpreted on the CPU.
      attention: the attention layers' decode implementation (static, ``attention.attend``).
      projection: the MLP and Mamba projections (static): 'xla' (XLA's dot) or 'pallas'
        (``pallas_kernels.matmul``, weight-streaming; ``model.projection``).

    Returns:
      The new state (``length + run``) and the final hidden state (after ``norm_f``) [B, D], fp32.
    """
    if ssm_kernel not in SSM_KERNELS:
        raise ValueError(f"ssm_kernel must be one of {SSM_KERNELS}: {ssm_kernel!r}")
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}: {projection!r}")
    B = embeds.shape[0]
    run = jnp.ones((B,), bool) if run is None else run
    act = params.embed.dtype
    pos = state.length
    ssm, conv, kc, vc = list(state.ssm), list(state.conv), list(state.k), list(state.v)
    x = embeds.astype(F32)
    for kind, j in _layer_slots(cfg):
        if kind == "M":
            h = _block_norm(params.mamba.norm[j], x, act, cfg)
            mamba = _mamba_step_fused if ssm_kernel == "fused" else _mamba_step
            conv[j], ssm[j], out = mamba(
                params.mamba, j, h, conv[j], ssm[j], run, cfg, ssm_kernel, projection
            )
        elif kind == "-":
            h = _block_norm(params.mlp.norm[j], x, act, cfg)
            out = _mlp(params.mlp, j, h, projection, cfg)
        else:
            h = _block_norm(params.attn.norm[j], x, act, cfg)
            kc[j], vc[j], out = _attn(
                params.attn, j, h[:, None], kc[j], vc[j], pos, run[:, None], cfg, attention
            )
            out = out[:, 0]
        x = x + out.astype(F32)
    hidden = rms_norm(x, params.norm_f, cfg.norm_eps)
    new = NanoState(
        ssm=tuple(ssm),
        conv=tuple(conv),
        k=tuple(kc),
        v=tuple(vc),
        length=pos + run.astype(jnp.int32),
    )
    return new, hidden
