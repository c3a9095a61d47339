"""Beat latency against sessions from the capacity rows, with the 160 ms beat and the 140 ms p99
target, through the experiments' one plotting path (``experiments.plot``). See README.md.

  PYTHONPATH=. python3 experiments/capacity/plot.py \
    --rows=experiments/capacity/results/h200_reference.jsonl \
    --out=experiments/capacity/results/latency_vs_sessions.png
"""

from __future__ import annotations

import collections

from absl import app, flags

from experiments import plot, rows

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", None, "JSON-lines files of capacity rows.")
flags.DEFINE_string("out", None, "PNG written.")
flags.mark_flags_as_required(["rows", "out"])

BEAT_MS = 160.0
TARGET_P99_MS = 140.0


def series(rows: list[dict]) -> dict[str, list[dict]]:
    """Served rows grouped by configuration, loop and fill (the last row per session count wins).

    A configuration is the policy with its codec products and speech-decoder attention; rows from
    before those were recorded ran full fp32 codec products and XLA's attention.
    """
    groups: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for r in rows:
        if r.get("kind") != "serve":
            continue
        fill = "full" if r.get("hold_full") else "churn" if r.get("churn") else "filling"
        # a policy named for its codec products is the same configuration as its base policy
        # with them (the rows name the products either way)
        config = r.get("policy", "reference").removesuffix("_tf32x3_codec")
        config = {"tf32x3_codec": "reference"}.get(config, config)
        if r.get("codec_matmul", "float32") != "float32":
            config += f" + {r['codec_matmul']} codec"
        if r.get("tts_attention", "xla") != "xla":
            config += f" + {r['tts_attention']}"
        name = f"{config}, {r['loop']}, {fill} caches"
        groups[name][r["sessions"]] = r
    return {k: [v[n] for n in sorted(v)] for k, v in sorted(groups.items())}


def main(argv: list[str]) -> None:
    del argv
    found = [r for path in FLAGS.rows for r in rows.load(path)]
    named = [{**p, "series": name} for name, points in series(found).items() for p in points]
    fig, ax = plot.figure(size=(11, 5))
    ax.set_prop_cycle(color=plot.pyplot().get_cmap("tab20").colors)  # more series than tab10's
    ys = [
        plot.Y("p99_ms", "o-", label="{group}: p99"),
        plot.Y("p50_ms", "s--", style={"alpha": 0.6}),
        plot.Y("max_ms", "^", style={"alpha": 0.6}),
    ]
    plot.lines(ax, named, "sessions", ys, group="series")
    for p in named:
        if p["missed_ticks"]:
            ax.annotate(f"{p['missed_ticks']} missed", (p["sessions"], p["max_ms"]), fontsize=8)
    top = max([BEAT_MS, *(p["max_ms"] for p in named)])
    low = min([TARGET_P99_MS, *(p["p50_ms"] for p in named)])
    n = [p["sessions"] for p in named] or [1]
    ax.set_xlim(min(n) - 8, max(n) + 8)
    ax.set_ylim(low - 10, top * 1.05)
    plot.rule(ax, BEAT_MS, text="160 ms beat", color="red", lw=1)
    plot.rule(ax, TARGET_P99_MS, text="140 ms p99 target", color="gray", lw=1, ls=":")
    ax.set_xlabel("sessions (one H200, 11B, 1,500-frame cap)")
    ax.set_ylabel("beat latency, ms (square p50, circle p99, triangle max)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    plot.save(fig, FLAGS.out, dpi=120)


if __name__ == "__main__":
    app.run(main)
