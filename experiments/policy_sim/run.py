"""Batching-policy simulator: fit, validate against the H200 serving rows, then use it.

Fits the step-cost and tail models (``sim.py``) to H200 rows, checks the simulated lockstep server
against the real one, compares policies (lockstep, batch-1 stepping, request-style batching with a
window) at fixed loads, serves an hour of Poisson calls, and sketches several GPUs behind a router.
Writes raw rows (JSON lines, as they come, each with its provenance: ``experiments.harness``, the
device ``simulation``; a row that names a measured row it was fitted to gives that row's commit as
``input_commit``) and a PNG; prints short tables last. ``--fit`` picks the rows:
``capacity`` (default: the current engine's ``experiments/capacity`` rows, ``sim.fit_capacity``)
or ``beat_profile`` (the older engine's ``experiments/beat_profile`` rows, ``sim.fit_h200``: the
README's historical section). See README.md beside this file. Host only: no device is used.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np
from absl import app, flags, logging

from experiments import harness
from experiments.policy_sim import engine_runs as er
from experiments.policy_sim import fits, sim

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "fit",
    "capacity",
    ["capacity", "beat_profile"],
    "Rows the models are fitted to: 'capacity' (--capacity_rows: the current engine's batch-1 "
    "baseline, hold_full probes and serving rows) or 'beat_profile' (--profile_rows: the older "
    "engine's tick and serving rows).",
)
fits.define_config_flag()
flags.DEFINE_string(
    "capacity_rows",
    str(_REPO / "experiments/capacity/results/h200_reference.jsonl"),
    "capacity rows: kind=baseline, probe and serve (only hold_full runs are used).",
)
flags.DEFINE_string(
    "profile_rows",
    str(_REPO / "experiments/beat_profile/results/h200_voicechat_11b.jsonl"),
    "beat_profile rows: kind=tick, serve and component (the components' byte share is used by "
    "both fits).",
)
flags.DEFINE_string(
    "latency_rows",
    str(_REPO / "experiments/beat_latency/results/h200_voicechat_11b.jsonl"),
    "Older beat_latency rows (cap 256), for the context check only.",
)
flags.DEFINE_string(
    "out",
    None,
    "JSON-lines output (overwritten); default results/rows_current.jsonl for --fit=capacity "
    "(results/rows_xla_tts.jsonl with --capacity_config=xla_tts), results/rows.jsonl for "
    "--fit=beat_profile.",
)
flags.DEFINE_string(
    "plot",
    None,
    "PNG output ('' for none); default policy_sim_current.png for --fit=capacity "
    "(policy_sim_xla_tts.png with --capacity_config=xla_tts), policy_sim.png for "
    "--fit=beat_profile.",
)
flags.DEFINE_integer("validate_ticks", 200, "Steady ticks per validation run (as measured).")
flags.DEFINE_integer("seeds", 5, "Seeds per validation and capacity run.")
flags.DEFINE_integer("capacity_beats", 500, "Beats per capacity probe.")
flags.DEFINE_integer("hour_beats", 22500, "Beats of Poisson traffic (22,500 = one hour).")
flags.DEFINE_list(
    "erlangs", ["20", "40", "60", "80", "100"], "Arrival rate x --mean_call_s (before the cap)."
)
flags.DEFINE_float("mean_call_s", 60.0, "Mean call length (exponential), seconds.")
flags.DEFINE_float("max_call_s", 120.0, "Calls end at the context cap (1,500 frames = 120 s).")
flags.DEFINE_list("gpus", ["1", "2", "4", "8"], "Engine counts for the several-GPU sketch.")
flags.DEFINE_list("windows_ms", ["0", "20", "60"], "Request-batching windows.")


_DEFAULT_OUT = {
    "capacity": "results/rows_current.jsonl",
    "capacity_xla_tts": "results/rows_xla_tts.jsonl",
    "beat_profile": "results/rows.jsonl",
}
_DEFAULT_PLOT = {
    "capacity": "policy_sim_current.png",
    "capacity_xla_tts": "policy_sim_xla_tts.png",
    "beat_profile": "policy_sim.png",
}


def _mean_summary(runs: list[dict]) -> dict:
    keys = ("p50_ms", "p99_ms", "max_ms", "missed", "miss_rate", "busy_gpu_s_per_conv_h")
    return {k: float(np.mean([r[k] for r in runs])) for k in keys}


def _p999(real: dict, runs: list[sim.Result]) -> dict:
    """The real row's p99.9 (where it has one) beside the simulated one (mean over seeds)."""
    if "p99.9_ms" not in real:
        return {}
    sim_p = [float(np.nanpercentile(x.latency_ms, 99.9)) for x in runs]
    return {"real_p99.9_ms": real["p99.9_ms"], "sim_p99.9_ms": float(np.mean(sim_p))}


