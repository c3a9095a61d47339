"""Admission under overload: refuse against queue-with-timeout, and where to set the threshold.

Simulated part (``--parts=sim``; host only; the answer for one H200): 90 minutes of calls
(Poisson; Poisson plus a burst on the hour; Poisson plus a flash crowd), admitted by a threshold
``max_live`` with or without a queue (``sim.admit_calls``, which is ``scheduler.AdmissionControl``),
served in lockstep in slot buckets by the simulator fitted to the H200 rows (``--fit``:
``capacity``, the default, the current engine's ``experiments/capacity`` rows, ``sim.fit_capacity``
(``--capacity_config=xla_tts``: the previous engine's, the README's history); or ``beat_profile``,
the older engine's, ``sim.fit_h200``: the README's older history). Per policy:
fraction of calls refused, waits, fraction of admitted session-beats late, goodput (on-time
session-beats per beat: calls served on time, on average).

Engine part (``--parts=engine``; tiny on the CPU for smoke rows, ``--model=voicechat_11b`` on the
H200): the server with ``AdmissionControl`` under a scripted burst of more calls than slots, refuse
against queue: refused, waited, missed beats. See README.md beside this file.
"""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
from absl import app, flags, logging

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
sys.path.insert(0, str(_HERE.parent / "policy_sim"))
import engine_runs as er  # noqa: E402
import fits  # noqa: E402
import sim  # noqa: E402

from voicechat_jax.engine import Engine  # noqa: E402
from voicechat_jax.serving import scheduler as sched  # noqa: E402
from voicechat_jax.serving.server import SessionPlan  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("parts", ["engine", "sim"], "engine (real runs) and/or sim (H200 simulator).")
flags.DEFINE_integer("slots", 4, "Engine slots (admission threshold = slots).")
flags.DEFINE_integer("burst", 12, "Engine part: calls arriving in the burst.")
flags.DEFINE_integer("burst_beats", 4, "Engine part: the burst arrives within this many beats.")
flags.DEFINE_integer("mean_call_beats", 15, "Engine part: mean call length (exponential).")
flags.DEFINE_list("queue_beats", ["0", "10", "30"], "Engine part: queue timeouts compared.")
flags.DEFINE_integer("ticks", 80, "Engine part: real-time beats per run.")
flags.DEFINE_integer("context_frames", 64, "Context cap in frames (1500 on the H200).")
flags.DEFINE_string("out", str(_HERE / "results/cpu_tiny.jsonl"), "Engine rows (appended).")
flags.DEFINE_float("span_s", 5400.0, "Simulated seconds of traffic (90 minutes).")
flags.DEFINE_float("base_erlangs", 40.0, "Offered load outside bursts (arrivals x mean call).")
flags.DEFINE_list("poisson_erlangs", ["50", "60", "80"], "Plain Poisson loads (overload).")
flags.DEFINE_integer("burst_calls", 150, "Extra calls in the burst on the hour (within 60 s).")
flags.DEFINE_float("flash_factor", 3.0, "Flash crowd: the arrival rate times this ...")
flags.DEFINE_float("flash_s", 900.0, "... for this long, from 30 minutes in.")
flags.DEFINE_list("max_live", ["40", "50", "56", "64"], "Admission thresholds (live calls).")
flags.DEFINE_list("queue_s", ["0", "10", "30"], "Queue timeouts in seconds (0: refuse at once).")
flags.DEFINE_float("mean_call_s", 60.0, "Mean call length (exponential), seconds ...")
flags.DEFINE_float("max_call_s", 120.0, "... cut at the context cap.")
er.define_engine_flags()
fits.define_fit_flags("admission_overload")


# ---- engine part -------------------------------------------------------------------------------


