"""Phase-staggered slot groups: two half-size groups offset by half a beat, against one group.

Engine part (``--parts=engine``; tiny on the CPU for smoke rows, ``--model=voicechat_11b`` on the
H200): one group of n slots served in lockstep by the ``Server`` on the real-time clock, against
two groups of n/2 slots (one compiled n/2-slot tick, two session states) whose beats start half a
beat apart: a clock of half the period dispatches the groups in turn, a reader thread timestamps
each group's outputs; each group's beat latency is measured from its own beat's start.

Simulated part (``--parts=sim``; host only): ``sim.simulate_groups`` with the step-cost and tail
models fitted to the H200 rows: capacity at zero misses, p50/p99 and device busy for 1, 2 and 4
groups. One group is the validated lockstep simulator; staggered groups are not validated yet.
``--fit`` picks the rows: ``capacity`` (default: the current engine's ``experiments/capacity``
rows, ``sim.fit_capacity``; ``--capacity_config=xla_tts`` the earlier engine's, the README's
history) or ``beat_profile`` (the older engine's, ``sim.fit_h200``: the oldest history).
``--parts=`` (neither part) draws only the figure, from the rows already written (``--sim_out``,
``--out``), through ``experiments.plot``. See README.md beside this file.
"""

from __future__ import annotations

import os
import pathlib
import queue
import threading
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
from voicechat_jax.serving.clock import BeatClock  # noqa: E402
from voicechat_jax.serving.server import session_key  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("parts", ["engine", "sim"], "engine (real runs) and/or sim (H200 simulator).")
flags.DEFINE_list("sessions", ["4"], "Total sessions n (even): one group of n, two of n/2.")
flags.DEFINE_integer("ticks", 60, "Beats per group per run (warm-up included).")
flags.DEFINE_integer("warmup_ticks", 5, "Beats per group reported apart as warm-up.")
flags.DEFINE_integer("timed_ticks", 10, "Back-to-back ticks timed per slot count.")
flags.DEFINE_integer("context_frames", 64, "Context cap in frames (1500 on the H200).")
flags.DEFINE_string("out", str(_HERE / "results/cpu_tiny.jsonl"), "Engine rows (appended).")
flags.DEFINE_list("groups", ["1", "2", "4"], "Simulated group counts (equal sizes, equal offsets).")
flags.DEFINE_integer("seeds", 5, "Simulator seeds per point.")
flags.DEFINE_integer("sim_beats", 500, "Simulated beats per probe.")
flags.DEFINE_list(
    "sim_sessions", ["8", "16", "24", "32", "40", "48"],
    "Simulated session counts reported (besides the capacity; those a multiple of the groups).",
)  # fmt: skip
harness.define_engine_flags()
fits.define_fit_flags("phase_stagger")


def staggered_run(engine: Engine, groups: int, n_ticks: int, warmup: int) -> dict:
    """``groups`` groups of ``engine.serve.slots`` sessions, beats offset by P / groups."""
    engine.reset()
    states = [engine.state] + [
        jax.tree_util.tree_map(lambda x: x.copy(), engine.state) for _ in range(groups - 1)
    ]
    S = engine.serve.slots
    P = engine.serve.beat_ms / 1e3
    spb = engine.samples_per_beat
    audio = [[harness.speech(n_ticks * spb, g * S + i) for i in range(S)] for g in range(groups)]
    clock = BeatClock(P / groups, "realtime", deadline_s=P / groups)
    done: queue.SimpleQueue = queue.SimpleQueue()
    lat = np.full((groups, n_ticks), np.nan)

    def reader():
        while (item := done.get()) is not None:
            g, k, start, out = item
            jax.device_get(out.frames.wav)
            lat[g, k] = (time.monotonic() - start) * 1e3

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    clock.begin()
    last = None
    while (j := clock.next_tick(last)) < n_ticks * groups:
        timing = clock.wait_for_tick(j)
        last = j
        g, k = j % groups, j // groups
        beat = engine.empty_beat()
        for i in range(S):
            beat.audio[i] = audio[g][i][k * spb : (k + 1) * spb]
        if k == 0:
            beat.admit[:] = True
            beat.key[:] = [session_key(0, f"g{g}s{i}") for i in range(S)]
        engine.state = states[g]
        out = engine.tick(beat)
        states[g] = engine.state
        done.put((g, k, timing.start, out))
    done.put(None)
    th.join()
    steady = lat[:, warmup:]
    missed = np.isnan(steady) | (steady > engine.serve.beat_ms)
    ok = steady[~np.isnan(steady)]
    return {
        "kind": "groups",
        "groups": groups,
        "group_slots": S,
        "sessions": groups * S,
        "steady_ticks": int(steady.size),
        "p50_ms": float(np.percentile(ok, 50)),
        "p99_ms": float(np.percentile(ok, 99)),
        "max_ms": float(ok.max()),
        "missed_ticks": int(missed.sum()),
        "per_group_p50_ms": [float(np.nanpercentile(x, 50)) for x in steady],
    }


