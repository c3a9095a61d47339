"""A serving run: an ``Engine`` (device side) driven on the beat clock by a ``Server`` (host).

``Engine`` (``voicechat_jax.engine``) holds the parameters, the fresh-session template, the slot
state, the slot rule and the compiled tick. The ``Server`` is split at its seams:

- ``planner.BeatPlanner`` (beat thread): sources, admission, leaves, client input, the
  scheduler's plan and the roll-over policy: each beat's ``BeatInput`` and who was where. Pure
  host work, testable without a device.
- ``fanout.OutputFanout`` (writer thread): each beat's outputs into each session's files,
  in-memory output and network stream, its conversation memory and the metrics.
- the two loop drivers here, with identical outputs:

  - ``resident``: one jitted ``lax.while_loop`` for the whole run (``step.resident_loop``); the
    device calls back to the host for each beat's input (``_next_beat``: the clock's wait and the
    beat's preparation) and hands each beat's output back (``_deliver``: a copy into a pooled host
    buffer and a queue put, nothing else).
  - ``dispatch``: one donated jitted call per beat; its outputs, packed into one array
    (``Engine.pack``), start back to the host as soon as the device has them
    (``copy_to_host_async``), and a reader thread waits for beat k's output (and timestamps it)
    while the beat thread sleeps to beat k+1 and dispatches it.

The beat path itself (clock, input, the tick) touches JAX only to dispatch the tick; garbage
collection runs in the beat's slack (``gc_policy.GcPolicy``); every container that grows with
uptime is bounded. ``Server.hub`` is the thread-safe front for sources other than the
``SessionPlan``s given to ``run`` (admit, release, push audio; each session's output to a bounded
``writer.OutputStream`` the caller drains: ``serving.net``). ``request_stop`` (any thread) drains
the server: no new admission, the beat in flight is finished and written, every live session ends
with a ``shutdown`` event and its files are closed.

An idle real-time server runs no tick: when no session is live, waiting or asked for, and no
scripted one is due, the beat thread sleeps (``_idle``) until a request comes (``SessionHub``),
a scripted session's tick, a stop or the run's end, and the clock goes on from the next beat.
Those ticks owe nothing; they are counted apart (``idle_ticks``), neither run nor missed.
"""

from __future__ import annotations

import collections
import dataclasses
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
from voicechat_jax.serving.fanout import (
    SHUTDOWN,
    STOP,
    Beat,
    Dispatched,
    OutputFanout,
    Skipped,
    Snapshot,
)
from voicechat_jax.serving.gc_policy import GcMonitor, GcPolicy
from voicechat_jax.serving.hub import SessionHub, SessionPlan
from voicechat_jax.serving.memory import MemoryConfig, RolloverPolicy, TextTokenizer
from voicechat_jax.serving.metrics import Cause, MetricsRecorder
from voicechat_jax.serving.planner import BeatPlanner, session_key
from voicechat_jax.serving.scheduler import Lockstep, Scheduler
from voicechat_jax.serving.sessions import InputQueues, SlotTable
from voicechat_jax.serving.writer import (
    BeatPool,
    SessionFiles,
    SessionOutput,
    frame_lines,
    to_pcm16,
)

__all__ = [
    "AUTO",
    "LOOPS",
    "SHUTDOWN",
    "Engine",
    "Server",
    "ServerConfig",
    "SessionPlan",
    "pick_loop",
    "session_key",
]

LOOPS = ("resident", "dispatch")
AUTO = "auto"  # ``ServerConfig.loop``: the resident loop where it can serve, else dispatch


def pick_loop(loop: str, *, mesh: bool, buckets: bool) -> str:
    """The loop a server runs: ``loop`` itself, or for ``"auto"`` the resident loop on one device
    with one compiled slot count, and the dispatch loop on a mesh or with slot buckets (the
    resident loop serves neither).

    The resident loop is the default because it held the beat with the lighter tail: 51 faithful
    sessions on an H100 at the 1,500-frame cap, every roll-over, p99 111.2 ms against 124.3 on
    the dispatch loop, the host's wake and pickup 0.7 ms at p99 against a 28.5 ms dispatch call
    (2026-12-06, ``94d43d0``, ``experiments/capacity``; ``docs/decisions.md``).

    Raises ValueError for the resident loop named where it cannot serve.
    """
    if loop == AUTO:
        return "dispatch" if mesh or buckets else "resident"
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {(AUTO, *LOOPS)}, got {loop!r}")
    if loop == "resident" and (mesh or buckets):
        what = "a mesh (devices > 1)" if mesh else "slot buckets"
        raise ValueError(f"{what} is served by the dispatch loop only, not the resident loop")
    return loop


