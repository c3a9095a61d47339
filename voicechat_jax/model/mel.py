"""Streaming log-mel front end: NeMo ``AudioToMelSpectrogramPreprocessor`` computed incrementally.

Mirrors ``nemo.collections.asr.parts.preprocessing.features.FilterbankFeatures.forward`` in eval
mode as the release configures it: no dither; preemphasis ``y[n] = x[n] - 0.97 x[n-1]`` (with
``y[0] = x[0]``); ``torch.stft(n_fft=512, hop=160, win_length=400, center=True,
pad_mode="constant")`` with the symmetric Hann window (``torch.hann_window(400, periodic=False)``,
zero-padded to 512 in the middle, as ``torch.stft`` does); ``|X|`` then ``** 2``; the Slaney
mel filterbank (``fb @ power``); ``log(x + 2**-24)``; ``normalize: 'NA'`` (none). NeMo always
runs it in fp32, and so does this module, whatever the encoder's dtype.

Alignment. Mel frame ``i`` is the STFT frame centred on sample ``160 i``: with ``center=True``
and zero padding it reads samples ``160 i - 256 .. 160 i + 255``, of which the window is non-zero
on ``160 i - 199 .. 160 i + 198`` (plus the sample before, for preemphasis). Input frame ``c``
(samples ``1280 c .. 1280 c + 1279``) produces mel frames ``8 c - 7 .. 8 c``: the last of them
needs samples up to ``1280 c + 198``, so a frame's mel is complete as soon as the frame has arrived
(no added delay), and it is exactly the chunk NeMo's ``CacheAwareStreamingAudioBuffer`` hands the
encoder at step ``c`` (step 0: mel frame 0 alone; step ``c >= 1``: frames ``8 c - 7 .. 8 c``). For
``c = 0`` the positions ``-7 .. -1`` do not exist; they are emitted as zero log-mel frames, which is
what that buffer places in the encoder's pre-encode cache before the clip starts.

Every frame emitted is bit-for-bit the frame NeMo's whole-clip mel has at that position, up to the
FFT's rounding (the clip's last frame, which NeMo masks to zero because ``get_seq_len`` counts
``len // 160`` frames, is never emitted: it belongs to an end-of-stream flush).

The carried tail is the last ``n_fft/2 - hop + 1280 + 1`` = 1377 raw samples: the next call's first
frame (``8 c + 1``) starts 96 samples before the current input frame, and preemphasis needs the
sample before that. A fresh tail is zeros, which reproduces the STFT's zero padding (and
``y[0] = x[0]``) at the start of the stream.

Axes: ``B`` slots, ``T`` mel frames (8 per 80 ms input frame), ``M`` mel bins, ``F`` STFT bins
(``n_fft/2 + 1``), ``W`` window length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from voicechat_jax.config import MelConfig

# NeMo computes the whole front end in fp32 (``AudioPreprocessor.forward`` casts its input).
MEL_DTYPE = jnp.float32


@struct.dataclass
class MelParams:
    """The featurizer's two buffers (``preprocessor.featurizer.{fb,window}`` in the release)."""

    fb: jax.Array  # [M, F]  Slaney mel filterbank (the release's [1, M, F] buffer, squeezed)
    window: jax.Array  # [W]  symmetric Hann window


def tail_len(cfg: MelConfig) -> int:
    """Raw samples carried between calls: from the next call's first STFT frame start, minus one."""
    return cfg.n_fft // 2 - cfg.hop_length + cfg.samples_per_frame + 1


def slaney_filterbank(cfg: MelConfig) -> np.ndarray:
    """``librosa.filters.mel(sr, n_fft, n_mels, fmin=0, fmax=sr/2, norm='slaney')``: [M, F].

    The release stores this matrix as a buffer; it is rebuilt here for ``init`` (float64 maths, cast
    to fp32 at the end, as librosa does).
    """

    def hz_to_mel(f):
        f = np.asarray(f, np.float64)
        f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
        lin = f / f_sp
        log = min_log_hz / f_sp + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep
        return np.where(f >= min_log_hz, log, lin)

    def mel_to_hz(m):
        m = np.asarray(m, np.float64)
        f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
        min_log_mel = min_log_hz / f_sp
        return np.where(
            m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m
        )

    freqs = np.fft.rfftfreq(cfg.n_fft, 1.0 / cfg.sample_rate)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(cfg.sample_rate / 2), cfg.n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return weights.astype(np.float32)