def engine_part(rows: list[dict]) -> None:
    base = er.engine_setup(FLAGS.model)
    cfg, params = er.build(FLAGS.model)
    template = None
    for n in (int(x) for x in FLAGS.sessions):
        for groups in (1, 2):
            serve = harness.serve_config(slots=n // groups, context_frames=FLAGS.context_frames)
            engine = Engine(params, cfg, serve, template=template)
            template = engine.template
            t = float(np.median(harness.tick_ms(engine, FLAGS.timed_ticks)))
            r = staggered_run(engine, groups, FLAGS.ticks, FLAGS.warmup_ticks)
            rows.append({**base, **r, "tick_ms": t})
            if groups == 1:  # the same through the server, for reference
                plans = er.plans_all_joined(n, FLAGS.ticks, engine.samples_per_beat)
                row, _ = er.serve(engine, plans, FLAGS.ticks, warmup_ticks=FLAGS.warmup_ticks)
                rows.append({**base, "kind": "server", "sessions": n, **row, "tick_ms": t})
            del engine


def sim_part() -> list[dict]:
    fit = fits.fit_models(er.read_rows(FLAGS.profile_rows))
    rows = [fits.model_row(fit)] + [{"kind": "validation", **v} for v in sim.validate(fit)]

    def probe(n: int, groups: int) -> dict:
        size = n // groups
        runs = []
        for s in range(FLAGS.seeds):
            res = sim.simulate_groups(fit.cost, FLAGS.sim_beats, [size] * groups,
                                      [g * sim.BEAT_MS / groups for g in range(groups)],
                                      tail=fit.quiet, rng=np.random.default_rng(s))  # fmt: skip
            lat = np.concatenate([r.latency_ms for r in res])
            lat = lat[~np.isnan(lat)]
            busy = sum(r.busy_ms for r in res) / res[0].span_ms
            runs.append({"p50_ms": float(np.percentile(lat, 50)),
                         "p99_ms": float(np.percentile(lat, 99)),
                         "missed": int(sum(r.missed.sum() for r in res)),
                         "busy_frac": float(busy)})  # fmt: skip
        return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}

    for groups in (int(x) for x in FLAGS.groups):
        cap = 0
        for n in range(groups, 256, groups):
            if probe(n, groups)["missed"]:
                break
            cap = n
        for n in sorted({*(int(x) for x in FLAGS.sim_sessions), cap} - {0}):
            if n % groups == 0:
                rows.append({"kind": "sim", "groups": groups, "sessions": n, **probe(n, groups)})
        rows.append({"kind": "capacity", "groups": groups, "capacity": cap,
                     **(probe(cap, groups) if cap else {})})  # fmt: skip
        logging.info("groups %d: capacity %d", groups, cap)
    return rows


def plot(sim_rows: list[dict], engine_rows: list[dict], path: str) -> None:
    """Left: simulated p50 and p99 against sessions per number of phase groups; right: the
    measured p50 (bars) and p99 per grouping (``experiments.plot``)."""
    fig, ax = draw.figure(1, 2, size=(11, 4.2))
    pts = [r for r in sim_rows if r["kind"] == "sim"]
    for g in sorted({r["groups"] for r in pts}):
        ys = [draw.Y("p50_ms", "o-", label=f"{g} p50"), draw.Y("p99_ms", "x--", label=f"{g} p99")]
        draw.lines(ax[0], [r for r in pts if r["groups"] == g], "sessions", ys)
    draw.rule(ax[0], 160, color="grey", lw=0.8, ls="--")
    label = fits.fit_label(sim_rows)
    ax[0].set(xlabel="sessions (all groups)", ylabel="beat latency ms",
              title=f"H200, simulated ({label}): offsets P / groups")  # fmt: skip
    ax[0].legend(fontsize=7, ncol=2)
    gr = [{**r, "bar": i} for i, r in enumerate(r for r in engine_rows if r["kind"] == "groups")]
    if gr:
        draw.bars(ax[1], gr, "bar", "p50_ms", xs=range(len(gr)), label="p50")
        draw.lines(ax[1], gr, "bar", [draw.Y("p99_ms", "kx", label="p99")], sort=False)
        ax[1].set_xticks(range(len(gr)), [f"{r['groups']} x {r['group_slots']}" for r in gr])
    model = engine_rows[0]["model"] if engine_rows else "?"
    dev = engine_rows[0]["device"] if engine_rows else "?"
    ax[1].set(ylabel="beat latency ms", title=f"measured: {model} on {dev}")
    ax[1].legend(fontsize=8)
    draw.save(fig, path, dpi=110)


def print_tables(sim_rows: list[dict], engine_rows: list[dict]) -> None:
    if engine_rows:
        r0 = engine_rows[0]
        print(f"measured: {r0['model']} on {r0['device']}, jax {r0['jax']}, commit {r0['commit']}")
        for r in engine_rows:
            what = "server" if r["kind"] == "server" else f"{r['groups']} x {r['group_slots']}"
            print(f"{what:>8}: p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} "
                  f"max {r['max_ms']:.1f} missed {r['missed_ticks']}/{r['steady_ticks']} "
                  f"tick {r['tick_ms']:.1f} ms")  # fmt: skip
    if sim_rows:
        print(f"simulated H200, fit to {fits.fit_label(sim_rows)}")
        fits.print_validation(sim_rows)
        for r in (r for r in sim_rows if r["kind"] == "sim"):
            print(f"  {r['groups']} group(s), {r['sessions']:>3} sessions: p50 {r['p50_ms']:.1f} "
                  f"p99 {r['p99_ms']:.1f} ms, missed {r['missed']:.1f}, "
                  f"busy {r['busy_frac']:.2f}")  # fmt: skip
        for r in (r for r in sim_rows if r["kind"] == "capacity"):
            p99, busy = r.get("p99_ms", float("nan")), r.get("busy_frac", 0.0)
            print(f"{r['groups']} group(s): capacity {r['capacity']}, p99 at capacity "
                  f"{p99:.1f} ms, busy {busy:.2f}")  # fmt: skip


def main(argv):
    del argv
    sim_out, plot_path = fits.sim_files(_HERE, "phase_stagger")
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
