"""The RVQ-VAE speech codec (``RVQVAEModel``): codes <-> 22.05 kHz waveform, offline and streaming.

Mirrors NeMo 3.0's ``nemo/collections/speechlm2/modules/ear_tts_vae_codec.py``:

- ``codes_to_latent`` / ``encode_latent_to_codes``: ``PreTrainedProbabilisticVQ.decode`` (sum of
  the selected codebook rows) and ``.encode`` (greedy residual nearest neighbour, distances
  computed as ``|r|² + |e|² - 2⟨r, e⟩`` like ``_dist_sq``).
- ``encode_latent``: ``Wav2Latent.forward`` (``spectrogram`` with zero padding (n_fft - hop) / 2
  each side, then [real ‖ imag] -> Conv1d k1 -> per stage ``ConvNeXt1d`` blocks and a strided Conv1d
  with kernel = stride). ``encode`` = ``RVQVAEModel.encode`` (what ``DuplexEARTTS`` calls to make
  ``codec_silence_tokens`` and the speaker-prompt warm-up codes from silence).
- ``decode_offline``: ``RVQVAEModel.decode(codes)`` without a cache (``Latent2Wav.forward``:
  per stage a ConvTranspose1d with kernel = stride, ``ConvNeXt1d`` blocks; a Conv1d k1 to
  mag/phase logits; ``spec_to_wav`` with ``constrain_value_range=True``).
- ``decode_step``: ``RVQVAEModel.decode(codes, cache=CausalConv1dCache())`` called on successive
  chunks. Each decoder ``ConvNeXt1d`` keeps its last ``k - 1`` input steps; ``Latent2Wav`` keeps the
  last ``2 * ceil(((n_fft - hop) // 2) / hop)`` spectral frames (4 in the release) and trims
  ``ceil(...) * hop`` samples (8) more on each side. We keep those frames after the inverse FFT,
  windowing and clamping (the same values NeMo recomputes from its cached spectra), so the state
  is real. The ConvTransposes (kernel = stride) need no state.

Alignment of streaming and offline (measured in tests/test_codec.py): the concatenated stream is
the offline waveform delayed by 8 samples, ``stream[m] == offline[m - 8]``, except where the offline
path is at its left edge. The stream's first 8 samples are the left tail of the first frame (the
part offline trims), and offline samples 0..5 are normalised by a partial window envelope where the
stream has full overlap (with zero frames). So ``stream[14:] == offline[6:-8]``; every call returns
exactly ``T * samples_per_frame`` samples (1764 per code frame).

Precision: everything runs in the policy's ``codec`` dtype (fp32), and every matmul here passes
``precision=HIGHEST``. With DEFAULT precision XLA runs fp32 dots on the GPU in TF32 (10-bit
mantissa): measured on an H200 (jax 0.11.2, full-size random weights) the waveform then moves by
1e-3 relative and the latent by 1e-3, and 7 of 4712 codes of a random clip flip at the encoder's
residual nearest-neighbour search (near ties compound over 31 codebooks), where HIGHEST matches
the CPU to 3e-6 with identical codes. NeMo keeps the codec in full fp32 the same way
(``disable_tf32()`` around encode/decode). On the CPU HIGHEST costs nothing. The one exception is
``decode_step``'s ``matmul`` (the ``tf32_codec`` policies): its products only make the waveform,
so TF32 there cannot flip a code.

Layouts (torch -> ours, see ``voicechat_jax.keys.codec``): Conv1d weights use the project's
CONV1D layout ``[k, in, out]`` (so the k1 convs keep a leading axis of 1), the depthwise ones
``[k, C]`` (DEPTHWISE_CONV1D); ConvTranspose1d weights keep torch's ``[in, out, k]``: with
kernel = stride the layer is one matmul per input step whose ``[out, k]`` result is laid out as
``k`` output steps.

Axes (see ``voicechat_jax.model``): ``B`` slots, ``T`` code frames (12.5 Hz) or, inside a stage,
that stage's time steps, ``Q`` quantizers, ``V`` codebook size, ``D`` latent size, ``C`` channels
of a stage, ``F`` ConvNeXt hidden width (4C), ``L`` ConvNeXt blocks of a stage, ``W`` the STFT
window / FFT size (``n_fft``), ``R`` frequency bins (``n_fft // 2 + 1``).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from voicechat_jax.config import CodecConfig
from voicechat_jax.model.common import dense, fan_in_normal, layer_norm, normal
from voicechat_jax.precision import KernelProduct, Precision, ProductPrecision, lax_precision

_HIGHEST = jax.lax.Precision.HIGHEST
_LN_EPS = 1e-6  # LayerNormNd default
_MAX_MAG = 100.0  # Latent2Wav's magnitude cap


@struct.dataclass
class ConvNeXtParams:
    """``ConvNeXt1d`` blocks of one stage, stacked on ``L``."""

    dw: jax.Array  # [L, k, C]  dwconv (depthwise, causal: left pad k - 1)
    dw_b: jax.Array  # [L, C]
    norm_w: jax.Array  # [L, C]  LayerNormNd over channels
    norm_b: jax.Array  # [L, C]
    pw1: jax.Array  # [L, 1, C, F]  pwconv1 (k1 conv)
    pw1_b: jax.Array  # [L, F]
    pw2: jax.Array  # [L, 1, F, C]  pwconv2 (k1 conv)
    pw2_b: jax.Array  # [L, C]


@struct.dataclass
class DecoderStage:
    """One upsampling stage of ``Latent2Wav``: ConvTranspose1d (kernel = stride = r), blocks."""

    up: jax.Array  # [C_in, C, r]  torch ConvTranspose1d layout [in, out, k], no bias
    blocks: ConvNeXtParams


@struct.dataclass
class DecoderParams:
    """``Latent2Wav``: stages in decoding order (rates and channel_mult reversed), output conv."""

    stages: tuple[DecoderStage, ...]
    out: jax.Array  # [1, C, 2R]  Conv1d k1 to [mag logits ‖ phase], no bias


@struct.dataclass
class EncoderStage:
    """One downsampling stage of ``Wav2Latent``: blocks, then a Conv1d with kernel = stride = r."""

    blocks: ConvNeXtParams
    down: jax.Array  # [r, C, C_out]  no bias


@struct.dataclass
class EncoderParams:
    """``Wav2Latent``: input conv on the [real ‖ imag] STFT, then the stages."""

    inp: jax.Array  # [1, 2R, C]  Conv1d k1, no bias
    stages: tuple[EncoderStage, ...]


@struct.dataclass
class CodecParams:
    """``RVQVAEModel``. ``prvq._variance_list`` (training-only log-std) is not kept."""

    mus: jax.Array  # [Q, V, D]  prvq.mus_list
    encoder: EncoderParams
    decoder: DecoderParams


@struct.dataclass
class CodecState:
    """The streaming decoder's state per slot (NeMo's ``CausalConv1dCache`` contents).

    A fresh stream is all zeros, as NeMo pads its first call with zeros.
    """

    conv: tuple[jax.Array, ...]  # per decoder stage s: [B, L, k - 1, C_s] last inputs per block
    istft: jax.Array  # [B, S, W] last S windowed inverse-FFT frames (S = 4 in the release)
    # [B, Q] int32: the codes of a frame made and not yet decoded, -1 where none (the codec a
    # frame behind the speech decoder, ``Kernels.codec_frame_behind``); None otherwise
    pending: jax.Array | None = None


# ---------------------------------------------------------------------------------------------
# Shapes, params, state
# ---------------------------------------------------------------------------------------------


def _decoder_dims(cfg: CodecConfig) -> list[tuple[int, int, int]]:
    """Per decoder stage: (input channels, channels, rate)."""
    mults, rates = tuple(reversed(cfg.channel_mult)), tuple(reversed(cfg.rates))
    dims, c_in = [], cfg.latent_size
    for m, r in zip(mults, rates, strict=True):
        dims.append((c_in, cfg.base_hidden * m, r))
        c_in = cfg.base_hidden * m
    return dims


def _encoder_dims(cfg: CodecConfig) -> list[tuple[int, int, int]]:
    """Per encoder stage: (channels, output channels, rate)."""
    chans = [cfg.base_hidden * m for m in cfg.channel_mult]
    outs = [*chans[1:], cfg.latent_size]
    return list(zip(chans, outs, cfg.rates, strict=True))


def _n_freq(cfg: CodecConfig) -> int:
    return cfg.n_fft // 2 + 1


def _istft_tail(cfg: CodecConfig) -> int:
    """Spectral frames ``Latent2Wav`` caches: 2 * ceil(((n_fft - hop) // 2) / hop)."""
    return 2 * math.ceil(((cfg.n_fft - cfg.hop_length) // 2) / cfg.hop_length)


def _check_cfg(cfg: CodecConfig) -> None:
    if cfg.n_fft % cfg.hop_length or (cfg.n_fft - cfg.hop_length) % 2:
        raise ValueError("the codec's overlap-add needs n_fft = whole hops and an even trim")


def _init_blocks(key: jax.Array, cfg: CodecConfig, C: int, dt) -> ConvNeXtParams:
    L, k, F = cfg.num_blocks, cfg.kernel_size, 4 * C
    ks = jax.random.split(key, 8)
    return ConvNeXtParams(
        dw=fan_in_normal(ks[0], (L, k, C), dt, k),
        dw_b=normal(ks[1], (L, C), dt, std=0.1),
        norm_w=(1.0 + normal(ks[2], (L, C), jnp.float32, std=0.1)).astype(dt),
        norm_b=normal(ks[3], (L, C), dt, std=0.1),
        pw1=fan_in_normal(ks[4], (L, 1, C, F), dt, C),
        pw1_b=normal(ks[5], (L, F), dt, std=0.1),
        # Small second projection: the residual stream grows slowly through the blocks.
        pw2=normal(ks[6], (L, 1, F, C), dt, std=0.5 * F**-0.5),
        pw2_b=normal(ks[7], (L, C), dt, std=0.1),
    )


def init(key: jax.Array, cfg: CodecConfig, precision: Precision) -> CodecParams:
    """Random weights that keep activations of order one (a random-weight test model).

    Codebooks follow NeMo's init (unit rows scaled by (Q - q) / Q); the output conv is scaled so the
    magnitude logits stay moderate and the iSTFT clamp rarely saturates.
    """
    _check_cfg(cfg)
    dt = precision.codec
    k_mus, k_enc, k_dec = jax.random.split(key, 3)
    Q, V, D = cfg.n_quantizers, cfg.codebook_size, cfg.latent_size
    mus = jax.random.normal(k_mus, (Q, V, D), jnp.float32)
    mus = mus / jnp.linalg.norm(mus, axis=-1, keepdims=True)
    mus = mus * ((Q - jnp.arange(Q, dtype=jnp.float32)) / Q)[:, None, None]

    enc_dims = _encoder_dims(cfg)
    ke = jax.random.split(k_enc, 2 * len(enc_dims) + 1)
    encoder = EncoderParams(
        inp=fan_in_normal(ke[0], (1, 2 * _n_freq(cfg), enc_dims[0][0]), dt, 2 * _n_freq(cfg)),
        stages=tuple(
            EncoderStage(
                blocks=_init_blocks(ke[2 * s + 1], cfg, C, dt),
                down=fan_in_normal(ke[2 * s + 2], (r, C, C_out), dt, r * C),
            )
            for s, (C, C_out, r) in enumerate(enc_dims)
        ),
    )
    dec_dims = _decoder_dims(cfg)
    kd = jax.random.split(k_dec, 2 * len(dec_dims) + 1)
    C_last = dec_dims[-1][1]
    decoder = DecoderParams(
        stages=tuple(
            DecoderStage(
                up=fan_in_normal(kd[2 * s], (C_in, C, r), dt, C_in),
                blocks=_init_blocks(kd[2 * s + 1], cfg, C, dt),
            )
            for s, (C_in, C, r) in enumerate(dec_dims)
        ),
        out=normal(kd[-1], (1, C_last, 2 * _n_freq(cfg)), dt, std=0.3 * C_last**-0.5),
    )
    return CodecParams(mus=mus.astype(dt), encoder=encoder, decoder=decoder)


def abstract(cfg: CodecConfig, precision: Precision) -> CodecParams:
    """The params' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves); allocates nothing."""
    return jax.eval_shape(lambda k: init(k, cfg, precision), jax.random.key(0))


def init_state(
    cfg: CodecConfig, batch: int, precision: Precision, *, pending: bool = False
) -> CodecState:
    """The state of a fresh stream (zeros, as NeMo's ``CausalConv1dCache`` starts); with
    ``pending``, room for one frame's codes waiting to be decoded (none yet)."""
    dt = precision.codec
    k = cfg.kernel_size
    return CodecState(
        conv=tuple(
            jnp.zeros((batch, cfg.num_blocks, k - 1, C), dt) for _, C, _ in _decoder_dims(cfg)
        ),
        istft=jnp.zeros((batch, _istft_tail(cfg), cfg.n_fft), dt),
        pending=jnp.full((batch, cfg.n_quantizers), -1, jnp.int32) if pending else None,
    )


# ---------------------------------------------------------------------------------------------
# Quantizer
# ---------------------------------------------------------------------------------------------


def codes_to_latent(params: CodecParams, codes: jax.Array) -> jax.Array:
    """``PreTrainedProbabilisticVQ.decode``: codes [B, T, Q] (valid ids < V) -> latent [B, T, D].

    Control codes (speech BOS/EOS/PAD) must be replaced by silence codes before this.
    """
    Q = params.mus.shape[0]
    rows = params.mus[jnp.arange(Q), codes]  # [B, T, Q, D]
    z = rows[..., 0, :]
    for q in range(1, Q):  # summed in codebook order, as NeMo does
        z = z + rows[..., q, :]
    return z


def encode_latent_to_codes(params: CodecParams, latent: jax.Array) -> jax.Array:
    """``PreTrainedProbabilisticVQ.encode``: latent [B, T, D] -> codes [B, T, Q] int32.

    Greedy residual nearest neighbour; ties go to the lowest id (torch and jnp argmin agree).
    """

    def one(r, mus):  # r [B, T, D], mus [V, D]
        dist = (
            jnp.sum(r * r, axis=-1, keepdims=True)
            + jnp.sum(mus * mus, axis=-1)
            - 2.0 * jnp.einsum("btd,vd->btv", r, mus, precision=_HIGHEST)
        )  # [B, T, V]
        idx = jnp.argmin(dist, axis=-1).astype(jnp.int32)  # [B, T]
        return r - mus[idx], idx

    _, codes = jax.lax.scan(one, latent, params.mus)  # codes [Q, B, T]
    return jnp.moveaxis(codes, 0, -1)


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def _pointwise(x: jax.Array, w: jax.Array, prec: ProductPrecision = _HIGHEST) -> jax.Array:
    """A k1 Conv1d, x [B, T, C_in], w [1, C_in, C_out] -> [B, T, C_out]."""
    if isinstance(prec, KernelProduct):
        return dense(x, w[0], precision=prec)
    return jnp.einsum("btc,co->bto", x, w[0].astype(x.dtype), precision=prec)


def _convnext_in(p: ConvNeXtParams, x: jax.Array, tail: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A ``ConvNeXt1d``'s depthwise causal conv and norm: (the first product's input, new tail)."""
    k, T = p.dw.shape[0], x.shape[1]
    xp = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, T + k - 1, C]
    h = p.dw_b.astype(x.dtype) + sum(xp[:, j : j + T] * p.dw[j].astype(x.dtype) for j in range(k))
    return layer_norm(h, p.norm_w, p.norm_b, _LN_EPS), xp[:, T:]


def _convnext(
    p: ConvNeXtParams, x: jax.Array, tail: jax.Array, prec: ProductPrecision = _HIGHEST
) -> tuple[jax.Array, jax.Array]:
    """One ``ConvNeXt1d``, one block's slice of the stack (no ``L`` axis).

    x [B, T, C]; tail [B, k - 1, C] the block's previous inputs (zeros at a stream's start, as
    the offline left padding); ``prec`` its products' precision. Returns (output [B, T, C], new
    tail [B, k - 1, C]).
    """
    h, tail = _convnext_in(p, x, tail)
    h = _pointwise(h, p.pw1, prec) + p.pw1_b.astype(x.dtype)
    h = jax.nn.gelu(h, approximate=False)  # torch nn.GELU(): erf
    h = _pointwise(h, p.pw2, prec) + p.pw2_b.astype(x.dtype)
    return x + h, tail


def _convnext_stack(
    blocks: ConvNeXtParams, x: jax.Array, tails: jax.Array, prec: ProductPrecision = _HIGHEST
) -> tuple[jax.Array, jax.Array]:
    """A stage's blocks in order. x [B, T, C], tails [B, L, k - 1, C] -> (x, new tails)."""

    def body(h, layer):
        p, tail = layer
        h, tail = _convnext(p, h, tail, prec)
        return h, tail

    x, new = jax.lax.scan(body, x, (blocks, jnp.moveaxis(tails, 1, 0)))
    return x, jnp.moveaxis(new, 0, 1)


def _zero_tails(blocks: ConvNeXtParams, x: jax.Array) -> jax.Array:
    L, k, C = blocks.dw.shape
    return jnp.zeros((x.shape[0], L, k - 1, C), x.dtype)


def _hann(n: int) -> np.ndarray:
    """``torch.hann_window(n)`` (periodic)."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def _irfft_basis(n_fft: int) -> tuple[np.ndarray, np.ndarray]:
    """Real matrices [R, W] with ``irfft(re + i·im, n) = re @ cos_m + im @ sin_m`` (norm backward).

    The imaginary parts of DC and Nyquist are ignored, as irfft does (their sine rows are zero).
    """
    R = n_fft // 2 + 1
    k, n = np.arange(R)[:, None], np.arange(n_fft)[None, :]
    c = np.where((k == 0) | (k == n_fft // 2), 1.0, 2.0) / n_fft
    ang = 2.0 * np.pi * k * n / n_fft
    return c * np.cos(ang), -c * np.sin(ang)


def _stft_basis(n_fft: int) -> np.ndarray:
    """[W, 2R]: a windowed frame @ basis = [real ‖ imag] of its one-sided DFT (``torch.stft``)."""
    R = n_fft // 2 + 1
    n, k = np.arange(n_fft)[:, None], np.arange(R)[None, :]
    ang = 2.0 * np.pi * n * k / n_fft
    w = _hann(n_fft)[:, None]
    return np.concatenate([w * np.cos(ang), -w * np.sin(ang)], axis=1)


def _overlap_add(frames: jax.Array, hop: int) -> jax.Array:
    """frames [B, N, W] at hop -> [B, (N - 1) * hop + W] (``F.fold``), W a multiple of hop."""
    B, N, W = frames.shape
    P = W // hop
    parts = frames.reshape(B, N, P, hop)
    out = sum(jnp.pad(parts[:, :, j], ((0, 0), (j, P - 1 - j), (0, 0))) for j in range(P))
    return out.reshape(B, (N + P - 1) * hop)  # [B, (N + P - 1) * hop]


def _envelope(n_frames: int, cfg: CodecConfig, dtype) -> jax.Array:
    """The overlap-added squared window of ``n_frames`` frames, [(N - 1) * hop + W]."""
    w2 = jnp.asarray(_hann(cfg.n_fft) ** 2, dtype)
    return _overlap_add(jnp.broadcast_to(w2, (1, n_frames, cfg.n_fft)), cfg.hop_length)[0]


def _decoder_trunk(
    dec: DecoderParams,
    latent: jax.Array,
    tails: tuple[jax.Array, ...],
    prec: ProductPrecision = _HIGHEST,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """latent [B, T, D] -> (mag/phase logits [B, N, 2R], new tails); N = T * prod(rates)."""
    x, new_tails = latent, []
    for stage, tail in zip(dec.stages, tails, strict=True):
        C_in, C, r = stage.up.shape
        if isinstance(prec, KernelProduct):  # one [C_in, r * C] product, its columns step-major
            y = dense(x, jnp.swapaxes(stage.up, 1, 2).reshape(C_in, r * C), precision=prec)
        else:
            y = jnp.einsum("btc,cor->btro", x, stage.up.astype(x.dtype), precision=prec)
        x = y.reshape(x.shape[0], x.shape[1] * r, C)  # kernel = stride: k outputs per input step
        x, tail = _convnext_stack(stage.blocks, x, tail, prec)
        new_tails.append(tail)
    return _pointwise(x, dec.out, prec), tuple(new_tails)


def _synth_frames(
    logits: jax.Array, cfg: CodecConfig, prec: jax.lax.Precision = _HIGHEST
) -> jax.Array:
    """``Latent2Wav``'s spectrum head and per-frame inverse FFT: [B, N, 2R] -> [B, N, W].

    mag = 100·exp(-softplus(-m + ln 100)); spectrum mag·(cos φ, sin φ); irfft; clamp to ±window
    (``constrain_value_range=True``, the decode default); times the window.
    """
    R = _n_freq(cfg)
    m, ph = logits[..., :R], logits[..., R:]
    mag = _MAX_MAG * jnp.exp(-jax.nn.softplus(-m + math.log(_MAX_MAG)))
    cos_m, sin_m = _irfft_basis(cfg.n_fft)
    dt = logits.dtype
    frames = jnp.einsum(
        "bnr,rw->bnw", mag * jnp.cos(ph), jnp.asarray(cos_m, dt), precision=prec
    ) + jnp.einsum("bnr,rw->bnw", mag * jnp.sin(ph), jnp.asarray(sin_m, dt), precision=prec)
    w = jnp.asarray(_hann(cfg.n_fft), dt)
    frames = jnp.where(frames >= 0, jnp.minimum(frames, w), jnp.maximum(frames, -w))
    return frames * w


# ---------------------------------------------------------------------------------------------
# Decoder: offline and streaming
# ---------------------------------------------------------------------------------------------


def decode_latent_offline(params: CodecParams, latent: jax.Array, *, cfg: CodecConfig) -> jax.Array:
    """``RVQVAEModel.ae_decode`` without a cache: latent [B, T, D] -> wav [B, T * spf].

    ``spf`` is ``cfg.samples_per_frame`` (1764).
    """
    _check_cfg(cfg)
    dec = params.decoder
    zero = tuple(_zero_tails(s.blocks, latent) for s in dec.stages)
    logits, _ = _decoder_trunk(dec, latent, zero)
    frames = _synth_frames(logits, cfg)  # [B, N, W]
    pad = (cfg.n_fft - cfg.hop_length) // 2
    n = frames.shape[1] * cfg.hop_length
    wav = _overlap_add(frames, cfg.hop_length)[:, pad : pad + n]
    return wav / _envelope(frames.shape[1], cfg, wav.dtype)[pad : pad + n]


def decode_offline(params: CodecParams, codes: jax.Array, *, cfg: CodecConfig) -> jax.Array:
    """``RVQVAEModel.decode(codes)``: codes [B, T, Q] -> wav [B, T * samples_per_frame]."""
    return decode_latent_offline(params, codes_to_latent(params, codes), cfg=cfg)


def decode_step(
    params: CodecParams,
    state: CodecState,
    codes: jax.Array,
    *,
    cfg: CodecConfig,
    matmul: str = "float32",
) -> tuple[CodecState, jax.Array]:
    """Decode the next ``T`` code frames of each slot's stream.

    ``RVQVAEModel.decode(codes, cache=CausalConv1dCache())`` on successive chunks. codes [B, T, Q]
    (valid ids, control codes already replaced by silence) -> (state, wav [B, T * spf]), spf =
    ``cfg.samples_per_frame`` (1764).
    One call of T frames equals T calls of one frame. The output is the offline decode delayed by
    8 samples (see the module docstring). ``matmul`` (static, ``Precision.codec_matmul``): the
    decoder's products in full fp32 ('float32', NeMo's ``disable_tf32``) or TF32
    ('tensorfloat32'); only the waveform depends on it.
    """
    _check_cfg(cfg)
    prec = lax_precision(matmul)
    latent = codes_to_latent(params, codes).astype(state.istft.dtype)
    logits, conv = _decoder_trunk(params.decoder, latent, state.conv, prec)
    # the inverse FFT's two small products stay XLA's (1 % of the FLOPs), in full fp32 under
    # a ``KernelProduct``
    out_prec = _HIGHEST if isinstance(prec, KernelProduct) else prec
    return _stream_out(state, conv, logits, cfg, out_prec)


def _stream_out(
    state: CodecState,
    conv: tuple[jax.Array, ...],
    logits: jax.Array,
    cfg: CodecConfig,
    prec: jax.lax.Precision,
) -> tuple[CodecState, jax.Array]:
    """The streaming decoder's spectrum head and overlap-add after its trunk: (state, wav)."""
    frames = jnp.concatenate([state.istft, _synth_frames(logits, cfg, prec)], axis=1)
    S = state.istft.shape[1]
    hop = cfg.hop_length
    # spec_to_wav trims (n_fft - hop) // 2 each side, then Latent2Wav trims (S // 2) * hop more.
    start = (cfg.n_fft - hop) // 2 + (S // 2) * hop
    n = (frames.shape[1] - S) * hop
    wav = _overlap_add(frames, hop)[:, start : start + n]
    wav = wav / _envelope(frames.shape[1], cfg, wav.dtype)[start : start + n]
    return state.replace(conv=conv, istft=frames[:, frames.shape[1] - S :]), wav


def _product_flops(params: CodecParams, rows: int) -> list[int]:
    """The multiply-adds of ``decode_step_products``' products in order, for ``rows`` = B * T."""
    flops = []
    for stage in params.decoder.stages:
        C_in, C, r = stage.up.shape
        flops.append(rows * C_in * r * C)
        rows *= r
        F = stage.blocks.pw1.shape[-1]
        flops += [rows * C * F, rows * F * C] * stage.blocks.dw.shape[0]
    return flops


def halved_products(flops: Sequence[int], launches: int | None) -> set[int]:
    """Which of products costing ``flops`` (in order) ``decode_step_products`` asks for in two
    halves of their rows with ``launches`` places for them: the largest (the earlier of equals)
    until every place has a product."""
    spare = max(0, (launches or 0) - len(flops))
    return set(sorted(range(len(flops)), key=lambda i: (-flops[i], i))[:spare])


def _in_pieces(x: jax.Array, w: jax.Array, pieces: int):
    """``x @ w`` asked for as ``pieces`` products of consecutive rows (a sub-generator)."""
    if pieces == 1:
        return (yield x, w)
    parts = []
    for part in jnp.array_split(x, pieces):
        parts.append((yield part, w))
    return jnp.concatenate(parts)


def decode_step_products(
    params: CodecParams,
    state: CodecState,
    codes: jax.Array,
    *,
    cfg: CodecConfig,
    launches: int | None = None,
) -> Generator[tuple[jax.Array, jax.Array], jax.Array, tuple[CodecState, jax.Array]]:
    """``decode_step`` (full fp32) as a generator of its large products, for whoever runs them.

    Yields each of the trunk's products in order as ``(x [M, C], w [C, F])`` fp32 and expects
    ``x @ w`` [M, F] in full fp32 back (``send``): every stage's transposed conv (its weight laid
    out [C_in, r * C], so that the product's rows are the stage's output steps in order) and every
    ConvNeXt block's two pointwise products, the blocks unrolled. The output conv (2R = 18
    columns) and the spectrum head stay here. Returns ``decode_step``'s (state, wav).
    ``model.beside.Beside`` runs its products inside the speech decoder's attention launches,
    and XLA's dot for the rest (``Beside.finish`` alone: every product by XLA). Same math as
    ``decode_step``; the sums may be taken in another order (fp32 rounding).

    ``launches``: the places there are for products (the speech decoder's layers, one attention
    launch each). Where they outnumber the products, the largest products are asked for in two
    halves of their rows, the largest first, until every place has one (at the 11B, 21
    products for 28 layers: the last stage's six pointwise products, 50 GFLOP each at 96
    slots, and the middle stage's first, in halves), so that no launch carries far more
    product than the others.
    """
    _check_cfg(cfg)
    latent = codes_to_latent(params, codes).astype(state.istft.dtype)
    flops = _product_flops(params, latent.shape[0] * latent.shape[1])
    halved = halved_products(flops, launches)
    order = iter(range(len(flops)))

    def product(x, w):  # the next product, in halves if it is among the largest
        return (yield from _in_pieces(x, w, 2 if next(order) in halved else 1))

    x, conv = latent, []
    for stage, tails in zip(params.decoder.stages, state.conv, strict=True):
        C_in, C, r = stage.up.shape
        B, T, _ = x.shape
        up = jnp.swapaxes(stage.up, 1, 2).reshape(C_in, r * C).astype(x.dtype)  # [in, (r, out)]
        y = yield from product(x.reshape(B * T, C_in), up)
        x = y.reshape(B, T * r, C)
        new_tails = []
        for l in range(stage.blocks.dw.shape[0]):
            p = jax.tree.map(lambda a, l=l: a[l], stage.blocks)
            h, tail = _convnext_in(p, x, tails[:, l])
            y = yield from product(h.reshape(-1, C), p.pw1[0].astype(x.dtype))
            h = jax.nn.gelu(y + p.pw1_b.astype(x.dtype), approximate=False)  # torch nn.GELU()
            y = yield from product(h, p.pw2[0].astype(x.dtype))
            x = x + (y + p.pw2_b.astype(x.dtype)).reshape(x.shape)
            new_tails.append(tail)
        conv.append(jnp.stack(new_tails, axis=1))
    logits = _pointwise(x, params.decoder.out)
    return _stream_out(state, tuple(conv), logits, cfg, _HIGHEST)


# ---------------------------------------------------------------------------------------------
# Encoder (offline)
# ---------------------------------------------------------------------------------------------


def encode_latent(params: CodecParams, wav: jax.Array, *, cfg: CodecConfig) -> jax.Array:
    """``Wav2Latent.forward``: wav [B, T * samples_per_frame] -> latent [B, T, D]."""
    _check_cfg(cfg)
    B, n = wav.shape
    if n % cfg.samples_per_frame:
        raise ValueError(f"{n} samples is not a whole number of {cfg.samples_per_frame}-frames")
    W, hop = cfg.n_fft, cfg.hop_length
    dt = params.mus.dtype
    # spectrogram(): zero pad (W - hop) // 2 left, the rest right; frames at hop, center=False.
    pad_l = (W - hop) // 2
    x = jnp.pad(wav.astype(dt), ((0, 0), (pad_l, W - hop - pad_l)))
    N, P = n // hop, W // hop
    hops = x.reshape(B, N + P - 1, hop)
    frames = jnp.concatenate([hops[:, j : j + N] for j in range(P)], axis=-1)  # [B, N, W]
    spec = jnp.einsum("bnw,wr->bnr", frames, jnp.asarray(_stft_basis(W), dt), precision=_HIGHEST)
    enc = params.encoder
    x = _pointwise(spec, enc.inp)
    for stage in enc.stages:
        x, _ = _convnext_stack(stage.blocks, x, _zero_tails(stage.blocks, x))
        r, C, _ = stage.down.shape
        x = x.reshape(B, x.shape[1] // r, r, C)
        x = jnp.einsum("btrc,rco->bto", x, stage.down.astype(x.dtype), precision=_HIGHEST)
    return x


def encode(params: CodecParams, wav: jax.Array, *, cfg: CodecConfig) -> jax.Array:
    """``RVQVAEModel.encode``: wav [B, T * samples_per_frame] -> codes [B, T, Q] int32."""
    return encode_latent_to_codes(params, encode_latent(params, wav, cfg=cfg))
