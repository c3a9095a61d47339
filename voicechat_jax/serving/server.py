"""A serving run: an ``Engine`` (device side) driven on the beat clock by a ``Server`` (host).

``Engine`` (``voicechat_jax.engine``) holds the parameters, the fresh-session template, the slot
state and the compiled tick. ``Server`` owns the clock, the slot table, the per-session input
queues, the metrics and each session's output, and drives the engine in one of two loops with
identical outputs:

- ``resident``: one jitted ``lax.while_loop`` for the whole run (``step.resident_loop``); the
  device calls back to the host for each beat's input (``_next_beat``: the clock's wait and the
  beat's preparation) and hands each beat's output back (``_deliver``: a copy into a pooled host
  buffer and a queue put, nothing else).
- ``dispatch``: one donated jitted call per beat; a reader thread waits for beat k's output (and
  timestamps it) while the beat thread sleeps to beat k+1 and dispatches it.

Either way, a writer thread takes each beat's outputs off the beat path: into each session's
files (``writer.SessionFiles``: ``output.wav`` and ``frames.jsonl`` streamed beat by beat) and/or
memory (``writer.SessionOutput``), and into the metrics with the beat's host timeline. The beat
path itself (clock, input, the tick) touches JAX only to dispatch the tick; garbage collection runs
in the beat's slack (``gc_policy.GcPolicy``); every container that grows with uptime is bounded.

Sessions come from sources (``hub.SessionSource``), asked at every beat who leaves and who joins:
the ``SessionPlan``s given to ``run`` (a file's audio, when to join and leave, which beats arrive
late) and ``Server.hub``, the thread-safe front for any other source (admit, release, push audio;
each session's output to a bounded ``writer.OutputStream`` the caller drains: ``serving.net``).
``request_stop`` (any thread) drains the server: no new admission, the beat in flight is finished
and written, every live session ends with a ``shutdown`` event and its files are closed.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
from absl import logging

from voicechat_jax import state as state_lib
from voicechat_jax.engine import Engine
from voicechat_jax.serving.clock import OFFLINE, BeatClock, TickTiming
from voicechat_jax.serving.gc_policy import GcMonitor, GcPolicy
from voicechat_jax.serving.hub import (
    CLIENT_ERROR,
    Join,
    ScriptedSessions,
    SessionHub,
    SessionPlan,
    SessionSource,
)
from voicechat_jax.serving.memory import (
    ConversationMemory,
    MemoryConfig,
    RolloverPolicy,
    TextTokenizer,
    build_capsule,
)
from voicechat_jax.serving.metrics import Cause, HostTimeline, MetricsRecorder
from voicechat_jax.serving.scheduler import Lockstep, Scheduler, retarget
from voicechat_jax.serving.sessions import (
    CapacityError,
    EndedRecords,
    InputQueues,
    SlotTable,
)
from voicechat_jax.serving.writer import (
    BeatPool,
    BeatStamp,
    HostBeat,
    OutputStream,
    SessionFiles,
    SessionOutput,
    SessionSink,
    frame_lines,
    to_pcm16,
)

LOOPS = ("resident", "dispatch")
SHUTDOWN = "shutdown"
_now = time.monotonic  # the beat clock's time source


def session_key(seed: int, session_id: Hashable) -> np.ndarray:
    """A session's raw sampling key ([2] uint32) from the run seed and the session's id.

    It depends on nothing else (not the slot, not the order of admission), so a session's speech
    is the same whichever slot it lands in and whoever else is served.
    """
    digest = hashlib.sha256(repr(session_id).encode()).digest()
    return np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")]).generate_state(
        2, np.uint32
    )


# ---- messages to the writer thread (in beat order) -------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """Who was in which slot for a tick, and whose input was incomplete."""

    live: list  # [B] session id or None
    underruns: list
    memories: list | None = None  # [B] each live slot's ConversationMemory (roll-over modes)
    rollovers: dict | None = None  # slot -> the roll-over the host asked for this beat


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """Beat thread -> reader (dispatch loop): a beat whose output is on its way."""

    tick: int
    timing: TickTiming
    prepared: float
    dispatched: float
    out: state_lib.BeatOutput
    snapshot: _Snapshot


@dataclasses.dataclass(frozen=True)
class _Beat:
    """A beat's outputs on the host."""

    tick: int
    timing: TickTiming
    snapshot: _Snapshot
    beat: HostBeat
    prepared: float
    dispatched: float | None
    reader_began: float | None
    ready: float
    readable: float


