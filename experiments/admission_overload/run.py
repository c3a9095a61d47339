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
against queue: refused, waited, missed beats.

The sim part also checks the simulator against the measured H200 burst rows (``--burst_rows``):
the same burst replayed through the server's admission and ``sim.admit_calls``, then served by
the dispatch loop on the current fit (``burst_replay.py``; kinds ``burst_admission`` and
``burst_validation``).
``--parts=`` (neither part) draws only the figure, from the rows already written (``--sim_out``,
``--out``), through ``experiments.plot``. See README.md beside this file.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
from absl import app, flags, logging

from experiments import harness

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
from experiments import plot as draw  # noqa: E402
from experiments.admission_overload import burst_replay as br  # noqa: E402
from experiments.policy_sim import engine_runs as er  # noqa: E402
from experiments.policy_sim import fits, sim  # noqa: E402
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
flags.DEFINE_string(
    "burst_rows", str(_HERE / "results/h200_voicechat_11b.jsonl"),
    "Sim part, current fit: measured burst rows (kind 'burst') the simulator is checked against "
    "('' or a missing file: no check).",
)  # fmt: skip
harness.define_engine_flags()
fits.define_fit_flags("admission_overload")


# ---- engine part -------------------------------------------------------------------------------


def burst_plans(spb: int) -> list[SessionPlan]:
    """The burst's scripted calls (``br.burst_schedule``), ``spb`` audio samples a beat, by join."""
    schedule = br.burst_schedule(FLAGS.burst, FLAGS.burst_beats, FLAGS.mean_call_beats)
    plans = [SessionPlan(id=f"b{i:03d}", audio=harness.speech((leave - join) * spb, i), join=join,
                         leave=leave) for i, (join, leave) in enumerate(schedule)]  # fmt: skip
    return sorted(plans, key=lambda p: p.join)


