"""Stacked bar per slot count: each component's ms per frame-step, beside the whole tick's.

Reads the JSON-lines rows that ``run.py`` wrote and saves a PNG, through the experiments' one
plotting path (``experiments.plot``). Slot counts whose components were not profiled show the
whole tick alone.
"""

from __future__ import annotations

from absl import app, flags

from experiments import plot, rows

FLAGS = flags.FLAGS
flags.DEFINE_string("rows", "experiments/beat_profile/results/h200_voicechat_11b.jsonl", "Rows.")
flags.DEFINE_string("png", "experiments/beat_profile/profile.png", "Output PNG.")


def main(argv: list[str]) -> None:
    del argv
    found = rows.load(FLAGS.rows)
    ticks = [r for r in found if r.get("kind") == "tick"]
    slots = sorted(r["slots"] for r in ticks)
    fig, ax = plot.figure(size=(10, 6))
    colors = plot.pyplot().get_cmap("tab20").colors
    comps = [r for r in found if r.get("kind") == "component"]
    plot.bars(ax, comps, "slots", "ms", xs=slots, stack="component", offset=-0.2, width=0.4,
              colors=colors)  # fmt: skip
    plot.bars(ax, ticks, "slots", "ms_per_frame_step", xs=slots, offset=0.2, width=0.4,
              color="0.4", label="whole tick")  # fmt: skip
    plot.rule(ax, 80.0, color="red", linestyle="--", linewidth=1, label="80 ms (real time)")
    ax.set_xticks(list(range(len(slots))), [f"B={b}" for b in slots])
    ax.set_ylabel("ms per frame-step (a 160 ms beat has two)")
    ax.set_title("11B, H200, cap 1,500 frames: components (left) and the whole tick (right)")
    ax.legend(fontsize=7, loc="upper left")
    plot.save(fig, FLAGS.png, dpi=110)


if __name__ == "__main__":
    app.run(main)
