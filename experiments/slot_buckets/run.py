"""Slot buckets against one fixed slot count: cost at partial load, compiles, the cost of a move.

Engine part (``--parts=engine``; tiny on the CPU for smoke rows, ``--model=voicechat_11b`` on the
H200): a fixed ``Engine`` of the largest bucket and an ``Engine`` with ``buckets`` (sharing its
tick); times every bucket's tick back to back, every move between buckets (``Engine.place``,
blocked on), counts the compiles, and serves the same churning sessions under ``Lockstep`` (fixed)
and ``SlotBuckets`` on the real-time clock.

Simulated part (``--parts=sim``; host only): an hour of Poisson calls on one H200 with the
simulator fitted to the H200 rows: fixed slots against buckets, with a move cost and hysteresis.
``--fit`` picks the rows: ``capacity`` (default: the current engine's ``experiments/capacity``
rows, ``sim.fit_capacity``; with ``--capacity_config=xla_tts`` the rows of the engine with XLA's
speech-decoder attention, the README's history) or ``beat_profile`` (the older engine's,
``sim.fit_h200``: the README's older history); the move cost comes from the beat_profile component
and copy rows under each.
``--parts=`` (neither part) draws only the figure, from the rows already written (``--sim_out``,
``--out``), through ``experiments.plot``. See README.md beside this file.
"""

from __future__ import annotations

import itertools
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
from voicechat_jax.serving.server import SessionPlan  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("parts", ["engine", "sim"], "engine (real runs) and/or sim (H200 simulator).")
flags.DEFINE_list("buckets", ["1", "2", "4"], "Slot buckets; the largest is the fixed engine's.")
flags.DEFINE_integer("context_frames", 64, "Context cap in frames (1500 on the H200).")
flags.DEFINE_integer("timed_ticks", 10, "Back-to-back ticks timed per bucket.")
flags.DEFINE_integer("moves", 3, "Timed moves per bucket pair.")
flags.DEFINE_integer("ticks", 60, "Real-time beats per serving run (warm-up included).")
flags.DEFINE_float("mean_live", 0.5, "Churn load: mean live sessions as a share of the slots.")
flags.DEFINE_integer("mean_call_beats", 20, "Churn: mean call length in beats (exponential).")
flags.DEFINE_integer("shrink_after", 10, "SlotBuckets' hysteresis in beats (engine runs).")
flags.DEFINE_string("out", str(_HERE / "results/cpu_tiny.jsonl"), "Engine rows (appended).")
flags.DEFINE_list(
    "sim_buckets", ["8", "16", "32", "capacity"],
    "Simulated buckets (H200); the largest is the server's slots. 'capacity': the fit's simulated "
    "lockstep capacity at zero misses (--seeds x --capacity_beats, host stalls off).",
)  # fmt: skip
flags.DEFINE_integer("seeds", 5, "Simulator seeds per capacity probe.")
flags.DEFINE_integer("capacity_beats", 500, "Beats per simulated capacity probe.")
flags.DEFINE_list("erlangs", ["10", "20", "30", "40", "50"], "Simulated offered loads.")
flags.DEFINE_list("hysteresis", ["0", "25", "125"], "Simulated shrink_after values (beats).")
flags.DEFINE_integer("hour_beats", 22500, "Simulated beats (22,500 = one hour).")
harness.define_engine_flags()
fits.define_fit_flags("slot_buckets")


def churn_plans(slots: int, n_ticks: int, spb: int) -> list[SessionPlan]:
    """Poisson arrivals and exponential call lengths for a mean live of ``mean_live * slots``."""
    rng = np.random.default_rng(3)
    rate = FLAGS.mean_live * slots / FLAGS.mean_call_beats  # arrivals per beat
    plans, k, i = [], 0.0, 0
    while True:
        k += rng.exponential(1.0 / rate)
        if k >= n_ticks - 1:
            break
        join = int(k)
        leave = join + 1 + int(rng.exponential(FLAGS.mean_call_beats))
        plans.append(SessionPlan(id=f"c{i:04d}", audio=harness.speech((leave - join) * spb, i),
                                 join=join, leave=leave if leave < n_ticks else None))  # fmt: skip
        i += 1
    return plans