def engine_part(rows: list[dict]) -> None:
    base = er.engine_setup(FLAGS.model)
    cfg, params = er.build(FLAGS.model)
    serve = harness.serve_config(slots=FLAGS.slots, context_frames=FLAGS.context_frames)
    engine = Engine(params, cfg, serve)
    plans = burst_plans(engine.samples_per_beat)
    for q in (int(x) for x in FLAGS.queue_beats):
        policy = sched.AdmissionControl(sched.Lockstep(), queue_beats=q)
        row, server = er.serve(engine, plans, FLAGS.ticks, scheduler=policy)
        waits = [server.slots.session(p.id).admitted_tick - p.join
                 for p in plans if p.id in {s.id for s in server.slots.sessions()}]  # fmt: skip
        rows.append({**base, "kind": "burst", "queue_beats": q, "offered": len(plans),
                     "burst_beats": FLAGS.burst_beats, "mean_call_beats": FLAGS.mean_call_beats,
                     "ticks": FLAGS.ticks, "withdraw_at_leave": True,
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


# The simulated cases the burst rows are checked against: (name, fit, step cost at the fill).
BURST_CASES = (("auto_fill", "auto", True), ("auto_full", "auto", False),
               ("tick_line", "line", False))  # fmt: skip


def current_fits(fit: sim.H200Fit) -> dict[str, sim.H200Fit]:
    """The current engine's two step costs: ``auto`` (``sim.fit_capacity``, the auto kernels'
    capacity rows) and ``line`` (``sim.fit_tick_line`` through ``--tick_rows``), from ``fit`` (one
    of them) and the flags' rows."""
    if fit.tick_line:
        return {"auto": fits.capacity_fit("auto", er.read_rows(FLAGS.profile_rows)), "line": fit}
    return {"auto": fit, "line": sim.fit_tick_line(fit, fits.tick_points())}


def burst_check(fit: sim.H200Fit) -> list[dict]:
    """The measured burst rows (``--burst_rows``) against the replay and the simulator.

    Per row: one ``burst_admission`` row (the engine's counts; those of ``br.replay_burst``, the
    server's admission replayed; those of ``sim.admit_calls`` with the beat as time unit; the
    replayed live count and cache fill), and one ``burst_validation`` row per ``BURST_CASES``
    (the dispatch loop on the replayed live count: step cost at each beat's mean fill or at full
    caches, the fit's host overhead and jitter; the mean of 5 seeds), each naming the measured row
    by its ``input_commit`` and ``input_device``. Only for the current fit
    (``--fit=capacity --capacity_config=auto``): the rows are of the current engine.
    """
    path = FLAGS.burst_rows
    if (FLAGS.fit, FLAGS.capacity_config) != ("capacity", "auto") or not path:
        return []
    if not os.path.exists(path):
        logging.info("no burst rows at %s: the burst check is skipped", path)
        return []
    measured = [r for r in er.read_rows(path) if r.get("kind") == "burst"]
    if not measured:
        return []
    fitted = current_fits(fit)
    out = []
    for r in measured:
        setup = {k: r.get(k, v) for k, v in br.FIRST_ROWS_SETUP.items()}
        ticks, q, slots = setup["ticks"], r["queue_beats"], r["slots"]
        warmup = ticks - r["steady_ticks"]
        schedule = br.burst_schedule(r["offered"], setup["burst_beats"], setup["mean_call_beats"])
        shape = {
            "slots": slots,
            "queue_beats": q,
            "ticks": ticks,
            "frames_per_tick": r["frames_per_tick"],
            "context_frames": r["context_frames"],
        }
        # the rule of the rows' server (rows without the field: before the withdrawal existed)
        rep = br.replay_burst(schedule, **shape,
                              withdraw_at_leave=r.get("withdraw_at_leave", False))  # fmt: skip
        now = br.replay_burst(schedule, **shape)  # the server's rule today
        engine = {"refused": r["refused"], "queued": r["queued"], "waited_beats": r["waited_beats"],
                  "admitted": r["events"].get("admitted", 0), "ended": r["events"].get("ended", 0),
                  "session_beats": r["session_beats"],
                  "live_at_end_waits": sorted(r["live_at_end_waits"])}  # fmt: skip
        replay = {"refused": rep.refused, "queued": rep.queued, "waited_beats": rep.waited_beats,
                  "admitted": rep.admitted, "ended": rep.ended,
                  "session_beats": rep.session_beats(warmup),
                  "live_at_end_waits": rep.live_at_end_waits}  # fmt: skip
        current = {"refused": now.refused, "withdrawn": now.withdrawn, "queued": now.queued,
                   "waited_beats": now.waited_beats, "admitted": now.admitted,
                   "session_beats": now.session_beats(warmup)}  # fmt: skip
        calls = br.admit_calls_counts(schedule, slots=slots, queue_beats=q, ticks=ticks,
                                      warmup=warmup)  # fmt: skip
        steady = slice(warmup, ticks)
        base = {"queue_beats": q, "slots": slots, "offered": r["offered"],
                "input_commit": r["commit"], "input_device": r["device"],
                "burst_beats": setup["burst_beats"],
                "mean_call_beats": setup["mean_call_beats"], "run_ticks": ticks,
                "ticks": r["steady_ticks"]}  # fmt: skip
        out.append({
            "kind": "burst_admission", **base, "engine": engine, "replay": replay,
            "admit_calls": calls, "replay_matches": replay == engine,
            "replay_current_rule": current,
            "admit_calls_matches": all(calls[k] == engine[k] for k in calls),
            "real_late_frac": r["missed_session_beats"] / max(r["session_beats"], 1),
            "mean_live": float(rep.live[steady].mean()),
            "mean_fill_frames": float(rep.fill_frames[steady].mean()),
            "max_fill_frames": float(rep.fill_frames[steady].max()),
        })  # fmt: skip
        for case, which, fill in BURST_CASES:
            f = fitted[which]
            s = br.simulate_burst(f, rep, slots=slots, warmup=warmup, fill=fill)
            out.append({
                "kind": "burst_validation", **base, "case": case, "host_ms": f.tail.host_ms,
                "real_p50_ms": r["p50_ms"], "sim_p50_ms": s["sim_p50_ms"],
                "p50_error": s["sim_p50_ms"] / r["p50_ms"] - 1,
                "real_p99_ms": r["p99_ms"], "sim_p99_ms": s["sim_p99_ms"],
                "p99_error": s["sim_p99_ms"] / r["p99_ms"] - 1,
                "real_max_ms": r["max_ms"], "sim_max_ms": s["sim_max_ms"],
                "real_missed": r["missed_ticks"], "sim_missed": s["sim_missed"],
                "sim_late_frac": s["sim_late_frac"],
            })  # fmt: skip
    return out


def sim_part() -> list[dict]:
    fit = fits.fit_models(er.read_rows(FLAGS.profile_rows))
    rows = [fits.model_row(fit)] + [{"kind": "validation", **v} for v in sim.validate(fit)]
    rows += burst_check(fit)
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
    """One panel per traffic pattern: calls refused against admitted session-beats late, a line
    per queue timeout, each point labelled with its admission threshold; a last panel for the
    measured burst where the rows have it (``experiments.plot``)."""
    pol = [r for r in sim_rows if r["kind"] == "policy"]
    names = list(dict.fromkeys(r["pattern"] for r in pol))
    burst = [r for r in sim_rows if r["kind"] == "burst_admission"]
    n = len(names) + bool(burst)
    fig, ax = draw.figure(1, n, size=(4 * n, 4), squeeze=False, sharey=True)
    # per cent late, on one symlog axis from 0 for every panel (most points are exactly 0)
    top = max([0.01, *(2 * 100 * r["late_frac"] for r in pol)])
    for a, name in zip(ax[0][: len(names)], names, strict=True):
        rs = sorted((r for r in pol if r["pattern"] == name),
                    key=lambda r: (r["queue_s"], r["max_live"]))  # fmt: skip
        draw.lines(a, rs, "refused_frac", [draw.Y("late_frac*100", label="queue {group:g} s")],
                   group="queue_s", sort=False)  # fmt: skip
        draw.labels(a, rs, "refused_frac", "late_frac*100", "{max_live}", fontsize=7)
        a.set(xlabel="calls refused (fraction)", title=name)
        a.set_yscale("symlog", linthresh=1e-3)
        a.set_ylim(0, top)
        a.legend(fontsize=7)
    if burst:
        plot_burst(ax[0][-1], burst, [r for r in sim_rows if r["kind"] == "burst_validation"])
    ax[0][0].set_ylabel("admitted session-beats late, %")
    label = fits.fit_label(sim_rows)
    what = "; last panel: the measured burst, simulated too" if burst else ""
    fig.suptitle(f"H200, simulated ({label}): labels are the admission threshold{what}")
    draw.save(fig, path, dpi=110)


def plot_burst(a, admission: list[dict], validation: list[dict]) -> None:
    """The measured burst rows on the policy panels' axes (labels: the queue in beats), and the
    simulator's (``sim.admit_calls`` refusals, late session-beats of each ``BURST_CASES``)."""
    r0 = admission[0]
    measured = [{**r, "x": r["engine"]["refused"] / r["offered"], "y": 100 * r["real_late_frac"]}
                for r in admission]  # fmt: skip
    draw.lines(a, measured, "x", [draw.Y("y", "k*", label="measured (q: queue, beats)",
                                         style={"ms": 11})], sort=False)  # fmt: skip
    draw.labels(a, measured, "x", "y", "q {queue_beats}", fontsize=7, xytext=(4, 6),
                textcoords="offset points")  # fmt: skip
    for (case, _, _), m in zip(BURST_CASES, "sDv", strict=True):
        simulated = [{"x": a_["admit_calls"]["refused"] / a_["offered"],
                      "y": 100 * v["sim_late_frac"]}
                     for a_ in admission for v in validation
                     if v["case"] == case and v["queue_beats"] == a_["queue_beats"]]  # fmt: skip
        draw.lines(a, simulated, "x", [draw.Y("y", m, label=f"simulated, {case}",
                                              style={"mfc": "none"})], sort=False)  # fmt: skip
    a.set(xlabel="calls refused (fraction)",
          title=f"H200 burst: {r0['offered']} calls in {r0['burst_beats']} beats, "
                f"{r0['slots']} slots")  # fmt: skip
    a.set_yscale("symlog", linthresh=1e-3)
    a.set_xlim(0, 1.25 * max(r["x"] for r in measured))
    a.legend(fontsize=7, loc="upper left")


def print_burst_check(sim_rows: list[dict]) -> None:
    """The ``burst_admission`` and ``burst_validation`` rows, one line each."""

    def counts(d: dict) -> str:
        return " / ".join(str(d[k]) for k in ("refused", "queued", "waited_beats", "session_beats"))

    for r in (r for r in sim_rows if r["kind"] == "burst_admission"):
        print(f"  burst, queue {r['queue_beats']} beats ({r['input_device']}, "
              f"{r['input_commit']}): refused / queued / waited / session-beats: engine "
              f"{counts(r['engine'])}, replay {counts(r['replay'])}, admit_calls "
              f"{counts(r['admit_calls'])}; mean live "
              f"{r['mean_live']:.1f}, mean fill {r['mean_fill_frames']:.1f} frames")  # fmt: skip
        if "replay_current_rule" in r:
            c = r["replay_current_rule"]
            print(f"    with today's rule (a waiter whose leave comes is withdrawn): "
                  f"{counts(c)}, {c['withdrawn']} withdrawn")  # fmt: skip
    for r in (r for r in sim_rows if r["kind"] == "burst_validation"):
        print(f"  burst, queue {r['queue_beats']:>2} beats, {r['case']:>9}: p50 real "
              f"{r['real_p50_ms']:.1f} sim {r['sim_p50_ms']:.1f} ms "
              f"({100 * r['p50_error']:+.1f} %), p99 {r['real_p99_ms']:.1f} / "
              f"{r['sim_p99_ms']:.1f} ({100 * r['p99_error']:+.1f} %), missed "
              f"{r['real_missed']} / {r['sim_missed']:g} of {r['ticks']}")  # fmt: skip


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
        print_burst_check(sim_rows)
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
