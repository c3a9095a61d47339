"""Frames per tick 1, 2, 3, 4: the latency a longer beat adds against the capacity it gains.

Engine part (``--parts=engine``; tiny on the CPU for smoke rows, ``--model=voicechat_11b`` on the
H200): for each frames-per-tick f and slot count B, the tick timed back to back, and one serving
run on the real-time clock of f * 80 ms beats.

Simulated part (``--parts=sim``; host only): the H200 tick at f frames built from the component
rows of ``experiments/beat_profile`` (measured at f = 2): the LLM and speech-decoder pieces step
once per frame (f times a tick), the encoder, RNNT head and codec run once per beat on the beat's
frames, either at a cost independent of f (launch-bound) or proportional to f (the two bounds);
scaled to the whole-tick fit at f = 2. Capacity at zero misses with the simulator fitted to the
H200 rows. ``--fit`` picks the whole-tick fit: ``capacity`` (default: the current engine's
``experiments/capacity`` rows, ``sim.fit_capacity``; ``--capacity_config=xla_tts`` the earlier
engine's, the README's history) or ``beat_profile`` (the older engine's, ``sim.fit_h200``: the
oldest history); the split into per-frame and per-beat parts comes from the beat_profile
component rows under every fit (``--split=components``); the default ``--split=measured`` takes
it from the H200's ticks at f = 2, 3 and 4 and is validated against H200 serving rows at f = 3
and 4 (README.md).
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
from experiments.policy_sim import engine_runs as er  # noqa: E402
from experiments.policy_sim import fits, sim  # noqa: E402
from voicechat_jax.engine import Engine  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("parts", ["engine", "sim"], "engine (real runs) and/or sim (H200 simulator).")
flags.DEFINE_list("fpt", ["1", "2", "3", "4"], "Frames per tick.")
flags.DEFINE_list("sessions", ["1", "4"], "Slot counts timed per frames-per-tick.")
flags.DEFINE_integer("serve_sessions", 4, "Sessions of the serving run (0: none).")
flags.DEFINE_integer("ticks", 40, "Real-time beats per serving run (warm-up included).")
flags.DEFINE_integer("timed_ticks", 10, "Back-to-back ticks timed per point.")
flags.DEFINE_integer("context_frames", 64, "Context cap in frames (1500 on the H200).")
flags.DEFINE_string("out", str(_HERE / "results/cpu_tiny.jsonl"), "Engine rows (appended).")
flags.DEFINE_integer("seeds", 5, "Simulator seeds per capacity probe.")
flags.DEFINE_integer("capacity_beats", 500, "Beats per simulated capacity probe.")
flags.DEFINE_enum(
    "split", "measured", ["measured", "components"],
    "How the simulated tick at f frames splits into per-frame and per-beat parts: 'measured' "
    "(a line in f through the H200 ticks at 32 slots, --fpt_rows and the f = 2 ticks of "
    "--tick_rows; outputs named *_measured) or 'components' (the beat_profile component rows, "
    "fixed and ~f bounds: the history).",
)  # fmt: skip
flags.DEFINE_string(
    "fpt_rows", str(_HERE / "results/h200_voicechat_11b.jsonl"),
    "H200 engine rows of this experiment (ticks and serves at f != 2), for --split=measured.",
)  # fmt: skip
harness.define_engine_flags()
fits.define_fit_flags("frames_per_tick")


# Components that run once per beat on all its frames (the rest step once per frame).
PER_BEAT = ("mel + encoder", "RNNT head", "codec decode")
FRAME_MS = 80.0


def engine_part(rows: list[dict]) -> None:
    base = er.engine_setup(FLAGS.model)
    cfg, params = er.build(FLAGS.model)
    template = None
    for f in (int(x) for x in FLAGS.fpt):
        counts = sorted({int(x) for x in FLAGS.sessions} | {FLAGS.serve_sessions} - {0})
        for n in counts:
            serve = harness.serve_config(slots=n, frames_per_tick=f,
                                           context_frames=FLAGS.context_frames)  # fmt: skip
            engine = Engine(params, cfg, serve, template=template)
            template = engine.template
            t = harness.tick_ms(engine, FLAGS.timed_ticks)
            rows.append({**base, "kind": "tick", "frames_per_tick": f, "slots": n,
                         "tick_ms": float(np.median(t)), "ms": t.tolist(),
                         "compile_s": engine.compile_s})  # fmt: skip
            if n == FLAGS.serve_sessions:
                plans = er.plans_all_joined(n, FLAGS.ticks, engine.samples_per_beat)
                row, _ = er.serve(engine, plans, FLAGS.ticks)
                rows.append({**base, "kind": "serve", **row, "beat_ms": serve.beat_ms,
                             # the first sample of a beat waits a beat for the tick, then p50
                             "input_to_output_p50_ms": serve.beat_ms + row["p50_ms"]})  # fmt: skip
            del engine


# ---- simulated -----------------------------------------------------------------------------


def component_lines(components: list[dict]) -> dict[str, tuple[float, float]]:
    """Each component's ms per frame-step at f = 2 as a line in B through its 16- and 32-slot
    rows: name -> (intercept, slope). Admission is left out (it is per join, not per beat)."""
    by = {(r["component"], r["slots"]): r["ms"] for r in components}
    out = {}
    for name in {c for c, _ in by}:
        if name.startswith("admission") or (name, 16) not in by or (name, 32) not in by:
            continue
        slope = (by[(name, 32)] - by[(name, 16)]) / 16
        out[name] = (by[(name, 16)] - 16 * slope, slope)
    return out


def tick_model(fit: sim.H200Fit, lines: dict, f: int, per_beat_scales: bool):
    """Device ms of a tick of B slots at f frames per tick (see the module docstring)."""

    def ms(B: float) -> float:
        frame = sum(a + b * B for n, (a, b) in lines.items() if not n.startswith(PER_BEAT))
        beat = 2 * sum(a + b * B for n, (a, b) in lines.items() if n.startswith(PER_BEAT))
        total2 = 2 * frame + beat  # the components' tick at f = 2
        scale = fit.cost.tick_ms(B) / total2  # the components sum a little above the tick
        beat_f = beat * (f / 2 if per_beat_scales else 1.0)
        return scale * (f * frame + beat_f)

    return ms


def measured_split(fpt_rows: list[dict], f2_points: list[dict], slots: int = 32) -> dict:
    """The tick at ``slots`` slots as a line in f, ``per_beat + f * per_frame`` ms, fitted (least
    squares) to the measured ticks: this experiment's at f != 2 and the scheduling experiments'
    at f = 2 (``sim.measured_ticks``, their mean). ``share``: the per-beat part's share of the
    f = 2 tick on the line."""
    points = [(2, float(np.mean([p["tick_ms"] for p in f2_points if p["slots"] == slots])))]
    ticks = [r for r in fpt_rows if r["kind"] == "tick" and r["slots"] == slots]
    points += [(r["frames_per_tick"], r["tick_ms"]) for r in ticks if r["frames_per_tick"] != 2]
    f, t = np.array(points, float).T
    per_frame, per_beat = np.polyfit(f, t, 1)
    return {"kind": "split", "slots": slots, "points": points, "per_beat_ms": float(per_beat),
            "per_frame_ms": float(per_frame),
            "share": float(per_beat / (per_beat + 2 * per_frame)),
            "max_error": float(np.max(np.abs(per_beat + per_frame * f - t) / t))}  # fmt: skip


def split_tick_model(fit: sim.H200Fit, share: float, f: int):
    """Device ms of a tick of B slots at f frames: the fitted f = 2 tick with its per-beat share
    paid once a beat and the rest once a frame (``measured_split``; the share measured at 32
    slots, held at every B)."""
    return lambda B: fit.cost.tick_ms(B) * (share + (1 - share) * f / 2)


def _probe(tick, period: float, n: int, fit: sim.H200Fit, beats: int) -> list[dict]:
    """``FLAGS.seeds`` simulated lockstep runs of ``n`` sessions on ``n`` slots."""
    return [
        sim.simulate_lockstep(fit.cost, beats, n, slots=n, tail=fit.quiet,
                              rng=np.random.default_rng(s), period_ms=period,
                              tick_cost=tick).summary()
        for s in range(FLAGS.seeds)
    ]  # fmt: skip


def serve_validation(fit: sim.H200Fit, share: float, fpt_rows: list[dict]) -> list[dict]:
    """The measured split's simulated p50 and p99 against each H200 serving row at f != 2."""
    out = []
    for r in (r for r in fpt_rows if r["kind"] == "serve"):
        f, n = r["frames_per_tick"], r["slots"]
        runs = _probe(split_tick_model(fit, share, f), FRAME_MS * f, n, fit, r["steady_ticks"])
        p50 = float(np.mean([x["p50_ms"] for x in runs]))
        out.append({"kind": "serve_validation", "frames_per_tick": f, "sessions": n,
                    "real_p50_ms": r["p50_ms"], "sim_p50_ms": p50,
                    "p50_error": p50 / r["p50_ms"] - 1, "real_p99_ms": r["p99_ms"],
                    "sim_p99_ms": float(np.mean([x["p99_ms"] for x in runs])),
                    "real_missed": r["missed_ticks"],
                    "sim_missed": float(np.mean([x["missed"] for x in runs]))})  # fmt: skip
    return out


