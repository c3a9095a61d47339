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
component rows under every fit. Not validated at f != 2 (no such rows yet). See README.md beside
this file.
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
er.define_engine_flags()
fits.define_fit_flags("frames_per_tick")


# Components that run once per beat on all its frames (the rest step once per frame).
PER_BEAT = ("mel + encoder", "RNNT head", "codec decode")
FRAME_MS = 80.0


def engine_part(rows: list[dict]) -> None:
    base = er.provenance(FLAGS.model)
    cfg, params = er.build(FLAGS.model)
    template = None
    for f in (int(x) for x in FLAGS.fpt):
        counts = sorted({int(x) for x in FLAGS.sessions} | {FLAGS.serve_sessions} - {0})
        for n in counts:
            serve = er.serve_config(slots=n, frames_per_tick=f,
                                           context_frames=FLAGS.context_frames)  # fmt: skip
            engine = Engine(params, cfg, serve, template=template)
            template = engine.template
            t = er.tick_ms(engine, FLAGS.timed_ticks)
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


def sim_part() -> list[dict]:
    fit = fits.fit_models(er.read_rows(FLAGS.profile_rows))
    lines = component_lines(fit.components)
    rows = [fits.model_row(fit), {"kind": "components", "lines": lines}]
    rows += [{"kind": "validation", **v} for v in sim.validate(fit)]
    for per_beat_scales in (False, True):
        for f in (int(x) for x in FLAGS.fpt):
            tick = tick_model(fit, lines, f, per_beat_scales)
            period = FRAME_MS * f

            def probe(n, tick=tick, period=period):
                return [
                    sim.simulate_lockstep(fit.cost, FLAGS.capacity_beats, n, slots=n,
                                          tail=fit.quiet, rng=np.random.default_rng(s),
                                          period_ms=period, tick_cost=tick).summary()
                    for s in range(FLAGS.seeds)
                ]  # fmt: skip

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    caps = [r for r in sim_rows if r["kind"] == "capacity"]
    label = fits.fit_label(sim_rows)
    for scales, mark in ((False, "o-"), (True, "s--")):
        rs = [r for r in caps if r["per_beat_scales"] == scales]
        lab = "per-beat parts ~ f" if scales else "per-beat parts fixed"
        ax[0].plot([r["input_to_output_p50_at_16_ms"] for r in rs], [r["capacity"] for r in rs],
                   mark, label=lab)  # fmt: skip
        for r in rs:
            ax[0].annotate(f"f={r['frames_per_tick']}", (r["input_to_output_p50_at_16_ms"],
                                                         r["capacity"]), fontsize=8)  # fmt: skip
    ax[0].set(xlabel="input-to-output p50 at 16 sessions (beat + tick) ms",
              ylabel="capacity at zero misses",
              title=f"H200, simulated ({label}; not validated at f != 2)")  # fmt: skip
    ax[0].legend(fontsize=8)
    ticks = [r for r in engine_rows if r["kind"] == "tick"]
    for n in sorted({r["slots"] for r in ticks}):
        rs = sorted((r for r in ticks if r["slots"] == n), key=lambda r: r["frames_per_tick"])
        per_frame = [r["tick_ms"] / r["frames_per_tick"] for r in rs]
        ax[1].plot([r["frames_per_tick"] for r in rs], per_frame, "o-", label=f"B={n}")
    model = engine_rows[0]["model"] if engine_rows else "?"
    dev = engine_rows[0]["device"] if engine_rows else "?"
    ax[1].set(xlabel="frames per tick", ylabel="tick ms per frame",
              title=f"measured: {model} on {dev}")  # fmt: skip
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
        print(f"simulated H200, fit to {fits.fit_label(sim_rows)} (not validated at f != 2)")
        fits.print_validation(sim_rows)
        print(f"{'f':>2} {'per-beat':>9} {'beat':>5} {'cap':>4} {'tick@16':>8} {'p99@cap':>8} "
              f"{'in->out p50@16':>14}")  # fmt: skip
        for r in (r for r in sim_rows if r["kind"] == "capacity"):
            p99 = r["p99_at_capacity_ms"] or float("nan")
            print(f"{r['frames_per_tick']:>2} {'~f' if r['per_beat_scales'] else 'fixed':>9} "
                  f"{r['beat_ms']:>5.0f} {r['capacity']:>4} {r['tick_ms_at_16']:>8.1f} "
                  f"{p99:>8.1f} {r['input_to_output_p50_at_16_ms']:>14.1f}")  # fmt: skip


def main(argv):
    del argv
    sim_out, plot_path = fits.sim_files(_HERE, "frames_per_tick")
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
