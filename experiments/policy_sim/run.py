"""Batching-policy simulator: fit, validate against the H200 serving rows, then use it.

Fits the step-cost and tail models (``sim.py``) to ``experiments/beat_profile``'s rows, checks the
simulated lockstep server against the real one, compares policies (lockstep, batch-1 stepping,
request-style batching with a window) at fixed loads, serves an hour of Poisson calls, and sketches
several GPUs behind a router. Writes raw rows (JSON lines) and a PNG; prints short tables last.
See README.md beside this file. Host only: no device is used.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import sim
from absl import app, flags, logging

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "profile_rows",
    str(_REPO / "experiments/beat_profile/results/h200_voicechat_11b.jsonl"),
    "beat_profile rows: kind=tick, serve and component.",
)
flags.DEFINE_string(
    "latency_rows",
    str(_REPO / "experiments/beat_latency/results/h200_voicechat_11b.jsonl"),
    "Older beat_latency rows (cap 256), for the context check only.",
)
flags.DEFINE_string("out", str(_HERE / "results/rows.jsonl"), "JSON-lines output (overwritten).")
flags.DEFINE_string("plot", str(_HERE / "policy_sim.png"), "PNG output ('' for none).")
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


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mean_summary(runs: list[dict]) -> dict:
    keys = ("p50_ms", "p99_ms", "max_ms", "missed", "miss_rate", "busy_gpu_s_per_conv_h")
    return {k: float(np.mean([r[k] for r in runs])) for k in keys}


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
    rows_out: list[dict] = []

    def emit(row: dict) -> None:
        rows_out.append(row)

    prof = _rows(FLAGS.profile_rows)
    ticks = sorted((r for r in prof if r["kind"] == "tick"), key=lambda r: r["slots"])
    serves = sorted((r for r in prof if r["kind"] == "serve"), key=lambda r: r["sessions"])
    comps = [r for r in prof if r["kind"] == "component"]
    B = [r["slots"] for r in ticks]
    y = [r["ms_per_frame_step"] for r in ticks]

    # 1. Step-cost model and its leave-one-out error.
    share = sim.context_share(comps)
    cost = sim.fit_step_cost(B, y, context_share=share)
    loo = sim.leave_one_out(B, y, context_share=share)
    emit({"kind": "model", "context_share": share, **vars(cost)} | {"frames_per_tick": 2})
    for b, m, p in zip(B, y, loo, strict=True):
        emit({"kind": "fit", "slots": b, "measured_ms": m, "fit_ms": cost.frame_step_ms(b),
              "loo_ms": p})  # fmt: skip

    # Context check against the older cap-256 serving rows (an older engine: indicative only).
    for r in (r for r in _rows(FLAGS.latency_rows) if r["loop"] == "dispatch"):
        x = r["context_frames"] / sim.CAP_FRAMES
        emit({"kind": "context_check", "sessions": r["sessions"], "context_frames":
              r["context_frames"], "ssm_kernel": r.get("ssm_kernel", "xla"), "p50_ms": r["p50_ms"],
              "model_tick_ms": cost.tick_ms(r["sessions"], x)})  # fmt: skip

    # 2. Tail: jitter from p99 - p50 of the serving rows the server kept up with; host overhead;
    # host stalls from the missed ticks of the rows whose jitter cannot explain them.
    ok = [r for r in serves if r["p50_ms"] < sim.BEAT_MS]
    u, v = sim.fit_jitter([r["sessions"] for r in ok], [r["p99_ms"] - r["p50_ms"] for r in ok])
    jitter = sim.Tail(log_sigma0=u, log_sigma1=v, sigma_batch_max=max(r["sessions"] for r in ok))
    tick_of = {r["slots"]: float(np.median(r["ms"])) for r in ticks}
    host_each = {r["sessions"]: r["p50_ms"] - tick_of[r["sessions"]] for r in ok}
    host = float(np.mean(list(host_each.values())))
    # Rows whose jitter reaches no deadline (max spike at 200 ticks: ~ 2.3 scales past p50).
    quiet = [r for r in ok if r["p50_ms"] + 3 * jitter.sigma_ms(r["sessions"]) < sim.BEAT_MS]
    stall = sum(r["missed_ticks"] for r in quiet) / sum(r["steady_ticks"] for r in quiet)
    tail = sim.Tail(u, v, stall, host, jitter.sigma_batch_max)
    emit({"kind": "tail", **vars(tail), "host_each": host_each})
    for r in ok:
        n = r["sessions"]
        emit({"kind": "tail_fit", "sessions": n, "p99_minus_p50_ms": r["p99_ms"] - r["p50_ms"],
              "model_ms": tail.p99_minus_p50_ms(n)})  # fmt: skip

    # 3. Validation: simulated lockstep server against the real one (host overhead left out of
    # the fit for the row it is checked on, where there are other rows to take it from).
    for r in serves:
        n = r["sessions"]
        others = [h for m, h in host_each.items() if m != n] or [host]
        t = sim.Tail(u, v, stall, float(np.mean(others)), jitter.sigma_batch_max)
        runs = [
            sim.simulate_lockstep(cost, r["steady_ticks"], n, slots=n, tail=t,
                                  rng=np.random.default_rng(s)).summary()
            for s in range(FLAGS.seeds)
        ]  # fmt: skip
        emit({"kind": "validation", "sessions": n, "real_p50_ms": r["p50_ms"],
              "real_p99_ms": r["p99_ms"], "real_max_ms": r["max_ms"],
              "real_missed": r["missed_ticks"], "ticks": r["steady_ticks"],
              **{f"sim_{k}": val for k, val in _mean_summary(runs).items()}})  # fmt: skip

    # 4. Policies at fixed loads: capacity at zero misses, p99, GPU-seconds per conversation-hour.
    # Stalls off here: they are load-independent host misses that no policy removes.
    quiet_tail = sim.Tail(u, v, 0.0, host, jitter.sigma_batch_max)
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

    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        for r in rows_out:
            f.write(json.dumps(r) + "\n")
    if FLAGS.plot:
        import plot  # matplotlib only when a plot is asked for

        plot.plot(rows_out, FLAGS.plot)
    print_tables(rows_out)


def print_tables(rows: list[dict]) -> None:
    """The fit, the validation and the capacities, as short tables."""

    def kind(k):
        return [r for r in rows if r["kind"] == k]

    m = kind("model")[0]
    print(f"t(B) per frame-step = {m['a_ms']:.2f} + {m['b_ms']:.3f}*B + {m['c_ms']:.3f}*B*x ms")
    print(f"{'B':>4} {'meas ms':>8} {'fit ms':>7} {'err %':>6} {'LOO ms':>7} {'LOO %':>6}")
    for r in kind("fit"):
        e, lo = (r["fit_ms"] / r["measured_ms"] - 1) * 100, (r["loo_ms"] / r["measured_ms"] - 1)
        print(f"{r['slots']:>4} {r['measured_ms']:>8.2f} {r['fit_ms']:>7.2f} {e:>6.1f} "
              f"{r['loo_ms']:>7.2f} {lo * 100:>6.1f}")  # fmt: skip
    print(f"{'sess':>4} {'real p50':>8} {'sim p50':>8} {'err %':>6} {'real p99':>8} "
          f"{'sim p99':>8} {'real miss':>9} {'sim miss':>8}")  # fmt: skip
    for r in kind("validation"):
        e = (r["sim_p50_ms"] / r["real_p50_ms"] - 1) * 100
        print(f"{r['sessions']:>4} {r['real_p50_ms']:>8.1f} {r['sim_p50_ms']:>8.1f} {e:>6.1f} "
              f"{r['real_p99_ms']:>8.1f} {r['sim_p99_ms']:>8.1f} {r['real_missed']:>9} "
              f"{r['sim_missed']:>8.1f}")  # fmt: skip
    print(f"{'policy':>14} {'capacity':>8} {'p99 ms':>7} {'held GPU-s/conv-h':>17} {'busy':>6}")
    for r in kind("capacity"):
        p99 = r["p99_at_capacity_ms"] or float("nan")
        held = r["held_gpu_s_per_conv_h"] or float("nan")
        busy = r["busy_gpu_s_per_conv_h"] or float("nan")
        print(f"{r['policy']:>14} {r['capacity']:>8} {p99:>7.1f} {held:>17.1f} {busy:>6.1f}")


if __name__ == "__main__":
    app.run(main)
