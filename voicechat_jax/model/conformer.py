"""The listening front end: streaming log-mel, cache-aware causal FastConformer, perception.proj.

One call of ``encoder_step`` takes ``k`` new 80 ms input frames (``k * 1280`` samples at 16 kHz) per
slot and returns ``k`` encoder frames and their projections into the LLM's width. It reproduces
NeMo 3.0's cache-aware streaming path with one-frame chunks, i.e. what
``CacheAwareStreamingAudioBuffer`` + ``ConformerEncoder.cache_aware_stream_step`` compute,
driven as ``ASRModuleMixin.transcribe_simulate_cache_aware_streaming`` drives them, for
``att_context_size [left, 0]``, ``att_context_style: chunked_limited`` and
``causal_downsampling: true``, followed by ``AudioPerceptionModule.proj``. Pieces and the NeMo
code they mirror:

- mel: ``voicechat_jax.model.mel`` (``FilterbankFeatures``), computed incrementally.
- pre-encode cache (``setup_streaming_params``: ``pre_encode_cache_size [0, 9]``,
  ``drop_extra_pre_encoded 2``): step ``c >= 1`` runs the subsampling on the 9 cached mel frames
  ``8 c - 16 .. 8 c - 8`` plus the 8 new ones and drops the first 2 of its 3 outputs. Before the
  stream the cache holds zero log-mel frames (the buffer's ``zeros_pads``); at step 1 those zero
  frames go through the convolutions as data. Step 0 is different: the buffer feeds mel frame 0
  alone with ``drop_extra_pre_encoded = 0``, so each convolution pads zero *activations* around it.
  ``_subsample`` on that single frame gives exactly that, and is selected for slots at step 0.
- subsampling: ``ConvSubsampling('dw_striding', x8, is_causal=True)``: ``CausalConv2D`` pads 2
  before and 1 after on time and frequency; Conv2d(1->C, 3x3, s2), ReLU, then twice
  [depthwise Conv2d(C, 3x3, s2), pointwise 1x1, ReLU]; then ``out`` Linear(C * F' -> D) over the
  (channel, frequency) flattening.
- ``RelPositionalEncoding``: the input is scaled by ``sqrt(D)`` (``xscaling``); sinusoidal
  embeddings of the relative distance ``query - key`` (base 10000, sin on even, cos on odd dims).
- ``ConformerLayer`` x L: ``x + 0.5 FF1(LN x)``; ``+ RelPositionMultiHeadAttention(LN x)``;
  ``+ ConformerConvolution(LN x)``; ``+ 0.5 FF2(LN x)``; ``norm_out``. FF: Linear, SiLU, Linear.
  Attention (Transformer-XL): scores ``((q + u) k + (q + v) W_pos pe(q - k)) / sqrt(H)``, masked
  to the ``left`` previous frames and the frame itself (``chunked_limited``, chunk 1), with cache
  entries that do not exist yet masked (``cache_last_channel_len``); masked scores are -10000 and
  their probabilities 0, as ``forward_attention`` does. NeMo's attention cache
  (``cache_last_channel``) holds the last ``left`` normed layer inputs and recomputes keys and
  values from all of them every step; here the cache holds those inputs' *projected keys and
  values* (``linear_k`` / ``linear_v`` have no bias and act row by row, so this is the same
  function), and a step projects only its own new frames: ``T`` rows instead of ``S + T``.
  Conv: pointwise Linear D->2D, GLU, causal depthwise conv (kernel K, the last K-1 GLU outputs
  cached: ``cache_last_time``), LayerNorm (``conv_norm_type: layer_norm``, the tensor is still
  named ``batch_norm``), SiLU, pointwise Linear D->D. No biases in the layers
  (``use_bias: false``); the subsampling convs and ``proj`` have biases.

``k`` frames in one call equal ``k`` calls of one frame: the ``k`` frames go through the layers
together with each frame's attention limited to the frames a single-frame call would see.

Axes: ``B`` slots, ``T`` encoder frames of the call (``k``), ``S`` attention cache length
(``att_left_context``), ``N`` heads, ``H`` head dim, ``D`` encoder width, ``F`` FF width, ``L``
layers, ``C`` subsampling channels, ``M`` mel bins, ``K`` depthwise-conv kernel, ``R`` relative
distances (``S + T``), ``D_llm`` = ``output_dim``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from voicechat_jax.config import ENCODER_CALL_FRAMES, EncoderConfig
from voicechat_jax.model import mel as mel_lib
from voicechat_jax.model.attention import masked_softmax
from voicechat_jax.model.common import dense, keep_rows, layer_norm
from voicechat_jax.precision import Precision, ProductPrecision

# ``forward_attention`` fills masked scores with -INF_VAL (NeMo's INF_VAL = 10000), not -inf.
_MASKED_SCORE = -10000.0
# ``create_pe``'s base: ``div_term = exp(arange(0, D, 2) * -(log(INF_VAL) / D))``.
_PE_BASE = 10000.0


@struct.dataclass
class SubsamplingParams:
    """``encoder.pre_encode``: causal dw_striding x8 (conv kernels [time, freq, in/g, out])."""

    conv_in: jax.Array  # [3, 3, 1, C]  conv.0
    conv_in_b: jax.Array  # [C]
    dw: jax.Array  # [2, 3, 3, 1, C]  conv.2, conv.5 (depthwise)
    dw_b: jax.Array  # [2, C]
    pw: jax.Array  # [2, 1, 1, C, C]  conv.3, conv.6 (pointwise)
    pw_b: jax.Array  # [2, C]
    out: jax.Array  # [C * F', D]  rows in torch's (channel, frequency) flattening order
    out_b: jax.Array  # [D]


@struct.dataclass
class FeedForwardParams:
    """A macaron half-step feed-forward block with its pre-norm (``norm_feed_forward{1,2}``)."""

    norm: jax.Array  # [L, D]
    norm_b: jax.Array  # [L, D]
    up: jax.Array  # [L, D, F]  linear1
    down: jax.Array  # [L, F, D]  linear2


@struct.dataclass
class AttentionParams:
    """``norm_self_att`` + ``RelPositionMultiHeadAttention`` (no biases, untied u/v per layer).
    Per layer in the serving layout on a GPU (``serving_layout``), where ``q``, ``k`` and ``v``
    are None and ``qkv`` [D, 3D] holds them side by side: one product."""

    norm: jax.Array  # [L, D]
    norm_b: jax.Array  # [L, D]
    q: jax.Array  # [L, D, D]
    k: jax.Array  # [L, D, D]
    v: jax.Array  # [L, D, D]
    o: jax.Array  # [L, D, D]  linear_out
    pos: jax.Array  # [L, D, D]  linear_pos
    pos_bias_u: jax.Array  # [L, N, H]
    pos_bias_v: jax.Array  # [L, N, H]
    qkv: jax.Array | None = None  # [D, 3D]  q | k | v (the serving layout, per layer)


@struct.dataclass
class ConvParams:
    """``norm_conv`` + ``ConformerConvolution`` (pointwise convs kept as width-1 conv kernels)."""

    norm: jax.Array  # [L, D]
    norm_b: jax.Array  # [L, D]
    pw1: jax.Array  # [L, 1, D, 2D]
    dw: jax.Array  # [L, K, 1, D]  causal depthwise
    ln: jax.Array  # [L, D]  conv.batch_norm (a LayerNorm)
    ln_b: jax.Array  # [L, D]
    pw2: jax.Array  # [L, 1, D, D]


@struct.dataclass
class LayerParams:
    """The L ``ConformerLayer``s, stacked."""

    ff1: FeedForwardParams
    attn: AttentionParams
    conv: ConvParams
    ff2: FeedForwardParams
    out_norm: jax.Array  # [L, D]
    out_norm_b: jax.Array  # [L, D]


@struct.dataclass
class EncoderParams:
    """``stt_model.perception``: mel buffers, encoder, ``proj`` (the adapter has no parameters)."""

    mel: mel_lib.MelParams  # fp32 always
    sub: SubsamplingParams
    layers: LayerParams | tuple[LayerParams, ...]  # stacked on L, or L layers (serving_layout)
    proj: jax.Array  # [D, D_llm]
    proj_b: jax.Array  # [D_llm]


@struct.dataclass
class EncoderState:
    """What a stream carries between calls (slot axis first)."""

    mel_tail: jax.Array  # [B, tail_len] fp32 raw samples (see ``mel``)
    pre_cache: jax.Array  # [B, pre_encode_cache, M] fp32 last mel frames (zeros before the stream)
    # keys (linear_k) and values (linear_v) of the last normed attention inputs, a ring of
    # R = S + ENCODER_CALL_FRAMES rows: encoder frame f at row f mod R (``ring_rows``, ``_layers``)
    att_k: jax.Array  # [B, L, R, D]
    att_v: jax.Array  # [B, L, R, D]
    conv_cache: jax.Array  # [B, L, K - 1, D] last K-1 GLU outputs per layer
    pos: jax.Array  # [B] int32 input frames (= encoder frames) consumed so far


def serving_layout(params: EncoderParams, *, unrolled: bool | None = None) -> EncoderParams:
    """The encoder as the engine serves it: on a GPU its L layers as L ``LayerParams`` of
    per-layer leaves, which ``_layers`` runs unrolled, each layer's q, k and v one product
    (``qkv``: one launch for three); elsewhere stacked, run as a scan.

    On a GPU a scan copies each layer's weights out of their stack before its products (2.7 ms
    of the faithful 40-slot tick on an H100, 2026-12-05, ``experiments/tick_profile``); an
    unrolled layer reads its own leaves where they lie. On the CPU there is no such cost to save,
    and the unrolled step compiles several times slower (3.2 s against 0.7 at the 11B's shapes).
    The CPU test suite's classic emitters (``tests/conftest.py``) also make an unrolled encoder's
    last bits depend on the program around it, which its bit-for-bit checks between programs
    would fail (``docs/decisions.md``). ``unrolled``: force the choice (default: on a GPU).
    Params already in the asked-for layout are returned as they are.
    """
    if unrolled is None:
        unrolled = jax.default_backend() == "gpu"
    if not unrolled or isinstance(params.layers, tuple):
        return params
    return params.replace(layers=_split_layers(params.layers))


@jax.jit
def _split_layers(stacked: LayerParams) -> tuple[LayerParams, ...]:
    """L layers of per-layer leaves, each layer's q | k | v one [D, 3D] product."""
    layers = []
    for l in range(stacked.out_norm.shape[0]):
        lp = jax.tree.map(lambda a, l=l: a[l], stacked)
        a = lp.attn
        qkv = jnp.concatenate([a.q, a.k, a.v], axis=-1)
        layers.append(lp.replace(attn=a.replace(qkv=qkv, q=None, k=None, v=None)))
    return tuple(layers)


def _check_streaming(cfg: EncoderConfig) -> None:
    """The pre-encode numbers must be the ones ``setup_streaming_params`` derives."""
    f = cfg.subsampling_factor
    if cfg.pre_encode_cache != f + 1 or cfg.drop_pre_encoded != 1 + (cfg.pre_encode_cache - 1) // f:
        raise ValueError(
            f"pre_encode_cache {cfg.pre_encode_cache} / drop_pre_encoded {cfg.drop_pre_encoded} "
            f"are not NeMo's values for subsampling x{f} ({f + 1} / 2)"
        )
    if cfg.mel.mels_per_frame != f:
        raise ValueError("one input frame must give one encoder frame")


@dataclasses.dataclass(frozen=True)
class _Draw:
    """A random leaf to draw: ``mean + std * N(0, 1)`` of ``shape`` (a pytree leaf, not a node)."""

    shape: tuple[int, ...]
    std: float
    mean: float = 0.0


def _init_plan(cfg: EncoderConfig) -> tuple[SubsamplingParams, LayerParams, _Draw, _Draw]:
    """What ``init`` draws: unit-scale activations (1/sqrt(fan-in) weights), norms near 1."""
    D, F, L, N, H = cfg.d_model, cfg.ff_dim, cfg.n_layers, cfg.n_heads, cfg.head_dim
    C, K, Fs = cfg.subsampling_channels, cfg.conv_kernel, cfg.subsampled_freq

    def w(shape, fan_in):
        return _Draw(shape, fan_in**-0.5)

    def small(shape):
        return _Draw(shape, 0.1)

    def norm():
        return _Draw((L, D), 0.1, 1.0), small((L, D))

    def ff():
        n, nb = norm()
        return FeedForwardParams(norm=n, norm_b=nb, up=w((L, D, F), D), down=w((L, F, D), F))

    sub = SubsamplingParams(
        conv_in=w((3, 3, 1, C), 9),
        conv_in_b=small((C,)),
        dw=w((2, 3, 3, 1, C), 9),
        dw_b=small((2, C)),
        pw=w((2, 1, 1, C, C), C),
        pw_b=small((2, C)),
        out=w((C * Fs, D), C * Fs),
        out_b=small((D,)),
    )
    ff1 = ff()
    an, anb = norm()
    attn = AttentionParams(
        norm=an,
        norm_b=anb,
        q=w((L, D, D), D),
        k=w((L, D, D), D),
        v=w((L, D, D), D),
        o=w((L, D, D), D),
        pos=w((L, D, D), D),
        pos_bias_u=small((L, N, H)),
        pos_bias_v=small((L, N, H)),
    )
    cn, cnb = norm()
    cl, clb = norm()
    conv = ConvParams(
        norm=cn,
        norm_b=cnb,
        pw1=w((L, 1, D, 2 * D), D),
        dw=w((L, K, 1, D), K),
        ln=cl,
        ln_b=clb,
        pw2=w((L, 1, D, D), D),
    )
    ff2 = ff()
    on, onb = norm()
    layers = LayerParams(ff1=ff1, attn=attn, conv=conv, ff2=ff2, out_norm=on, out_norm_b=onb)
    return sub, layers, w((D, cfg.output_dim), D), small((cfg.output_dim,))


@functools.partial(jax.jit, static_argnums=(1, 2))
def init(key: jax.Array, cfg: EncoderConfig, precision: Precision) -> EncoderParams:
    """Random weights at a sane scale (unit-scale activations, norms near 1); exact mel buffers.

    All leaves come from one normal draw (one jitted program: fast to compile on the CPU).
    """
    plan, treedef = jax.tree_util.tree_flatten(_init_plan(cfg))
    sizes = [math.prod(d.shape) for d in plan]
    z = jax.random.normal(key, (sum(sizes),), jnp.float32)
    leaves, offset = [], 0
    for d, n in zip(plan, sizes, strict=True):
        x = d.mean + d.std * z[offset : offset + n].reshape(d.shape)
        leaves.append(x.astype(precision.encoder))
        offset += n
    sub, layers, proj, proj_b = jax.tree_util.tree_unflatten(treedef, leaves)
    return EncoderParams(
        mel=mel_lib.init(cfg.mel), sub=sub, layers=layers, proj=proj, proj_b=proj_b
    )


def abstract(cfg: EncoderConfig, precision: Precision) -> EncoderParams:
    """The params' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves); allocates nothing."""
    return jax.eval_shape(lambda k: init(k, cfg, precision), jax.random.key(0))


def ring_rows(cfg: EncoderConfig) -> int:
    """Rows of the attention caches' ring: the S frames of context and room for a call's new
    frames, written before the call reads (NeMo shifts an S-row cache instead)."""
    return cfg.att_left_context + ENCODER_CALL_FRAMES


def init_state(cfg: EncoderConfig, batch: int, precision: Precision) -> EncoderState:
    """A fresh stream: zero tail, zero log-mel pre-encode cache, empty caches, position 0."""
    _check_streaming(cfg)
    dt = precision.encoder
    L, D = cfg.n_layers, cfg.d_model
    return EncoderState(
        mel_tail=mel_lib.init_tail(cfg.mel, batch),
        pre_cache=jnp.zeros((batch, cfg.pre_encode_cache, cfg.mel.n_mels), mel_lib.MEL_DTYPE),
        att_k=jnp.zeros((batch, L, ring_rows(cfg), D), dt),
        att_v=jnp.zeros((batch, L, ring_rows(cfg), D), dt),
        conv_cache=jnp.zeros((batch, L, cfg.conv_kernel - 1, D), dt),
        pos=jnp.zeros((batch,), jnp.int32),
    )


def _causal_conv2d(x: jax.Array, w: jax.Array, b: jax.Array, groups: int = 1) -> jax.Array:
    """``CausalConv2D``, stride 2, pads 2 before and 1 after: x [B, T, M, C] -> [B, T', M', C']."""
    y = jax.lax.conv_general_dilated(
        x,
        w.astype(x.dtype),
        window_strides=(2, 2),
        padding=((2, 1), (2, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups,
    )
    return y + b.astype(x.dtype)


def _subsample(p: SubsamplingParams, x: jax.Array) -> jax.Array:
    """``ConvSubsampling.forward`` on log-mel frames: x [B, T, M] -> [B, T', D]."""
    C = p.conv_in.shape[-1]
    h = jax.nn.relu(_causal_conv2d(x[..., None], p.conv_in, p.conv_in_b))  # [B, T', M', C]
    for i in range(p.dw.shape[0]):
        h = _causal_conv2d(h, p.dw[i], p.dw_b[i], groups=C)
        h = jnp.einsum("btfc,ce->btfe", h, p.pw[i, 0, 0].astype(h.dtype))
        h = jax.nn.relu(h + p.pw_b[i].astype(h.dtype))
    Fs = h.shape[2]
    out = p.out.reshape(C, Fs, -1).astype(h.dtype)  # torch flattens (channel, frequency)
    return jnp.einsum("btfc,cfd->btd", h, out) + p.out_b.astype(h.dtype)


def _rel_pos_table(R: int, D: int) -> np.ndarray:
    """``RelPositionalEncoding`` embeddings of distances 0 .. R-1: [R, D] (fp32, as NeMo)."""
    r = np.arange(R, dtype=np.float32)[:, None]
    div = np.exp(np.arange(0, D, 2, dtype=np.float32) * np.float32(-math.log(_PE_BASE) / D))
    pe = np.zeros((R, D), np.float32)
    pe[:, 0::2] = np.sin(r * div)
    pe[:, 1::2] = np.cos(r * div)
    return pe


def _feed_forward(
    p: FeedForwardParams, x: jax.Array, eps: float, product: ProductPrecision = None
) -> jax.Array:
    h = layer_norm(x, p.norm, p.norm_b, eps)
    return dense(jax.nn.silu(dense(h, p.up, precision=product)), p.down, precision=product)


def _attention(
    p: AttentionParams,
    x: jax.Array,
    k_rings: jax.Array,
    v_rings: jax.Array,
    l: int | jax.Array,
    write: tuple[jax.Array, jax.Array],
    age: jax.Array,
    mask: jax.Array,
    rel_idx: np.ndarray,
    pe: np.ndarray,
    eps: float,
    product: ProductPrecision = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rel-pos MHA over [context, new frames], layer ``l``: x [B, T, D], every layer's k/v
    rings [B, L, R, D] -> (y, k rings, v rings).

    Only the ``T`` new frames are projected; layer ``l``'s ring already holds the earlier frames'
    keys and values. The new ones are written first, in place, at ``write`` (slot and row index
    arrays [B, 1] and [B, T]; a row past the ring is dropped), over frames no query of the call
    sees; then the ring is read. The scores are taken against the rows where they lie; ``age``
    [B, R] gives each row's place ``s`` in time order among the ``S + T`` keys NeMo's cache and
    the new frames make (outside ``[0, S + T)`` the row is not a key of this call), by which the
    positional term and ``mask`` [B, T, S + T] are read.
    """
    B, T, D = x.shape
    N, H = p.pos_bias_u.shape
    xn = layer_norm(x, p.norm, p.norm_b, eps)
    if p.qkv is not None:  # the serving layout: one product, its columns split
        q, k_new, v_new = jnp.split(dense(xn, p.qkv, precision=product), 3, axis=-1)
    else:
        q, k_new, v_new = (dense(xn, w, precision=product) for w in (p.q, p.k, p.v))
    slot, rows = write
    k_rings = k_rings.at[slot, l, rows].set(k_new.astype(k_rings.dtype), mode="drop")
    v_rings = v_rings.at[slot, l, rows].set(v_new.astype(v_rings.dtype), mode="drop")
    R = k_rings.shape[2]
    q = q.reshape(B, T, N, H)
    # Layer l's ring is to be read where it lies: the two products over it are written as
    # multiplies and sums, which XLA can fuse with the slice of the stacked ring (a GPU's
    # fusion is still to be seen in a profile; the CPU's XLA copies the slice); as
    # dot_generals each took a copy of the slice first on the H200 (1.05 ms of slices and 0.97
    # of products in the faithful 96-slot tick, 2026-12-05, ``a6cb770``). T is 1-2 rows: the
    # products are tiny, the ring's bytes are the cost.
    k = k_rings[:, l].astype(x.dtype).reshape(B, 1, R, N, H)
    v = v_rings[:, l].astype(x.dtype).reshape(B, 1, R, N, H)
    qu = (q + p.pos_bias_u.astype(x.dtype))[:, :, None]  # [B, T, 1, N, H]
    ac = jnp.sum(qu * k, axis=-1).transpose(0, 3, 1, 2)  # [B, N, T, R] by ring row
    pos = dense(jnp.asarray(pe, x.dtype), p.pos).reshape(-1, N, H)[rel_idx]  # [T, S + T, N, H]
    bd = jnp.einsum("btnh,tsnh->bnts", q + p.pos_bias_v.astype(x.dtype), pos)  # in time order
    s = jnp.clip(age, 0, bd.shape[-1] - 1)  # [B, R]
    bd = jnp.take_along_axis(bd, s[:, None, None, :], axis=-1)  # [B, N, T, R]
    keys = jnp.take_along_axis(mask, s[:, None, :], axis=-1) & (age == s)[:, None, :]
    scores = ((ac + bd) / math.sqrt(H)).astype(jnp.float32)
    probs = masked_softmax(scores, keys[:, None], x.dtype, fill=_MASKED_SCORE, zero_masked=True)
    y = jnp.sum(probs.transpose(0, 2, 3, 1)[..., None] * v, axis=2).reshape(B, T, D)
    return dense(y, p.o, precision=product), k_rings, v_rings


def _convolution(
    p: ConvParams, x: jax.Array, cache: jax.Array, eps: float, product: ProductPrecision = None
) -> tuple[jax.Array, jax.Array]:
    """Conformer conv module with a causal depthwise conv: x [B, T, D], cache [B, K-1, D]."""
    T = x.shape[1]
    K = p.dw.shape[0]
    h = dense(layer_norm(x, p.norm, p.norm_b, eps), p.pw1[0], precision=product)  # [B, T, 2D]
    a, g = jnp.split(h, 2, axis=-1)
    h = a * jax.nn.sigmoid(g)  # GLU over channels
    buf = jnp.concatenate([cache, h], axis=1)  # [B, K - 1 + T, D]
    w = p.dw[:, 0].astype(h.dtype)  # [K, D]
    y = sum(buf[:, i : i + T] * w[i] for i in range(K))
    y = jax.nn.silu(layer_norm(y, p.ln, p.ln_b, eps))
    return dense(y, p.pw2[0], precision=product), buf[:, T:]


def _layers(
    p: LayerParams,
    x: jax.Array,
    att_k: jax.Array,
    att_v: jax.Array,
    conv_cache: jax.Array,
    pos: jax.Array,
    mask: jax.Array,
    run: jax.Array,
    cfg: EncoderConfig,
    product: ProductPrecision = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The L Conformer layers: x [B, T, D], caches [B, L, ...] -> (y, caches). Stacked weights
    run as a ``lax.scan``; per-layer weights (``serving_layout`` on a GPU) run unrolled.

    ``pos`` [B]: the frames each slot has encoded. The attention caches are rings of ``R``
    rows, frame f at row f mod R: a layer writes its ``T`` new frames' keys and values over
    frames older than its queries see, then reads (NeMo's ``cache_last_channel`` shifts instead:
    copied and written back every layer, about 2 ms of the H200's faithful 72-slot tick,
    2026-12-04, ``3a7efcd``, ``experiments/tick_profile``).

    ``run`` [B] bool: a row that is not set keeps its caches; each layer's write masks itself,
    so no select over the whole cache follows (on an H100 at 40 slots that select and the two
    copies of the cache it forced took 0.87 ms a tick, 2026-12-05, ``d4d68c4``).
    """
    T = x.shape[1]
    S, eps = cfg.att_left_context, cfg.ln_eps
    R = att_k.shape[2]
    if T > R - S:
        raise ValueError(f"{T} frames a call: the encoder's cache ring takes at most {R - S}")
    pe = _rel_pos_table(S + T, cfg.d_model)
    # distance query - key for query t (at S + t) and key s; keys right of the query are masked
    rel_idx = np.clip(S + np.arange(T)[:, None] - np.arange(S + T)[None, :], 0, S + T - 1)
    keep = ~run[:, None, None]  # [B, 1, 1] against a layer's conv cache [B, K - 1, D]
    # The T new frames' rows, [B, T] (past the ring, so dropped, for a slot that does not run),
    # and each row's place among this call's S + T keys: key s is frame pos - S + s.
    slot = jnp.arange(x.shape[0])[:, None]
    rows = jnp.where(run[:, None], (pos[:, None] + jnp.arange(T)) % R, R)
    # [B, R]: row j holds the newest frame f = j (mod R) up to pos + T - 1, key f - pos + S
    age = S + T - R + (jnp.arange(R) - pos[:, None] - T) % R

    def layer(carry, xs):
        # The caches stay [B, L, ...] and are carried: layer l's slab is read and written back in
        # place (no transpose of the whole cache around the scan).
        h, ak, av, conv = carry
        lp, l = xs
        h = h + 0.5 * _feed_forward(lp.ff1, h, eps, product)
        y, ak, av = _attention(
            lp.attn, h, ak, av, l, (slot, rows), age, mask, rel_idx, pe, eps, product
        )
        h = h + y
        tail = conv[:, l]
        y, cc = _convolution(lp.conv, h, tail, eps, product)
        h = h + y
        h = h + 0.5 * _feed_forward(lp.ff2, h, eps, product)
        h = layer_norm(h, lp.out_norm, lp.out_norm_b, eps)
        cc = jnp.where(keep, tail, cc.astype(conv.dtype))
        conv = jax.lax.dynamic_update_index_in_dim(conv, cc, l, axis=1)
        return (h, ak, av, conv), None

    carry = (x, att_k, att_v, conv_cache)
    if isinstance(p, tuple):  # the serving layout: one leaf per layer, unrolled
        for l, lp in enumerate(p):
            carry, _ = layer(carry, (lp, l))
        return carry
    L = att_k.shape[1]
    carry, _ = jax.lax.scan(layer, carry, (p, jnp.arange(L)))
    return carry


def _attention_mask(pos: jax.Array, T: int, S: int) -> jax.Array:
    """[B, T, S + T]: query t sees keys t .. S + t that exist (the cache fills as frames come)."""
    s = jnp.arange(S + T)[None, None, :]
    t = jnp.arange(T)[None, :, None]
    exists = s >= S - jnp.minimum(pos, S)[:, None, None]  # NeMo's cache_last_channel_len
    return exists & (s >= t) & (s <= S + t)


def encoder_step(
    params: EncoderParams,
    state: EncoderState,
    samples: jax.Array,
    run: jax.Array | None = None,
    *,
    cfg: EncoderConfig,
    precision: Precision,
) -> tuple[EncoderState, jax.Array, jax.Array]:
    """Advance the slots in ``run`` by ``k`` input frames.

    Args:
      params: the perception weights.
      state: each slot's stream state (``init_state`` for a fresh stream); slots may be at
        different positions.
      samples: [B, k * 1280] new 16 kHz samples (1 <= k <= ``ENCODER_CALL_FRAMES``, static).
      run: [B] bool, the slots that advance (default all). The others' state comes back
        bit-identical (their outputs are meaningless): the caches' writes in each layer leave
        their rows alone (``_layers``), the small leaves are selected at the end.
      cfg: the encoder config.
      precision: the dtype policy (``precision.encoder`` for weights and activations; the mel is
        always fp32; ``encoder_product`` the Conformer layers' weight products).

    Returns:
      (state, enc [B, k, D], proj [B, k, D_llm]): the encoder frames (what the RNNT head reads)
      and ``perception.proj`` of them (what enters the LLM input sum).
    """
    _check_streaming(cfg)
    dt = precision.encoder
    mpf, S = cfg.mel.mels_per_frame, cfg.att_left_context
    k = samples.shape[1] // cfg.mel.samples_per_frame
    mel_tail, mel = mel_lib.logmel_step(
        params.mel, state.mel_tail, samples, state.pos, cfg=cfg.mel
    )  # mel [B, 8k, M] at positions 8 pos - 7 .. 8 (pos + k - 1)
    frames = jnp.concatenate([state.pre_cache, mel], axis=1)  # [B, 9 + 8k, M]
    x = _subsample(params.sub, frames.astype(dt))[:, cfg.drop_pre_encoded :]  # [B, k, D]
    # Step 0: NeMo's buffer feeds mel frame 0 alone (no pre-encode cache, nothing dropped).
    first = _subsample(params.sub, mel[:, mpf - 1 : mpf].astype(dt))[:, 0]  # [B, D]
    x = x.at[:, 0].set(jnp.where((state.pos == 0)[:, None], first, x[:, 0]))
    if cfg.xscaling:
        x = x * math.sqrt(cfg.d_model)
    mask = _attention_mask(state.pos, k, S)
    run = jnp.ones(state.pos.shape, bool) if run is None else run
    enc, att_k, att_v, conv_cache = _layers(
        params.layers,
        x,
        state.att_k,
        state.att_v,
        state.conv_cache,
        state.pos,
        mask,
        run,
        cfg,
        precision.encoder_product(),
    )
    proj = dense(enc, params.proj, params.proj_b)
    mel_tail, pre_cache, pos = keep_rows(
        run,
        (mel_tail, frames[:, -cfg.pre_encode_cache :], state.pos + k),
        (state.mel_tail, state.pre_cache, state.pos),
    )
    state = EncoderState(
        mel_tail=mel_tail,
        pre_cache=pre_cache,
        att_k=att_k,
        att_v=att_v,
        conv_cache=conv_cache,
        pos=pos,
    )
    return state, enc, proj
