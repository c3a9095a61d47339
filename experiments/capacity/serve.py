"""Capacity on the user's path: ``voicechat-serve``'s own run, every session through its roll-over.

For each policy in ``--policies``, session count in ``--sessions`` and loop in ``--loops``, the
run ``voicechat-serve --model=M --slots=N --sessions=N --seconds=S --at_cap=memory --loop=L``
makes (``serving.runner.run``: random weights unless ``--checkpoint``, the bundled recording for
every session, the real-time clock, every output written to files), and one row of what it held:
the steady ticks, the beat latency, the misses and skips by cause, each host stage at p99, the
roll-overs served, the compile and warm-up times, and the byte floor of the beat (a slot's bytes
from its state under the policy, ``engine.frame_step_bytes``). A point holds when no steady tick
missed over at least ``--min_ticks`` ticks; with ``--seconds=170`` at the two-minute cap a run
covers a full fill and every session's memory roll-over (spread one a beat from the soft
threshold, 90 s in). Rows go to ``--out`` as they are measured, each with the commit, device,
jax version and command (``experiments.harness``).

The kernel-level worst case, every cache held full on every tick with no roll-over, is
``experiments/capacity/run.py --hold_full``: labelled as such, never the headline.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import jax
import numpy as np
from absl import app, flags

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax.engine import byte_floor_ms, template_fn
from voicechat_jax.model import voicechat
from voicechat_jax.precision import policy
from voicechat_jax.serving import metrics as metrics_lib
from voicechat_jax.serving import runner

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "voicechat_11b", "Model preset (random weights unless --checkpoint).")
flags.DEFINE_string("checkpoint", None, "A converted checkpoint to serve instead.")
flags.DEFINE_list("policies", ["reference"], "Precision policies (voicechat_jax.precision).")
flags.DEFINE_list("sessions", ["64"], "Session counts (slots = sessions).")
flags.DEFINE_list("loops", ["dispatch", "resident"], "Loops to serve each point on.")
flags.DEFINE_float("seconds", 170.0, "Seconds served per point (170 s: 1,062 beats).")
flags.DEFINE_integer("context_frames", 1500, "The context cap (1,500: two minutes).")
flags.DEFINE_string("at_cap", "memory", "What a session does at the cap (ServeConfig.at_cap).")
flags.DEFINE_integer("min_ticks", 1059, "Steady ticks a holding point must have served.")
flags.DEFINE_string("ssm_kernel", "auto", "ServeConfig.ssm_kernel.")
flags.DEFINE_string("attention", "auto", "ServeConfig.attention.")
flags.DEFINE_string("out", None, "Rows (JSON lines), appended as measured.")
flags.DEFINE_string("output_dir", None, "Where each run writes its outputs (default: a temp dir).")
flags.DEFINE_float(
    "switch_interval_ms",
    None,
    "Python's GIL switch interval for the runs (sys.setswitchinterval; default Python's, 5 ms).",
)
flags.DEFINE_string("table", None, "Print the README table of these rows (JSON lines) and exit.")


def floor_ms(cfg, serve: config_lib.ServeConfig) -> float:
    """The byte floor of a beat of ``serve.slots`` sessions at the cap (``engine.byte_floor_ms``),
    from the shapes alone."""
    params = voicechat.abstract(cfg, serve.precision)
    template = jax.eval_shape(template_fn(cfg, serve), params)
    return byte_floor_ms(params, template, serve.slots)


def row_of(
    result: runner.RunResult, n: int, loop: str, name: str, floor: float, metrics_path: str
) -> dict:
    """The row of one run: what it held, where each beat's time went, and what the roll-over
    beats cost over the plain beats before them (``rollover_window``)."""
    s = result.summary
    held = s["missed_ticks"] == 0 and s["ticks"] >= FLAGS.min_ticks
    return {
        "kind": "user_path",
        "policy": name,
        "sessions": n,
        "loop": loop,
        "seconds": FLAGS.seconds,
        "context_frames": FLAGS.context_frames,
        "at_cap": FLAGS.at_cap,
        **harness.latency_fields(s),
        "rollovers": s["events"].get("rollover", 0),
        "switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3),
        "failed_sessions": result.failed,
        "compile_s": s["compile_s"],
        "floor_ms": floor,
        "holds": held,
        **rollover_window(metrics_path),
    }


def rollover_window(metrics_path: str, before: int = 50) -> dict:
    """What a roll-over costs its beat (issue 30's "a beat with a roll-over runs at most 3 ms over
    a plain beat at the same fill"), from the run's ``metrics.jsonl``.

    A session's memory roll-over is recorded at the tick k whose slot was reseeded: its capsule was
    prefilled after tick k-1 and swapped in before tick k, so both programs' device work lies
    between the two ticks and shows in beat k. The roll-over beats are the steady ticks with at
    least one such event; the plain beats at the same fill are the ``before`` steady ticks just
    before the first roll-over (every cache then near the cap). Each side's beats (``n``), and
    their latency and device stage in ms as the serving summary gives them
    (``metrics.percentiles``)."""
    ticks, rolled = {}, set()
    with open(metrics_path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "tick" and rec["phase"] == "steady" and not rec["skipped"]:
                ticks[rec["tick"]] = rec
            elif rec.get("event") == "rollover" and rec.get("reason") != "cap":
                rolled.add(rec["tick"])
    rolled &= ticks.keys()
    if not rolled:
        return {"rollover_beats": None, "plain_beats_before": None}
    first = min(rolled)
    plain = [k for k in ticks if first - before <= k < first]

    def side(ks):
        lat = np.array([ticks[k]["latency"] for k in ks], np.float64)
        dev = [ticks[k]["stages"]["device"] for k in ks if ticks[k].get("stages")]
        return {
            "n": len(ks),
            "latency_ms": metrics_lib.percentiles(lat),
            "device_ms": metrics_lib.percentiles(np.array(dev, np.float64)),
        }

    out = {"rollover_beats": side(sorted(rolled)), "plain_beats_before": side(plain)}
    r, p = out["rollover_beats"]["latency_ms"], out["plain_beats_before"]["latency_ms"]
    if plain:
        out["rollover_extra_ms"] = {q: r[q] - p[q] for q in ("p50", "p99", "max")}
    return out


def table(rows: list[dict]) -> str:
    """The README's table of ``user_path`` rows (markdown): one line per point, its commit."""
    head = (
        "| policy | sessions | loop | steady ticks | p50 / p99 / max ms | missed (host, device) "
        "| p99 ms: prepare / dispatch / device / pickup | roll-overs | floor ms | holds | commit |"
    )
    lines = [head, "|---|---:|---|---:|---|---|---|---:|---:|---|---|"]
    for r in rows:
        if r.get("kind") != "user_path":
            continue
        st = r["stage_p99_ms"]
        stages = " / ".join(
            "-" if st.get(k) is None else f"{st[k]:.1f}"
            for k in ("prepare", "dispatch", "device", "pickup")
        )
        cause = r["missed_by_cause"]
        lines.append(
            f"| {r['policy']} | {r['sessions']} | {r['loop']} | {r['steady_ticks']:,} "
            f"| {r['p50_ms']:.1f} / {r['p99_ms']:.1f} / {r['max_ms']:.1f} "
            f"| {r['missed_ticks']} ({cause['host']}, {cause['device']}) | {stages} "
            f"| {r['rollovers']} | {r['floor_ms']:.1f} | {'yes' if r['holds'] else 'no'} "
            f"| `{r['commit']}` |"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.table:
        with open(FLAGS.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    if FLAGS.switch_interval_ms is not None:
        # The beat thread hands off to the reader and writer threads: each wait for the GIL can
        # last up to this interval.
        sys.setswitchinterval(FLAGS.switch_interval_ms / 1e3)
    rows = harness.RowLog(FLAGS.out)
    out_root = FLAGS.output_dir or tempfile.mkdtemp(prefix="capacity_serve_")
    cfg = config_lib.PRESETS[FLAGS.model]()
    for name in FLAGS.policies:
        for n in (int(x) for x in FLAGS.sessions):
            serve = config_lib.ServeConfig(
                slots=n,
                context_frames=FLAGS.context_frames,
                at_cap=FLAGS.at_cap,
                precision=policy(name),
                ssm_kernel=FLAGS.ssm_kernel,
                attention=FLAGS.attention,
            )
            floor = floor_ms(cfg, serve)
            for loop in FLAGS.loops:
                options = runner.RunOptions(
                    serve=serve,
                    model=FLAGS.model,
                    checkpoint=FLAGS.checkpoint,
                    sessions=n,
                    seconds=FLAGS.seconds,
                    loop=loop,
                    clock="realtime",
                    output_dir=os.path.join(out_root, f"{name}_{n}_{loop}"),
                    overwrite=True,
                )
                try:
                    result = runner.run(options)
                except Exception as e:  # a count that does not fit is a result
                    rows.write({"kind": "error", "policy": name, "sessions": n, "loop": loop,
                                "error": str(e)[:300]})  # fmt: skip
                    continue
                metrics_path = os.path.join(options.output_dir, "metrics.jsonl")
                row = rows.write(row_of(result, n, loop, name, floor, metrics_path))
                print(
                    f"{name} {n} {loop}: p50/p99/max {row['p50_ms']:.1f} / {row['p99_ms']:.1f} / "
                    f"{row['max_ms']:.1f} ms, missed {row['missed_ticks']} "
                    f"{row['missed_by_cause']} of {row['steady_ticks']}, "
                    f"p99 stages {_fmt(row['stage_p99_ms'])}, "
                    f"roll-overs {row['rollovers']}, floor {floor:.1f} ms: "
                    f"{'holds' if row['holds'] else 'does not hold'}; "
                    f"roll-over beats over the plain ones before: {row.get('rollover_extra_ms')}"
                )


def _fmt(stages: dict) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in stages.items() if v is not None)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
