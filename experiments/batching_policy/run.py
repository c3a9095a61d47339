"""Lockstep against per-session (batch-1) stepping and dynamic batching with a waiting window.

Engine part (``--parts=engine``; the tiny model on the CPU for smoke rows, ``--model=voicechat_11b``
on the H200): serves n sessions in lockstep (every slot, every beat) on the real-time clock; steps
n sessions one after another at batch 1 each beat (one compiled 1-slot tick, n session states);
times the ticks back to back (GPU-seconds per conversation-hour); and, with late client input,
compares the server's ``Lockstep`` with its ``WaitingWindow`` policy.

Simulated part (``--parts=sim``; host only): the policy simulator fitted to the H200 rows
(``experiments/policy_sim``) gives capacity at zero misses, p99 and GPU-seconds per
conversation-hour for lockstep, batch 1 and request-style batching with windows, with the
simulator's validation against the real server. ``--fit`` picks the rows: ``capacity`` (default:
the current engine's ``experiments/capacity`` rows, ``sim.fit_capacity``; with
``--capacity_config=xla_tts`` the rows of the engine with XLA's speech-decoder attention, the
README's history) or ``beat_profile`` (the older engine's rows, ``sim.fit_h200``: the README's older
history).
``--parts=`` (neither part) draws only the figure, from the rows already written (``--sim_out``,
``--out``), through ``experiments.plot``. See README.md beside this file.
"""

from __future__ import annotations

import os
import pathlib
import time

import jax
import numpy as np
from absl import app, flags, logging

from experiments import harness

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
from experiments import plot as draw  # noqa: E402
from experiments.policy_sim import engine_runs as er  # noqa: E402
from experiments.policy_sim import fits, sim  # noqa: E402
from voicechat_jax.engine import Engine  # noqa: E402
from voicechat_jax.serving import scheduler as sched  # noqa: E402
from voicechat_jax.serving.clock import BeatClock  # noqa: E402
from voicechat_jax.serving.server import SessionPlan, session_key  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("parts", ["engine", "sim"], "engine (real runs) and/or sim (H200 simulator).")
flags.DEFINE_list("sessions", ["1", "2", "4"], "Lockstep session counts (slots = sessions).")
flags.DEFINE_list("per_session", ["1", "2", "4"], "Session counts stepped at batch 1.")
flags.DEFINE_integer("ticks", 40, "Real-time beats per run (warm-up included).")
flags.DEFINE_integer("warmup_ticks", 5, "Beats reported apart as warm-up.")
flags.DEFINE_integer("timed_ticks", 10, "Back-to-back ticks timed per slot count.")
flags.DEFINE_integer("context_frames", 64, "Context cap in frames (1500 on the H200).")
flags.DEFINE_float("late_fraction", 0.1, "Share of client beats that arrive one beat late.")
flags.DEFINE_integer("window_beats", 1, "WaitingWindow's window in the late-input comparison.")
flags.DEFINE_string("out", str(_HERE / "results/cpu_tiny.jsonl"), "Engine rows (appended).")
flags.DEFINE_integer("seeds", 5, "Simulator seeds per point.")
flags.DEFINE_integer("capacity_beats", 500, "Beats per simulated capacity probe.")
flags.DEFINE_list("windows_ms", ["0", "20", "60"], "Request-batching windows (simulated).")
harness.define_engine_flags()
fits.define_fit_flags("batching_policy")


def per_session_run(engine: Engine, n: int, n_ticks: int, warmup: int) -> dict:
    """n sessions stepped one after another at batch 1 every beat, on the real-time clock.

    One compiled 1-slot tick and n session states swapped into the engine in turn. Beat latency:
    from the beat's start until the last session's output is on the host; a session's latency:
    until its own is. The clock skips beats whose slot passed (as the server's does).
    """
    engine.reset()
    states = [engine.state] + [
        jax.tree_util.tree_map(lambda x: x.copy(), engine.state) for _ in range(n - 1)
    ]
    period = engine.serve.beat_ms / 1e3
    clock = BeatClock(period, "realtime")
    audio = [harness.speech(n_ticks * engine.samples_per_beat, i) for i in range(n)]
    spb = engine.samples_per_beat
    beat_lat, sess_lat, missed, skipped = [], [], 0, 0
    clock.begin()
    last = None
    while (k := clock.next_tick(last)) < n_ticks:
        timing = clock.wait_for_tick(k)
        skipped += timing.skipped
        last = k
        outs = []
        for i in range(n):
            beat = engine.empty_beat()
            beat.audio[0] = audio[i][k * spb : (k + 1) * spb]
            if k == 0:
                beat.admit[0] = True
                beat.key[0] = session_key(0, f"s{i}")
            engine.state = states[i]
            outs.append(engine.tick(beat))
            states[i] = engine.state
        ready = []
        for out in outs:
            jax.device_get(out.frames.wav)
            ready.append((time.monotonic() - timing.start) * 1e3)
        if k >= warmup:
            beat_lat.append(ready[-1])
            sess_lat.append(ready)
            missed += ready[-1] > engine.serve.beat_ms
    beat_lat = np.asarray(beat_lat)
    per = np.asarray(sess_lat)
    return {
        "kind": "per_session",
        "sessions": n,
        "steady_ticks": len(beat_lat),
        "p50_ms": float(np.percentile(beat_lat, 50)),
        "p99_ms": float(np.percentile(beat_lat, 99)),
        "max_ms": float(beat_lat.max()),
        "first_session_p50_ms": float(np.percentile(per[:, 0], 50)),
        "missed_ticks": int(missed),
        "skipped_ticks": int(skipped),
    }


