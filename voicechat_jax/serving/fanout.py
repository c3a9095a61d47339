"""The output fan-out: each beat's outputs to its sessions' sinks, off the beat thread.

``OutputFanout.main`` is the writer thread of a ``Server``: it takes the messages the beat thread
and the reader send, in beat order (``Beat``: a beat's outputs on the host; ``Skipped``: a tick
the clock or the server skipped; ``Opened`` / ``Ended``: a session's sink opened and closed;
``Event``: a session event for the metrics), and fans each beat's outputs out to every live
session's sink (``writer.SessionSink``: its files, its in-memory output and its network stream),
its conversation memory (the roll-over capsule's source) and the metrics with the beat's host
timeline. The beat path never waits for any of it, except on the offline clock, where a beat
starts once the last one is collected (``await_collected``), as on a server that reads each beat
before the next. Sessions that reach the context cap (``at_cap='end'``) go back to the beat
thread's planner through ``cap_reached``.

It owns ``logs``, ``outputs``, the sinks and the capped set (the writer thread's); ``logs`` and
``outputs`` may be read by any thread once the run is over.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from voicechat_jax import state as state_lib
from voicechat_jax.serving.clock import TickTiming
from voicechat_jax.serving.gc_policy import GcMonitor
from voicechat_jax.serving.metrics import Cause, HostTimeline, MetricsRecorder
from voicechat_jax.serving.sessions import EndedRecords
from voicechat_jax.serving.writer import (
    BeatPool,
    BeatStamp,
    HostBeat,
    OutputStream,
    SessionFiles,
    SessionOutput,
    SessionSink,
    to_pcm16,
)

if TYPE_CHECKING:
    import jax

SHUTDOWN = "shutdown"
_now = time.monotonic  # the beat clock's time source


# ---- messages to the writer thread (in beat order) -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Who was in which slot for a tick, and whose input was incomplete."""

    live: list  # [B] session id or None
    underruns: list
    memories: list | None = None  # [B] each live slot's ConversationMemory (roll-over modes)
    rollovers: dict | None = None  # slot -> the roll-over applied in this beat


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """Beat thread -> reader (dispatch loop): a beat whose output is on its way."""

    tick: int
    timing: TickTiming
    prepared: float
    dispatched: float
    out: state_lib.BeatOutput  # on the device: its shapes size a new host buffer
    packed: jax.Array  # ``Engine.pack(out)``, on its way to the host
    snapshot: Snapshot


@dataclasses.dataclass(frozen=True)
class Beat:
    """A beat's outputs on the host."""

    tick: int
    timing: TickTiming
    snapshot: Snapshot
    beat: HostBeat
    prepared: float
    dispatched: float | None
    reader_began: float | None
    ready: float
    readable: float


@dataclasses.dataclass(frozen=True)
class Skipped:
    tick: int
    start: float
    deadline: float
    live: list
    cause: Cause | None = None  # known at the skip (the device behind); else the metrics decide


@dataclasses.dataclass(frozen=True)
class Opened:
    session: Hashable
    stream: OutputStream | None = None
    record: bool = True


@dataclasses.dataclass(frozen=True)
class Ended:
    session: Hashable
    reason: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Event:
    fields: dict


STOP = object()


class Retained(EndedRecords):
    """Live entries always kept; at most ``limit`` retired ones (the oldest dropped first)."""

    def __init__(self, limit: int):
        super().__init__(limit)
        self._live: dict = {}

    def __setitem__(self, key, value) -> None:
        self._d.pop(key, None)
        self._live[key] = value

    def retire(self, key) -> None:
        if key in self._live:
            EndedRecords.__setitem__(self, key, self._live.pop(key))

    def __getitem__(self, key):
        return self._live[key] if key in self._live else self._d[key]

    def __delitem__(self, key) -> None:
        if key in self._live:
            del self._live[key]
        else:
            del self._d[key]

    def __iter__(self):
        yield from self._live
        yield from self._d

    def __len__(self) -> int:
        return len(self._live) + len(self._d)


