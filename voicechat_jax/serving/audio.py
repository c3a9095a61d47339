"""Audio in and out of the server: WAV files, frames from a queue, and their validation.

Input is 16 kHz mono (the encoder's ``MelConfig.sample_rate``), as float32 in [-1, 1]; output is
the codec's 22.05 kHz. Every check that fails raises ``AudioInputError`` naming the source (a file
path, or a session / message) and the problem, so that bad input can fail its session alone
(docs/serving.md §5, gate 6) with a message a client can act on.

WAV files are read with a small RIFF parser rather than the stdlib ``wave`` module, which on
Python 3.11 reads neither IEEE-float nor WAVE_FORMAT_EXTENSIBLE files and reports a truncated file
only as a short read. Output is written with ``wave`` (PCM16).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import wave

import numpy as np

INPUT_RATE = 16000  # Hz, MelConfig.sample_rate
OUTPUT_RATE = 22050  # Hz, CodecConfig.sample_rate
FRAME_LEN = 1280  # samples per 80 ms input frame, MelConfig.samples_per_frame

_FORMAT_PCM = 0x0001
_FORMAT_FLOAT = 0x0003
_FORMAT_EXTENSIBLE = 0xFFFE
_UNKNOWN_SIZE = 0xFFFFFFFF  # data size left unset by streaming writers (e.g. ffmpeg to a pipe)
# Samples read from one file at most (an hour at 16 kHz): past them a file is not read. A run
# reads less: the frames it can serve (``runner``), at most the context cap when sessions end there.
MAX_WAV_SAMPLES = 3600 * INPUT_RATE


class AudioInputError(ValueError):
    """Bad audio input: ``source`` names the file, session or message, ``problem`` what is wrong."""

    def __init__(self, source: str, problem: str):
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


# ---------------------------------------------------------------------------------------------
# Reading WAV files


def _parse_riff(
    path: str, data: bytes | mmap.mmap, max_samples: int | None = None
) -> tuple[dict[str, int], bytes]:
    """Returns the ``fmt `` fields and the ``data`` chunk's bytes of a RIFF/WAVE file (its first
    ``max_samples`` samples at most: only those are copied out of ``data``)."""
    if not data:
        raise AudioInputError(path, "empty file (0 bytes)")
    if len(data) < 12:
        raise AudioInputError(path, f"truncated: {len(data)} bytes, shorter than a WAV header")
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioInputError(
            path, f"not a RIFF/WAVE file (starts with {data[:4]!r}, form {data[8:12]!r})"
        )
    fmt: dict[str, int] | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id = data[pos : pos + 4]
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = pos + 8
        available = len(data) - body
        if chunk_id == b"fmt ":
            if size < 16 or size > available:
                raise AudioInputError(
                    path,
                    f"corrupt or truncated fmt chunk ({size} bytes declared, {available} left)",
                )
            tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == _FORMAT_EXTENSIBLE and size >= 40:
                # The real format code is the first two bytes of the SubFormat GUID.
                (tag,) = struct.unpack_from("<H", data, body + 24)
            fmt = {
                "tag": tag,
                "channels": channels,
                "rate": rate,
                "block_align": block_align,
                "bits": bits,
            }
        elif chunk_id == b"data":
            if fmt is None:
                raise AudioInputError(path, "corrupt: data chunk before the fmt chunk")
            if size == _UNKNOWN_SIZE:
                size = available
            if size > available:
                raise AudioInputError(
                    path,
                    f"truncated: data chunk declares {size} bytes but only {available} are present",
                )
            if max_samples is not None:
                size = min(size, max_samples * max(fmt["block_align"], 1))
            return fmt, data[body : body + size]
        pos = body + size + (size & 1)  # chunks are padded to an even size
    if fmt is None:
        raise AudioInputError(path, "truncated or corrupt: no fmt chunk")
    raise AudioInputError(path, "truncated or corrupt: no data chunk")


def _decode(path: str, fmt: dict[str, int], pcm: bytes) -> np.ndarray:
    """Decodes mono sample bytes to float32 [n]."""
    tag, bits = fmt["tag"], fmt["bits"]
    width = bits // 8
    if bits % 8 or fmt["block_align"] != width * fmt["channels"]:
        raise AudioInputError(
            path,
            f"corrupt fmt chunk: {bits} bits x {fmt['channels']} channels but "
            f"block_align {fmt['block_align']}",
        )
    if len(pcm) % width:
        raise AudioInputError(
            path, f"truncated: data ends mid-sample ({len(pcm)} bytes, {width} per sample)"
        )
    if tag == _FORMAT_PCM and bits == 8:
        return (np.frombuffer(pcm, np.uint8).astype(np.float32) - 128.0) / 128.0
    if tag == _FORMAT_PCM and bits == 16:
        return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    if tag == _FORMAT_PCM and bits == 24:
        raw = np.frombuffer(pcm, np.uint8).reshape(-1, 3).astype(np.int32)
        value = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        value = np.where(value >= 1 << 23, value - (1 << 24), value)
        return (value / float(1 << 23)).astype(np.float32)
    if tag == _FORMAT_PCM and bits == 32:
        return (np.frombuffer(pcm, "<i4") / float(1 << 31)).astype(np.float32)
    if tag == _FORMAT_FLOAT and bits in (32, 64):
        return np.frombuffer(pcm, "<f4" if bits == 32 else "<f8").astype(np.float32)
    raise AudioInputError(
        path,
        f"unsupported sample format (format code {tag:#06x}, {bits} bits); "
        "expected PCM 8/16/24/32-bit or IEEE float 32/64-bit",
    )


def read_wav(
    path: str | os.PathLike, expected_rate: int = INPUT_RATE, max_samples: int = MAX_WAV_SAMPLES
) -> np.ndarray:
    """Reads a mono WAV file at ``expected_rate`` as float32 [n] in [-1, 1], its first
    ``max_samples`` samples at most (the rest is not read).

    Accepts PCM 8/16/24/32-bit and IEEE float 32/64-bit (plain or WAVE_FORMAT_EXTENSIBLE). Raises
    ``AudioInputError`` naming the file for: a missing or unreadable file, anything but a regular
    file (a device such as /dev/zero, a FIFO, a directory: never read), an empty file, a file
    that is not WAV, a truncated or corrupt file, more than one channel, a sample rate other than
    ``expected_rate`` (both named; nothing is resampled silently), no samples, NaN/Inf samples, and
    float samples outside [-1, 1] (clipped).
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO must not wait
    except OSError as e:
        raise AudioInputError(name, f"cannot read: {e.strerror or e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise AudioInputError(name, f"not a regular file ({_file_kind(mode)}); give a WAV file")
        if os.fstat(fd).st_size == 0:
            raise AudioInputError(name, "empty file (0 bytes)")
        # Mapped, not read: only the chunk headers and the samples taken are paged in.
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
            fmt, pcm = _parse_riff(name, data, max_samples)
    except OSError as e:
        raise AudioInputError(name, f"cannot read: {e.strerror or e}") from e
    finally:
        os.close(fd)
    problems = []
    if fmt["channels"] != 1:
        problems.append(f"{fmt['channels']} channels; expected mono (1 channel)")
    if fmt["rate"] != expected_rate:
        problems.append(
            f"sample rate {fmt['rate']} Hz; expected {expected_rate} Hz (resample it first)"
        )
    if problems:
        raise AudioInputError(name, "; ".join(problems))
    samples = _decode(name, fmt, pcm)
    if samples.size == 0:
        raise AudioInputError(name, "no audio samples (the data chunk is empty)")
    _check_values(name, samples)
    return samples


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


# ---------------------------------------------------------------------------------------------
# Frames from a queue or the network


def _check_values(source: str, samples: np.ndarray) -> None:
    """Raises on NaN/Inf or samples outside [-1, 1]; ``samples`` is float32."""
    if samples.size == 0 or np.abs(samples).max() <= 1.0:  # one pass; NaN compares False
        return
    finite = np.isfinite(samples)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise AudioInputError(
            source, f"{bad.size} NaN/Inf sample(s), the first at index {int(bad[0])}"
        )
    clipped = np.abs(samples) > 1.0
    if clipped.any():
        bad = np.flatnonzero(clipped)
        raise AudioInputError(
            source,
            f"{bad.size} sample(s) outside [-1, 1] (clipped), the first at index {int(bad[0])} "
            f"= {float(samples[bad[0]]):.4g}",
        )


def validate_samples(
    samples: np.ndarray,
    *,
    frame_len: int = FRAME_LEN,
    exact: bool = False,
    source: str = "input",
) -> np.ndarray:
    """Checks one chunk of mono input and returns it as float32 [n].

    Accepted: a 1-D NumPy array of float32 in [-1, 1] or int16 PCM (scaled by 1/32768), whose
    length is ``frame_len`` (``exact``) or a positive multiple of it. Anything else (another dtype,
    another shape, a partial frame, NaN/Inf, clipped float samples) raises ``AudioInputError``.
    """
    if not isinstance(samples, np.ndarray):
        raise AudioInputError(source, f"expected a NumPy array, got {type(samples).__name__}")
    if samples.dtype == np.int16:
        samples = samples.astype(np.float32) / 32768.0
    elif samples.dtype != np.float32:
        raise AudioInputError(
            source, f"dtype {samples.dtype}; expected float32 in [-1, 1] or int16 PCM"
        )
    if samples.ndim != 1:
        raise AudioInputError(source, f"shape {samples.shape}; expected mono samples [n]")
    n = samples.shape[0]
    if exact and n != frame_len:
        raise AudioInputError(source, f"{n} samples; expected one frame of {frame_len}")
    if not exact and (n == 0 or n % frame_len):
        raise AudioInputError(
            source, f"{n} samples; expected a positive multiple of the {frame_len}-sample frame"
        )
    _check_values(source, samples)
    return samples


def validate_frame(samples: np.ndarray, frame_len: int = FRAME_LEN, *, source: str = "frame"):
    """Checks exactly one frame (see ``validate_samples``) and returns it as float32 [frame_len]."""
    return validate_samples(samples, frame_len=frame_len, exact=True, source=source)


def decode_pcm16(data: bytes, *, source: str = "message") -> np.ndarray:
    """Decodes little-endian PCM16 bytes (a network message) to float32 [n]."""
    if len(data) % 2:
        raise AudioInputError(source, f"malformed PCM16 payload: odd length {len(data)} bytes")
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def frames(samples: np.ndarray, frame_len: int = FRAME_LEN) -> np.ndarray:
    """Splits a clip [n] into frames [T, frame_len], zero-padding the last; T = ceil(n / len)."""
    samples = np.asarray(samples, np.float32).reshape(-1)
    T = -(-samples.shape[0] // frame_len)
    out = np.zeros((T, frame_len), np.float32)
    out.reshape(-1)[: samples.shape[0]] = samples
    return out


# ---------------------------------------------------------------------------------------------
# Writing


def write_wav(path: str | os.PathLike, samples: np.ndarray, rate: int = OUTPUT_RATE) -> None:
    """Writes mono float samples [n] as PCM16, clipping to [-1, 1]. NaN/Inf raise ValueError."""
    samples = np.asarray(samples, np.float32).reshape(-1)
    if not np.isfinite(samples).all():
        raise ValueError(f"{os.fspath(path)}: refusing to write NaN/Inf samples")
    pcm = np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(os.fspath(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