def late_plans(n: int, n_ticks: int, spb: int, fraction: float) -> list[SessionPlan]:
    rng = np.random.default_rng(1)
    return [
        SessionPlan(
            id=f"s{i:03d}",
            audio=harness.speech(n_ticks * spb, i),
            late=frozenset(int(b) for b in np.flatnonzero(rng.random(n_ticks) < fraction)),
        )
        for i in range(n)
    ]


def engine_part(rows: list[dict]) -> None:
    base = er.engine_setup(FLAGS.model)
    cfg, params = er.build(FLAGS.model)
    template = None
    one_slot = None
    last_engine = None
    for n in (int(x) for x in FLAGS.sessions):
        serve = harness.serve_config(slots=n, context_frames=FLAGS.context_frames)
        engine = Engine(params, cfg, serve, template=template)
        template = engine.template
        t = harness.tick_ms(engine, FLAGS.timed_ticks)
        plans = er.plans_all_joined(n, FLAGS.ticks, engine.samples_per_beat)
        row, _ = er.serve(engine, plans, FLAGS.ticks, warmup_ticks=FLAGS.warmup_ticks)
        tick = float(np.median(t))
        rows.append({**base, "kind": "lockstep", "sessions": n, **row, "tick_ms": tick,
                     "busy_gpu_s_per_conv_h": tick / 1e3 * (3600 / 0.16) / n})  # fmt: skip
        if n == 1:
            one_slot = engine
        last_engine = engine
    if one_slot is None:
        serve = harness.serve_config(slots=1, context_frames=FLAGS.context_frames)
        one_slot = Engine(params, cfg, serve, template=template)
    one_slot.compile_tick()
    t1 = float(np.median(harness.tick_ms(one_slot, FLAGS.timed_ticks)))
    for n in (int(x) for x in FLAGS.per_session):
        r = per_session_run(one_slot, n, FLAGS.ticks, FLAGS.warmup_ticks)
        rows.append({**base, **r, "tick1_ms": t1,
                     "busy_gpu_s_per_conv_h": t1 / 1e3 * (3600 / 0.16)})  # fmt: skip
    # Late client input: Lockstep feeds silence (an underrun), WaitingWindow holds the session.
    n = last_engine.serve.slots
    plans = late_plans(n, FLAGS.ticks, last_engine.samples_per_beat, FLAGS.late_fraction)
    for policy in (sched.Lockstep(), sched.WaitingWindow(FLAGS.window_beats)):
        row, _ = er.serve(last_engine, plans, FLAGS.ticks, scheduler=policy,
                          warmup_ticks=FLAGS.warmup_ticks)  # fmt: skip
        rows.append({**base, "kind": "late_input", "sessions": n, **row,
                     "late_fraction": FLAGS.late_fraction,
                     "held_session_beats": getattr(policy, "held_session_beats", 0)})  # fmt: skip


def _mean(runs: list[dict]) -> dict:
    keys = ("p50_ms", "p99_ms", "max_ms", "missed", "busy_gpu_s_per_conv_h")
    return {k: float(np.mean([r[k] for r in runs])) for k in keys}


def sim_part() -> list[dict]:
    fit = fits.fit_models()
    rows = [fits.model_row(fit)]
    rows += [{"kind": "validation", **v} for v in sim.validate(fit, FLAGS.seeds)]
    nb, quiet, cost = FLAGS.capacity_beats, fit.quiet, fit.cost

    def seeds(f):
        return [f(np.random.default_rng(s)).summary() for s in range(FLAGS.seeds)]

    policies = {
        "lockstep": lambda n, g: sim.simulate_lockstep(cost, nb, n, slots=n, tail=quiet, rng=g),
        "batch1": lambda n, g: sim.simulate_requests(cost, n, nb, window_ms=0, max_batch=1,
                                                     tail=quiet, rng=g),
    }  # fmt: skip
    phases = np.random.default_rng(1).uniform(0, sim.BEAT_MS, 512)  # each session's phase
    for w in (float(x) for x in FLAGS.windows_ms):
        policies[f"dynamic_w{w:g}"] = lambda n, g, w=w: sim.simulate_requests(
            cost, n, nb, window_ms=w, max_batch=512, tail=quiet, rng=g, phases_ms=phases[:n]
        )
    for name, f in policies.items():
        cap = 0
        for n in range(1, 257):
            if any(s["missed"] for s in seeds(lambda g, n=n, f=f: f(n, g))):
                break
            cap = n
        for n in sorted({1, 2, 4, 8, 16, 32, 48, 64, 80, cap, cap + 1} - {0}):
            rows.append({"kind": "policy", "policy": name, "sessions": n,
                         **_mean(seeds(lambda g, n=n, f=f: f(n, g)))})  # fmt: skip
        at = _mean(seeds(lambda g, f=f, c=cap: f(c, g))) if cap else {}
        rows.append({"kind": "capacity", "policy": name, "capacity": cap,
                     "p99_at_capacity_ms": at.get("p99_ms"),
                     "held_gpu_s_per_conv_h": 3600.0 / cap if cap else None,
                     "busy_gpu_s_per_conv_h": at.get("busy_gpu_s_per_conv_h")})  # fmt: skip
        logging.info("simulated capacity %s: %d", name, cap)
    return rows


