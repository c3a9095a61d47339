"""Beat latency of the engine: model preset x loop x sessions, random weights, one run each.

Prints one row per configuration (compile time; beat latency p50 / p99 / max over steady ticks;
missed ticks) and appends the rows as JSON lines to --out as they are measured, each with its
provenance (``experiments.harness``). See README.md beside this file.
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax
import numpy as np
from absl import app, flags, logging

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax.engine import Engine
from voicechat_jax.precision import Precision
from voicechat_jax.serving.server import Server, SessionPlan

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("sessions", ["1", "8", "32"], "Session counts (slots = sessions).")
flags.DEFINE_list("loops", ["dispatch", "resident"], "Loops to measure.")
flags.DEFINE_integer("ticks", 60, "Ticks per run (160 ms beats), warm-up included.")
flags.DEFINE_integer("warmup_ticks", 5, "Ticks reported apart as warm-up.")
flags.DEFINE_integer("context_frames", 256, "Context cap in frames (short context).")
flags.DEFINE_enum("clock", "realtime", ["realtime", "offline"], "Beat clock.")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")
# --ssm_kernel, --attention, --tts_attention, --projection (the precision is the reference policy).
harness.define_engine_flags(precision=False)
flags.DEFINE_enum(
    "at_cap",
    "end",
    [m.value for m in config_lib.AtCap],
    "At the context cap: end the session, or keep it live (rollover, reset, memory).",
)
flags.DEFINE_bool(
    "hold_full",
    False,
    "Benchmark only: hold every slot's attention caches full (ServeConfig.hold_full), so kernels "
    "that skip unfilled rows read the whole 1,500-frame cache on every tick (the worst case).",
)
flags.DEFINE_bool(
    "churn",
    False,
    "Real fills under churn: every slot serves sessions back to back, each lasting a uniform "
    "random number of beats up to one beat short of the context cap (all start at tick 0).",
)


def serve_config(precision, sessions: int, **serve_kw) -> config_lib.ServeConfig:
    """The flags' server configuration for ``sessions`` slots (``harness.serve_config``)."""
    return harness.serve_config(
        precision=precision,
        slots=sessions,
        frames_per_tick=2,
        context_frames=FLAGS.context_frames,
        at_cap=FLAGS.at_cap,
        hold_full=FLAGS.hold_full,
        **serve_kw,
    )


def make_engine(params, cfg, precision, sessions: int, template=None, **serve_kw) -> Engine:
    return Engine(params, cfg, serve_config(precision, sessions, **serve_kw), template=template)


def churn_plans(
    slots: int, ticks: int, cap_beats: int, samples_per_beat: int, seed: int = 0
) -> tuple[list[SessionPlan], np.ndarray]:
    """Back-to-back sessions in each of ``slots`` lanes for ``ticks`` beats.

    Lane ``i``'s sessions follow one another with no gap: each joins on the beat the previous one
    leaves, and lasts a uniform random number of beats in ``[1, cap_beats - 1]`` (one beat short
    of the cap, so none ends by reaching it). Returns the plans and the fill [ticks, slots]: the
    frames of context of each lane's session at the end of each beat (2 frames a beat).
    """
    rng = np.random.default_rng(seed)
    plans, fill = [], np.zeros((ticks, slots), np.int32)
    for lane in range(slots):
        join, n = 0, 0
        while join < ticks:
            length = int(rng.integers(1, max(2, cap_beats)))
            leave = join + length
            end = min(leave, ticks)
            audio = harness.speech((end - join) * samples_per_beat, lane * 1000 + n)
            last = None if leave >= ticks else leave
            plans.append(SessionPlan(id=f"s{lane}_{n}", audio=audio, join=join, leave=last))
            fill[join:end, lane] = 2 * np.arange(1, end - join + 1)
            join, n = leave, n + 1
    return plans, fill


