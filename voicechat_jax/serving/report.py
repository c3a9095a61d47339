"""The serving report in its two readable forms: a short text table (``format_table``) and
Prometheus (``SummaryCollector`` for a live registry, ``prometheus_text`` for a summary), both from
a ``metrics.MetricsRecorder`` summary."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)

from voicechat_jax.serving.metrics import QUANTILES, MetricsRecorder


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _by_cause(counts: dict[str, int]) -> str:
    text = f"host {counts['host']} / device {counts['device']}"
    return text + (f" / unknown {counts['unknown']}" if counts.get("unknown") else "")


def format_table(summary: dict) -> str:
    """A short human-readable table of a ``summary()``."""
    lat = summary["latency_ms"]
    warm = summary["warmup"]
    bound = summary["miss_rate_bound_95"]
    rate = summary["miss_rate_session_beats"]
    rate_pct = _fmt(None if rate is None else 100 * rate, ".3f")
    stages = summary["host_stages_ms"]
    gc_policy, gc_auto = summary["gc"]["policy"], summary["gc"]["automatic"]
    rows = [
        ("steady ticks (skipped)", f"{summary['ticks']} ({summary['ticks_skipped']})"),
        ("idle ticks (nothing live: not run)", f"{summary.get('idle_ticks', 0)}"),
        ("session-beats", f"{summary['session_beats']}"),
        (
            "beat latency ms p50/p99/p99.9/max",
            "/".join(_fmt(lat[k]) for k in ("p50", "p99", "p99.9", "max")),
        ),
        ("missed ticks", f"{summary['missed_ticks']}"),
        ("  late, by cause", _by_cause(summary["missed_by_cause"])),
        ("  skipped, by cause", _by_cause(summary["skipped_by_cause"])),
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
            "host ms p99/max wake|prepare|dispatch|pickup",
            " | ".join(
                f"{_fmt(stages[s]['p99'])}/{_fmt(stages[s]['max'])}"
                for s in ("wake", "prepare", "dispatch", "pickup")
            ),
        ),
        (
            "device ms p50/p99/max",
            "/".join(_fmt(stages["device"][k]) for k in ("p50", "p99", "max")),
        ),
        (
            "GC collections gen 0/1/2 (automatic)",
            "/".join(str(n) for n in gc_policy)
            + f" ({'/'.join(str(n) for n in gc_auto)}), max "
            + f"{_fmt(max(summary['gc']['max_pause_ms']))} ms",
        ),
        (
            "warm-up ticks, latency max ms, missed",
            f"{warm['ticks']}, {_fmt(warm['latency_ms']['max'])}, {warm['missed_ticks']}",
        ),
    ]
    rows += [(f"compile {what} s", f"{s:.2f}") for what, s in summary["compile_s"].items()]
    rows += [(f"sessions {event}", f"{n}") for event, n in sorted(summary["events"].items())]
    rows += [(f"sessions ended: {why}", f"{n}") for why, n in sorted(summary["ended"].items())]
    rows.append(("sessions failed", f"{summary['failed_sessions']}"))
    if "admission" in summary:  # scheduler.AdmissionControl's counts (the runner adds them)
        a = summary["admission"]
        rows.append(("sessions queued (beats waited)", f"{a['queued']} ({a['waited_beats']})"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


class SummaryCollector:
    """A ``prometheus_client`` collector over a summary (or a live recorder's summaries)."""

    def __init__(self, source: dict | MetricsRecorder, *, prefix: str = "voicechat"):
        self.source = source
        self.prefix = prefix

    def describe(self):
        return []  # no fixed description: the families depend on what was measured

    def collect(self):
        s = self.source.summary() if isinstance(self.source, MetricsRecorder) else self.source
        p = self.prefix
        lat = s["latency_ms"]
        ran = s["ticks"] - s["ticks_skipped"]
        latency = SummaryMetricFamily(
            f"{p}_beat_latency_seconds",
            "Tick start to outputs readable on the host, steady state.",
            count_value=ran,
            sum_value=s["latency_sum_s"],
        )
        for name, q in QUANTILES.items():
            if lat[name] is not None:
                latency.add_sample(
                    f"{p}_beat_latency_seconds", {"quantile": f"{q / 100:g}"}, lat[name] / 1e3
                )
        yield latency
        hist = s.get("latency_histogram")
        if hist is not None:
            cumulative = np.cumsum(hist["counts"]).tolist()
            buckets = [(f"{le:g}", n) for le, n in zip(hist["le_s"], cumulative, strict=False)]
            buckets.append(("+Inf", cumulative[-1]))
            yield HistogramMetricFamily(
                f"{p}_beat_latency_histogram_seconds",
                "Tick start to outputs readable on the host, steady state, by bucket (whole run).",
                buckets=buckets,
                sum_value=s["latency_sum_s"],
            )
        counters = [
            ("ticks", "Steady-state ticks (skipped included).", s["ticks"]),
            ("ticks_skipped", "Ticks skipped because the host fell behind.", s["ticks_skipped"]),
            (
                "ticks_idle",
                "Ticks not run because no session was live or asked for a slot.",
                s.get("idle_ticks", 0),
            ),
            ("session_beats", "Steady-state session-beats.", s["session_beats"]),
            ("missed_ticks", "Ticks readable after their deadline, or skipped.", s["missed_ticks"]),
            (
                "missed_session_beats",
                "Session-beats readable after their deadline.",
                s["missed_session_beats"],
            ),
            ("input_underruns", "Session-beats whose input had not fully arrived.", s["underruns"]),
            ("sessions_failed", "Sessions that failed.", s["failed_sessions"]),
        ]
        for name, help_text, value in counters:
            yield CounterMetricFamily(f"{p}_{name}", help_text, value=value)
        by_cause = CounterMetricFamily(
            f"{p}_missed_ticks_by_cause",
            "Steady-state missed ticks by cause (late: readable after the deadline; skipped).",
            labels=["cause", "kind"],
        )
        for kind, key in (("late", "missed_by_cause"), ("skipped", "skipped_by_cause")):
            for cause, n in s[key].items():
                by_cause.add_metric([cause, kind], n)
        yield by_cause
        stages = GaugeMetricFamily(
            f"{p}_tick_stage_seconds",
            "Per-tick host timeline over the steady window: p99 and max of each stage.",
            labels=["stage", "stat"],
        )
        for stage, stats in s["host_stages_ms"].items():
            for stat in ("p99", "max"):
                if stats[stat] is not None:
                    stages.add_metric([stage, stat], stats[stat] / 1e3)
        yield stages
        gc_counts = CounterMetricFamily(
            f"{p}_gc_collections",
            "Garbage collections during the run, by generation and by who ran them.",
            labels=["generation", "by"],
        )
        for by in ("policy", "automatic"):
            for gen, n in enumerate(s["gc"][by]):
                gc_counts.add_metric([str(gen), by], n)
        yield gc_counts
        gc_max = GaugeMetricFamily(
            f"{p}_gc_pause_max_seconds", "Longest collection pause.", labels=["generation"]
        )
        for gen, ms in enumerate(s["gc"]["max_pause_ms"]):
            gc_max.add_metric([str(gen)], ms / 1e3)
        yield gc_max
        events = CounterMetricFamily(
            f"{p}_session_events", "Session events by kind.", labels=["event"]
        )
        for event, n in sorted(s["events"].items()):
            events.add_metric([event], n)
        yield events
        ended = CounterMetricFamily(
            f"{p}_sessions_ended", "Sessions that ended before the run did.", labels=["reason"]
        )
        for reason, n in sorted(s["ended"].items()):
            ended.add_metric([reason], n)
        yield ended
        if lat["max"] is not None:
            yield GaugeMetricFamily(
                f"{p}_beat_latency_max_seconds",
                "Worst steady-state beat latency.",
                value=lat["max"] / 1e3,
            )


def prometheus_text(summary: dict, *, prefix: str = "voicechat") -> str:
    """A ``summary()`` in the Prometheus text exposition format (via ``prometheus_client``)."""
    registry = CollectorRegistry()
    registry.register(SummaryCollector(summary, prefix=prefix))
    return generate_latest(registry).decode()
