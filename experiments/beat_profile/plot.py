"""Stacked bar per slot count: each component's ms per frame-step, beside the whole tick's.

Reads the JSON-lines rows that ``run.py`` wrote and saves a PNG. Slot counts whose components were
not profiled show the whole tick alone.
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("rows", "experiments/beat_profile/results/h200_voicechat_11b.jsonl", "Rows.")
flags.DEFINE_string("png", "experiments/beat_profile/profile.png", "Output PNG.")


def main(argv):
    del argv
    with open(FLAGS.rows) as f:
        rows = [json.loads(line) for line in f]
    ticks = {r["slots"]: r["ms_per_frame_step"] for r in rows if r.get("kind") == "tick"}
    comps = [r for r in rows if r.get("kind") == "component"]
    names: list[str] = []
    for r in comps:
        if r["component"] not in names:
            names.append(r["component"])
    slots = sorted(ticks)
    fig, ax = plt.subplots(figsize=(10, 6))
    x = range(len(slots))
    colors = plt.get_cmap("tab20").colors
    bottom = [0.0] * len(slots)
    for i, name in enumerate(names):
        vals = [
            next((r["ms"] for r in comps if r["slots"] == b and r["component"] == name), 0.0)
            for b in slots
        ]
        ax.bar([p - 0.2 for p in x], vals, 0.4, bottom=bottom, label=name, color=colors[i % 20])
        bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
    ax.bar([p + 0.2 for p in x], [ticks[b] for b in slots], 0.4, color="0.4", label="whole tick")
    ax.axhline(80.0, color="red", linestyle="--", linewidth=1, label="80 ms (real time)")
    ax.set_xticks(list(x), [f"B={b}" for b in slots])
    ax.set_ylabel("ms per frame-step (a 160 ms beat has two)")
    ax.set_title("11B, H200, cap 1,500 frames: components (left) and the whole tick (right)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(FLAGS.png, dpi=110)


if __name__ == "__main__":
    app.run(main)
