"""Kept outputs on the writer thread: the cost of one beat's appends, chunked against doubling.

A server that keeps every session's frames in memory (``Server(keep_outputs=True)``: the
benchmarks of ``beat_latency`` and ``capacity``, tests) appends each beat's text, codes and audio
to per-session buffers. Before, those buffers doubled when full, copying everything they held; all
sessions reach a doubling at the same beat when they started together. Now they grow in chunks
(``writer._Growing``). This times, per beat, the appends of all sessions' audio and codes in both
ways, in one run, and prints the p50, p99 and max of a beat's appends and their ratio.

  PYTHONPATH=. python3 experiments/host_jitter/output_buffers.py --sessions=56 --beats=1000
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from voicechat_jax.serving.writer import _Growing

FLAGS = flags.FLAGS
flags.DEFINE_integer("sessions", 56, "Sessions appended to every beat.")
flags.DEFINE_integer("beats", 1000, "Beats (two frames each).")
flags.DEFINE_integer("samples", 3528, "Audio samples per session per beat (22.05 kHz, 160 ms).")


class _Doubling:
    """The buffer before: one array that doubles when full, copying what it holds."""

    def __init__(self, tail, dtype, capacity=64):
        self._buf = np.zeros((capacity, *tail), dtype)
        self.n = 0

    def extend(self, rows):
        need = self.n + rows.shape[0]
        if need > self._buf.shape[0]:
            grown = np.zeros(
                (max(need, 2 * self._buf.shape[0]), *self._buf.shape[1:]), self._buf.dtype
            )
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : need] = rows
        self.n = need


def _beats(kind) -> np.ndarray:
    wav = [kind((), np.float32, capacity=64 * FLAGS.samples // 2) for _ in range(FLAGS.sessions)]
    codes = [kind((8,), np.int32) for _ in range(FLAGS.sessions)]
    audio = np.random.default_rng(0).standard_normal(FLAGS.samples).astype(np.float32)
    frame_codes = np.ones((2, 8), np.int32)
    times = []
    for _ in range(FLAGS.beats):
        t = time.perf_counter()
        for b in range(FLAGS.sessions):
            wav[b].extend(audio)
            codes[b].extend(frame_codes)
        times.append(1e3 * (time.perf_counter() - t))
    return np.asarray(times)


def main(argv):
    del argv
    rows = {name: _beats(kind) for name, kind in (("doubling", _Doubling), ("chunked", _Growing))}
    print(f"{FLAGS.sessions} sessions x {FLAGS.beats} beats, {FLAGS.samples} samples a beat")
    print(f"{'buffer':10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, t in rows.items():
        print(f"{name:10} {np.median(t):8.2f} {np.percentile(t, 99):8.2f} {t.max():8.2f}")
    ratio = rows["doubling"].max() / rows["chunked"].max()
    print(f"max beat: doubling / chunked = {ratio:.1f}x")


if __name__ == "__main__":
    app.run(main)