_now = time.monotonic  # the beat clock's time source
_IDLE_POLL_S = 0.1  # an idle beat thread looks at the stop flag this often


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """A server's options (beyond its engine, sinks, callbacks and scheduler).

    Attributes:
      clock: ``"realtime"`` (the beat clock) or ``"offline"`` (beats back to back).
      loop: ``"resident"``, ``"dispatch"`` (``LOOPS``) or ``"auto"``: the resident loop on one
        device with one compiled slot count, the dispatch loop otherwise (``pick_loop``).
      seed: the run seed of every session's sampling key.
      warmup_ticks: ticks reported apart as warm-up.
      max_backlog_beats: input queued per session before the oldest is dropped (None: no bound).
      vanish_beats: a live session that delivers no audio at all for this many consecutive beats
        (4 s at the default beat) is taken for a vanished client: it fails with that message and
        its slot is freed. None never ends a silent session.
      gc_policy: ``"slack"`` (collections only in a beat's slack) or ``"default"`` (Python's
        automatic collector, as before the policy existed; for comparison).
      output_dir: stream each session's ``output.wav`` and ``frames.jsonl`` into
        ``output_dir/<session id>/`` as the run goes (None: no files).
      keep_outputs: also keep every session's frames in memory (``logs``); for tests and short
        runs, since it grows with the frames served.
      max_ended: records of sessions that ended (``logs``, ``outputs``, ``failures``, ``ended``)
        kept; older ones are dropped (their counts stay in the metrics).
      metrics_window: steady ticks kept for exact percentiles.
      max_inflight: dispatch loop, real-time clock: a tick that comes due while this many earlier
        beats are still on the device is skipped (a device-caused miss) rather than queued, so
        that a device slower than the beat cannot make the latency grow without bound.
      rollover: when sessions roll over (``memory.RolloverPolicy``); default: the engine's
        ``ServeConfig.at_cap`` with the default thresholds scaled to its context cap. In the
        ``reset`` and ``memory`` modes the host rolls sessions over (``planner``), each with a
        ``ConversationMemory`` fed by the writer thread; every roll-over (the host's or the
        device's fallback at the cap) is a ``rollover`` event in the metrics and marks the
        session's ``frames.jsonl``.
      memory: how the conversation memory splits and bounds turns.
    """

    clock: str = "realtime"
    loop: str = AUTO
    seed: int = 0
    warmup_ticks: int = 2
    max_backlog_beats: int | None = 4
    vanish_beats: int | None = 25
    gc_policy: str = "slack"
    output_dir: str | os.PathLike | None = None
    keep_outputs: bool = True
    max_ended: int = 1024
    metrics_window: int = 1 << 16
    max_inflight: int = 2
    rollover: RolloverPolicy | None = None
    memory: MemoryConfig | None = None

    def __post_init__(self):
        if self.loop not in (AUTO, *LOOPS):
            raise ValueError(f"loop must be one of {(AUTO, *LOOPS)}, got {self.loop!r}")