def plot(sim_rows: list[dict], engine_rows: list[dict], path: str) -> None:
    """Left: simulated p99 against sessions per policy; right: the measured lockstep and batch-1
    p99 (``experiments.plot``)."""
    fig, ax = draw.figure(1, 2, size=(11, 4.2))
    pol = [r for r in sim_rows if r["kind"] == "policy"]
    draw.lines(ax[0], pol, "sessions", [draw.Y("p99_ms", ".-", label="{group}")], group="policy")
    draw.rule(ax[0], 160, color="grey", lw=0.8, ls="--")
    ax[0].set(xscale="log", yscale="log", xlabel="sessions", ylabel="p99 beat latency ms",
              title=f"H200, simulated (fit to {fits.fit_label(sim_rows)})")  # fmt: skip
    ax[0].legend(fontsize=8)
    for kind, mark in (("lockstep", "o-"), ("per_session", "s--")):
        rs = [r for r in engine_rows if r["kind"] == kind]
        draw.lines(ax[1], rs, "sessions", [draw.Y("p99_ms", mark, label=kind)])
    draw.rule(ax[1], 160, color="grey", lw=0.8, ls="--")
    dev = engine_rows[0]["device"] if engine_rows else "?"
    model = engine_rows[0]["model"] if engine_rows else "?"
    ax[1].set(xlabel="sessions", ylabel="p99 beat latency ms",
              title=f"measured: {model} on {dev}")  # fmt: skip
    ax[1].legend(fontsize=8)
    draw.save(fig, path, dpi=110)


def print_tables(sim_rows: list[dict], engine_rows: list[dict]) -> None:
    if engine_rows:
        r0 = engine_rows[0]
        print(f"measured: {r0['model']} on {r0['device']}, jax {r0['jax']}, commit {r0['commit']}")
        print(f"{'kind':>12} {'sess':>4} {'p50':>7} {'p99':>7} {'max':>7} {'missed':>6} "
              f"{'ticks':>5} {'busy GPU-s/conv-h':>17}")  # fmt: skip
        for r in engine_rows:
            if r["kind"] in ("lockstep", "per_session"):
                print(f"{r['kind']:>12} {r['sessions']:>4} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} "
                      f"{r['max_ms']:>7.1f} {r['missed_ticks']:>6} {r['steady_ticks']:>5} "
                      f"{r['busy_gpu_s_per_conv_h']:>17.1f}")  # fmt: skip
        for r in (r for r in engine_rows if r["kind"] == "late_input"):
            print(f"late input, {r['scheduler']}: underruns {r['underruns']}, held "
                  f"{r['held_session_beats']}, p50 {r['p50_ms']:.1f} ms")  # fmt: skip
    if sim_rows:
        m = next(r for r in sim_rows if r["kind"] == "model")
        print(f"simulated H200, fit to {fits.fit_label(sim_rows)}: t(B) = {m['a_ms']:.2f} + "
              f"{m['b_ms']:.3f}*B + {m['c_ms']:.3f}*B*x ms per frame-step")  # fmt: skip
        print("validation: p50 error per real serving row")
        for v in (r for r in sim_rows if r["kind"] == "validation"):
            print(f"  {v['sessions']:>4} sessions: real {v['real_p50_ms']:.1f} sim "
                  f"{v['sim_p50_ms']:.1f} ms ({100 * v['p50_error']:+.1f} %)")  # fmt: skip
        print(f"{'policy':>14} {'capacity':>8} {'p99 ms':>7} {'held':>7} {'busy':>7}")
        for r in (r for r in sim_rows if r["kind"] == "capacity"):
            p99 = r["p99_at_capacity_ms"] or float("nan")
            held = r["held_gpu_s_per_conv_h"] or float("nan")
            busy = r["busy_gpu_s_per_conv_h"] or float("nan")
            print(f"{r['policy']:>14} {r['capacity']:>8} {p99:>7.1f} {held:>7.1f} {busy:>7.1f}")


def main(argv):
    del argv
    sim_out, plot_path = fits.sim_files(_HERE, "batching_policy")
    er.run_parts(
        FLAGS.parts,
        out=FLAGS.out,
        sim_out=sim_out,
        plot_path=plot_path,
        engine_part=engine_part,
        sim_part=sim_part,
        plot=plot,
        print_tables=print_tables,
    )


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