def engine_part(rows: list[dict]) -> None:
    base = er.engine_setup(FLAGS.model)
    buckets = sorted(int(x) for x in FLAGS.buckets)
    top = buckets[-1]
    cfg, params = er.build(FLAGS.model)
    serve = harness.serve_config(slots=top, context_frames=FLAGS.context_frames)
    fixed = Engine(params, cfg, serve)  # its programs are shared with the buckets
    fixed.compile_tick()
    rows.append({**base, "kind": "compile", "engine": "fixed", "programs": 1,
                 "compile_s": fixed.compile_s, "template_s": fixed.template_s})  # fmt: skip
    for live in sorted({1, *buckets}):
        t = harness.tick_ms(fixed, FLAGS.timed_ticks, live=live)
        rows.append({**base, "kind": "tick", "engine": "fixed", "slots": top, "live": live,
                     "tick_ms": float(np.median(t)), "ms": t.tolist()})  # fmt: skip
    plans = churn_plans(top, FLAGS.ticks, fixed.samples_per_beat)
    row, _ = er.serve(fixed, plans, FLAGS.ticks)
    rows.append({**base, "kind": "serve", "engine": "fixed", **row})
    shared = {top: fixed.programs()}
    template = fixed.template
    fixed.state = None  # its state goes before the bucket engine's (they need not fit together)
    del fixed
    engine = Engine(params, cfg, serve, buckets=buckets, template=template, programs=shared)
    engine.compile_tick()
    rows.append({**base, "kind": "compile", "engine": "buckets", "programs": engine.compiles,
                 "compile_s": engine.compile_s, "buckets": buckets})  # fmt: skip
    for b in buckets:
        t = harness.tick_ms(engine, FLAGS.timed_ticks, live=b)
        rows.append({**base, "kind": "tick", "engine": "buckets", "slots": b, "live": b,
                     "tick_ms": float(np.median(t)), "ms": t.tolist()})  # fmt: skip
    run = np.ones(top, bool)
    for a, b in itertools.permutations(buckets, 2):
        ms = []
        for _ in range(FLAGS.moves):
            engine.reset()
            engine.place(sched.BeatPlan(run=run, bucket=a))
            beat = engine.empty_beat()
            beat.admit[: min(a, b)] = True  # the kept slots are live
            jax.block_until_ready(engine.tick(beat))
            t = time.perf_counter()
            engine.place(sched.BeatPlan(run=run, bucket=b))
            jax.block_until_ready(engine.state)
            ms.append((time.perf_counter() - t) * 1e3)
        rows.append({**base, "kind": "move", "from": a, "to": b, "kept": min(a, b),
                     "ms": float(np.median(ms)), "all_ms": ms})  # fmt: skip
    policy = sched.SlotBuckets(buckets, shrink_after=FLAGS.shrink_after)
    row, _ = er.serve(engine, plans, FLAGS.ticks, scheduler=policy)
    rows.append({**base, "kind": "serve", "engine": "buckets", **row, "moves": policy.moves,
                 "resizes": policy.resizes, "moved_slots": engine.moved_slots})  # fmt: skip


# ---- simulated -----------------------------------------------------------------------------


def bucket_sequence(live: np.ndarray, buckets: list[int], shrink_after: int) -> np.ndarray:
    """Per beat, the bucket ``SlotBuckets`` would run for these live counts (sessions compacted:
    the highest slot is the live count): grow at once, shrink after ``shrink_after`` beats of
    fitting a smaller bucket (0: every beat the smallest that fits)."""
    out = np.empty_like(live)
    cur, fits = buckets[0], 0
    for k, n in enumerate(live):
        target = sim.bucket_for(int(n), buckets)
        cur = max(cur, target)
        fits = fits + 1 if target < cur else 0
        if fits >= max(shrink_after, 1):
            cur, fits = target, 0
        out[k] = cur
    return out


def lockstep_capacity(fit: sim.H200Fit) -> int:
    """The largest n that lockstep (slots = n, host stalls off) serves with no miss in any of
    ``--seeds`` runs of ``--capacity_beats`` beats (as ``experiments/batching_policy``)."""
    cap = 0
    for n in range(1, 257):
        runs = [
            sim.simulate_lockstep(fit.cost, FLAGS.capacity_beats, n, slots=n, tail=fit.quiet,
                                  rng=np.random.default_rng(s)).summary()
            for s in range(FLAGS.seeds)
        ]  # fmt: skip
        if any(r["missed"] for r in runs):
            break
        cap = n
    return cap


def one_grow(fit: sim.H200Fit, buckets: list[int], resize_ms, beats: int = 40) -> dict:
    """One move from the second largest bucket into the largest, no jitter, the fit's host time:
    how many beats come out late, and the latencies from the grow on (the backlog draining)."""
    low, top = buckets[-2], buckets[-1]
    res = sim.simulate_lockstep(fit.cost, 2 * beats, lambda k: low if k < beats else top,
                                slots=top, buckets=buckets,
                                tail=sim.Tail(host_ms=fit.tail.host_ms),
                                resize_ms=resize_ms)  # fmt: skip
    after = res.latency_ms[beats:]
    return {"kind": "one_grow", "from": low, "to": top, "move_ms": resize_ms(low, top),
            "tick_ms": fit.cost.tick_ms(top), "host_ms": fit.tail.host_ms,
            "late_beats": int(res.missed.sum()),
            "latency_ms": after[: int(res.missed.sum()) + 2].tolist()}  # fmt: skip