class OutputFanout:
    """The writer thread's work; see the module docstring.

    Args:
      sample_rate: the output audio's rate (the codec's).
      context_frames: the context cap, for the log line of a session that ends at it.
      cap_ends: the engine ends a session at the context cap (``at_cap='end'``): such a session
        is handed to ``cap_reached`` once, for the planner to release.
      output_dir, keep_outputs, tokenizer, max_ended: as ``ServerConfig`` / ``Server``.
      on_fail: called with the exception if the thread fails (the server then stops).
    """

    def __init__(
        self,
        *,
        metrics: MetricsRecorder,
        gc_monitor: GcMonitor,
        pool: BeatPool,
        sample_rate: int,
        context_frames: int,
        cap_ends: bool,
        cap_reached: queue.SimpleQueue,
        output_dir: str | None,
        keep_outputs: bool,
        tokenizer: Callable[[np.ndarray], str] | None,
        max_ended: int,
        on_fail: Callable[[BaseException], None],
    ):
        self.metrics = metrics
        self.gc_monitor = gc_monitor
        self.pool = pool
        self.sample_rate = sample_rate
        self.context_frames = context_frames
        self.cap_ends = cap_ends
        self.cap_reached = cap_reached
        self.output_dir = output_dir
        self.keep_outputs = keep_outputs
        self.tokenizer = tokenizer
        self.on_fail = on_fail
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.logs = Retained(max_ended)  # session -> SessionOutput (keep_outputs)
        self.outputs = Retained(max_ended)  # session -> {"wav": path, "frames": path, ...}
        self._sinks: dict[Hashable, SessionSink] = {}
        self._capped: set[Hashable] = set()
        self._pcm: np.ndarray | None = None
        self._collected = threading.Condition()  # offline: the beat thread waits for the writer
        self.collected_through = -1

    def retained(self) -> dict[str, int]:
        return {
            "logs": len(self.logs),
            "outputs": len(self.outputs),
            "sinks": len(self._sinks),
            "capped": len(self._capped),
        }

    def main(self) -> None:
        """The writer thread: every message of ``inbox`` until ``STOP``."""
        try:
            while (msg := self.inbox.get()) is not STOP:
                self.metrics.record_gc(self.gc_monitor.drain())
                if isinstance(msg, Beat):
                    self._collect(msg)
                elif isinstance(msg, Skipped):
                    self.metrics.record(
                        msg.tick, msg.start, None, msg.deadline, msg.live, cause=msg.cause
                    )
                elif isinstance(msg, Event):
                    self.metrics.record_event(**msg.fields)
                    if msg.fields["event"] == "ended":
                        self._log_end(**msg.fields)
                elif isinstance(msg, Opened):
                    self._open_sink(msg.session, msg.stream, msg.record)
                elif isinstance(msg, Ended):
                    self._close_sink(msg.session, msg.reason, msg.detail)
        except BaseException as e:
            logging.exception("the output writer failed")
            self.on_fail(e)
        finally:
            with self._collected:
                self.collected_through = 1 << 62
                self._collected.notify_all()
            for sid in list(self._sinks):
                self._close_sink(sid, SHUTDOWN, "the server stopped")
            self.metrics.record_gc(self.gc_monitor.drain())

    def await_collected(self, k: int) -> None:
        """Beat k's outputs are in the sessions (the offline clock: so that a context cap it
        reached ends the session before the next beat)."""
        with self._collected:
            self._collected.wait_for(lambda: self.collected_through >= k)

    def _log_end(self, *, session: Hashable, reason: str, tick: int, **_) -> None:
        if reason == "context cap":
            cap = self.context_frames
            logging.info(
                "session %s ended at the context cap (%d frames) at tick %d", session, cap, tick
            )
        elif reason == SHUTDOWN:
            logging.info("session %s ended: server shutdown at tick %d", session, tick)
        else:
            logging.info("session %s ended (%s) at tick %d", session, reason, tick)

    def _open_sink(self, sid: Hashable, stream: OutputStream | None, record: bool) -> None:
        files = None
        if self.output_dir is not None and record:
            files = SessionFiles(
                os.path.join(self.output_dir, str(sid)),
                sample_rate=self.sample_rate,
                tokenizer=self.tokenizer,
            )
            self.outputs[sid] = dict(files.paths)
        output = SessionOutput() if self.keep_outputs else None
        if output is not None:
            self.logs[sid] = output
        self._sinks[sid] = SessionSink(output, files, stream)

    def _close_sink(self, sid: Hashable, reason: str, detail: str) -> None:
        sink = self._sinks.pop(sid, None)
        self._capped.discard(sid)
        if sink is None:
            return
        paths = sink.close(reason, detail)
        if paths:
            self.outputs[sid] = paths
            self.outputs.retire(sid)
        if sid in self.logs:
            self.logs.retire(sid)

    def _collect(self, msg: Beat) -> None:
        """A beat's outputs into each live session's sink, then its tick record."""
        t0 = _now()
        beat = msg.beat
        pcm = None
        if self.output_dir is not None:
            if self._pcm is None or self._pcm.shape != beat.wav.shape:
                self._pcm = np.zeros(beat.wav.shape, "<i2")
            pcm = to_pcm16(beat.wav, out=self._pcm)
        stamp = BeatStamp(msg.tick, msg.timing.start, msg.timing.deadline, msg.readable)
        underran = set(msg.snapshot.underruns)
        live = msg.snapshot.live
        memories = msg.snapshot.memories
        applied = msg.snapshot.rollovers or {}
        for b, sid in enumerate(live):
            if sid is None:
                continue
            rollover = None
            if beat.reseeded[b]:
                # The host's roll-over, or the device's at the cap (``at_cap='rollover'``).
                rollover = applied.get(b, {"reason": "cap", "capsule_len": 0})
                self.metrics.record_event(
                    "rollover", session=sid, tick=msg.tick, frame=int(beat.frame[b]), **rollover
                )
                logging.info("session %s rolled over at tick %d: %s", sid, msg.tick, rollover)
            if beat.ran[b]:
                sink = self._sinks.get(sid)
                if sink is not None:
                    pcm_b = None if pcm is None else pcm[b]
                    sink.append(beat, b, pcm_b, rollover, stamp=stamp, underrun=sid in underran)
                memory = None if memories is None else memories[b]
                if memory is not None:
                    memory.observe(beat.text[b], beat.transcript[b], beat.n_transcript[b])
            elif beat.at_cap[b] and self.cap_ends and sid not in self._capped:
                self._capped.add(sid)
                self.cap_reached.put(sid)
        self.pool.give(beat)
        timing = msg.timing
        self.metrics.record(
            msg.tick,
            timing.start,
            msg.readable,
            timing.deadline,
            sessions=[s for s in live if s is not None],
            underrun_sessions=msg.snapshot.underruns,
            timeline=HostTimeline(
                woke=timing.began,
                prepared=msg.prepared,
                dispatched=msg.dispatched,
                ready=msg.ready,
                readable=msg.readable,
                reader_began=msg.reader_began,
                collect_s=_now() - t0,
            ),
        )
        with self._collected:
            self.collected_through = msg.tick
            self._collected.notify_all()
