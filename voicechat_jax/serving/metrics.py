"""Per-tick timing records, where each tick's time went on the host, and the serving report.

One ``TickRecord`` per tick: its start, the moment its outputs were readable on the host, the
deadline, who was live and, when the server measured it, the tick's *host timeline*
(``HostTimeline``): wake lateness, input preparation, dispatch, device time, output pickup,
collection and the garbage-collection pauses that fell inside the tick. A tick that finished after
its deadline misses for every live session in it; a tick the clock skipped (the host fell more than
a beat behind) was never produced, so it misses too and has no latency. Ticks, not session-beats,
are the independent samples: percentiles and the rule-of-three bound are over ticks.

**Attribution.** Every missed or skipped tick is attributed to the ``device`` or the ``host``
(``Cause``). A late tick is charged to the stage that made it late. It is the device's when the
device's share of its latency alone exceeds the deadline budget (a perfect host would have missed
it too). Otherwise each stage is set against what it usually takes (its median over the last
``recent`` ticks): the stage that ran furthest over its usual made the beat late, and the beat is
the device's when that stage is the device's own time, the host's (naming the stage) when it is a
host stage. So the device work of an admission or roll-over program, which the dispatch loop
launches before the tick and which lengthens the beat's device stage, counts as device, however
much of the beat the host's usual dispatch took. The device's share is the measured device time
less what the host is known to have added to it (GC pauses inside the device interval; in the
dispatch loop, the time the reader thread came late for an output that was already there), plus,
in the resident loop, the part of the tick's wake lateness that the previous beat's device time
forced. A skipped tick is the
device's when a perfect host, ready the moment the previous beat's device work ended, would still
have woken after the skipped tick's slot. In the dispatch loop the beat thread never waits for the
device, so its skips are the host's, except the ticks the server skips on purpose because the device
is still busy with earlier beats (``Server(max_inflight=...)``): those are the device's. Where the
split cannot be measured the host is blamed, so "no host-caused miss" is a conservative claim.
Records without a timeline attribute misses as ``unknown``. The largest host stage of a
host-caused miss is named in ``host_stage``.

**Bounded.** A server runs for hours: the recorder keeps running counters over the whole run,
exact percentiles over the last ``window`` steady ticks (a NumPy ring), the last ``recent`` tick
records, and per-session figures for live sessions plus the last ``max_sessions`` that ended (older
ones are folded into the counters). The first ``warmup_ticks`` ticks are labelled ``warmup`` and
reported apart; compile times are recorded apart too.

The recorder is shared between threads through one lock. Output: JSON lines (one object per tick and
per event, a summary at the end); the summary's text table and Prometheus forms are ``report``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import math
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TextIO

import numpy as np

from voicechat_jax.serving.gc_policy import GcPause

WARMUP = "warmup"
STEADY = "steady"
QUANTILES = {"p50": 50.0, "p99": 99.0, "p99.9": 99.9}
_WAITED_S = 0.001  # a reader wait shorter than this found the output already there
_DEVICE_PART = "device"  # the device's own share of a tick, beside the host's stages


class Cause(enum.StrEnum):
    """Who lost a missed or skipped tick."""

    HOST = "host"
    DEVICE = "device"
    UNKNOWN = "unknown"  # recorded without a timeline


# Upper bounds (seconds) of the steady-state beat latency histogram's buckets (and +Inf): finer
# around the 160 ms beat, where a deadline falls.
LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.14, 0.15, 0.16, 0.18, 0.2, 0.32, 0.64, 1.28,
)  # fmt: skip

# Columns of the steady-state ring, in order: latency, then the host stages (seconds).
STAGES = ("wake", "prepare", "dispatch", "device", "pickup", "collect", "gc")
_COLUMNS = ("latency", *STAGES)


@dataclasses.dataclass(frozen=True)
class HostTimeline:
    """The moments of one tick on the host (seconds on the beat clock's time source).

    The stages follow: ``wake`` = woke - start (the clock's lateness), ``prepare`` = prepared -
    woke, ``dispatch`` = dispatched - prepared (dispatch loop; the resident loop has none),
    ``device`` = ready - (dispatched or prepared), ``pickup`` = readable - ready; ``collect`` is the
    writer thread's time for the beat after ``readable`` (outside the latency).
    """

    woke: float  # the beat thread returned from the clock's wait
    prepared: float  # the beat's input was built (membership, client audio)
    dispatched: float | None  # dispatch loop: the tick call returned
    ready: float  # dispatch: the reader's block_until_ready returned; resident: deliver entered
    readable: float  # outputs copied into the host's beat buffer
    reader_began: float | None = None  # dispatch loop: the reader began waiting for this beat
    collect_s: float | None = None

    @property
    def device_start(self) -> float:
        return self.prepared if self.dispatched is None else self.dispatched


@dataclasses.dataclass(frozen=True)
class TickRecord:
    """One tick's timing. Times in seconds on the beat clock's time source."""

    tick: int
    start: float  # the tick's start (the clock's schedule)
    readable: float | None  # when all slots' outputs were readable on the host; None: skipped
    latency: float | None  # readable - start; None when skipped
    deadline: float
    missed: bool  # readable after the deadline, or skipped
    live_sessions: int
    underruns: int  # sessions of this tick whose input beat was incomplete
    phase: str  # "warmup" | "steady"
    skipped: bool = False
    cause: str | None = None  # Cause of a miss; None when not missed
    host_stage: str | None = None  # the largest host stage of a host-caused miss
    stages: dict[str, float] | None = None  # STAGES -> seconds (None where not measured)
    gc_pauses: int = 0  # collections that overlapped [start, readable]
    gc_generation: int | None = None  # the oldest generation among them

    def to_json(self) -> dict:
        return {"type": "tick", **dataclasses.asdict(self)}


def percentiles(values: np.ndarray) -> dict[str, float | None]:
    """Stats in ms of durations in seconds (NaN left out): p50, p99, p99.9 (numpy linear
    interpolation), max, mean; every one None when no value is left."""
    values = values[~np.isnan(values)]
    if values.size == 0:
        return {name: None for name in (*QUANTILES, "max", "mean")}
    ms = values * 1e3
    stats = {name: float(np.percentile(ms, q)) for name, q in QUANTILES.items()}
    stats["max"] = float(ms.max())
    stats["mean"] = float(ms.mean())
    return stats


def _overlap(pauses: Iterable[GcPause], t0: float, t1: float) -> tuple[float, int, int | None]:
    """Seconds of ``pauses`` inside [t0, t1], how many touched it, the oldest generation."""
    total, n, oldest = 0.0, 0, None
    for p in pauses:
        lo, hi = max(p.start, t0), min(p.end, t1)
        if hi > lo or (p.start >= t0 and p.end <= t1):
            total += max(0.0, hi - lo)
            n += 1
            oldest = p.generation if oldest is None else max(oldest, p.generation)
    return total, n, oldest


class _Ring:
    """The last ``capacity`` rows of ``width`` float64 columns; grows by doubling up to it."""

    def __init__(self, capacity: int, width: int):
        self.capacity = capacity
        self._data = np.full((min(capacity, 1024), width), np.nan)
        self._next = 0  # rows written in all
        self.width = width

    def append(self, row: Sequence[float]) -> None:
        n = self._data.shape[0]
        if self._next >= n and n < self.capacity:
            grown = np.full((min(2 * n, self.capacity), self.width), np.nan)
            grown[:n] = self._data
            self._data = grown
        self._data[self._next % self._data.shape[0]] = row
        self._next += 1

    def __len__(self) -> int:
        return min(self._next, self._data.shape[0])

    def column(self, j: int) -> np.ndarray:
        return self._data[: len(self), j]


@dataclasses.dataclass
class _PhaseCounters:
    ticks: int = 0
    skipped: int = 0
    session_beats: int = 0
    ran: int = 0
    latency_sum: float = 0.0
    missed: int = 0
    missed_beats: int = 0
    underruns: int = 0
    missed_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class MetricsRecorder:
    """Collects tick records, GC pauses and session events; writes JSON lines to ``sink``.

    Args:
      warmup_ticks: ticks with index < this are warm-up (ticks count from 0).
      sink: a text stream for JSON lines (the caller opens and closes it).
      period_s: the beat period, for attributing skipped ticks.
      beat_waits_for_device: the beat thread waits for each beat's device work before it takes
        the next beat (the resident loop), so device time can make it late or skip.
      window: steady ticks kept for exact percentiles (default ~2.9 h of 160 ms beats).
      recent: tick records kept in ``recent``.
      max_sessions: per-session figures kept for sessions that ended.
    """

    def __init__(
        self,
        warmup_ticks: int,
        *,
        sink: TextIO | None = None,
        period_s: float | None = None,
        beat_waits_for_device: bool = False,
        window: int = 1 << 16,
        recent: int = 256,
        max_sessions: int = 1024,
    ):
        if warmup_ticks < 0:
            raise ValueError(f"warmup_ticks must be >= 0, got {warmup_ticks}")
        self.warmup_ticks = warmup_ticks
        self.sink = sink
        self.period_s = period_s
        self.beat_waits_for_device = beat_waits_for_device
        self.recent: collections.deque[TickRecord] = collections.deque(maxlen=recent)
        self.compile_s: dict[str, float] = {}
        self.event_counts: collections.Counter[str] = collections.Counter()
        self.ended_counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        self._steady = _PhaseCounters()
        self._warm = _PhaseCounters()
        self.idle_ticks = 0  # ticks not run: nothing live, nothing asked (``add_idle``)
        self._ring = _Ring(window, len(_COLUMNS))
        # Steady ticks that ran, by latency bucket (the last: above every bound), whole run.
        self._histogram = np.zeros((len(LATENCY_BUCKETS_S) + 1,), np.int64)
        self._warm_latency: list[float] = []  # at most warmup_ticks entries
        # Per session (steady state only): [beats, missed, underruns].
        self._live: dict[Hashable, list[int]] = {}
        self._ended: collections.OrderedDict[Hashable, list[int]] = collections.OrderedDict()
        self.max_sessions = max_sessions
        self._folded = {"sessions": 0, "with_misses": 0, "max_missed": 0}
        # GC pauses not yet behind every tick still to come; and the run's GC counters.
        self._pauses: list[GcPause] = []
        self.gc_counts = {"policy": [0, 0, 0], "automatic": [0, 0, 0]}
        self.gc_max_s = [0.0, 0.0, 0.0]
        self.gc_total_s = 0.0
        # When a perfect host could have taken the next beat, after the last ran tick (resident).
        self._device_free: float | None = None
        self._timed = False  # some tick came with a timeline

    # ---- recording ---------------------------------------------------------------------------

    def record_gc(self, pauses: Iterable[GcPause]) -> None:
        """Adds collections (from ``GcMonitor.drain``) to the run's counters and tick accounting."""
        with self._lock:
            for p in pauses:
                kind = "policy" if p.policy else "automatic"
                self.gc_counts[kind][p.generation] += 1
                self.gc_max_s[p.generation] = max(self.gc_max_s[p.generation], p.seconds)
                self.gc_total_s += p.seconds
                self._pauses.append(p)

    def record(
        self,
        tick: int,
        start: float,
        readable: float | None,
        deadline: float,
        sessions: Sequence[Hashable] = (),
        underrun_sessions: Sequence[Hashable] = (),
        *,
        phase: str | None = None,
        timeline: HostTimeline | None = None,
        cause: Cause | None = None,
    ) -> TickRecord:
        """Records one tick.

        Args:
          tick: the tick index k.
          start, deadline: from the beat clock (``TickTiming``).
          readable: when the tick's outputs were readable on the host; None for a skipped tick.
          sessions: ids of the sessions live in this tick.
          underrun_sessions: ids of those whose input beat was incomplete.
          phase: override the warm-up rule ("warmup" | "steady").
          timeline: the tick's host timeline (ran ticks), for its stages and attribution.
          cause: the cause of a skip when the server knew it (it skipped a beat the device was
            still behind on).
        """
        phase = phase or (WARMUP if tick < self.warmup_ticks else STEADY)
        if phase not in (WARMUP, STEADY):
            raise ValueError(f"phase must be {WARMUP!r} or {STEADY!r}, got {phase!r}")
        with self._lock:
            skipped = readable is None
            latency = None if skipped else readable - start
            missed = skipped or readable > deadline
            given, cause = cause, None
            stages, gc_n, gc_gen, host_stage = None, 0, None, None
            if skipped:
                cause = given or self._skip_cause(start)
            else:
                if timeline is not None:
                    self._timed = True
                    stages, gc_n, gc_gen, device_bound, parts = self._stages(start, timeline)
                    if missed:
                        cause, host_stage = self._charge(deadline - start, device_bound, parts)
                    self._device_free = start + device_bound
                elif missed:
                    cause = Cause.UNKNOWN
                self._prune(start)
            rec = TickRecord(
                tick=tick,
                start=start,
                readable=readable,
                latency=latency,
                deadline=deadline,
                missed=missed,
                live_sessions=len(sessions),
                underruns=len(underrun_sessions),
                phase=phase,
                skipped=skipped,
                cause=None if cause is None else str(cause),
                host_stage=host_stage,
                stages=stages,
                gc_pauses=gc_n,
                gc_generation=gc_gen,
            )
            self.recent.append(rec)
            counters = self._steady if phase == STEADY else self._warm
            counters.ticks += 1
            counters.skipped += skipped
            counters.session_beats += len(sessions)
            counters.underruns += len(underrun_sessions)
            if not skipped:
                counters.ran += 1
                counters.latency_sum += latency
            if missed:
                counters.missed += 1
                counters.missed_beats += len(sessions)
                (counters.skipped_by if skipped else counters.missed_by)[rec.cause] += 1
            if phase == STEADY:
                if latency is not None:
                    self._histogram[np.searchsorted(LATENCY_BUCKETS_S, latency)] += 1
                row = [math.nan if latency is None else latency]
                row += [math.nan if not stages or stages[s] is None else stages[s] for s in STAGES]
                self._ring.append(row)
                for sid in sessions:
                    self._session(sid)[0] += 1
                    if missed:
                        self._session(sid)[1] += 1
                for sid in underrun_sessions:
                    self._session(sid)[2] += 1
            elif latency is not None and len(self._warm_latency) < max(self.warmup_ticks, 64):
                self._warm_latency.append(latency)
            self._write(rec.to_json())
            return rec

    def _stages(self, start: float, t: HostTimeline):
        """The tick's stages, GC overlap, device-bound part of its latency, host parts."""
        wake = t.woke - start
        prepare = t.prepared - t.woke
        dispatch = None if t.dispatched is None else t.dispatched - t.prepared
        device = t.ready - t.device_start
        pickup = t.readable - t.ready
        gc_s, gc_n, gc_gen = _overlap(self._pauses, start, t.readable)
        gc_device, _, _ = _overlap(self._pauses, t.device_start, t.ready)
        reader_excess = 0.0
        if t.reader_began is not None and t.ready - t.reader_began < _WAITED_S:
            # The output was there before the reader looked: the wait for the reader is host time.
            reader_excess = max(0.0, t.reader_began - t.device_start)
        device_own = max(0.0, device - gc_device - reader_excess)
        wake_device = 0.0
        if self.beat_waits_for_device and self._device_free is not None:
            wake_device = min(wake, max(0.0, self._device_free - start))
        stages = {
            "wake": wake,
            "prepare": prepare,
            "dispatch": dispatch,
            "device": device,
            "pickup": pickup,
            "collect": t.collect_s,
            "gc": gc_s,
        }
        parts = {  # the tick's latency split between the host's stages and the device's own
            "wake": wake - wake_device,
            "prepare": prepare,
            "dispatch": dispatch or 0.0,
            "reader": reader_excess,
            "pickup": pickup,
            "gc": gc_s,
            _DEVICE_PART: device_own,
        }
        return stages, gc_n, gc_gen, wake_device + device_own, parts

    def _charge(
        self, budget: float, device_bound: float, parts: dict[str, float]
    ) -> tuple[Cause, str | None]:
        """The cause of a late tick and, when the host's, its stage (see the module docstring).

        ``parts`` holds this tick's seconds per stage (``_stages``); the usual of each is its
        median over the recorded ticks in ``recent`` (0 before any), so with no history the
        largest stage is charged.
        """
        if device_bound > budget:
            return Cause.DEVICE, None
        usual = self._usual_stages()
        excess = {s: v - usual.get(s, 0.0) for s, v in parts.items()}
        worst = max(excess, key=excess.get)
        if worst == _DEVICE_PART:
            return Cause.DEVICE, None
        return Cause.HOST, worst

    def _usual_stages(self) -> dict[str, float]:
        """Each stage's median seconds over the ticks in ``recent`` that have a timeline."""
        timed = [r.stages for r in self.recent if r.stages is not None]
        if not timed:
            return {}
        usual = {}
        for s in ("wake", "prepare", "dispatch", "pickup", "gc", "device"):
            values = [t[s] for t in timed if t.get(s) is not None]
            if values:
                usual[_DEVICE_PART if s == "device" else s] = float(np.median(values))
        return usual

    def _skip_cause(self, start: float) -> Cause:
        if not self._timed:
            return Cause.UNKNOWN
        if (
            self.beat_waits_for_device
            and self.period_s is not None
            and self._device_free is not None
            and self._device_free >= start + self.period_s
        ):
            return Cause.DEVICE
        return Cause.HOST

    def _prune(self, start: float) -> None:
        # Ticks are recorded in order of start: a pause over before this start touches no later one.
        if self._pauses and self._pauses[0].end < start:
            self._pauses = [p for p in self._pauses if p.end >= start]

    def _session(self, sid: Hashable) -> list[int]:
        figures = self._live.get(sid)
        if figures is None:
            figures = self._ended.pop(sid, None) or [0, 0, 0]
            self._live[sid] = figures
        return figures

    def add_idle(self, n: int) -> None:
        """Counts ``n`` more ticks that the server did not run, as their starts pass: no session
        was live or asked for a slot, so nothing was owed. Neither run nor missed, and not in
        ``ticks``."""
        with self._lock:
            self.idle_ticks += n

    def record_idle(self, first: int, n: int) -> None:
        """Writes one line for an idle period: ``n`` ticks from ``first`` (``add_idle``)."""
        if n > 0:
            with self._lock:
                self._write({"type": "idle", "tick": first, "ticks": n})

    def record_compile(self, what: str, seconds: float) -> None:
        """Records a compile (or other start-up) time, reported apart from the ticks."""
        with self._lock:
            self.compile_s[what] = seconds
            self._write({"type": "compile", "what": what, "seconds": seconds})

    def record_event(self, event: str, **fields) -> None:
        """Records a session event (admitted, released, refused, failed, ended, ...).

        ``ended`` carries the ``reason`` (left, context cap, failed, shutdown); ``released``
        moves the session's figures to the bounded record of ended sessions.
        """
        with self._lock:
            self.event_counts[event] += 1
            if event == "ended":
                self.ended_counts[str(fields.get("reason"))] += 1
            if event == "released" and fields.get("session") in self._live:
                self._retire(fields["session"])
            self._write({"type": "event", "event": event, **fields})

    def _retire(self, sid: Hashable) -> None:
        self._ended[sid] = self._live.pop(sid)
        while len(self._ended) > self.max_sessions:
            _, (_, missed, _) = self._ended.popitem(last=False)
            self._folded["sessions"] += 1
            self._folded["with_misses"] += missed > 0
            self._folded["max_missed"] = max(self._folded["max_missed"], missed)

    def retained(self) -> dict[str, int]:
        """Sizes of everything the recorder keeps (all bounded; the tests hold them flat)."""
        with self._lock:
            return {
                "recent": len(self.recent),
                "window": len(self._ring),
                "sessions": len(self._live) + len(self._ended),
                "pauses": len(self._pauses),
                "warmup": len(self._warm_latency),
            }

    # ---- the report --------------------------------------------------------------------------

    def summary(self) -> dict:
        """The serving report of docs/serving.md §2 as a dict (times in ms)."""
        with self._lock:
            out = self._phase_stats(self._steady, self._ring.column(0))
            n = out["ticks"]
            out["window_ticks"] = len(self._ring)
            out["idle_ticks"] = self.idle_ticks
            # Counts per bucket (not cumulative), the last above every bound; whole run.
            out["latency_histogram"] = {
                "le_s": list(LATENCY_BUCKETS_S),
                "counts": self._histogram.tolist(),
            }
            out["miss_rate_ticks"] = out["missed_ticks"] / n if n else None
            beats = out["session_beats"]
            out["miss_rate_session_beats"] = out["missed_session_beats"] / beats if beats else None
            # Rule of three: zero misses in n independent ticks bound the miss rate at 3/n (95 %).
            out["miss_rate_bound_95"] = 3.0 / n if n and out["missed_ticks"] == 0 else None
            figures = {**self._ended, **self._live}
            out["per_session"] = {
                str(sid): {"beats": b, "missed": m, "underruns": u}
                for sid, (b, m, u) in figures.items()
            }
            out["sessions_with_misses"] = self._folded["with_misses"] + sum(
                1 for _, m, _ in figures.values() if m
            )
            out["max_missed_per_session"] = max(
                [self._folded["max_missed"], *(m for _, m, _ in figures.values())]
            )
            out["host_stages_ms"] = {
                s: percentiles(self._ring.column(1 + i)) for i, s in enumerate(STAGES)
            }
            out["gc"] = {
                "policy": list(self.gc_counts["policy"]),
                "automatic": list(self.gc_counts["automatic"]),
                "max_pause_ms": [1e3 * s for s in self.gc_max_s],
                "total_s": self.gc_total_s,
            }
            out["warmup"] = self._phase_stats(self._warm, np.array(self._warm_latency))
            out["compile_s"] = dict(self.compile_s)
            out["events"] = dict(self.event_counts)
            out["ended"] = dict(self.ended_counts)
            out["failed_sessions"] = self.event_counts.get("failed", 0)
            return out

    def close(self, extra: Mapping[str, object] | None = None) -> dict:
        """Writes the summary as the last JSON line and returns it; ``extra``: more of the run's
        report (the scheduler's counts, say), in the line and the returned dict alike."""
        summary = {**self.summary(), **(extra or {})}
        with self._lock:
            self._write({"type": "summary", **summary})
        return summary

    @staticmethod
    def _phase_stats(c: _PhaseCounters, latencies: np.ndarray) -> dict:
        return {
            "ticks": c.ticks,
            "ticks_skipped": c.skipped,
            "session_beats": c.session_beats,
            "latency_ms": percentiles(np.asarray(latencies, np.float64)),
            "latency_sum_s": c.latency_sum,
            "missed_ticks": c.missed,
            "missed_session_beats": c.missed_beats,
            "underruns": c.underruns,
            "missed_by_cause": {str(k): c.missed_by[str(k)] for k in Cause},
            "skipped_by_cause": {str(k): c.skipped_by[str(k)] for k in Cause},
        }

    def _write(self, obj: dict) -> None:
        if self.sink is not None:
            self.sink.write(json.dumps(obj, default=str) + "\n")