def _capacity_extras(fit: sim.H200Fit, caps: dict, seeds, n_beats: int, emit) -> None:
    """Beside the capacity fit: lockstep capacity with the largest host overhead a serving row
    shows (its p50 minus its probe: a pessimistic bound, the host's share having grown at the top
    row), and the batch-1 capacity against the measured baselines' ``160 // p99`` rule."""
    own = {r["sessions"]: r["p50_ms"] - fit.tick_of[r["sessions"]]
           for r in fit.serves if r["sessions"] in fit.tick_of}  # fmt: skip
    n_worst = max(own, key=own.get)
    t = dataclasses.replace(fit.quiet, host_ms=own[n_worst])

    def run_at(n: int) -> list[dict]:
        return seeds(lambda g: sim.simulate_lockstep(fit.cost, n_beats, n, slots=n, tail=t, rng=g))

    c = capacity(run_at)
    at = _mean_summary(run_at(c)) if c else {}
    emit({"kind": "capacity", "policy": "lockstep_host_max", "capacity": c,
          "host_ms": own[n_worst], "host_from_sessions": n_worst,
          "held_gpu_s_per_conv_h": 3600.0 / c if c else None,
          "p99_at_capacity_ms": at.get("p99_ms"),
          "busy_gpu_s_per_conv_h": at.get("busy_gpu_s_per_conv_h")})  # fmt: skip
    for r in (r for r in fit.ticks if r["kind"] == "baseline"):
        model_p99 = fit.cost.tick_ms(1) + fit.tail.p99_minus_p50_ms(1)
        emit({"kind": "baseline_check", "input_commit": r.get("commit"),
              "measured_p50_ms": r["ms_p50"], "measured_p99_ms": r["ms_p99"],
              "measured_held": r["sessions_held"],
              "rule_held": int(sim.BEAT_MS // r["ms_p99"]), "fit_tick_ms": fit.cost.tick_ms(1),
              "model_p99_ms": model_p99, "model_rule_held": int(sim.BEAT_MS // model_p99),
              "sim_batch1_capacity": caps["batch1"]})  # fmt: skip


def capacity(run_at, start: int = 1, stop: int = 256) -> int:
    """The largest n with no miss in ``run_at(n)`` (which returns a list of summaries)."""
    best = 0
    for n in range(start, stop + 1):
        if any(s["missed"] for s in run_at(n)):
            break
        best = n
    return best


def main(argv):
    del argv
    out = FLAGS.out if FLAGS.out is not None else str(_HERE / _DEFAULT_OUT[fits.fit_key()])
    png = FLAGS.plot if FLAGS.plot is not None else str(_HERE / _DEFAULT_PLOT[fits.fit_key()])
    pathlib.Path(out).unlink(missing_ok=True)  # rewritten, row by row
    log = harness.RowLog(out, harness.SIMULATION)
    emit, rows = log.write, log.rows

    fit = fits.fit_models(er.read_rows(FLAGS.profile_rows))  # the rows --fit names
    cost, tail = fit.cost, fit.tail
    B = [b for b, _ in fit.step_points]
    y = [m for _, m in fit.step_points]

    # 1. Step-cost model and its leave-one-out error.
    share = fit.share
    loo = sim.leave_one_out(B, y, context_share=share)
    config = {"config": fit.config} if fit.config else {}  # as fits.model_row
    emit({"kind": "model", "source": fit.source, **config, "context_share": share, **vars(cost)}
         | {"frames_per_tick": 2})  # fmt: skip
    for row, b, m, p in zip(fit.ticks, B, y, loo, strict=True):
        capacity_row = fit.source == "capacity"
        where = {"row": row["kind"], "input_commit": row.get("commit")} if capacity_row else {}
        emit({"kind": "fit", "slots": b, "measured_ms": m, "fit_ms": cost.frame_step_ms(b),
              "loo_ms": p, **where})  # fmt: skip

    # Context check against the older cap-256 serving rows (an older engine: indicative only, and
    # only beside the fit to the older engine's rows).
    if fit.source == "beat_profile":
        for r in (r for r in er.read_rows(FLAGS.latency_rows) if r["loop"] == "dispatch"):
            x = r["context_frames"] / sim.CAP_FRAMES
            emit({"kind": "context_check", "sessions": r["sessions"],
                  "context_frames": r["context_frames"], "ssm_kernel": r.get("ssm_kernel", "xla"),
                  "p50_ms": r["p50_ms"],
                  "model_tick_ms": cost.tick_ms(r["sessions"], x)})  # fmt: skip

    # 2. Tail (fitted in sim.fit_h200 / fit_capacity): jitter from p99 - p50 of the serving rows
    # the server kept up with (and, for capacity rows, of the batch-1 baseline's ticks); host
    # overhead; host stalls from the missed ticks of the rows whose jitter cannot explain them.
    host_each = fit.host_each
    emit({"kind": "tail", **vars(tail), "host_each": host_each})
    for n, d in fit.jitter_points:
        emit({"kind": "tail_fit", "sessions": n, "p99_minus_p50_ms": d,
              "model_ms": tail.p99_minus_p50_ms(n)})  # fmt: skip

    # 3. Validation: simulated lockstep server against the real one (host overhead left out of
    # the fit for the row it is checked on, where there are other rows to take it from). For the
    # capacity rows also with the row's own host overhead (its p50 minus its probe): a diagnostic.
    def lockstep_runs(n: int, ticks: int, host_ms: float) -> list[sim.Result]:
        t = dataclasses.replace(tail, host_ms=host_ms)
        return [
            sim.simulate_lockstep(cost, ticks, n, slots=n, tail=t, rng=np.random.default_rng(s))
            for s in range(FLAGS.seeds)
        ]

    for r in fit.serves:
        n = r["sessions"]
        others = [h for m, h in host_each.items() if m != n] or [tail.host_ms]
        res = lockstep_runs(n, r["steady_ticks"], float(np.mean(others)))
        emit({"kind": "validation", "sessions": n, "real_p50_ms": r["p50_ms"],
              "real_p99_ms": r["p99_ms"], "real_max_ms": r["max_ms"],
              "real_missed": r["missed_ticks"], "ticks": r["steady_ticks"],
              "host_ms": float(np.mean(others)),
              **{f"sim_{k}": val for k, val in _mean_summary([x.summary() for x in res]).items()},
              **_p999(r, res)})  # fmt: skip
        if fit.source == "capacity" and n in fit.tick_of:
            own = r["p50_ms"] - fit.tick_of[n]
            res = lockstep_runs(n, r["steady_ticks"], own)
            emit({"kind": "validation_own_host", "sessions": n, "host_ms": own,
                  "real_p50_ms": r["p50_ms"], "real_p99_ms": r["p99_ms"],
                  "real_missed": r["missed_ticks"], "ticks": r["steady_ticks"],
                  **{f"sim_{k}": v for k, v in
                     _mean_summary([x.summary() for x in res]).items()}})  # fmt: skip

    # 4. Policies at fixed loads: capacity at zero misses, p99, GPU-seconds per conversation-hour.
    # Stalls off here: they are load-independent host misses that no policy removes.
    quiet_tail = fit.quiet
    nb = FLAGS.capacity_beats

    def seeds(f):
        return [f(np.random.default_rng(s)).summary() for s in range(FLAGS.seeds)]

    policies = {
        "lockstep": lambda n, g: sim.simulate_lockstep(cost, nb, n, slots=n, tail=quiet_tail,
                                                       rng=g),
        "batch1": lambda n, g: sim.simulate_requests(cost, n, nb, window_ms=0, max_batch=1,
                                                     tail=quiet_tail, rng=g),
    }  # fmt: skip
    for w in (float(x) for x in FLAGS.windows_ms):
        policies[f"dynamic_w{w:g}"] = lambda n, g, w=w: sim.simulate_requests(
            cost, n, nb, window_ms=w, max_batch=512, tail=quiet_tail, rng=g,
            phases_ms=np.random.default_rng(1).uniform(0, sim.BEAT_MS, n))  # fmt: skip
    caps = {}
    for name, f in policies.items():
        caps[name] = capacity(lambda n, f=f: seeds(lambda g: f(n, g)))
        for n in sorted({1, 2, 4, 8, 16, 32, 48, 64, 80, 96, caps[name], caps[name] + 1} - {0}):
            s = _mean_summary(seeds(lambda g, n=n, f=f: f(n, g)))
            emit({"kind": "policy", "policy": name, "sessions": n, **s})
        c = caps[name]
        at = _mean_summary(seeds(lambda g, c=c, f=f: f(c, g))) if c else {}
        emit({"kind": "capacity", "policy": name, "capacity": c,
              "held_gpu_s_per_conv_h": 3600.0 / c if c else None,
              "p99_at_capacity_ms": at.get("p99_ms"),
              "busy_gpu_s_per_conv_h": at.get("busy_gpu_s_per_conv_h")})  # fmt: skip
        logging.info("capacity %s: %d", name, c)
    if fit.source == "capacity":
        _capacity_extras(fit, caps, seeds, nb, emit)

    # 5. An hour of Poisson calls on one GPU: a fixed slot count (the engine) against buckets.
    cap = caps["lockstep"]
    bucket_sets = {"fixed": None, "buckets": sorted({8, 16, 32, 64, cap})}
    for e in (float(x) for x in FLAGS.erlangs):
        tr = sim.poisson_traffic(np.random.default_rng(7), rate_per_s=e / FLAGS.mean_call_s,
                                 mean_duration_s=FLAGS.mean_call_s, max_duration_s=FLAGS.max_call_s,
                                 n_beats=FLAGS.hour_beats, engines=1, slots=cap)  # fmt: skip
        for name, bk in bucket_sets.items():
            res = sim.simulate_lockstep(cost, FLAGS.hour_beats, lambda k, L=tr.live[0]: int(L[k]),
                                        slots=cap, tail=tail, buckets=bk,
                                        rng=np.random.default_rng(8)).summary()  # fmt: skip
            emit({"kind": "hour", "erlangs": e, "slots": cap, "variant": name,
                  "offered": tr.offered, "refused": tr.refused,
                  "mean_live": float(tr.live.mean()), **res})  # fmt: skip

    # 6. Several GPUs: N engines of `cap` slots (buckets), a router, 85 % of N * cap offered.
    for n_gpu in (int(x) for x in FLAGS.gpus):
        e = 0.85 * cap * n_gpu
        for router in ("least_loaded", "first_fit"):
            tr = sim.poisson_traffic(np.random.default_rng(11), rate_per_s=e / FLAGS.mean_call_s,
                                     mean_duration_s=FLAGS.mean_call_s,
                                     max_duration_s=FLAGS.max_call_s, n_beats=FLAGS.hour_beats,
                                     engines=n_gpu, slots=cap, router=router)  # fmt: skip
            per = [
                sim.simulate_lockstep(cost, FLAGS.hour_beats, lambda k, L=tr.live[i]: int(L[k]),
                                      slots=cap, tail=tail, buckets=bucket_sets["buckets"],
                                      rng=np.random.default_rng(20 + i)).summary()
                for i in range(n_gpu)
            ]  # fmt: skip
            conv_h = float(tr.live.sum()) * sim.BEAT_MS / 3.6e6
            busy_s = sum(p["busy_frac"] for p in per) * FLAGS.hour_beats * sim.BEAT_MS / 1e3
            emit({"kind": "gpus", "gpus": n_gpu, "router": router, "erlangs": e,
                  "offered": tr.offered, "refused": tr.refused,
                  "refused_frac": tr.refused / max(tr.offered, 1),
                  "missed_session_beat_rate": float(sum(
                      p["missed_session_beat_rate"] * w for p, w in
                      zip(per, tr.live.sum(axis=1), strict=True) if w) / tr.live.sum()),
                  "p99_ms_worst_engine": max(p["p99_ms"] for p in per),
                  "held_gpu_s_per_conv_h": n_gpu * FLAGS.hour_beats * sim.BEAT_MS / 1e3 / conv_h,
                  "busy_gpu_s_per_conv_h": busy_s / conv_h})  # fmt: skip

    if png:
        from experiments.policy_sim import plot  # matplotlib only when a plot is asked for

        plot.plot(rows, png)
    print_tables(rows)


def print_tables(rows: list[dict]) -> None:
    """The fit, the tail, the validation, the capacities, the hour and the GPUs, as short tables."""

    def kind(k):
        return [r for r in rows if r["kind"] == k]

    m = kind("model")[0]
    print(f"fit to: {m.get('source', 'beat_profile')}; context share {m['context_share']:.3f}")
    print(f"t(B) per frame-step = {m['a_ms']:.2f} + {m['b_ms']:.3f}*B + {m['c_ms']:.3f}*B*x ms "
          f"(slope b+c = {m['b_ms'] + m['c_ms']:.3f})")  # fmt: skip
    print(f"{'B':>4} {'row':>8} {'meas ms':>8} {'fit ms':>7} {'err %':>6} {'LOO ms':>7} "
          f"{'LOO %':>6}")  # fmt: skip
    for r in kind("fit"):
        e, lo = (r["fit_ms"] / r["measured_ms"] - 1) * 100, (r["loo_ms"] / r["measured_ms"] - 1)
        print(f"{r['slots']:>4} {r.get('row', 'tick'):>8} {r['measured_ms']:>8.2f} "
              f"{r['fit_ms']:>7.2f} {e:>6.1f} {r['loo_ms']:>7.2f} {lo * 100:>6.1f}")  # fmt: skip
    t = kind("tail")[0]
    host = ", ".join(f"{k}: {v:.2f}" for k, v in t["host_each"].items())
    print(f"tail: u {t['log_sigma0']:.3f}, v {t['log_sigma1']:.5f}/slot (held past "
          f"{t['sigma_batch_max']}), stall/beat {t['stall_prob']:.4f}, host ms {t['host_ms']:.2f} "
          f"({host})")  # fmt: skip
    for r in kind("tail_fit"):
        print(f"  jitter B={r['sessions']:>3}: p99-p50 measured {r['p99_minus_p50_ms']:.2f}, "
              f"model {r['model_ms']:.2f} ms")  # fmt: skip
    print(f"{'sess':>4} {'host':>5} {'real p50':>8} {'sim p50':>8} {'err %':>6} {'real p99':>8} "
          f"{'sim p99':>8} {'real p999':>9} {'sim p999':>8} {'real miss':>9} "
          f"{'sim miss':>8}")  # fmt: skip
    for r in kind("validation"):
        e = (r["sim_p50_ms"] / r["real_p50_ms"] - 1) * 100
        print(f"{r['sessions']:>4} {r.get('host_ms', math.nan):>5.2f} {r['real_p50_ms']:>8.1f} "
              f"{r['sim_p50_ms']:>8.1f} {e:>6.1f} {r['real_p99_ms']:>8.1f} "
              f"{r['sim_p99_ms']:>8.1f} {r.get('real_p99.9_ms', math.nan):>9.1f} "
              f"{r.get('sim_p99.9_ms', math.nan):>8.1f} {r['real_missed']:>9} "
              f"{r['sim_missed']:>8.1f}")  # fmt: skip
    if kind("validation_own_host"):
        print("with each row's own host ms (its p50 minus its probe):")
    for r in kind("validation_own_host"):
        print(f"{r['sessions']:>4} {r['host_ms']:>5.2f} {r['real_p50_ms']:>8.1f} "
              f"{r['sim_p50_ms']:>8.1f} {(r['sim_p50_ms'] / r['real_p50_ms'] - 1) * 100:>6.1f} "
              f"{r['real_p99_ms']:>8.1f} {r['sim_p99_ms']:>8.1f} {r['real_missed']:>9} "
              f"{r['sim_missed']:>8.1f}")  # fmt: skip
    print(f"{'policy':>18} {'capacity':>8} {'p99 ms':>7} {'held GPU-s/conv-h':>17} {'busy':>6}")
    for r in kind("capacity"):
        p99 = r["p99_at_capacity_ms"] or math.nan
        held = r["held_gpu_s_per_conv_h"] or math.nan
        busy = r["busy_gpu_s_per_conv_h"] or math.nan
        print(f"{r['policy']:>18} {r['capacity']:>8} {p99:>7.1f} {held:>17.1f} {busy:>6.1f}")
    for r in kind("baseline_check"):
        print(f"batch-1 baseline ({r['input_commit']}): tick p50 {r['measured_p50_ms']:.1f}, p99 "
              f"{r['measured_p99_ms']:.1f} ms -> 160 // p99 = {r['rule_held']} (row: "
              f"{r['measured_held']}); model t(1) {r['fit_tick_ms']:.1f}, p99 "
              f"{r['model_p99_ms']:.1f} -> {r['model_rule_held']}; simulated batch-1 capacity "
              f"{r['sim_batch1_capacity']}")  # fmt: skip
    print(f"{'E':>5} {'variant':>8} {'offered':>7} {'refused %':>9} {'live':>5} {'p50':>6} "
          f"{'p99':>6} {'miss %':>6} {'skip':>5} {'busy %':>6} {'busy s/ch':>9}")  # fmt: skip
    for r in kind("hour"):
        print(f"{r['erlangs']:>5.0f} {r['variant']:>8} {r['offered']:>7} "
              f"{100 * r['refused'] / max(r['offered'], 1):>9.1f} {r['mean_live']:>5.1f} "
              f"{r['p50_ms']:>6.1f} {r['p99_ms']:>6.1f} {100 * r['miss_rate']:>6.2f} "
              f"{r['skipped']:>5} {100 * r['busy_frac']:>6.1f} "
              f"{r['busy_gpu_s_per_conv_h']:>9.1f}")  # fmt: skip
    print(f"{'gpus':>4} {'router':>12} {'E':>6} {'refused %':>9} {'missed sb %':>11} "
          f"{'p99 worst':>9} {'held s/ch':>9} {'busy s/ch':>9}")  # fmt: skip
    for r in kind("gpus"):
        print(f"{r['gpus']:>4} {r['router']:>12} {r['erlangs']:>6.1f} "
              f"{100 * r['refused_frac']:>9.2f} {100 * r['missed_session_beat_rate']:>11.2f} "
              f"{r['p99_ms_worst_engine']:>9.1f} {r['held_gpu_s_per_conv_h']:>9.1f} "
              f"{r['busy_gpu_s_per_conv_h']:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