def burst_plans(spb: int) -> list[SessionPlan]:
    rng = np.random.default_rng(5)
    plans = []
    for i in range(FLAGS.burst):
        join = int(rng.integers(0, FLAGS.burst_beats))
        leave = join + 1 + int(rng.exponential(FLAGS.mean_call_beats))
        plans.append(SessionPlan(id=f"b{i:03d}", audio=er.speech((leave - join) * spb, i),
                                 join=join, leave=leave))  # fmt: skip
    return sorted(plans, key=lambda p: p.join)


def engine_part(rows: list[dict]) -> None:
    base = er.provenance(FLAGS.model)
    cfg, params = er.build(FLAGS.model)
    serve = er.serve_config(slots=FLAGS.slots, context_frames=FLAGS.context_frames)
    engine = Engine(params, cfg, serve)
    plans = burst_plans(engine.samples_per_beat)
    for q in (int(x) for x in FLAGS.queue_beats):
        policy = sched.AdmissionControl(sched.Lockstep(), queue_beats=q)
        row, server = er.serve(engine, plans, FLAGS.ticks, scheduler=policy)
        waits = [server.slots.session(p.id).admitted_tick - p.join
                 for p in plans if p.id in {s.id for s in server.slots.sessions()}]  # fmt: skip
        rows.append({**base, "kind": "burst", "queue_beats": q, "offered": len(plans),
                     "refused": server.slots.refused, "queued": policy.queued,
                     "waited_beats": policy.waited_beats, "live_at_end_waits": waits,
                     **row})  # fmt: skip


# ---- simulated ---------------------------------------------------------------------------------


def patterns(rng_seed: int) -> dict[str, np.ndarray]:
    """Arrival times (s) of each traffic pattern."""
    span, m = FLAGS.span_s, FLAGS.mean_call_s
    base = FLAGS.base_erlangs / m
    out = {}
    for e in (float(x) for x in FLAGS.poisson_erlangs):
        out[f"poisson_{e:g}"] = sim.arrival_times(np.random.default_rng(rng_seed), e / m, span)
    calls = sim.arrival_times(np.random.default_rng(rng_seed), base, span)
    extra = 3600.0 + np.sort(np.random.default_rng(rng_seed + 1).uniform(0, 60, FLAGS.burst_calls))
    out["burst_on_the_hour"] = np.sort(np.concatenate([calls, extra]))
    t0, f = 1800.0, FLAGS.flash_factor

    def rate(t):
        return np.where((t >= t0) & (t < t0 + FLAGS.flash_s), base * f, base)

    out["flash_crowd"] = sim.arrival_times(np.random.default_rng(rng_seed), rate, span,
                                           peak_per_s=base * f)  # fmt: skip
    return out


def sim_part() -> list[dict]:
    fit = fits.fit_models(er.read_rows(FLAGS.profile_rows))
    rows = [fits.model_row(fit)] + [{"kind": "validation", **v} for v in sim.validate(fit)]
    n_beats = int(FLAGS.span_s * 1e3 / sim.BEAT_MS)
    for name, arr in patterns(11).items():
        dur = np.minimum(np.random.default_rng(12).exponential(FLAGS.mean_call_s, arr.size),
                         FLAGS.max_call_s)  # fmt: skip
        for max_live in (int(x) for x in FLAGS.max_live):
            buckets = sorted({*range(8, max_live, 8), max_live})
            for q in (float(x) for x in FLAGS.queue_s):
                ad = sim.admit_calls(arr, dur, max_live=max_live, queue_s=q, n_beats=n_beats)
                res = sim.simulate_lockstep(fit.cost, n_beats, lambda k, L=ad.live: int(L[k]),
                                            slots=max_live, buckets=buckets, tail=fit.quiet,
                                            rng=np.random.default_rng(13))  # fmt: skip
                live = ad.live.astype(float)
                late = (res.missed * live).sum()
                s = res.summary()
                rows.append({
                    "kind": "policy", "pattern": name, "max_live": max_live, "queue_s": q,
                    "offered": ad.offered, "refused": ad.refused,
                    "refused_frac": ad.refused / max(ad.offered, 1),
                    "wait_p50_s": float(np.percentile(ad.waited_s, 50)),
                    "wait_p99_s": float(np.percentile(ad.waited_s, 99)),
                    "mean_live": float(live.mean()), "max_live_seen": int(live.max()),
                    "late_frac": float(late / live.sum()),
                    "goodput": float((live.sum() - late) / n_beats),
                    "p99_ms": s["p99_ms"], "missed_ticks": s["missed"],
                })  # fmt: skip
                logging.info("%s max_live %d queue %g: refused %.3f late %.4f", name, max_live,
                             q, rows[-1]["refused_frac"], rows[-1]["late_frac"])  # fmt: skip
    return rows