def sim_part() -> list[dict]:
    prof = er.read_rows(FLAGS.profile_rows)
    fit = fits.fit_models(prof)
    rows = [fits.model_row(fit)]
    rows += [{"kind": "validation", **v} for v in sim.validate(fit)]
    adm = next(r for r in fit.components if r["component"].startswith("admission"))
    slot_bytes = adm["bytes"]  # one slot's state (the template written on admission)
    copy_tbps = next(r["tbps"] for r in prof if r["kind"] == "copy")

    def resize_ms(a: int, b: int) -> float:
        """A move's device time: the new state written from the template at copy bandwidth, the
        kept slots read and written at the measured admission (slot write) bandwidth."""
        return (b * slot_bytes / (copy_tbps * 1e12) + 2 * min(a, b) * slot_bytes
                / (adm["tbps"] * 1e12)) * 1e3  # fmt: skip

    cap = lockstep_capacity(fit) if "capacity" in FLAGS.sim_buckets else None
    if cap is not None:
        rows.append({"kind": "capacity", "policy": "lockstep", "capacity": cap})
        logging.info("simulated lockstep capacity: %d", cap)
    buckets = sorted({cap if x == "capacity" else int(x) for x in FLAGS.sim_buckets})
    top = buckets[-1]
    pairs = itertools.permutations(buckets, 2)
    rows.append({"kind": "move_model", "slot_bytes": slot_bytes, "copy_tbps": copy_tbps,
                 "slot_write_tbps": adm["tbps"],
                 **{f"ms_{a}_{b}": resize_ms(a, b) for a, b in pairs}})  # fmt: skip
    if len(buckets) > 1:
        rows.append(one_grow(fit, buckets, resize_ms))
    n = FLAGS.hour_beats
    for e in (float(x) for x in FLAGS.erlangs):
        tr = sim.poisson_traffic(np.random.default_rng(7), rate_per_s=e / 60.0,
                                 mean_duration_s=60.0, max_duration_s=120.0, n_beats=n,
                                 engines=1, slots=top)  # fmt: skip
        live = tr.live[0]
        conv_h = float(live.sum()) * sim.BEAT_MS / 3.6e6
        variants = {"fixed": None, **{f"buckets_h{h}": int(h) for h in FLAGS.hysteresis}}
        for name, h in variants.items():
            if h is None:
                seq = np.full(n, top)
                res = sim.simulate_lockstep(fit.cost, n, top, slots=top, tail=fit.tail,
                                            rng=np.random.default_rng(8))  # fmt: skip
            else:
                seq = bucket_sequence(live, buckets, h)
                res = sim.simulate_lockstep(fit.cost, n, lambda k, s=seq: int(s[k]), slots=top,
                                            buckets=buckets, tail=fit.tail, resize_ms=resize_ms,
                                            rng=np.random.default_rng(8))  # fmt: skip
            s = res.summary()
            late = float((res.missed * live).sum() / live.sum())
            rows.append({"kind": "hour", "erlangs": e, "variant": name, "slots": top,
                         "mean_live": float(live.mean()), "refused": tr.refused,
                         "offered": tr.offered, "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
                         "missed_ticks": s["missed"], "missed_session_beat_rate": late,
                         "busy_frac": s["busy_frac"],
                         "busy_gpu_s_per_conv_h": res.busy_ms / 1e3 / conv_h,
                         "resizes": int((np.diff(seq) != 0).sum()),
                         "mean_bucket": float(seq.mean())})  # fmt: skip
            logging.info("E=%g %s: busy %.2f", e, name, s["busy_frac"])
    k = len(buckets)
    rows.append({"kind": "compiles", "fixed": 1, "buckets_ticks": k,
                 "buckets_resizes": k * (k - 1), "buckets_pads": k - 1})  # fmt: skip
    return rows


