"""PCM16 at the client's rate <-> the model's float32, resampled with ``soxr`` (streaming, so
chunk edges leave no seams); input cut into whole 80 ms frames. Part of ``serving.net.protocol``."""

from __future__ import annotations

import base64

import numpy as np
import soxr

from voicechat_jax.serving.audio import FRAME_LEN, INPUT_RATE, OUTPUT_RATE
from voicechat_jax.serving.net.protocol._events import DEFAULT_RATE
from voicechat_jax.serving.writer import PCM16_MAX


class InputAudio:
    """The client's PCM16 at ``rate`` -> whole 80 ms frames of float32 at 16 kHz (streaming)."""

    def __init__(self, rate: int = DEFAULT_RATE):
        self.rate = rate
        self._resampler = (
            None if rate == INPUT_RATE else soxr.ResampleStream(rate, INPUT_RATE, 1, "float32")
        )
        self._rest = np.zeros((0,), np.float32)
        self.samples_in = 0  # client samples taken

    def feed(self, pcm: bytes) -> np.ndarray:
        """Returns the whole frames now available, float32 [n * 1280] (n may be 0)."""
        x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        self.samples_in += x.shape[0]
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x)
            np.clip(x, -1.0, 1.0, out=x)  # the filter can ring just past full scale
        x = np.concatenate([self._rest, x]) if self._rest.size else x
        n = (x.shape[0] // FRAME_LEN) * FRAME_LEN
        self._rest = x[n:].copy()
        return x[:n]

    def clear(self) -> int:
        """Drops the part of a frame not yet queued (``input_audio_buffer.clear``); returns how
        many 16 kHz samples it held. Whole frames are the model's already: it hears them at the
        next beat."""
        n, self._rest = self._rest.shape[0], np.zeros((0,), np.float32)
        return n


class OutputAudio:
    """The model's 22.05 kHz float32 -> PCM16 bytes at ``rate``, one 80 ms frame in, exactly one
    80 ms frame out (streaming).

    A streaming resampler hands out its output in uneven blocks; a FIFO primed with ``lead_ms``
    of silence evens them out, so that every frame the client gets holds exactly 80 ms (a frame
    the FIFO cannot fill is padded with silence and counted in ``shortfalls``; with the default
    lead it does not happen at the supported rates).
    """

    def __init__(self, rate: int = DEFAULT_RATE, *, lead_ms: float = 30.0):
        self.rate = rate
        self._resampler = (
            None
            if rate == OUTPUT_RATE
            else soxr.ResampleStream(OUTPUT_RATE, rate, 1, "float32", quality="LQ")
        )
        self._fifo = np.zeros((0 if self._resampler is None else int(rate * lead_ms / 1000),))
        self.shortfalls = 0

    def convert(self, wav: np.ndarray) -> bytes:
        """One frame (or whole frames) of model audio -> the same duration at ``rate``."""
        x = np.asarray(wav, np.float32)
        n = x.shape[0] * self.rate // OUTPUT_RATE
        if self._resampler is not None:
            x = np.concatenate([self._fifo, self._resampler.resample_chunk(x)])
            if x.shape[0] < n:
                self.shortfalls += 1
                x = np.pad(x, (0, n - x.shape[0]))
            x, self._fifo = x[:n], x[n:]
        x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
        return np.rint(np.clip(x, -1.0, 1.0) * PCM16_MAX).astype("<i2").tobytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
