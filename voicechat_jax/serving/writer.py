"""A beat's outputs on the host, from pickup to each session's files, without per-frame objects.

- ``HostBeat`` / ``BeatPool``: preallocated NumPy copies of one beat's ``BeatOutput``, reused beat
  after beat. The pickup (the dispatch loop's reader thread, or the resident loop's ``deliver``
  callback) copies the device's arrays into a pooled ``HostBeat`` and hands it on; the server's
  writer thread fans it out to the sessions and gives it back. The pickup therefore does a bounded
  amount of work (a handful of ``np.copyto``) and never waits for the writer.
- ``SessionOutput``: one session's frames kept in memory, in chunked buffers that never copy
  what they hold (tests and short runs; a long-running server keeps none and streams to files).
- ``OutputStream``: one session's beats for a consumer on another thread (the network side):
  bounded, and never blocking the writer (the oldest beats are dropped, and counted, when the
  consumer falls behind).
- ``WavStream``, ``FramesStream``, ``SessionFiles``: each session's ``output.wav`` and
  ``frames.jsonl``, appended beat by beat. The WAV is PCM16 written through the standard
  ``wave`` module, which patches the RIFF and data sizes on every ``writeframes``, after the data;
  the file is unbuffered, so after every beat the file on disk is a valid WAV holding every beat
  appended so far (a crash between the data and the header patch leaves a header that counts one
  beat fewer than the data: still valid). ``frames.jsonl`` gets each beat's lines in one write of
  whole lines. So a crash loses at most the beats not yet written.

No JAX here: this module runs in the writer thread and in the device loop's ``io_callback``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import threading
import wave
import weakref
from collections.abc import Callable

import numpy as np
from absl import logging

PCM16_MAX = 32767.0


def to_pcm16(wav: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Float samples (any shape) -> little-endian PCM16, clipped to [-1, 1] (so +-Inf -> +-1);
    NaN -> 0. Only a beat with a NaN pays for a masked store: on one CPU core a 96-session beat
    (96 x 3,528 samples) takes 0.23 ms, against 0.82 ms through ``np.nan_to_num`` (2026-12-05).
    """
    x = np.clip(np.asarray(wav, np.float32), -1.0, 1.0)  # a new array; NaN stays NaN
    x *= PCM16_MAX
    np.rint(x, out=x)
    nan = np.isnan(x)
    if nan.any():
        x[nan] = 0.0
    if out is None:
        return x.astype("<i2")
    np.copyto(out, x, casting="unsafe")
    return out


# ---------------------------------------------------------------------------------------------
# One beat's outputs on the host


@dataclasses.dataclass
class HostBeat:
    """A beat's outputs as NumPy arrays, slot axis first (the fields of ``state.BeatOutput``)."""

    text: np.ndarray  # [B, T] int32
    function: np.ndarray  # [B, T] int32
    codes: np.ndarray  # [B, T, Q] int32
    wav: np.ndarray  # [B, T * 1764] float32, 22.05 kHz
    transcript: np.ndarray  # [B, T, M] int32, the first n_transcript valid
    n_transcript: np.ndarray  # [B, T] int32
    ran: np.ndarray  # [B] bool
    active: np.ndarray  # [B] bool
    at_cap: np.ndarray  # [B] bool
    reseeded: np.ndarray  # [B] bool: the session rolled over to a fresh context this beat
    frame: np.ndarray  # [B] int32

    @classmethod
    def like(cls, out) -> HostBeat:
        """Zeroed buffers shaped like ``out`` (a ``BeatOutput``; nothing is read from it)."""
        return cls(**{k: np.zeros(v.shape, np.dtype(v.dtype)) for k, v in out.named().items()})

    def fill(self, out) -> None:
        """Copies ``out``'s leaves (NumPy, or anything ``np.asarray`` reads) into these buffers."""
        for name, value in out.named().items():
            np.copyto(getattr(self, name), value)

    def fill_packed(self, words: np.ndarray) -> None:
        """Copies a beat packed by ``state.pack_output`` (its uint32 words, on the host) into
        these buffers, bit for bit."""
        bufs = [getattr(self, f.name) for f in dataclasses.fields(self)]
        if words.shape != (sum(b.size for b in bufs),):
            raise ValueError(
                f"a packed beat of {words.shape} words for {sum(b.size for b in bufs)} values"
            )
        at = 0
        for buf in bufs:
            chunk = words[at : at + buf.size].reshape(buf.shape)
            if buf.dtype == np.bool_:
                np.not_equal(chunk, 0, out=buf)
            else:
                np.copyto(buf, chunk.view(buf.dtype))
            at += buf.size

    @property
    def frames_per_beat(self) -> int:
        return self.text.shape[1]


