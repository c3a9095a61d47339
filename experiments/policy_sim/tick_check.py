"""The capacity fit's step cost against the scheduling experiments' measured H200 ticks.

The fit (``sim.fit_capacity``) has no row between 1 and 56 slots, and splits its slope between
state and caches by the component rows' byte share. The engine parts of ``batching_policy``,
``slot_buckets`` and ``phase_stagger`` time ticks of 1-32 slots back to back with caches nearly
empty. This script puts the two side by side (the fit at empty and at full caches), then fits one
line through every multi-slot point, those ticks and the capacity probes alike
(``sim.fit_tick_line``, the step cost ``--tick_line`` simulates with). The 2- and 4-slot ticks
(timed by ``frames_per_tick``'s script) lie below ``--min_slots``: checked against the line, not
fitted. Rows (JSON lines, with their provenance: ``experiments.harness``, the device
``simulation``) to ``--out``; a table last. README.md beside this file. Host only: no device is
used.
"""

from __future__ import annotations

import dataclasses
import pathlib

from absl import app, flags

from experiments import harness
from experiments.policy_sim import engine_runs as er
from experiments.policy_sim import fits, sim

_HERE = pathlib.Path(__file__).resolve().parent

FLAGS = flags.FLAGS
flags.DEFINE_string("capacity_rows", str(fits.CAPACITY_ROWS), "experiments/capacity rows.")
flags.DEFINE_string("profile_rows", str(er.H200_PROFILE), "beat_profile rows (component bytes).")
flags.DEFINE_list(
    "tick_rows", [str(p) for p in fits.TICK_ROWS], "The scheduling experiments' H200 engine rows."
)
flags.DEFINE_string("out", str(_HERE / "results/tick_check.jsonl"), "Rows (overwritten).")
flags.DEFINE_integer("min_slots", 8, "The line is fitted to the points of at least this many.")


def main(argv):
    del argv
    fit = fits.capacity_fit("auto", er.read_rows(FLAGS.profile_rows))
    cost = fit.cost
    points = fits.tick_points()
    rows = [fits.model_row(fit)]
    for p in points:
        B = p["slots"]
        rows.append({"kind": "tick", **p, "fit_empty_ms": cost.tick_ms(B, 0.0),
                     "fit_full_ms": cost.tick_ms(B, 1.0)})  # fmt: skip
    refit = sim.fit_tick_line(fit, points, min_slots=FLAGS.min_slots)
    # the line alone, at 1-7 slots too
    line = dataclasses.replace(refit.cost, one_slot_ms=None, small_line=None)
    B = [b for b, _ in refit.step_points if b > 1]
    for b, y in ((b, 2 * y) for b, y in refit.step_points if b > 1):
        rows.append({"kind": "line_point", "slots": b, "tick_ms": y,
                     "line_ms": line.tick_ms(b), "error": line.tick_ms(b) / y - 1})  # fmt: skip
    for p in (p for p in points if 1 < p["slots"] < FLAGS.min_slots):  # off the fit: a check
        rows.append({"kind": "below_line", **p, "line_ms": line.tick_ms(p["slots"]),
                     "error": line.tick_ms(p["slots"]) / p["tick_ms"] - 1})  # fmt: skip
    rows.append(
        {
            "kind": "line",
            "a_ms": line.a_ms,
            "slope_ms": line.b_ms + line.c_ms,
            "min_slots": FLAGS.min_slots,
            "points": len(B),
            "max_abs_error": max(abs(r["error"]) for r in rows if r["kind"] == "line_point"),
            "small_line": refit.cost.small_line,
        }
    )
    if FLAGS.out:
        pathlib.Path(FLAGS.out).unlink(missing_ok=True)
    log = harness.RowLog(FLAGS.out, harness.SIMULATION)
    rows = [log.write(r) for r in rows]
    print(f"capacity fit (auto): {cost.a_ms:.2f} + {cost.b_ms:.3f} B + {cost.c_ms:.3f} B x "
          "ms a frame-step")  # fmt: skip
    print(f"{'row':34s} {'B':>3} {'tick':>6} {'fit x=0':>12} {'fit x=1':>12}")
    for r in rows:
        if r["kind"] == "tick":
            e0, e1 = (r[k] / r["tick_ms"] - 1 for k in ("fit_empty_ms", "fit_full_ms"))
            print(
                f"{r['row']:34s} {r['slots']:>3} {r['tick_ms']:6.1f} "
                f"{r['fit_empty_ms']:6.1f} {e0:+5.0%} {r['fit_full_ms']:6.1f} {e1:+5.0%}"
            )
    if refit.cost.small_line is not None:
        a, s, below = refit.cost.small_line
        print(f"  their own line (2-{below - 1} slots, as --tick_line simulates them): "
              f"{a:.2f} + {s:.3f} B ms a frame-step")  # fmt: skip
    for r in (r for r in rows if r["kind"] == "below_line"):
        print(f"  {r['row']} ({r['slots']} slots, not fitted): {r['tick_ms']:.1f} ms, the line "
              f"{r['line_ms']:.1f} ({r['error']:+.1%})")  # fmt: skip
    last = rows[-1]
    print(
        f"one line through {last['points']} points of >= {FLAGS.min_slots} slots: "
        f"{last['a_ms']:.2f} + {last['slope_ms']:.3f} B ms a frame-step, "
        f"max error {last['max_abs_error']:.1%}"
    )
    print(
        f"  at 1 slot it gives {line.tick_ms(1):.1f} ms; measured (all XLA): "
        + ", ".join(f"{p['tick_ms']:.1f}" for p in points if p["slots"] == 1)
    )


if __name__ == "__main__":
    app.run(main)