def sim_part() -> list[dict]:
    fit = fits.fit_models(er.read_rows(FLAGS.profile_rows))
    rows = [fits.model_row(fit)]
    if FLAGS.split == "measured":
        fpt_rows = er.read_rows(FLAGS.fpt_rows)
        split = measured_split(fpt_rows, fits.tick_points())
        rows.append(split)
        models = [(None, f, split_tick_model(fit, split["share"], f))
                  for f in (int(x) for x in FLAGS.fpt)]  # fmt: skip
    else:
        lines = component_lines(fit.components)
        rows.append({"kind": "components", "lines": lines})
        models = [(scales, f, tick_model(fit, lines, f, scales))
                  for scales in (False, True) for f in (int(x) for x in FLAGS.fpt)]  # fmt: skip
    rows += [{"kind": "validation", **v} for v in sim.validate(fit)]
    if FLAGS.split == "measured":
        rows += serve_validation(fit, split["share"], fpt_rows)
    for per_beat_scales, f, tick in models:
        period = FRAME_MS * f

        def probe(n, tick=tick, period=period):
            return _probe(tick, period, n, fit, FLAGS.capacity_beats)

        cap = 0
        for n in range(1, 200):
            if any(r["missed"] for r in probe(n)):
                break
            cap = n
        at = probe(cap) if cap else []
        at16 = probe(16)
        p50_16 = float(np.mean([r["p50_ms"] for r in at16]))
        rows.append({
            "kind": "capacity", "frames_per_tick": f, "per_beat_scales": per_beat_scales,
            "beat_ms": period, "capacity": cap, "tick_ms_at_16": tick(16),
            "tick_ms_at_capacity": tick(cap) if cap else None,
            "p50_at_capacity_ms": float(np.mean([r["p50_ms"] for r in at])) if at else None,
            "p99_at_capacity_ms": float(np.mean([r["p99_ms"] for r in at])) if at else None,
            "p50_at_16_ms": p50_16, "input_to_output_p50_at_16_ms": period + p50_16,
            "busy_gpu_s_per_conv_h_at_capacity": (
                float(np.mean([r["busy_gpu_s_per_conv_h"] for r in at])) if at else None),
        })  # fmt: skip
        logging.info("f=%d scales=%s capacity %d", f, per_beat_scales, cap)
    return rows