def hann_window(cfg: MelConfig) -> np.ndarray:
    """``torch.hann_window(win_length, periodic=False)``."""
    n = np.arange(cfg.win_length, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * n / (cfg.win_length - 1))).astype(np.float32)


def init(cfg: MelConfig) -> MelParams:
    """The featurizer buffers as NeMo builds them (they carry no learned values)."""
    return MelParams(
        fb=jnp.asarray(slaney_filterbank(cfg), MEL_DTYPE),
        window=jnp.asarray(hann_window(cfg), MEL_DTYPE),
    )


def init_tail(cfg: MelConfig, batch: int) -> jax.Array:
    """A fresh stream's tail: zeros, i.e. the STFT's zero padding before the first sample."""
    return jnp.zeros((batch, tail_len(cfg)), MEL_DTYPE)


def logmel_step(
    params: MelParams, tail: jax.Array, samples: jax.Array, start: jax.Array, *, cfg: MelConfig
) -> tuple[jax.Array, jax.Array]:
    """Log-mel frames of ``k`` new input frames.

    Args:
      params: the filterbank and window.
      tail: [B, tail_len] the raw samples carried from the previous call (zeros at the start).
      samples: [B, k * samples_per_frame] the new 16 kHz samples.
      start: [B] int, the stream's index of the first new input frame (input frames already
        consumed); it only decides which leading positions are before the stream (zeroed).

    Returns:
      (tail, mel): the next tail [B, tail_len] and the mel frames [B, 8 k, M] at positions
      ``8 start - 7 .. 8 (start + k - 1)``; positions below 0 are zero log-mel frames.
    """
    spf, hop, n_fft = cfg.samples_per_frame, cfg.hop_length, cfg.n_fft
    k = samples.shape[1] // spf
    if samples.shape[1] != k * spf or k == 0:
        raise ValueError(f"samples must be a positive multiple of {spf}, got {samples.shape[1]}")
    x = jnp.concatenate([tail.astype(MEL_DTYPE), samples.astype(MEL_DTYPE)], axis=1)
    y = x[:, 1:] - cfg.preemph * x[:, :-1]  # [B, tail_len - 1 + k * spf]
    T = k * cfg.mels_per_frame
    # STFT frame j of this call starts at sample 160 j of y (frame 8 start - 7 starts 1376 before
    # the new samples); torch.stft centres the 400-sample window inside the 512-sample frame.
    idx = hop * np.arange(T)[:, None] + np.arange(n_fft)[None, :]  # [T, n_fft]
    frames = y[:, idx]  # [B, T, n_fft]
    left = (n_fft - cfg.win_length) // 2
    window = jnp.pad(params.window.astype(MEL_DTYPE), (left, n_fft - cfg.win_length - left))
    spec = jnp.fft.rfft(frames * window, n=n_fft, axis=-1)  # [B, T, F]
    mag = jnp.sqrt(jnp.square(spec.real) + jnp.square(spec.imag))
    power = mag**cfg.mag_power if cfg.mag_power != 2.0 else mag * mag
    mel = jnp.einsum(
        "btf,mf->btm", power, params.fb.astype(MEL_DTYPE), precision=jax.lax.Precision.HIGHEST
    )
    mel = jnp.log(mel + cfg.log_zero_guard)
    pos = cfg.mels_per_frame * start.astype(jnp.int32)[:, None] - (cfg.mels_per_frame - 1)
    pos = pos + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T] mel frame index in the stream
    mel = jnp.where((pos >= 0)[:, :, None], mel, 0.0)
    return x[:, -tail.shape[1] :], mel