@dataclasses.dataclass(frozen=True)
class _Skipped:
    tick: int
    start: float
    deadline: float
    live: list
    cause: Cause | None = None  # known at the skip (the device behind); else the metrics decide


@dataclasses.dataclass(frozen=True)
class _Opened:
    session: Hashable
    stream: OutputStream | None = None
    record: bool = True


@dataclasses.dataclass(frozen=True)
class _Ended:
    session: Hashable
    reason: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class _Event:
    fields: dict


_STOP = object()


class Server:
    """The host side of a serving run; see the module docstring.

    Args (beyond the engine and the loop):
      vanish_beats: a live session that delivers no audio at all for this many consecutive
        beats (4 s at the default beat) is taken for a vanished client: it fails with that
        message and its slot is freed. None never ends a silent session.
      gc_policy: ``"slack"`` (collections only in a beat's slack) or ``"default"`` (Python's
        automatic collector, as before the policy existed; for comparison).
      output_dir: stream each session's ``output.wav`` and ``frames.jsonl`` into
        ``output_dir/<session id>/`` as the run goes (None: no files).
      keep_outputs: also keep every session's frames in memory (``logs``); for tests and short
        runs, since it grows with the frames served.
      tokenizer: with ``output_dir``, writes each session's ``transcript.txt`` when it ends.
      max_ended: records of sessions that ended (``logs``, ``outputs``, ``failures``, ``ended``)
        kept; older ones are dropped (their counts stay in the metrics).
      stop_event: an event that, once set, drains the server (as ``request_stop``).
      max_inflight: dispatch loop, real-time clock: a tick that comes due while this many earlier
        beats are still on the device is skipped (a device-caused miss) rather than queued, so
        that a device slower than the beat cannot make the latency grow without bound.
      rollover: when sessions roll over (``memory.RolloverPolicy``); default: the engine's
        ``ServeConfig.at_cap`` with the default thresholds scaled to its context cap. In the
        ``reset`` and ``memory`` modes the host rolls sessions over (``prepare``), each with a
        ``ConversationMemory`` fed by the writer thread; every roll-over (the host's or the
        device's fallback at the cap) is a ``rollover`` event in the metrics and marks the
        session's ``frames.jsonl``.
      memory: how the conversation memory splits and bounds turns.
      llm_tokenizer: the LLM's text tokenizer (encode and decode), for a capsule in text with
        ``User:`` / ``Agent:`` turns and the directive; None: the agent's raw ids only.
      asr_decode: the RNNT head's ids -> text, so the caller's turns can enter the capsule
        (re-tokenized by ``llm_tokenizer``); None: the caller's turns are left out.
      scheduler: the batching policy (``scheduler.Scheduler``): admission, which slots run, which
        compiled bucket; default ``Lockstep`` (every slot, every beat). Used by the beat thread.
      on_ready: called once the tick is compiled and warmed, before the first beat (the beat
        thread; the runner logs the time to ready).

    A session of ``hub`` (a network client) that fails ends as ``CLIENT_ERROR``, not
    ``failed``: a client that vanished, stalled or sent what the protocol refuses is no failure of
    the server (``failed_sessions`` and ``failures`` hold the server's own sessions only).

    Threads, and what each one owns (every other field is set in ``__init__`` and then only read):

    - the *beat thread* runs ``prepare`` and the clock's waits, one beat at a time: the caller of
      ``run`` in the dispatch loop; the device loop's callback thread in the resident loop (with the
      first beat on the caller's thread before the loop starts). It owns ``failures``, ``ended``,
      ``failed_sessions``, ``_scripted``, ``_owner``, ``_silent``, ``_last``, ``_snapshot``,
      ``scheduler``, ``_waiting`` and, in the resident loop, ``_inflight`` (``_next_beat`` and
      ``_deliver`` run one at a time, in order: the device waits for each).
    - the *reader thread* (dispatch loop) owns nothing: it forwards messages in order.
    - the *writer thread* owns ``logs``, ``outputs``, ``_sinks``, ``_capped``, ``_pcm`` and the
      consuming end of the GC monitor.
    - shared, and safe by construction: ``slots``, ``queues`` and ``hub`` (each behind its own
      lock; any thread may admit, release and push client audio), ``metrics`` (one lock),
      ``pool``, ``_to_reader``, ``_to_writer`` and ``_cap_reached`` (``queue.SimpleQueue``: the
      writer tells the beat thread which sessions reached the context cap), ``_stop`` (an
      ``Event``), ``_picked_through`` (behind the ``_picked`` condition), ``_error`` (set once, by
      whichever thread fails first).

    ``logs``, ``outputs``, ``failures`` and ``ended`` may be read by any thread once ``run`` has
    returned.
    """

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
        gc_policy: str = "slack",
        output_dir: str | os.PathLike | None = None,
        keep_outputs: bool = True,
        tokenizer: Callable[[np.ndarray], str] | None = None,
        max_ended: int = 1024,
        metrics_window: int = 1 << 16,
        max_inflight: int = 2,
        stop_event: threading.Event | None = None,
        rollover: RolloverPolicy | None = None,
        memory: MemoryConfig | None = None,
        llm_tokenizer: TextTokenizer | None = None,
        asr_decode: Callable[[Sequence[int]], str] | None = None,
        scheduler: Scheduler | None = None,
        on_ready: Callable[[], None] | None = None,
    ):
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
        self.metrics = MetricsRecorder(
            warmup_ticks,
            sink=metrics_sink,
            period_s=period,
            beat_waits_for_device=loop == "resident",
            window=metrics_window,
            max_sessions=max_ended,
        )
        self.gc_monitor = GcMonitor()
        self.gc = GcPolicy(gc_policy, monitor=self.gc_monitor)
        self.output_dir = None if output_dir is None else os.fspath(output_dir)
        self.keep_outputs = keep_outputs
        self.tokenizer = tokenizer
        self.vanish_beats = vanish_beats
        self.max_inflight = max_inflight
        self.pool = BeatPool()
        self.rollover = rollover or RolloverPolicy.for_cap(
            serve.at_cap,
            serve.context_frames,
            serve.frames_per_tick,
            capsule_tokens=serve.capsule_tokens,
        )
        if self.rollover.host_rolls and serve.at_cap not in ("rollover", self.rollover.mode):
            raise ValueError(
                f"rollover mode {self.rollover.mode!r} needs an engine whose at_cap re-seeds at "
                f"the cap as a fallback (reset|memory|rollover), not {serve.at_cap!r}"
            )
        if self.rollover.capsule_limit > serve.capsule_tokens:
            raise ValueError("the capsule limit is above the device's capsule room")
        self.memory_config = memory or MemoryConfig()
        self.llm_tokenizer = llm_tokenizer
        self.asr_decode = asr_decode
        self.rollovers = 0  # roll-overs the host asked for (beat thread)
        self.scheduler = scheduler or Lockstep()
        if self.scheduler.buckets and self.scheduler.buckets != engine.buckets:
            raise ValueError(f"scheduler buckets {self.scheduler.buckets} need a BucketEngine")
        self._waiting: list[tuple[SessionSource, list[Join]]] = []  # joins the scheduler holds
        self._stop = stop_event or threading.Event()
        self._error: BaseException | None = None
        self._on_ready = on_ready
        # Beat thread.
        self.failures = EndedRecords(max_ended)  # session -> why it failed or was refused
        self.ended = EndedRecords(max_ended)  # session -> why it ended before the run did
        self.failed_sessions = 0  # sessions that failed (bad input, vanished); not refusals
        self.hub = SessionHub(self.queues)
        self._scripted = ScriptedSessions(samples_per_beat=engine.samples_per_beat)
        self._owner: dict[Hashable, SessionSource] = {}  # live session -> the source it came from
        self._silent: dict[Hashable, int] = {}  # consecutive beats with no input at all
        self._last: int | None = None
        self._snapshot: _Snapshot | None = None
        self._inflight: dict[int, tuple] = {}  # resident: device iteration -> the beat's stamps
        self._context: dict[Hashable, int] = {}  # LLM context frames after the beat prepared last
        self._memories: dict[Hashable, ConversationMemory] = {}
        # Roll-overs asked this beat, applied next beat: session -> their fields and capsule.
        self._rolling: dict[Hashable, dict] = {}
        self._n_ticks = 0
        # Writer thread.
        self.logs = _Retained(max_ended)  # session -> SessionOutput (keep_outputs)
        self.outputs = _Retained(max_ended)  # session -> {"wav": path, "frames": path, ...}
        self._sinks: dict[Hashable, SessionSink] = {}
        self._capped: set[Hashable] = set()
        self._pcm: np.ndarray | None = None
        # Channels.
        self._to_reader: queue.SimpleQueue = queue.SimpleQueue()
        self._to_writer: queue.SimpleQueue = queue.SimpleQueue()
        self._cap_reached: queue.SimpleQueue = queue.SimpleQueue()
        self._picked = threading.Condition()
        self._picked_through = -1
        self._collected = threading.Condition()  # offline: the beat thread waits for the writer
        self._collected_through = -1

    # ---- control -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Drains the server at the next beat boundary (any thread; see the module docstring)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def retained(self) -> dict[str, int]:
        """Sizes of every container that could grow with uptime (the tests hold them flat)."""
        return {
            "logs": len(self.logs),
            "outputs": len(self.outputs),
            "failures": len(self.failures),
            "ended": len(self.ended),
            **self._scripted.retained(),
            **self.hub.retained(),
            "owners": len(self._owner),
            "silent": len(self._silent),
            "inflight": len(self._inflight),
            "context": len(self._context),
            "rolling": len(self._rolling),
            "memories": len(self._memories),
            "sinks": len(self._sinks),
            "capped": len(self._capped),
            "pool_allocated": self.pool.allocated,
            **{f"metrics_{k}": v for k, v in self.metrics.retained().items()},
        }

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._stop.set()

    def _send(self, msg) -> None:
        """To the writer, after every beat already dispatched (the reader forwards in order)."""
        (self._to_reader if self.loop == "dispatch" else self._to_writer).put(msg)

    # ---- host beat preparation (beat thread) -------------------------------------------------

    def _load(self, plans: Sequence[SessionPlan]) -> None:
        self._scripted = ScriptedSessions(plans, samples_per_beat=self.engine.samples_per_beat)

    @property
    def _sources(self) -> tuple[SessionSource, ...]:
        return (self._scripted, self.hub)

    def _end(self, sid: Hashable, why: str, detail: str, tick: int) -> None:
        """Bookkeeping for a session whose slot was just released (beat thread)."""
        self.ended[sid] = detail
        owner = self._owner.pop(sid, None)
        if why == "failed" and owner is self.hub:
            why = CLIENT_ERROR  # the client's doing (bad audio, vanished), not the server's
            self.failures.pop(sid, None)
        if owner is not None:
            owner.ended(sid, why, detail, tick)
        self._silent.pop(sid, None)
        self._context.pop(sid, None)
        self._rolling.pop(sid, None)
        self._memories.pop(sid, None)
        if why == "failed":
            self.failed_sessions += 1
            if sid not in self.failures:  # failed by its source (a scripted session's file)
                self.failures[sid] = detail
            self._send(_Event({"event": "failed", "session": sid, "tick": tick, "message": detail}))
        # Logged by the writer thread: a log line can block (a full stderr pipe), the beat cannot.
        self._send(_Event({"event": "ended", "session": sid, "reason": why, "tick": tick}))
        self._send(_Ended(sid, why, detail))

    def prepare(self, k: int) -> state_lib.BeatInput:
        """The host's work before tick k: membership changes, client input, the beat's arrays."""
        B = self.engine.serve.slots
        admit = np.zeros((B,), np.bool_)
        release = np.zeros((B,), np.bool_)
        keys = np.zeros((B, 2), np.uint32)
        # Sessions leaving: their sources' leaves, failed input, context cap reached.
        leaving: dict[Hashable, tuple[str, str]] = {}
        for source in self._sources:
            for leave in source.leaves(k):
                leaving[leave.id] = (leave.why, leave.detail)
        for sid, reason in self.queues.failed().items():
            leaving[sid] = ("failed", f"failed: {reason}")
            self.failures[sid] = reason
        while True:
            try:
                sid = self._cap_reached.get_nowait()
            except queue.Empty:
                break
            leaving.setdefault(sid, ("context cap", "context cap"))
        for sid, (why, detail) in leaving.items():
            try:
                session = self.slots.release(sid, tick=k)
            except KeyError:
                continue
            self.queues.close(sid)
            release[session.slot] = True
            self._end(sid, why, detail, k)
        # Sessions joining; those the scheduler makes wait are asked again next beat, first.
        waiting, self._waiting = self._waiting, []
        for source, joins in [*waiting, *((s, s.joins(k)) for s in self._sources)]:
            for join in joins:
                try:
                    if join.id in leaving:  # it left while it waited
                        self.scheduler.withdraw(join.id)
                        raise CapacityError(f"session {join.id} left while waiting for a slot")
                    slot = self.scheduler.admit(self.slots, join.id, tick=k, source=join.source)
                except CapacityError as e:
                    self.failures[join.id] = str(e)
                    source.refused(join, e, k)
                    continue
                if slot is None:
                    self._waiting.append((source, [join]))
                    continue
                self.queues.open(self.slots.session(join.id))
                admit[slot] = True
                release[slot] = False
                keys[slot] = session_key(self.seed, join.id)
                self._owner[join.id] = source
                self._context[join.id] = 0
                if self.rollover.host_rolls:
                    self._memories[join.id] = ConversationMemory(self.memory_config)
                source.admitted(join, slot, k)
                self._send(_Opened(join.id, join.stream, join.record))
        for event in self.slots.drain_events():
            self._send(_Event(event))
        # Sources fed in step with the beat push its audio (scripted: a late beat comes next).
        for source in self._sources:
            source.feed(k, self.queues)
        schedule = self.scheduler.plan(k, self.slots, self.queues)  # moves sessions, if any
        self.engine.place(schedule)  # a BucketEngine moves the state into the beat's bucket
        retarget(schedule.moves, admit, release, keys)
        live = self.slots.slot_sessions()
        silent = {sid: self.queues.backlog(sid) == 0 for sid in live if sid is not None}
        audio, underrun = self.queues.take_beat(schedule.running(live))  # held: input kept
        for sid, nothing in silent.items():
            self._silent[sid] = self._silent.get(sid, 0) + 1 if nothing else 0
            if self.vanish_beats is not None and self._silent[sid] >= self.vanish_beats:
                # Fail it now; the next beat's membership step releases it.
                self.queues.fail(sid, f"client vanished: no audio for {self._silent[sid]} beats")
        beat = self.engine.empty_beat().replace(audio=audio, admit=admit, release=release, key=keys)
        beat.run[:] = schedule.run
        rollovers = self._roll_over(k, live, beat)
        memories = [None if sid is None else self._memories.get(sid) for sid in live]
        self._snapshot = _Snapshot(
            live, [live[b] for b in range(B) if underrun[b]], memories, rollovers
        )
        return beat

    def _roll_over(self, k: int, live: list, beat: state_lib.BeatInput) -> dict[int, dict]:
        """Sets ``beat``'s roll-overs by the policy; counts each live session's LLM context frames
        through this beat. Returns slot -> the fields of the roll-overs applied in this beat.

        A roll-over is asked a beat ahead: the policy's choice in beat k goes in beat k's
        ``prefill`` with its capsule (the engine prefills it after tick k, in the beat's slack,
        where it can) and in beat k + 1's ``reseed`` (applied before tick k + 1), so that its
        prefill need not lengthen a beat. The session runs beat k on its old context.

        The count is the device's own: every live slot runs ``fpt`` frames each beat it is not
        held in (a held one is not rolled over), and a re-seeded one starts again from its capsule.
        """
        fpt = self.engine.serve.frames_per_tick
        policy = self.rollover
        slot_of = {sid: b for b, sid in enumerate(live) if sid is not None}
        applied: dict[int, dict] = {}
        for sid, asked in self._rolling.items():  # asked last beat (a session that left is gone)
            b = slot_of[sid]
            capsule = asked.pop("capsule")
            n = capsule.shape[0]
            beat.reseed[b] = True
            beat.capsule[b, :n] = capsule
            beat.capsule_len[b] = n
            applied[b] = asked
            self._context[sid] = n
        self._rolling = {}
        running = []  # (slot, context, silent frames) of the sessions that run this beat
        for b, sid in enumerate(live):
            if sid is None or not beat.run[b] or b in applied:
                continue
            memory = self._memories.get(sid)
            silent = 0 if memory is None else memory.silent_frames()
            running.append((b, self._context.get(sid, 0), silent))
        for b, reason in policy.plan(running):
            sid = live[b]
            memory = self._memories.get(sid)
            capsule = np.zeros((0,), np.int32)
            if policy.capsule_limit and memory is not None:
                capsule = build_capsule(
                    memory.turns(),
                    policy.capsule_limit,
                    llm_tokenizer=self.llm_tokenizer,
                    asr_decode=self.asr_decode,
                )
            n = capsule.shape[0]
            beat.prefill[b] = True
            beat.capsule[b, :n] = capsule
            beat.capsule_len[b] = n
            self._rolling[sid] = {
                "reason": reason,
                "context": self._context.get(sid, 0) + fpt,  # at the roll-over, a beat later
                "capsule_len": n,
                "capsule": capsule,
            }
            self.rollovers += 1
        for b, sid in enumerate(live):
            if sid is not None and beat.run[b]:
                self._context[sid] = self._context.get(sid, 0) + fpt
        return applied

    def _wait_for(self, k: int, last: int | None) -> TickTiming:
        """Collects garbage in the slack before tick k if there is any, then waits for k.

        ``last``: the last tick whose beat went to the device (None: none yet).
        """
        if self.clock.mode == OFFLINE:
            self.gc.in_slack(math.inf)
            return self.clock.wait_for_tick(k)
        start = self.clock.tick_start(k)
        on_host = True
        if self.loop == "dispatch" and last is not None:
            # The slack begins when the last beat's output is on the host: a collection before
            # that would hold the GIL while the reader wants it.
            with self._picked:
                on_host = self._picked.wait_for(
                    lambda: self._picked_through >= last,
                    timeout=max(0.0, start - _now() - self.gc.margin_s),
                )
        # A beat whose output came back too late to leave any slack offers none: a due collection
        # is deferred (and counted), never run over the next beat.
        self.gc.in_slack(start - _now() if on_host else 0.0)
        return self.clock.wait_for_tick(k)

    def _skipped(self, last: int | None, k: int) -> None:
        """Ticks the clock skipped between ``last`` and ``k``: their input goes, they are missed."""
        if last is None or k == last + 1:
            return
        live = [s for s in self.slots.slot_sessions() if s is not None]
        for j in range(last + 1, k):
            self._send(_Skipped(j, self.clock.tick_start(j), self.clock.deadline(j), live))
        self.queues.discard_beats(k - last - 1)

    def _end_live_sessions(self, tick: int) -> None:
        """On a stop request: every live session ends with a ``shutdown`` event (beat thread).
        At any end, sessions still waiting for a slot are refused."""
        for source, joins in self._waiting:
            for join in joins:
                source.refused(join, CapacityError(f"server stopped: {join.id} refused"), tick)
        self._waiting.clear()
        if not self._stop.is_set():
            return
        for session in self.slots.sessions():
            self.slots.release(session.id, tick=tick)
            self.queues.close(session.id)
            self._end(session.id, SHUTDOWN, SHUTDOWN, tick)
        for event in self.slots.drain_events():
            self._send(_Event(event))

    # ---- the writer thread -------------------------------------------------------------------

    def _writer_main(self) -> None:
        try:
            while (msg := self._to_writer.get()) is not _STOP:
                self.metrics.record_gc(self.gc_monitor.drain())
                if isinstance(msg, _Beat):
                    self._collect(msg)
                elif isinstance(msg, _Skipped):
                    self.metrics.record(
                        msg.tick, msg.start, None, msg.deadline, msg.live, cause=msg.cause
                    )
                elif isinstance(msg, _Event):
                    self.metrics.record_event(**msg.fields)
                    if msg.fields["event"] == "ended":
                        self._log_end(**msg.fields)
                elif isinstance(msg, _Opened):
                    self._open_sink(msg.session, msg.stream, msg.record)
                elif isinstance(msg, _Ended):
                    self._close_sink(msg.session, msg.reason, msg.detail)
        except BaseException as e:
            logging.exception("the output writer failed")
            self._fail(e)
        finally:
            with self._collected:
                self._collected_through = 1 << 62
                self._collected.notify_all()
            for sid in list(self._sinks):
                self._close_sink(sid, SHUTDOWN, "the server stopped")
            self.metrics.record_gc(self.gc_monitor.drain())

    def _await_collected(self, k: int) -> None:
        """Offline clock: beat k's outputs are in the sessions (so a context cap it reached ends
        the session before the next beat, as on a server that reads each beat before the next)."""
        with self._collected:
            self._collected.wait_for(lambda: self._collected_through >= k)

    def _log_end(self, *, session: Hashable, reason: str, tick: int, **_) -> None:
        if reason == "context cap":
            cap = self.engine.serve.context_frames
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
                sample_rate=self.engine.cfg.codec.sample_rate,
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

    def _collect(self, msg: _Beat) -> None:
        """A beat's outputs into each live session's sink, then its tick record."""
        t0 = _now()
        beat = msg.beat
        pcm = None
        if self.output_dir is not None:
            if self._pcm is None or self._pcm.shape != beat.wav.shape:
                self._pcm = np.zeros(beat.wav.shape, "<i2")
            pcm = to_pcm16(beat.wav, out=self._pcm)
        cap_ends = self.engine.serve.at_cap == "end"
        stamp = BeatStamp(msg.tick, msg.timing.start, msg.timing.deadline, msg.readable)
        underran = set(msg.snapshot.underruns)
        live = msg.snapshot.live
        memories = msg.snapshot.memories
        asked = msg.snapshot.rollovers or {}
        for b, sid in enumerate(live):
            if sid is None:
                continue
            rollover = None
            if beat.reseeded[b]:
                # The host's roll-over, or the device's at the cap (``at_cap='rollover'``).
                rollover = asked.get(b, {"reason": "cap", "capsule_len": 0})
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
            elif beat.at_cap[b] and cap_ends and sid not in self._capped:
                self._capped.add(sid)
                self._cap_reached.put(sid)
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
            self._collected_through = msg.tick
            self._collected.notify_all()

    @property
    def warmed_up(self) -> bool:
        """The warm-up ticks have been served: what a front end waits for before it says ready.

        The first beats of a run pay one-time costs (first executions on the device: 0.7-1.3 s
        for the first beat on an H200), which callers admitted in them would see as a stall.
        On the offline clock no beat has a deadline: it is warmed up from the start.
        """
        if self.clock.mode == OFFLINE:
            return True
        return self._collected_through >= self.metrics.warmup_ticks - 1

    # ---- the two loops -----------------------------------------------------------------------

    def run(self, plans: Sequence[SessionPlan], n_ticks: int) -> dict:
        """Serves ``plans`` for ``n_ticks`` beats (or until a stop); returns the metrics summary."""
        self._load(plans)
        self._n_ticks = n_ticks
        compiled = None
        if self.loop == "dispatch":
            self.engine.compile_tick()
            self.metrics.record_compile("tick", self.engine.compile_s)
            warm_s = self.engine.warm()  # every path of the tick run once (0 when done before)
            if warm_s:
                self.metrics.record_compile("warm", warm_s)
        else:
            # Compile before the clock starts, so that compile time is not a late first beat.
            compiled = self.engine.compile_resident(self._next_beat, self._deliver)
            self.metrics.record_compile("resident_loop", self.engine.compile_s)
            # Run down every path before the clock too, as the dispatch tick's ``warm``.
            self.metrics.record_compile("warm", self.engine.warm_resident(compiled))
        if self._on_ready is not None:
            self._on_ready()
        writer = threading.Thread(target=self._writer_main, name="voicechat-writer", daemon=True)
        writer.start()
        try:
            with self.gc:
                # Installed after the policy's start-up collection: that one is before the clock.
                self.gc_monitor.install()
                try:
                    if self.loop == "dispatch":
                        self._run_dispatch(n_ticks)
                    else:
                        self._run_resident(compiled)
                finally:
                    # The writer drains under the policy too: its last beats are the run's.
                    self._to_writer.put(_STOP)
                    writer.join()
                    self.gc_monitor.uninstall()
        finally:
            if writer.is_alive():  # the policy's start failed before the loop began
                self._to_writer.put(_STOP)
                writer.join()
        self.hub.close("the server stopped")
        if self._error is not None:
            raise self._error
        return self.metrics.summary()

    def _run_dispatch(self, n_ticks: int) -> None:
        reader = threading.Thread(target=self._reader_main, name="voicechat-reader", daemon=True)
        reader.start()
        self.clock.begin()
        last = None  # the last tick run or skipped
        sent: collections.deque[int] = collections.deque()  # dispatched, not yet picked up
        try:
            while not self._stop.is_set():
                k = self.clock.next_tick(last)
                if k >= n_ticks:
                    break
                timing = self._wait_for(k, sent[-1] if sent else None)
                if self._stop.is_set():
                    break
                self._skipped(last, k)
                last = k
                with self._picked:
                    picked = self._picked_through
                while sent and sent[0] <= picked:
                    sent.popleft()
                if len(sent) >= self.max_inflight and self.clock.mode != OFFLINE:
                    # The device is still on earlier beats: queued behind them this beat, and
                    # every later one, would only come later still. It is skipped instead.
                    live = [s for s in self.slots.slot_sessions() if s is not None]
                    self._send(_Skipped(k, timing.start, timing.deadline, live, Cause.DEVICE))
                    self.queues.discard_beats(1)
                    continue
                sent.append(k)
                beat = self.prepare(k)
                prepared = _now()
                out = self.engine.tick(beat)
                self._to_reader.put(_Dispatched(k, timing, prepared, _now(), out, self._snapshot))
                if self.clock.mode == OFFLINE:
                    # Offline ticks run back to back: the next starts when this one is read.
                    self._await_collected(k)
            self._end_live_sessions(0 if last is None else last + 1)
        finally:
            self._to_reader.put(None)
            reader.join()

    def _reader_main(self) -> None:
        """Dispatch loop: waits for each beat's output, copies it to the host, passes it on."""
        try:
            while (item := self._to_reader.get()) is not None:
                if not isinstance(item, _Dispatched):
                    self._to_writer.put(item)
                    continue
                began = _now()
                jax.block_until_ready(item.out)
                ready = _now()
                beat = self.pool.take(jax.device_get(item.out))
                readable = _now()
                with self._picked:
                    self._picked_through = item.tick
                    self._picked.notify_all()
                self._to_writer.put(
                    _Beat(
                        item.tick,
                        item.timing,
                        item.snapshot,
                        beat,
                        item.prepared,
                        item.dispatched,
                        began,
                        ready,
                        readable,
                    )
                )
        except BaseException as e:
            logging.exception("the output reader failed")
            self._fail(e)
            with self._picked:
                self._picked_through = 1 << 62
                self._picked.notify_all()

    def _run_resident(self, compiled) -> None:
        self.clock.begin()
        timing = self._wait_for(0, None)
        self._last = 0
        first = self.prepare(0)
        self._inflight[0] = (0, timing, _now(), self._snapshot)
        try:
            self.engine.run_resident(compiled, first)
        except Exception:
            if self._error is None:
                raise
        self._end_live_sessions(self._last + 1)

    def _next_beat(self, i: int):
        """Resident loop, on the device's callback: the input of device iteration i + 1."""
        try:
            last = self._last
            if self.clock.mode == OFFLINE:
                self._await_collected(last)
            k = self.clock.next_tick(last)
            if k < self._n_ticks and not self._stop.is_set():
                timing = self._wait_for(k, last)
                if not self._stop.is_set():
                    self._skipped(last, k)
                    self._last = k
                    beat = self.prepare(k)
                    self._inflight[i + 1] = (k, timing, _now(), self._snapshot)
                    return beat, np.asarray(False)
        except BaseException as e:
            logging.exception("preparing a beat failed")
            self._fail(e)
        beat = self.engine.empty_beat()
        return beat, np.asarray(True)

    def _deliver(self, i: int, out) -> None:
        """Resident loop, on the device's callback: beat i's outputs into a pooled host buffer.

        Bounded work only (a few array copies and a queue put): the device waits for it.
        """
        ready = _now()
        try:
            k, timing, prepared, snapshot = self._inflight.pop(i)
            beat = self.pool.take(out)
            self._to_writer.put(
                _Beat(k, timing, snapshot, beat, prepared, None, None, ready, _now())
            )
        except BaseException as e:
            logging.exception("taking a beat's output failed")
            self._fail(e)


class _Retained(EndedRecords):
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


def write_session_outputs(
    out_dir: str, sid: Hashable, log: SessionOutput, *, sample_rate: int, tokenizer=None
) -> dict[str, str]:
    """Writes a kept session's ``output.wav``, ``frames.jsonl`` and (with a tokenizer)
    ``transcript.txt`` at once, in the layout the server streams."""
    d = os.path.join(out_dir, str(sid))
    files = SessionFiles(d, sample_rate=sample_rate, tokenizer=tokenizer)
    a = log.arrays()
    lines = frame_lines(
        0, a["text"], a["function"], a["codes"], a.get("transcript"), a.get("n_transcript")
    )
    files.append(lines, to_pcm16(a["wav"]), a["text"])
    return files.close()