def plot(sim_rows: list[dict], engine_rows: list[dict], path: str) -> None:
    """An hour of calls simulated per variant (busy GPU-seconds per conversation-hour, then p99,
    against mean live calls) and the measured ticks of the fixed and the bucketed engine
    (``experiments.plot``)."""
    fig, ax = draw.figure(1, 3, size=(15, 4.2))
    hr = [r for r in sim_rows if r["kind"] == "hour"]
    draw.lines(ax[0], hr, "mean_live", [draw.Y("busy_gpu_s_per_conv_h", ".-", label="{group}")],
               group="variant", sort=False)  # fmt: skip
    ax[0].set(xlabel="mean live calls", ylabel="busy GPU-s per conversation-hour",
              title="simulated: an hour of calls")  # fmt: skip
    ax[0].legend(fontsize=8)
    draw.lines(ax[1], hr, "mean_live", [draw.Y("p99_ms", ".-", label="{group}")],
               group="variant", sort=False)  # fmt: skip
    draw.rule(ax[1], 160, color="grey", lw=0.8, ls="--")
    ax[1].set(xlabel="mean live calls", ylabel="p99 beat ms",
              title="simulated: the beat")  # fmt: skip
    ax[1].legend(fontsize=8)
    ticks = [r for r in engine_rows if r["kind"] == "tick"]
    for eng, mark in (("fixed", "o-"), ("buckets", "s--")):
        rs = [r for r in ticks if r["engine"] == eng]
        draw.lines(ax[2], rs, "live", [draw.Y("tick_ms", mark, label=eng)])
    model = engine_rows[0]["model"] if engine_rows else "?"
    dev = engine_rows[0]["device"] if engine_rows else "?"
    ax[2].set(xlabel="live sessions", ylabel="tick ms (back to back)",
              title=f"measured: {model} on {dev}")  # fmt: skip
    ax[2].legend(fontsize=8)
    fig.suptitle(f"H200, simulated with the {fits.fit_label(sim_rows)}", fontsize=11)
    draw.save(fig, path, dpi=110)


def print_tables(sim_rows: list[dict], engine_rows: list[dict]) -> None:
    if engine_rows:
        r0 = engine_rows[0]
        print(f"measured: {r0['model']} on {r0['device']}, jax {r0['jax']}, commit {r0['commit']}")
        for r in engine_rows:
            if r["kind"] == "compile":
                print(f"compile {r['engine']}: {r['programs']} programs, {r['compile_s']:.1f} s")
            elif r["kind"] == "tick":
                print(f"tick {r['engine']:>7} slots {r['slots']:>3} live {r['live']:>3}: "
                      f"{r['tick_ms']:.2f} ms")  # fmt: skip
            elif r["kind"] == "move":
                print(f"move {r['from']:>3} -> {r['to']:>3} ({r['kept']} kept): {r['ms']:.2f} ms")
            elif r["kind"] == "serve":
                print(f"serve {r['engine']:>7}: p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} "
                      f"missed {r['missed_ticks']}/{r['steady_ticks']} "
                      f"moves {r.get('moves', 0)} resizes {r.get('resizes', 0)}")  # fmt: skip
    if sim_rows:
        m = next(r for r in sim_rows if r["kind"] == "model")
        print(f"simulated H200, fit to {fits.fit_label(sim_rows)}: t(B) = {m['a_ms']:.2f} + "
              f"{m['b_ms']:.3f}*B + {m['c_ms']:.3f}*B*x ms per frame-step")  # fmt: skip
        fits.print_validation(sim_rows)
        for r in (r for r in sim_rows if r["kind"] == "capacity"):
            print(f"  simulated lockstep capacity (the largest bucket): {r['capacity']}")
        mm = next(r for r in sim_rows if r["kind"] == "move_model")
        print("  move ms: " + ", ".join(f"{k[3:].replace('_', '->')} {v:.1f}"
                                        for k, v in mm.items() if k.startswith("ms_")))  # fmt: skip
        for g in (r for r in sim_rows if r["kind"] == "one_grow"):
            lat = ", ".join(f"{x:.1f}" for x in g["latency_ms"])
            print(f"  one grow {g['from']} -> {g['to']} ({g['move_ms']:.1f} ms on a "
                  f"{g['tick_ms']:.1f} ms tick, no jitter): {g['late_beats']} beats late; "
                  f"latency {lat} ms")  # fmt: skip
        print("an hour of Poisson calls")
        print(f"{'E':>4} {'variant':>12} {'live':>5} {'bucket':>6} {'p50':>6} {'p99':>6} "
              f"{'miss %':>6} {'busy':>5} {'GPU-s/conv-h':>12} {'resizes':>7}")  # fmt: skip
        for r in (r for r in sim_rows if r["kind"] == "hour"):
            print(f"{r['erlangs']:>4.0f} {r['variant']:>12} {r['mean_live']:>5.1f} "
                  f"{r['mean_bucket']:>6.1f} {r['p50_ms']:>6.1f} {r['p99_ms']:>6.1f} "
                  f"{100 * r['missed_session_beat_rate']:>6.2f} {r['busy_frac']:>5.2f} "
                  f"{r['busy_gpu_s_per_conv_h']:>12.1f} {r['resizes']:>7}")  # fmt: skip


def main(argv):
    del argv
    sim_out, plot_path = fits.sim_files(_HERE, "slot_buckets")
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