def plot(sim_rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = [r for r in sim_rows if r["kind"] == "policy"]
    names = list(dict.fromkeys(r["pattern"] for r in pol))
    fig, ax = plt.subplots(1, len(names), figsize=(4 * len(names), 4), squeeze=False, sharey=True)
    # per cent late, on one symlog axis from 0 for every panel (most points are exactly 0)
    top = max([0.01, *(2 * 100 * r["late_frac"] for r in pol)])
    for a, name in zip(ax[0], names, strict=True):
        for q in sorted({r["queue_s"] for r in pol}):
            rs = sorted((r for r in pol if r["pattern"] == name and r["queue_s"] == q),
                        key=lambda r: r["max_live"])  # fmt: skip
            a.plot([r["refused_frac"] for r in rs], [100 * r["late_frac"] for r in rs], "o-",
                   label=f"queue {q:g} s")  # fmt: skip
            for r in rs:
                a.annotate(str(r["max_live"]), (r["refused_frac"], 100 * r["late_frac"]),
                           fontsize=7)  # fmt: skip
        a.set(xlabel="calls refused (fraction)", title=name)
        a.set_yscale("symlog", linthresh=1e-3)
        a.set_ylim(0, top)
        a.legend(fontsize=7)
    ax[0][0].set_ylabel("admitted session-beats late, %")
    label = fits.fit_label(sim_rows)
    fig.suptitle(f"H200, simulated ({label}): labels are the admission threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_tables(sim_rows: list[dict], engine_rows: list[dict]) -> None:
    if engine_rows:
        r0 = engine_rows[0]
        print(f"measured: {r0['model']} on {r0['device']}, jax {r0['jax']}, commit {r0['commit']}")
        for r in engine_rows:
            print(f"burst, queue {r['queue_beats']} beats: refused {r['refused']}/{r['offered']}, "
                  f"queued {r['queued']}, waited {r['waited_beats']} beats, "
                  f"missed {r['missed_ticks']}/{r['steady_ticks']}")  # fmt: skip
    if sim_rows:
        print(f"simulated H200, fit to {fits.fit_label(sim_rows)}")
        fits.print_validation(sim_rows)
        print(f"{'pattern':>18} {'max':>4} {'queue':>5} {'refused':>8} {'wait p99':>8} "
              f"{'late':>8} {'goodput':>7}")  # fmt: skip
        for r in (r for r in sim_rows if r["kind"] == "policy"):
            print(f"{r['pattern']:>18} {r['max_live']:>4} {r['queue_s']:>5.0f} "
                  f"{r['refused_frac']:>8.4f} {r['wait_p99_s']:>8.1f} {r['late_frac']:>8.4f} "
                  f"{r['goodput']:>7.2f}")  # fmt: skip


def main(argv):
    del argv
    sim_out, plot_path = fits.sim_files(_HERE, "admission_overload")
    er.run_parts(
        FLAGS.parts,
        out=FLAGS.out,
        sim_out=sim_out,
        plot_path=plot_path,
        engine_part=engine_part,
        sim_part=sim_part,
        plot=lambda sr, en, path: plot(sr, path) if sr else None,
        print_tables=print_tables,
    )


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