def plot(sim_rows: list[dict], engine_rows: list[dict], path: str) -> None:
    """Left: simulated capacity against input-to-output latency per frames-per-tick model; right:
    the measured tick per frame against frames per tick, with the split's line
    (``experiments.plot``)."""
    fig, ax = draw.figure(1, 2, size=(11, 4.2))
    caps = [r for r in sim_rows if r["kind"] == "capacity"]
    label = fits.fit_label(sim_rows)
    names = {False: "per-beat parts fixed", True: "per-beat parts ~ f",
             None: "split measured (a line in f at 32 slots)"}  # fmt: skip
    x = "input_to_output_p50_at_16_ms"
    for scales, mark in ((False, "o-"), (True, "s--"), (None, "D-")):
        rs = [r for r in caps if r["per_beat_scales"] == scales]
        draw.lines(ax[0], rs, x, [draw.Y("capacity", mark, label=names[scales])], sort=False)
        draw.labels(ax[0], rs, x, "capacity", "f={frames_per_tick}", fontsize=8)
    ax[0].set(xlabel="input-to-output p50 at 16 sessions (beat + tick) ms",
              ylabel="capacity at zero misses",
              title=f"H200, simulated ({label})")  # fmt: skip
    ax[0].legend(fontsize=8)
    ticks = sorted((r for r in engine_rows if r["kind"] == "tick"), key=lambda r: r["slots"])
    per_frame = [{**r, "per_frame_ms": r["tick_ms"] / r["frames_per_tick"]} for r in ticks]
    draw.lines(ax[1], per_frame, "frames_per_tick", [draw.Y("per_frame_ms", label="B={group}")],
               group="slots")  # fmt: skip
    split = next((r for r in sim_rows if r["kind"] == "split"), None)
    if split:  # the line in f through the measured ticks, f = 2 from the scheduling experiments
        points = [{"f": float(f), "per_frame_ms": t / f} for f, t in split["points"]]
        draw.lines(ax[1], points, "f", [draw.Y("per_frame_ms", "kx", style={"ms": 8},
                   label=f"B={split['slots']}: points of the split fit")], sort=False)  # fmt: skip
        grid = [{"f": f, "per_frame_ms": split["per_beat_ms"] / f + split["per_frame_ms"]}
                for f in np.linspace(1, 4, 31)]  # fmt: skip
        line = f"{split['per_beat_ms']:.1f} / f + {split['per_frame_ms']:.1f} ms"
        draw.lines(ax[1], grid, "f", [draw.Y("per_frame_ms", "k:", label=line, style={"lw": 1})])
    model = engine_rows[0]["model"] if engine_rows else "?"
    dev = engine_rows[0]["device"] if engine_rows else "?"
    ax[1].set(xlabel="frames per tick", ylabel="tick ms per frame",
              title=f"measured: {model} on {dev}")  # fmt: skip
    ax[1].legend(fontsize=8)
    draw.save(fig, path, dpi=110)


