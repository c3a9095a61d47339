"""Per-tick timing records and the serving report (serving-spec §2).

One ``TickRecord`` per tick: its start, the moment its outputs were readable on the host, the
deadline, and who was live. A tick that finished after its deadline misses for every live session
in it; a tick the clock skipped (the host fell more than a beat behind) was never produced, so it
misses too and has no latency. Ticks, not session-beats, are the independent samples: every
session of a tick shares that tick's latency, so percentiles and the rule-of-three bound are over
ticks.

The first ``warmup_ticks`` ticks (compile, first runs) are labelled ``warmup`` and reported apart;
every steady-state statistic excludes them. Compile times are recorded apart too.

Output: JSON lines (one object per tick and per session event, a summary at the end), a short
text table, and Prometheus exposition text.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Hashable, Sequence
from typing import TextIO

import numpy as np

WARMUP = "warmup"
STEADY = "steady"
QUANTILES = {"p50": 50.0, "p99": 99.0, "p99.9": 99.9}


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

    def to_json(self) -> dict:
        return {"type": "tick", **dataclasses.asdict(self)}


def _percentiles(latencies: np.ndarray) -> dict[str, float | None]:
    """Latency stats in ms over ticks: p50, p99, p99.9 (numpy linear interpolation), max, mean."""
    if latencies.size == 0:
        return {name: None for name in (*QUANTILES, "max", "mean")}
    ms = latencies * 1e3
    stats = {name: float(np.percentile(ms, q)) for name, q in QUANTILES.items()}
    stats["max"] = float(ms.max())
    stats["mean"] = float(ms.mean())
    return stats


class MetricsRecorder:
    """Collects ``TickRecord``s and session events; writes JSON lines to ``sink`` if given.

    Args:
      warmup_ticks: ticks with index < this are warm-up (ticks count from 0).
      sink: a text stream for JSON lines (the caller opens and closes it).
    """

    def __init__(self, warmup_ticks: int, *, sink: TextIO | None = None):
        if warmup_ticks < 0:
            raise ValueError(f"warmup_ticks must be >= 0, got {warmup_ticks}")
        self.warmup_ticks = warmup_ticks
        self.sink = sink
        self.ticks: list[TickRecord] = []
        self.compile_s: dict[str, float] = {}
        self.event_counts: collections.Counter[str] = collections.Counter()
        # Steady state only: per-session beats live, missed beats and underruns.
        self._beats: collections.Counter[Hashable] = collections.Counter()
        self._missed: collections.Counter[Hashable] = collections.Counter()
        self._underruns: collections.Counter[Hashable] = collections.Counter()

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
    ) -> TickRecord:
        """Records one tick.

        Args:
          tick: the tick index k.
          start, deadline: from the beat clock (``TickTiming``).
          readable: when the tick's outputs were readable on the host; None for a skipped tick.
          sessions: ids of the sessions live in this tick.
          underrun_sessions: ids of those whose input beat was incomplete.
          phase: override the warm-up rule ("warmup" | "steady").
        """
        phase = phase or (WARMUP if tick < self.warmup_ticks else STEADY)
        if phase not in (WARMUP, STEADY):
            raise ValueError(f"phase must be {WARMUP!r} or {STEADY!r}, got {phase!r}")
        skipped = readable is None
        latency = None if skipped else readable - start
        missed = skipped or readable > deadline
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
        )
        self.ticks.append(rec)
        if phase == STEADY:
            self._beats.update(sessions)
            self._underruns.update(underrun_sessions)
            if missed:
                self._missed.update(sessions)
        self._write(rec.to_json())
        return rec

    def record_compile(self, what: str, seconds: float) -> None:
        """Records a compile (or other start-up) time, reported apart from the ticks."""
        self.compile_s[what] = seconds
        self._write({"type": "compile", "what": what, "seconds": seconds})

    def record_event(self, event: str, **fields) -> None:
        """Records a session event (admitted, released, refused, failed, ...)."""
        self.event_counts[event] += 1
        self._write({"type": "event", "event": event, **fields})

    def summary(self) -> dict:
        """The serving report of serving-spec §2 as a dict (times in ms)."""
        steady = [r for r in self.ticks if r.phase == STEADY]
        warm = [r for r in self.ticks if r.phase == WARMUP]
        out = self._phase_stats(steady)
        n = out["ticks"]
        out["miss_rate_ticks"] = out["missed_ticks"] / n if n else None
        beats = out["session_beats"]
        out["miss_rate_session_beats"] = out["missed_session_beats"] / beats if beats else None
        # Rule of three: zero misses in n independent ticks bound the miss rate at 3/n (95 %).
        out["miss_rate_bound_95"] = 3.0 / n if n and out["missed_ticks"] == 0 else None
        out["per_session"] = {
            str(sid): {
                "beats": self._beats[sid],
                "missed": self._missed[sid],
                "underruns": self._underruns[sid],
            }
            for sid in self._beats
        }
        out["sessions_with_misses"] = sum(1 for sid in self._beats if self._missed[sid])
        out["max_missed_per_session"] = max(self._missed.values(), default=0)
        out["warmup"] = self._phase_stats(warm)
        out["compile_s"] = dict(self.compile_s)
        out["events"] = dict(self.event_counts)
        return out

    def close(self) -> dict:
        """Writes the summary as the last JSON line and returns it."""
        summary = self.summary()
        self._write({"type": "summary", **summary})
        return summary

    @staticmethod
    def _phase_stats(records: Sequence[TickRecord]) -> dict:
        ran = np.array([r.latency for r in records if not r.skipped], np.float64)
        return {
            "ticks": len(records),
            "ticks_skipped": sum(r.skipped for r in records),
            "session_beats": sum(r.live_sessions for r in records),
            "latency_ms": _percentiles(ran),
            "latency_sum_s": float(ran.sum()),
            "missed_ticks": sum(r.missed for r in records),
            "missed_session_beats": sum(r.live_sessions for r in records if r.missed),
            "underruns": sum(r.underruns for r in records),
        }

    def _write(self, obj: dict) -> None:
        if self.sink is not None:
            self.sink.write(json.dumps(obj, default=str) + "\n")


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(summary: dict) -> str:
    """A short human-readable table of a ``summary()``."""
    lat = summary["latency_ms"]
    warm = summary["warmup"]
    bound = summary["miss_rate_bound_95"]
    rate = summary["miss_rate_session_beats"]
    rate_pct = _fmt(None if rate is None else 100 * rate, ".3f")
    rows = [
        ("steady ticks (skipped)", f"{summary['ticks']} ({summary['ticks_skipped']})"),
        ("session-beats", f"{summary['session_beats']}"),
        (
            "beat latency ms p50/p99/p99.9/max",
            "/".join(_fmt(lat[k]) for k in ("p50", "p99", "p99.9", "max")),
        ),
        ("missed ticks", f"{summary['missed_ticks']}"),
        (
            "missed session-beats (rate)",
            f"{summary['missed_session_beats']} ({rate_pct} %)",
        ),
        (
            "sessions with a miss (max per session)",
            f"{summary['sessions_with_misses']} ({summary['max_missed_per_session']})",
        ),
        ("miss-rate bound, 95 % (3/n)", "-" if bound is None else f"{100 * bound:.3f} % of ticks"),
        ("input underruns", f"{summary['underruns']}"),
        (
            "warm-up ticks, latency max ms, missed",
            f"{warm['ticks']}, {_fmt(warm['latency_ms']['max'])}, {warm['missed_ticks']}",
        ),
    ]
    rows += [(f"compile {what} s", f"{s:.2f}") for what, s in summary["compile_s"].items()]
    rows += [(f"sessions {event}", f"{n}") for event, n in sorted(summary["events"].items())]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def prometheus_text(summary: dict, *, prefix: str = "voicechat") -> str:
    """Steady-state figures of a ``summary()`` in the Prometheus text exposition format."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {prefix}_{name} {help_text}")
        lines.append(f"# TYPE {prefix}_{name} {kind}")
        for suffix_labels, value in samples:
            lines.append(f"{prefix}_{name}{suffix_labels} {value:.9g}")

    lat = summary["latency_ms"]
    quantiles = [
        (f'{{quantile="{q / 100:g}"}}', lat[name] / 1e3)
        for name, q in QUANTILES.items()
        if lat[name] is not None
    ]
    ran = summary["ticks"] - summary["ticks_skipped"]
    metric(
        "beat_latency_seconds",
        "summary",
        "Tick start to outputs readable on the host, steady state.",
        [*quantiles, ("_sum", summary["latency_sum_s"]), ("_count", ran)],
    )
    counters = [
        ("ticks_total", "Steady-state ticks (skipped included).", summary["ticks"]),
        (
            "ticks_skipped_total",
            "Ticks skipped because the host fell behind.",
            summary["ticks_skipped"],
        ),
        ("session_beats_total", "Steady-state session-beats.", summary["session_beats"]),
        ("missed_ticks_total", "Ticks readable after their deadline.", summary["missed_ticks"]),
        (
            "missed_session_beats_total",
            "Session-beats readable after their deadline.",
            summary["missed_session_beats"],
        ),
        (
            "input_underruns_total",
            "Session-beats whose input had not fully arrived.",
            summary["underruns"],
        ),
    ]
    for name, help_text, value in counters:
        metric(name, "counter", help_text, [("", value)])
    events = summary["events"]
    metric(
        "session_events_total",
        "counter",
        "Session events by kind.",
        [(f'{{event="{e}"}}', n) for e, n in sorted(events.items())],
    )
    if lat["max"] is not None:
        metric(
            "beat_latency_max_seconds",
            "gauge",
            "Worst steady-state beat latency.",
            [("", lat["max"] / 1e3)],
        )
    return "\n".join(lines) + "\n"