def measure(engine: Engine, loop: str, *, ticks: int | None = None) -> dict:
    """Serves ``slots`` sessions for ``ticks`` beats on ``engine``; one row of results.

    With ``--churn`` each slot serves back-to-back sessions of random lengths (``churn_plans``)
    and the row adds the sessions served and the mean context fill over the steady ticks.
    """
    ticks = FLAGS.ticks if ticks is None else ticks
    sessions = engine.serve.slots
    engine.reset()
    samples = ticks * engine.samples_per_beat
    churn = {}
    if FLAGS.churn:
        if FLAGS.hold_full:
            raise ValueError("--churn measures real fills; --hold_full holds them at the cap")
        cap_beats = engine.serve.context_frames // engine.serve.frames_per_tick
        plans, fill = churn_plans(sessions, ticks, cap_beats, engine.samples_per_beat)
        steady = fill[FLAGS.warmup_ticks :]
        churn = {
            "churn": True,
            "sessions_served": len(plans),
            "mean_fill_frames": float(steady.mean()),
            "mean_fill_of_cap": float(steady.mean() / engine.serve.context_frames),
        }
    else:
        plans = [SessionPlan(id=f"s{i}", audio=harness.speech(samples, i)) for i in range(sessions)]
    # Outputs streamed to files as ``voicechat-serve`` does, not kept in memory.
    with tempfile.TemporaryDirectory(prefix="beat_latency_") as out_dir:
        server = Server(
            engine,
            clock=FLAGS.clock,
            loop=loop,
            warmup_ticks=FLAGS.warmup_ticks,
            keep_outputs=False,
            output_dir=out_dir,
        )
        server.run(plans, ticks)
    s = server.metrics.summary()
    row = {
        "model": FLAGS.model,
        "loop": loop,
        **engine.kernels.row(),  # as the engine chose them ('auto' made)
        "sessions": sessions,
        "context_frames": FLAGS.context_frames,
        "clock": FLAGS.clock,
        "template_s": round(engine.template_s, 2),
        "compile_s": round(next(iter(s["compile_s"].values())), 2),
        **harness.latency_fields(s),
        "at_cap": FLAGS.at_cap,
        "hold_full": FLAGS.hold_full,
        "warmup_max_ms": s["warmup"]["latency_ms"]["max"],
        "state_gib": round(engine.memory.state_bytes / 2**30, 2),
        "memory_gib": harness.device_memory(),
    }
    if churn:
        row |= churn | {"events": s["events"], "ended": s.get("ended", {})}
    return row


@functools.cache
def _rows() -> harness.RowLog:
    return harness.RowLog(FLAGS.out)  # one provenance for every row of a run


def write_row(row: dict) -> dict:
    """Appends a result row to ``--out`` as a JSON line with its provenance
    (``experiments.harness``: commit, device, jax version, command, time), logs and returns it."""
    row = _rows().write(row)
    logging.info("%s", row)
    return row


def print_table(rows: list[dict]) -> None:
    head = f"{'loop':9} {'sess':>4} {'compile s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    head += f" {'missed':>6} {'ticks':>5}"
    print(
        f"{FLAGS.model} on {rows[0]['device']}, jax {jax.__version__}, {FLAGS.clock} clock, "
        f"160 ms beat, context cap {FLAGS.context_frames} frames"
    )
    print(head)

    def ms(x) -> str:
        return f"{x:>8.1f}" if x is not None else f"{'-':>8}"

    for r in rows:
        print(
            f"{r['loop']:9} {r['sessions']:>4} {r['compile_s']:>9.1f} {ms(r['p50_ms'])} "
            f"{ms(r['p99_ms'])} {ms(r['max_ms'])} {r['missed_ticks']:>6} {r['steady_ticks']:>5}"
        )


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = Precision.reference()
    params = harness.random_params(cfg, precision, FLAGS.model)
    template = None  # built by the first engine, shared by the others (same cap and prompt)
    rows = []
    for n in (int(x) for x in FLAGS.sessions):
        engine = make_engine(params, cfg, precision, n, template)
        template = engine.template
        for loop in FLAGS.loops:
            rows.append(write_row(measure(engine, loop)))
        del engine
    print_table(rows)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