class BeatPool:
    """Free ``HostBeat`` buffers shared by the pickup (takes) and the writer (gives back).

    ``take`` never blocks: when every buffer is in use (the writer is behind) it allocates a new
    one, counted in ``allocated``; ``give`` keeps at most ``capacity`` free buffers, so memory
    returns to the bound once the writer has caught up.
    """

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._free: queue.SimpleQueue[HostBeat] = queue.SimpleQueue()
        self.allocated = 0

    def take(self, out, packed: np.ndarray | None = None) -> HostBeat:
        """A buffer filled with ``out`` (a ``BeatOutput`` of host arrays), or with ``packed``,
        ``state.pack_output(out)`` on the host (``out`` then gives the shapes only)."""
        try:
            beat = self._free.get_nowait()
        except queue.Empty:
            beat = HostBeat.like(out)
            self.allocated += 1
        if packed is None:
            beat.fill(out)
        else:
            beat.fill_packed(packed)
        return beat

    def give(self, beat: HostBeat) -> None:
        if self._free.qsize() < self.capacity:
            self._free.put(beat)


# ---------------------------------------------------------------------------------------------
# In-memory output


class _Growing:
    """Rows of one dtype and trailing shape, kept in chunks that are never copied on growth.

    Each new chunk holds twice the rows of the last, up to ``_CHUNK_BYTES``; an append copies only
    its own rows, so its cost is bounded however long the session runs (a buffer that doubled,
    copying everything, stalled the writer thread for 0.2 s in one beat at 56 sessions on the
    H200's host: ``experiments/capacity``). ``view`` assembles the rows (for readers after).
    """

    def __init__(self, tail: tuple[int, ...], dtype, capacity: int = 64):
        self._tail = tail
        self._dtype = np.dtype(dtype)
        row_bytes = max(1, self._dtype.itemsize * int(np.prod(tail, dtype=np.int64)))
        self._max_rows = max(capacity, _CHUNK_BYTES // row_bytes)
        self._chunks = [np.zeros((capacity, *tail), dtype)]
        self._used = 0  # rows used in the last chunk
        self.n = 0

    def extend(self, rows: np.ndarray) -> None:
        done = 0
        while done < rows.shape[0]:
            last = self._chunks[-1]
            if self._used == last.shape[0]:
                grow = min(2 * last.shape[0], self._max_rows)  # no chunk exceeds _max_rows
                self._chunks.append(np.zeros((grow, *self._tail), self._dtype))
                self._used, last = 0, self._chunks[-1]
            take = min(rows.shape[0] - done, last.shape[0] - self._used)
            last[self._used : self._used + take] = rows[done : done + take]
            self._used += take
            done += take
        self.n += rows.shape[0]

    def row(self, t: int) -> np.ndarray:
        """Row t, read in its chunk."""
        if not 0 <= t < self.n:
            raise IndexError(f"row {t} of {self.n}")
        for chunk in self._chunks:
            if t < chunk.shape[0]:
                return chunk[t]
            t -= chunk.shape[0]
        raise AssertionError("unreachable: the chunks hold n rows")

    def view(self) -> np.ndarray:
        """Every row so far, [n, *tail] (a new array unless one chunk holds them all)."""
        if len(self._chunks) == 1:
            return self._chunks[0][: self.n]
        full = [*self._chunks[:-1], self._chunks[-1][: self._used]]
        return np.concatenate(full)


_CHUNK_BYTES = 4 << 20  # a chunk stops doubling at 4 MiB


class SessionOutput:
    """What one session produced, frame by frame, in growing NumPy buffers."""

    def __init__(self):
        self.frames = 0  # model frames collected
        self._text: _Growing | None = None
        self._function: _Growing | None = None
        self._codes: _Growing | None = None
        self._wav: _Growing | None = None
        self._transcript: _Growing | None = None
        self._n_transcript: _Growing | None = None

    def append(
        self,
        *,
        text: np.ndarray,
        function: np.ndarray,
        codes: np.ndarray,
        wav: np.ndarray,
        transcript: np.ndarray | None = None,
        n_transcript: np.ndarray | None = None,
    ) -> None:
        """Adds T frames: text, function [T], codes [T, Q], wav [n], transcript [T, M], n [T]."""
        T = text.shape[0]
        if self._text is None:
            self._text = _Growing((), np.int32)
            self._function = _Growing((), np.int32)
            self._codes = _Growing(codes.shape[1:], np.int32)
            self._wav = _Growing((), np.float32, capacity=64 * max(1, wav.shape[0] // max(T, 1)))
            if transcript is not None:
                self._transcript = _Growing(transcript.shape[1:], np.int32)
                self._n_transcript = _Growing((), np.int32)
        self._text.extend(text)
        self._function.extend(function)
        self._codes.extend(codes)
        self._wav.extend(np.asarray(wav, np.float32).reshape(-1))
        if self._transcript is not None and transcript is not None:
            self._transcript.extend(transcript)
            self._n_transcript.extend(n_transcript)
        self.frames += T

    def audio(self) -> np.ndarray:
        """All output audio, float32 [n]."""
        return np.zeros((0,), np.float32) if self._wav is None else self._wav.view().copy()

    def arrays(self) -> dict[str, np.ndarray]:
        """``text``, ``function`` [T] int32, ``codes`` [T, Q] int32, ``wav`` [n] float32 and, when
        collected, ``transcript`` [T, M] with ``n_transcript`` [T]."""
        if self._text is None:
            empty = np.zeros((0,), np.int32)
            return {
                "text": empty,
                "function": empty,
                "codes": np.zeros((0, 0), np.int32),
                "wav": np.zeros((0,), np.float32),
            }
        out = {
            "text": self._text.view().copy(),
            "function": self._function.view().copy(),
            "codes": self._codes.view().copy(),
            "wav": self.audio(),
        }
        if self._transcript is not None:
            out["transcript"] = self._transcript.view().copy()  # [T, M], the first n valid
            out["n_transcript"] = self._n_transcript.view().copy()  # [T]
        return out

    def transcript(self, t: int) -> list[int]:
        """Frame t's RNNT token ids."""
        if self._transcript is None:
            return []
        return [int(x) for x in self._transcript.row(t)[: int(self._n_transcript.row(t))]]


# ---------------------------------------------------------------------------------------------
# A session's output for another thread


@dataclasses.dataclass(frozen=True)
class BeatStamp:
    """When a beat ran, on the beat clock's time source (seconds)."""

    tick: int
    start: float  # the tick's start
    deadline: float
    readable: float  # its outputs were on the host

    @property
    def latency(self) -> float:
        return self.readable - self.start

    @property
    def missed(self) -> bool:
        return self.readable > self.deadline


@dataclasses.dataclass(frozen=True)
class StreamBeat:
    """One session's share of one beat (copies: the pooled ``HostBeat`` is reused)."""

    stamp: BeatStamp
    frame: int  # the session's frame count before this beat (the device's own counter)
    wav: np.ndarray  # [T * 1764] float32, 22.05 kHz
    text: np.ndarray  # [T] int32, the agent's text channel
    function: np.ndarray  # [T] int32, the function-call channel
    transcript: tuple[tuple[int, ...], ...]  # T tuples: each frame's RNNT ids (the caller's words)
    underrun: bool  # this session's input for the beat was incomplete
    rollover: dict | None = None  # the session rolled over in this beat


@dataclasses.dataclass(frozen=True)
class StreamEnd:
    """The session ended: ``reason`` as in the metrics (left, failed, context cap, shutdown)."""

    reason: str
    detail: str


class OutputStream:
    """A bounded FIFO of one session's ``StreamBeat``s, from the writer thread to a consumer.

    ``put`` never blocks: beyond ``capacity`` beats the oldest is dropped and counted in
    ``dropped`` (a consumer that stopped reading costs bounded memory). ``close`` puts the
    ``StreamEnd`` after the last beat; it is never dropped. ``notify`` (no arguments, called on
    the writer thread after each put and at the close, outside the lock) wakes the consumer, e.g.
    ``lambda: loop.call_soon_threadsafe(event.set)``; it must not block.
    """

    def __init__(self, capacity: int = 32, notify: Callable[[], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.notify = notify
        self.dropped = 0
        self.end: StreamEnd | None = None
        self._beats: collections.deque[StreamBeat] = collections.deque()
        self._lock = threading.Lock()

    def put(self, beat: StreamBeat) -> None:
        with self._lock:
            if self.end is not None:
                return
            self._beats.append(beat)
            while len(self._beats) > self.capacity:
                self._beats.popleft()
                self.dropped += 1
        if self.notify is not None:
            self.notify()

    def close(self, reason: str, detail: str) -> None:
        with self._lock:
            if self.end is not None:
                return
            self.end = StreamEnd(reason, detail)
        if self.notify is not None:
            self.notify()

    def drain(self) -> tuple[list[StreamBeat], StreamEnd | None]:
        """The beats queued since the last call, oldest first, and the end once it came (the end
        is returned only with, or after, the last beat)."""
        with self._lock:
            beats = list(self._beats)
            self._beats.clear()
            return beats, self.end

    def __len__(self) -> int:
        with self._lock:
            return len(self._beats)


# ---------------------------------------------------------------------------------------------
# Streamed files


class WavStream:
    """A mono PCM16 WAV file appended to beat by beat, valid after every append.

    A stream that is never closed is closed when it is collected or at interpreter exit, the
    WAV writer before its file (left to the interpreter, the file could go first, and the
    writer's own finaliser then failed on it: "Exception ignored in Wave_write.__del__").
    """

    def __init__(self, path: str | os.PathLike, rate: int):
        self.path = os.fspath(path)
        self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed in close())
        self._wav = wave.open(self._file, "wb")  # noqa: SIM115 (closed in close())
        self._closer = weakref.finalize(self, _close_wav, self._wav, self._file)
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(rate)
        self._wav.writeframes(b"")  # the header, counting 0 frames
        self.samples = 0

    def append(self, pcm: np.ndarray) -> None:
        """Appends PCM16 samples [n] (C-contiguous int16) and patches the header sizes."""
        self._wav.writeframes(memoryview(np.ascontiguousarray(pcm, "<i2")).cast("B"))
        self.samples += pcm.shape[0]

    def close(self) -> None:
        self._closer()  # once: later calls do nothing


def _close_wav(wav: wave.Wave_write, file) -> None:
    wav.close()
    file.close()


def frame_lines(
    first: int,
    text: np.ndarray,
    function: np.ndarray,
    codes: np.ndarray,
    transcript: np.ndarray | None = None,
    n_transcript: np.ndarray | None = None,
    rollover: dict | None = None,
) -> str:
    """``frames.jsonl`` lines for T frames numbered from ``first`` (``json.dumps``'s layout).

    ``rollover``: the session rolled over before these frames; the first line gets a
    ``"rollover"`` key with these fields.
    """
    lines = []
    codes_l = codes.tolist()
    for t in range(text.shape[0]):
        ids = [] if transcript is None else transcript[t, : int(n_transcript[t])].tolist()
        lines.append(
            f'{{"frame": {first + t}, "text": {int(text[t])}, "function": {int(function[t])}, '
            f'"codes": [{", ".join(map(str, codes_l[t]))}], '
            f'"transcript": [{", ".join(map(str, ids))}]'
            + ("" if rollover is None or t else f', "rollover": {json.dumps(rollover)}')
            + "}\n"
        )
    return "".join(lines)


class FramesStream:
    """``frames.jsonl``: each beat's lines appended in one write of whole lines."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed in close())

    def append(self, lines: str) -> None:
        data = memoryview(lines.encode())
        while data:
            data = data[self._file.write(data) :]

    def close(self) -> None:
        self._file.close()


class SessionFiles:
    """One session's directory: ``output.wav`` and ``frames.jsonl`` streamed, and at the end
    ``transcript.txt`` (with a tokenizer: the text channel decoded)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        sample_rate: int,
        tokenizer: Callable[[np.ndarray], str] | None = None,
    ):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.paths = {
            "wav": os.path.join(self.directory, "output.wav"),
            "frames": os.path.join(self.directory, "frames.jsonl"),
        }
        self.wav = WavStream(self.paths["wav"], sample_rate)
        self.frames = FramesStream(self.paths["frames"])
        self.tokenizer = tokenizer
        self._text = _Growing((), np.int32) if tokenizer is not None else None
        self.n_frames = 0

    def append(self, lines: str, pcm: np.ndarray, text: np.ndarray) -> None:
        """One beat: its ``frames.jsonl`` lines, its PCM16 samples, its text tokens [T]."""
        self.frames.append(lines)
        self.wav.append(pcm)
        if self._text is not None:
            self._text.extend(text)
        self.n_frames += text.shape[0]

    def close(self) -> dict[str, str]:
        """Closes the files (headers final); writes ``transcript.txt``; returns the paths."""
        self.wav.close()
        self.frames.close()
        if self.tokenizer is not None:
            self.paths["transcript"] = os.path.join(self.directory, "transcript.txt")
            try:
                text = self.tokenizer(self._text.view())
            except Exception as e:  # a tokenizer bug must not lose the session's other files
                logging.error("%s: transcript not written: %s", self.directory, e)
            else:
                with open(self.paths["transcript"], "w") as f:
                    f.write(text + "\n")
        return dict(self.paths)


class SessionSink:
    """Where one session's frames go: memory (``output``), files (``files``), a consumer on
    another thread (``stream``), or any of them."""

    def __init__(
        self,
        output: SessionOutput | None,
        files: SessionFiles | None,
        stream: OutputStream | None = None,
    ):
        self.output = output
        self.files = files
        self.stream = stream
        self.frames = 0

    def append(
        self,
        beat: HostBeat,
        b: int,
        pcm: np.ndarray | None,
        rollover: dict | None = None,
        *,
        stamp: BeatStamp | None = None,
        underrun: bool = False,
    ) -> None:
        """Slot ``b`` of ``beat`` (``pcm``: that slot's PCM16 row, needed with files;
        ``rollover``: the session rolled over in this beat, marked in ``frames.jsonl``;
        ``stamp`` and ``underrun``: when the beat ran and whether the session's input was
        complete, for the stream)."""
        transcript, n_transcript = beat.transcript[b], beat.n_transcript[b]
        if self.stream is not None and stamp is not None:
            T = beat.frames_per_beat
            self.stream.put(
                StreamBeat(
                    stamp=stamp,
                    frame=int(beat.frame[b]) - T,
                    wav=beat.wav[b].copy(),
                    text=beat.text[b].copy(),
                    function=beat.function[b].copy(),
                    transcript=tuple(
                        tuple(int(x) for x in transcript[t, : int(n_transcript[t])])
                        for t in range(T)
                    ),
                    underrun=underrun,
                    rollover=rollover,
                )
            )
        if self.output is not None:
            self.output.append(
                text=beat.text[b],
                function=beat.function[b],
                codes=beat.codes[b],
                wav=beat.wav[b],
                transcript=transcript,
                n_transcript=n_transcript,
            )
        if self.files is not None:
            lines = frame_lines(
                self.frames,
                beat.text[b],
                beat.function[b],
                beat.codes[b],
                transcript,
                n_transcript,
                rollover,
            )
            self.files.append(lines, pcm, beat.text[b])
        self.frames += beat.frames_per_beat

    def close(self, reason: str = "", detail: str = "") -> dict[str, str]:
        """Closes the files (returns their paths) and the stream (with the session's end)."""
        if self.stream is not None:
            self.stream.close(reason, detail)
        return {} if self.files is None else self.files.close()
