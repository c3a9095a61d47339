"""A serving run: an ``Engine`` (device side) driven on the beat clock by a ``Server`` (host).

``Engine`` (``voicechat_jax.engine``) holds the parameters, the fresh-session template, the slot
state and the compiled tick. ``Server`` owns the clock, the slot table, the per-session input
queues, the metrics and each session's collected output, and drives the engine in one of two loops
with identical outputs:

- ``resident``: one jitted ``lax.while_loop`` for the whole run (``step.resident_loop``); the
  device calls back to the host for each beat's input and hands each beat's output back.
- ``dispatch``: one donated jitted call per beat; a reader thread waits for beat k's output (and
  timestamps it) while the main thread sleeps to beat k+1 and dispatches it.

Sessions come from ``SessionPlan``s (a file's audio, when to join and leave, which beats arrive
late) or from any other source that pushes into ``Server.queues``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Hashable, Sequence

import jax
import numpy as np
from absl import logging

from voicechat_jax import state as state_lib
from voicechat_jax.engine import Engine  # noqa: F401  (re-exported: serving's entry point)
from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving.clock import BeatClock
from voicechat_jax.serving.metrics import MetricsRecorder
from voicechat_jax.serving.sessions import (
    CapacityError,
    InputQueues,
    Session,
    SessionOutput,
    SlotTable,
)

LOOPS = ("resident", "dispatch")


@dataclasses.dataclass
class SessionPlan:
    """A scripted client: its audio, and when it joins and leaves (tick indices)."""

    id: Hashable
    audio: np.ndarray  # [n] float32 at 16 kHz; silence is sent after it ends
    join: int = 0
    leave: int | None = None  # released before this tick; None: stays to the end of the run
    late: frozenset[int] = frozenset()  # beats whose audio arrives one tick late
    vanish: int | None = None  # the client stops sending at this beat of its session (tests)
    source: str = ""


def session_key(seed: int, session_id: Hashable) -> np.ndarray:
    """A session's raw sampling key ([2] uint32) from the run seed and the session's id.

    It depends on nothing else (not the slot, not the order of admission), so a session's speech
    is the same whichever slot it lands in and whoever else is served.
    """
    digest = hashlib.sha256(repr(session_id).encode()).digest()
    return np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")]).generate_state(
        2, np.uint32
    )


class Server:
    """The host side of a serving run; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        *,
        clock: str = "realtime",
        loop: str = "dispatch",
        seed: int = 0,
        warmup_ticks: int = 2,
        metrics_sink=None,
        max_backlog_beats: int | None = 4,
        vanish_beats: int | None = 25,
    ):
        """Args (beyond the engine and the loop):
        vanish_beats: a live session that delivers no audio at all for this many consecutive
          beats (4 s at the default beat) is taken for a vanished client: it fails with that
          message and its slot is freed. None never ends a silent session.
        """
        if loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
        serve = engine.serve
        self.engine = engine
        self.loop = loop
        self.seed = seed
        period = serve.beat_ms / 1000.0
        deadline = None if serve.deadline_ms is None else serve.deadline_ms / 1000.0
        self.clock = BeatClock(period, clock, deadline_s=deadline)
        self.slots = SlotTable(serve.slots)
        self.queues = InputQueues(
            serve.slots, engine.samples_per_beat, max_backlog_beats=max_backlog_beats
        )
        self.metrics = MetricsRecorder(warmup_ticks, sink=metrics_sink)
        self.logs: dict[Hashable, SessionOutput] = {}  # every admitted session's output
        self._records: dict[Hashable, Session] = {}  # kept after release: late beats collect
        self.failures: dict[Hashable, str] = {}
        self.ended: dict[Hashable, str] = {}  # session -> why it ended (left, failed, context cap)
        self._pending_release: dict[int, Hashable] = {}
        self._snapshots: dict[int, tuple[list, list]] = {}  # tick -> slot ids, underrun ids
        self._plans: list[SessionPlan] = []
        self._late_buffer: dict[Hashable, list[np.ndarray]] = {}
        self.vanish_beats = vanish_beats
        self._silent: dict[Hashable, int] = {}  # consecutive beats with no input at all

    # ---- host beat preparation -------------------------------------------------------------

    def _beat_audio(self, plan: SessionPlan, beat: int, joined: int) -> np.ndarray:
        n = self.engine.samples_per_beat
        i = (beat - joined) * n
        chunk = plan.audio[i : i + n]
        if chunk.size < n:
            chunk = np.pad(chunk, (0, n - chunk.size))
        return chunk.astype(np.float32)

    def prepare(self, k: int) -> state_lib.BeatInput:
        """The host's work before tick k: membership changes, client input, the beat's arrays."""
        B = self.engine.serve.slots
        admit = np.zeros((B,), np.bool_)
        release = np.zeros((B,), np.bool_)
        keys = np.zeros((B, 2), np.uint32)
        # Sessions leaving: scripted leaves, failed input, context cap reached.
        leaving = {p.id: "left" for p in self._plans if p.leave == k and p.id in self.logs}
        for sid, reason in self.queues.failed().items():
            leaving[sid] = f"failed: {reason}"
            self.failures[sid] = reason
        for slot, sid in list(self._pending_release.items()):
            leaving.setdefault(sid, "context cap")
            del self._pending_release[slot]
        for sid, reason in leaving.items():
            try:
                session = self.slots.release(sid, tick=k)
            except KeyError:
                continue
            self.queues.close(sid)
            release[session.slot] = True
            self.ended[sid] = reason
        # Sessions joining.
        for plan in self._plans:
            if plan.join != k:
                continue
            try:
                slot = self.slots.admit(plan.id, tick=k, source=plan.source)
            except CapacityError as e:
                self.failures[plan.id] = str(e)
                continue
            self.queues.open(self.slots.session(plan.id))
            admit[slot] = True
            release[slot] = False
            keys[slot] = session_key(self.seed, plan.id)
            session = self.slots.session(plan.id)
            self._records[plan.id] = session
            self.logs[plan.id] = session.output
        for event in self.slots.drain_events():
            self.metrics.record_event(**event)
        # Scripted clients push this beat's audio (late beats arrive with the next one).
        for plan in self._plans:
            if plan.id not in self.logs or self.ended.get(plan.id):
                continue
            try:
                joined = self.slots.session(plan.id).admitted_tick
            except KeyError:
                continue
            if plan.vanish is not None and k - joined >= plan.vanish:
                continue
            chunk = self._beat_audio(plan, k, joined)
            held = self._late_buffer.setdefault(plan.id, [])
            try:
                if (k - joined) in plan.late:
                    held.append(chunk)
                else:
                    for c in [*held, chunk]:
                        self.queues.push(plan.id, c)
                    held.clear()
            except audio_lib.AudioInputError as e:
                logging.warning("session %s failed: %s", plan.id, e)
        live = self.slots.slot_sessions()
        silent = {sid: self.queues.backlog(sid) == 0 for sid in live if sid is not None}
        audio, underrun = self.queues.take_beat(live)
        for sid, nothing in silent.items():
            self._silent[sid] = self._silent.get(sid, 0) + 1 if nothing else 0
            if self.vanish_beats is not None and self._silent[sid] >= self.vanish_beats:
                # Fail it now; the next beat's membership step releases it.
                self.queues.fail(sid, f"client vanished: no audio for {self._silent[sid]} beats")
        self._snapshots[k] = (live, [live[b] for b in range(B) if underrun[b]])
        return self.engine.empty_beat().replace(audio=audio, admit=admit, release=release, key=keys)

    # ---- host output collection ------------------------------------------------------------

    def collect(self, k: int, out, start: float, deadline: float) -> None:
        """Takes beat k's outputs (NumPy leaves) into each session's log and the metrics."""
        readable = time.monotonic()
        live, underruns = self._snapshots.pop(k)
        frames = out.frames
        for b, sid in enumerate(live):
            if sid is None or not out.ran[b]:
                if sid is not None and out.at_cap[b] and self.engine.serve.at_cap == "end":
                    self._pending_release[b] = sid
                continue
            T = frames.text.shape[1]
            self._records[sid].collect(
                T,
                wav=frames.wav[b],
                tokens=np.stack([frames.text[b], frames.function[b]], axis=-1),
                codes=frames.codes[b],
                transcript=[
                    [int(x) for x in frames.transcript[b, t, : int(frames.n_transcript[b, t])]]
                    for t in range(T)
                ],
            )
        self.metrics.record(
            k,
            start,
            readable,
            deadline,
            sessions=[s for s in live if s is not None],
            underrun_sessions=underruns,
        )

    # ---- the two loops ---------------------------------------------------------------------

    def run(self, plans: Sequence[SessionPlan], n_ticks: int) -> dict:
        """Serves ``plans`` for ``n_ticks`` beats; returns the metrics summary."""
        self._plans = list(plans)
        if self.loop == "dispatch":
            self.engine.compile_tick()
            self.metrics.record_compile("tick", self.engine.compile_s)
            self._run_dispatch(n_ticks)
        else:
            self._run_resident(n_ticks)
        return self.metrics.summary()

    def _run_dispatch(self, n_ticks: int) -> None:
        pending: queue.Queue = queue.Queue()

        def reader():
            while (item := pending.get()) is not None:
                k, out, start, deadline = item
                self.collect(k, jax.device_get(out), start, deadline)

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        self.clock.begin()
        last = None
        try:
            for _ in range(n_ticks):
                k = self.clock.next_tick(last)
                if k >= n_ticks:
                    break
                timing = self.clock.wait_for_tick(k)
                self._record_skipped(last, k)
                last = k
                beat = self.prepare(k)
                out = self.engine.tick(beat)
                pending.put((k, out, timing.start, timing.deadline))
                if self.clock.mode == "offline":
                    # Offline ticks run back to back: the next starts when this one is read.
                    jax.block_until_ready(out)
        finally:
            pending.put(None)
            thread.join()

    def _record_skipped(self, last: int | None, k: int) -> None:
        skipped = 0 if last is None else k - last - 1
        for j in range(last + 1 if last is not None else k, k):
            live = [s for s in self.slots.slot_sessions() if s is not None]
            self.metrics.record(j, self.clock.tick_start(j), None, self.clock.deadline(j), live)
        if skipped:
            self.queues.discard_beats(skipped)

    def _run_resident(self, n_ticks: int) -> None:
        timings: dict[int, tuple[float, float]] = {}
        ticks: list[int] = []  # device iteration -> wall tick

        def next_beat(i: int):
            nk = self.clock.next_tick(ticks[-1])
            stop = nk >= n_ticks
            if stop:
                beat = self.engine.empty_beat()
            else:
                timing = self.clock.wait_for_tick(nk)
                self._record_skipped(ticks[-1], nk)
                timings[nk] = (timing.start, timing.deadline)
                ticks.append(nk)
                beat = self.prepare(nk)
            return beat, np.asarray(stop, np.bool_)

        def deliver(i: int, out):
            k = ticks[i]
            self.collect(k, out, *timings.pop(k))

        # Compile before the clock starts, so that compile time is not a late first beat.
        compiled = self.engine.compile_resident(next_beat, deliver)
        self.metrics.record_compile("resident_loop", self.engine.compile_s)
        self.clock.begin()
        timing = self.clock.wait_for_tick(0)
        timings[0] = (timing.start, timing.deadline)
        ticks.append(0)
        self.engine.run_resident(compiled, self.prepare(0))


def write_session_outputs(
    out_dir: str, sid: Hashable, log: SessionOutput, *, sample_rate: int, tokenizer=None
) -> dict[str, str]:
    """Writes ``output.wav``, ``frames.jsonl`` and (with a tokenizer) ``transcript.txt``."""
    d = os.path.join(out_dir, str(sid))
    os.makedirs(d, exist_ok=True)
    arrays = log.arrays()
    paths = {"wav": os.path.join(d, "output.wav"), "frames": os.path.join(d, "frames.jsonl")}
    audio_lib.write_wav(paths["wav"], arrays["wav"], rate=sample_rate)
    with open(paths["frames"], "w") as f:
        for t in range(arrays["text"].shape[0]):
            row = {
                "frame": t,
                "text": int(arrays["text"][t]),
                "function": int(arrays["function"][t]),
                "codes": [int(c) for c in arrays["codes"][t]],
                "transcript": log.transcript[t] if t < len(log.transcript) else [],
            }
            f.write(json.dumps(row) + "\n")
    if tokenizer is not None:
        paths["transcript"] = os.path.join(d, "transcript.txt")
        with open(paths["transcript"], "w") as f:
            f.write(tokenizer(arrays["text"]) + "\n")
    return paths