def print_tables(sim_rows: list[dict], engine_rows: list[dict]) -> None:
    if engine_rows:
        r0 = engine_rows[0]
        print(f"measured: {r0['model']} on {r0['device']}, jax {r0['jax']}, commit {r0['commit']}")
        for r in engine_rows:
            if r["kind"] == "tick":
                print(f"f={r['frames_per_tick']} B={r['slots']:>3}: tick {r['tick_ms']:.2f} ms "
                      f"({r['tick_ms'] / r['frames_per_tick']:.2f} per frame)")  # fmt: skip
            else:
                print(f"f={r['frames_per_tick']} serve {r['slots']}: p50 {r['p50_ms']:.1f} "
                      f"p99 {r['p99_ms']:.1f} missed {r['missed_ticks']}/{r['steady_ticks']}, "
                      f"input-to-output p50 {r['input_to_output_p50_ms']:.0f} ms")  # fmt: skip
    if sim_rows:
        print(f"simulated H200, fit to {fits.fit_label(sim_rows)}")
        fits.print_validation(sim_rows)
        for r in (r for r in sim_rows if r["kind"] == "split"):
            pts = ", ".join(f"f={f} {t:.1f}" for f, t in r["points"])
            print(f"  split at {r['slots']} slots: tick = {r['per_beat_ms']:.2f} + "
                  f"{r['per_frame_ms']:.2f} f ms (per-beat share {r['share']:.1%} at f = 2; "
                  f"points {pts}; max error {r['max_error']:.1%})")  # fmt: skip
        for v in (r for r in sim_rows if r["kind"] == "serve_validation"):
            print(f"  serve f={v['frames_per_tick']} {v['sessions']} sessions: real p50 "
                  f"{v['real_p50_ms']:.1f} sim {v['sim_p50_ms']:.1f} ms "
                  f"({100 * v['p50_error']:+.1f} %), p99 {v['real_p99_ms']:.1f} / "
                  f"{v['sim_p99_ms']:.1f}")  # fmt: skip
        print(f"{'f':>2} {'per-beat':>9} {'beat':>5} {'cap':>4} {'tick@16':>8} {'p99@cap':>8} "
              f"{'in->out p50@16':>14}")  # fmt: skip
        for r in (r for r in sim_rows if r["kind"] == "capacity"):
            p99 = r["p99_at_capacity_ms"] or float("nan")
            split = {None: "measured", False: "fixed", True: "~f"}[r["per_beat_scales"]]
            print(f"{r['frames_per_tick']:>2} {split:>9} "
                  f"{r['beat_ms']:>5.0f} {r['capacity']:>4} {r['tick_ms_at_16']:>8.1f} "
                  f"{p99:>8.1f} {r['input_to_output_p50_at_16_ms']:>14.1f}")  # fmt: skip


def main(argv):
    del argv
    sim_out, plot_path = fits.sim_files(_HERE, "frames_per_tick")
    if FLAGS.split == "measured":  # its own outputs beside the components split's
        if FLAGS.sim_out is None:
            sim_out = sim_out.replace(".jsonl", "_measured.jsonl")
        if FLAGS.plot is None:
            plot_path = plot_path.replace(".png", "_measured.png")
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