class Server:
    """The host side of a serving run; see the module docstring.

    Args:
      engine: the device side.
      config: the options (``ServerConfig``); or give them as keyword arguments (``options``).
      metrics_sink: a text stream for the metrics' JSON lines.
      tokenizer: with ``output_dir``, writes each session's ``transcript.txt`` when it ends.
      stop_event: an event that, once set, drains the server (as ``request_stop``).
      llm_tokenizer: the LLM's text tokenizer (encode and decode), for a capsule in text with
        ``User:`` / ``Agent:`` turns and the directive; None: the agent's raw ids only.
      asr_decode: the RNNT head's ids -> text, so the caller's turns can enter the capsule
        (re-tokenized by ``llm_tokenizer``); None: the caller's turns are left out.
      scheduler: the batching policy (``scheduler.Scheduler``): admission, which slots run, which
        compiled bucket; default ``Lockstep`` (every slot, every beat).
      on_ready: called once the tick is compiled and warmed, before the first beat (the beat
        thread; the runner logs the time to ready).

    A session of ``hub`` (a network client) that fails ends as ``CLIENT_ERROR``, not
    ``failed``: a client that vanished, stalled or sent what the protocol refuses is no failure of
    the server (``failed_sessions`` and ``failures`` hold the server's own sessions only).

    Threads, and what each one owns (every other field is set in ``__init__`` and then only read):

    - the *beat thread* runs ``prepare`` (the ``planner``, which owns the session bookkeeping,
      the scheduler and the records of ended and failed sessions) and the clock's waits, one beat
      at a time: the caller of ``run`` in the dispatch loop; the device loop's callback thread in
      the resident loop (with the first beat on the caller's thread before the loop starts). It
      also owns ``_snapshot``, ``_last`` and, in the resident loop, ``_inflight`` (``_next_beat``
      and ``_deliver`` run one at a time, in order: the device waits for each).
    - the *reader thread* (dispatch loop) owns nothing: it forwards messages in order.
    - the *writer thread* runs the ``fanout``, which owns ``logs``, ``outputs`` and the sinks.
    - shared, and safe by construction: ``slots``, ``queues`` and ``hub`` (each behind its own
      lock; any thread may admit, release and push client audio), ``metrics`` (one lock),
      ``pool``, the channels (``queue.SimpleQueue``; ``_cap_reached``: the writer tells the
      planner which sessions reached the context cap), ``_stop`` (an ``Event``),
      ``_picked_through`` (behind the ``_picked`` condition), ``_error`` (set once, by whichever
      thread fails first).

    ``logs``, ``outputs``, ``failures`` and ``ended`` may be read by any thread once ``run`` has
    returned.
    """

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig | None = None,
        *,
        metrics_sink=None,
        tokenizer: Callable[[np.ndarray], str] | None = None,
        stop_event: threading.Event | None = None,
        llm_tokenizer: TextTokenizer | None = None,
        asr_decode: Callable[[Sequence[int]], str] | None = None,
        scheduler: Scheduler | None = None,
        on_ready: Callable[[], None] | None = None,
        **options,
    ):
        if config is not None and options:
            raise TypeError(f"give the options in config or as keywords, not both: {options}")
        config = config or ServerConfig(**options)
        serve = engine.serve
        self.config = config
        self.engine = engine
        scheduler = scheduler or Lockstep()
        self.loop = pick_loop(
            config.loop, mesh=engine.mesh is not None, buckets=len(engine.buckets) > 1
        )
        period = serve.beat_ms / 1000.0
        deadline = None if serve.deadline_ms is None else serve.deadline_ms / 1000.0
        self.clock = BeatClock(period, config.clock, deadline_s=deadline)
        self.slots = SlotTable(serve.slots)
        self.queues = InputQueues(
            serve.slots, engine.samples_per_beat, max_backlog_beats=config.max_backlog_beats
        )
        self.metrics = MetricsRecorder(
            config.warmup_ticks,
            sink=metrics_sink,
            period_s=period,
            beat_waits_for_device=self.loop == "resident",
            window=config.metrics_window,
            max_sessions=config.max_ended,
        )
        self.gc_monitor = GcMonitor()
        self.gc = GcPolicy(config.gc_policy, monitor=self.gc_monitor)
        self.max_inflight = config.max_inflight
        self.pool = BeatPool()
        self.rollover = config.rollover or RolloverPolicy.for_cap(
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
        if scheduler.buckets and scheduler.buckets != engine.buckets:
            raise ValueError(
                f"scheduler buckets {scheduler.buckets} need an engine compiled for them "
                f"(Engine(buckets=...)); this one has {engine.buckets}"
            )
        self._stop = stop_event or threading.Event()
        self._error: BaseException | None = None
        self._on_ready = on_ready
        # Channels.
        self._to_reader: queue.SimpleQueue = queue.SimpleQueue()
        self._cap_reached: queue.SimpleQueue = queue.SimpleQueue()
        self._picked = threading.Condition()
        self._picked_through = -1
        self.hub = SessionHub(self.queues)
        self.fanout = OutputFanout(
            metrics=self.metrics,
            gc_monitor=self.gc_monitor,
            pool=self.pool,
            sample_rate=engine.cfg.codec.sample_rate,
            context_frames=serve.context_frames,
            cap_ends=serve.at_cap == "end",
            cap_reached=self._cap_reached,
            output_dir=None if config.output_dir is None else os.fspath(config.output_dir),
            keep_outputs=config.keep_outputs,
            tokenizer=tokenizer,
            max_ended=config.max_ended,
            on_fail=self._fail,
        )
        self.planner = BeatPlanner(
            engine,
            slots=self.slots,
            queues=self.queues,
            hub=self.hub,
            scheduler=scheduler,
            rollover=self.rollover,
            memory=config.memory or MemoryConfig(),
            llm_tokenizer=llm_tokenizer,
            asr_decode=asr_decode,
            seed=config.seed,
            vanish_beats=config.vanish_beats,
            max_ended=config.max_ended,
            send=self._send,
            cap_reached=self._cap_reached,
        )
        # Beat thread.
        self._last: int | None = None
        self._snapshot: Snapshot | None = None
        self._inflight: dict[int, tuple] = {}  # resident: device iteration -> the beat's stamps
        self._n_ticks = 0

    # ---- what the parts own, read through the server -------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        return self.planner.scheduler

    @property
    def failures(self):
        return self.planner.failures

    @property
    def ended(self):
        return self.planner.ended

    @property
    def failed_sessions(self) -> int:
        return self.planner.failed_sessions

    @property
    def rollovers(self) -> int:
        return self.planner.rollovers

    @property
    def logs(self):
        return self.fanout.logs

    @property
    def outputs(self):
        return self.fanout.outputs

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
            **self.planner.retained(),
            **self.fanout.retained(),
            "inflight": len(self._inflight),
            "pool_allocated": self.pool.allocated,
            **{f"metrics_{k}": v for k, v in self.metrics.retained().items()},
        }

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._stop.set()

    def _send(self, msg) -> None:
        """To the writer, after every beat already dispatched (the reader forwards in order)."""
        (self._to_reader if self.loop == "dispatch" else self.fanout.inbox).put(msg)

    # ---- the beat thread ---------------------------------------------------------------------

    def prepare(self, k: int) -> state_lib.BeatInput:
        """The host's work before tick k (``planner.BeatPlanner.prepare``): the beat's input."""
        beat, self._snapshot = self.planner.prepare(k)
        return beat

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

    def _feed_ahead(self, k: int, last: int | None) -> None:
        """The scripted sessions' audio for tick k, pushed before its beat starts (as a network
        client's arrives), so that the beat's ``prepare`` only takes it. Only for the tick after
        ``last``: ticks the clock skips discard their input (``_skipped``), and audio fed ahead
        would be what they discarded."""
        if k == (0 if last is None else last + 1):
            self.planner.feed(k)

    def _skipped(self, last: int | None, k: int) -> None:
        """Ticks the clock skipped between ``last`` and ``k``: their input goes, they are missed."""
        if last is None or k == last + 1:
            return
        live = [s for s in self.slots.slot_sessions() if s is not None]
        for j in range(last + 1, k):
            self._send(Skipped(j, self.clock.tick_start(j), self.clock.deadline(j), live))
        self.queues.discard_beats(k - last - 1)

    def _next_tick(self, last: int | None, n_ticks: int) -> tuple[int, int | None]:
        """Both loops: the tick to run after ``last`` (the clock's), past any idle stretch
        (``_idle``); returns it with the ``last`` to go on from (the tick before it when the
        ticks between were idle, so that none of them counts as skipped)."""
        k = self.clock.next_tick(last)
        if k < n_ticks and (woke := self._idle(k, n_ticks)) != k:
            return woke, woke - 1
        return k, last

    def _idle(self, k: int, n_ticks: int) -> int:
        """Tick k on a real-time clock with nothing to do (``BeatPlanner.quiet``), past the
        warm-up: sleeps until a request comes, a scripted session is due, a stop or the run's
        end, and returns the tick to run next: the first whose start is still ahead when a
        request woke it (no beat starts late for it), else the scripted tick or ``n_ticks``.
        The ticks from k to it are idle (``MetricsRecorder.add_idle``, counted as their starts
        pass). Returns k itself when it is not idle. A stop wakes it within ``_IDLE_POLL_S``."""
        if (
            self.clock.mode == OFFLINE
            or k < self.metrics.warmup_ticks
            or self._stop.is_set()
            or not self.planner.quiet(k)
        ):
            return k
        due = self.planner.next_scripted_join()
        until = n_ticks if due is None else min(n_ticks, max(due, k))

        def ahead() -> int:  # the first tick in [k, until] whose start has not passed
            return min(until, max(k, self.clock.due_tick() + 1))

        counted = k  # idle ticks counted so far: those whose start has passed
        woke = until
        while not self._stop.is_set():
            passed = ahead()
            self.metrics.add_idle(passed - counted)
            counted = passed
            remaining = self.clock.tick_start(until) - _now()
            if remaining <= 0:
                break
            if self.hub.wait_for_request(min(remaining, _IDLE_POLL_S)):
                woke = ahead()
                break
        if self._stop.is_set():
            woke = ahead()
        self.metrics.add_idle(woke - counted)
        self.metrics.record_idle(k, woke - k)
        return woke

    def _end_live_sessions(self, tick: int) -> None:
        """At any end, sessions still waiting for a slot are refused; on a stop request every
        live session ends with a ``shutdown`` event (beat thread)."""
        self.planner.end_all(tick, stopping=self._stop.is_set())

    @property
    def warmed_up(self) -> bool:
        """The warm-up ticks have been served: what a front end waits for before it says ready.

        The first beats of a run pay one-time costs (first executions on the device: 0.7-1.3 s
        for the first beat on an H200), which callers admitted in them would see as a stall.
        On the offline clock no beat has a deadline: it is warmed up from the start.
        """
        if self.clock.mode == OFFLINE:
            return True
        return self.fanout.collected_through >= self.metrics.warmup_ticks - 1

    # ---- the two loops -----------------------------------------------------------------------

    def run(self, plans: Sequence[SessionPlan], n_ticks: int) -> dict:
        """Serves ``plans`` for ``n_ticks`` beats (or until a stop); returns the metrics summary."""
        self.planner.load(plans)
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
        writer = threading.Thread(target=self.fanout.main, name="voicechat-writer", daemon=True)
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
                    self.fanout.inbox.put(STOP)
                    writer.join()
                    self.gc_monitor.uninstall()
        finally:
            if writer.is_alive():  # the policy's start failed before the loop began
                self.fanout.inbox.put(STOP)
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
                k, last = self._next_tick(last, n_ticks)
                if k >= n_ticks or self._stop.is_set():
                    break
                self._feed_ahead(k, last)
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
                    self._send(Skipped(k, timing.start, timing.deadline, live, Cause.DEVICE))
                    self.queues.discard_beats(1)
                    continue
                sent.append(k)
                beat = self.prepare(k)
                prepared = _now()
                # one array: one copy back, not one a leaf; packed ahead of the next beat's lanes
                out, packed = self.engine.tick_packed(beat)
                packed.copy_to_host_async()  # back to the host as soon as the device has it
                self._to_reader.put(
                    Dispatched(k, timing, prepared, _now(), out, packed, self._snapshot)
                )
                if self.clock.mode == OFFLINE:
                    # Offline ticks run back to back: the next starts when this one is read.
                    self.fanout.await_collected(k)
            self._end_live_sessions(0 if last is None else last + 1)
        finally:
            self._to_reader.put(None)
            reader.join()

    def _reader_main(self) -> None:
        """Dispatch loop: waits for each beat's output, copies it to the host, passes it on."""
        try:
            while (item := self._to_reader.get()) is not None:
                if not isinstance(item, Dispatched):
                    self.fanout.inbox.put(item)
                    continue
                began = _now()
                jax.block_until_ready(item.packed)
                ready = _now()
                beat = self.pool.take(item.out, np.asarray(item.packed))
                readable = _now()
                with self._picked:
                    self._picked_through = item.tick
                    self._picked.notify_all()
                self.fanout.inbox.put(
                    Beat(
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
                self.fanout.await_collected(last)
            k, last = self._next_tick(last, self._n_ticks)
            if k < self._n_ticks and not self._stop.is_set():
                self._feed_ahead(k, last)
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
            self.fanout.inbox.put(
                Beat(k, timing, snapshot, beat, prepared, None, None, ready, _now())
            )
        except BaseException as e:
            logging.exception("taking a beat's output failed")
            self._fail(e)


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
