"""What a roll-over costs the beat: beat time with and without sessions re-seeded in it.

Every slot is live (noise audio); after warm-up, beats alternate between plain beats and beats in
which ``--rolled`` slots roll over, with capsules of ``--capsule_lens`` ids (U: a full capsule;
0: an empty one, rolled over without a prefill). Each beat is timed from dispatch to its output
ready (``block_until_ready``). Prints one row per (sessions, capsule, rolled): p50 / p99 beat
time of the plain and the roll-over beats and the p50 extra; appends the rows as JSON lines to
``--out`` as they are measured, each with its provenance (``experiments.harness``).

  python3 experiments/rollover_cost/run.py --model=voicechat_11b --sessions=16,56 \
    --capsule_lens=full,0 --out=rows.jsonl
  python3 experiments/rollover_cost/run.py --model=tiny --sessions=2 --beats=6   # CPU smoke
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax.engine import Engine
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b (random weights).")
flags.DEFINE_list("sessions", ["16", "56"], "Session counts (slots = sessions).")
flags.DEFINE_list("rolled", ["1", "4"], "Slots rolled over in one roll-over beat.")
flags.DEFINE_integer("beats", 40, "Measured beats per row (half of them roll-over beats).")
flags.DEFINE_integer("warmup", 5, "Beats before measuring.")
flags.DEFINE_integer("context_frames", 1500, "Context cap in frames.")
flags.DEFINE_integer("capsule_tokens", 96, "U: capsule room.")
flags.DEFINE_list(
    "capsule_lens",
    ["full"],
    "Ids in each roll-over's capsule, one row set per entry: full (U: at_cap=memory's worst), "
    "0 (at_cap=reset and the at-cap fallback: no prefill) or a count.",
)
flags.DEFINE_enum("precision", "reference", ["reference", "fp32"], "Dtype policy.")
flags.DEFINE_enum(
    "ssm_kernel", "auto", [m.value for m in config_lib.SSMKernel], "Mamba-2 decode update."
)
flags.DEFINE_enum(
    "attention", "auto", [m.value for m in config_lib.AttentionImpl], "Decode attention (both)."
)
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")


def _ms(x: list[float], q: float) -> float:
    return round(1000.0 * float(np.percentile(x, q)), 3)


def make_engine(params, cfg, precision, sessions: int) -> Engine:
    serve = config_lib.ServeConfig(
        slots=sessions,
        frames_per_tick=2,
        context_frames=FLAGS.context_frames,
        capsule_tokens=FLAGS.capsule_tokens,
        at_cap="memory",
        ssm_kernel=FLAGS.ssm_kernel,
        attention=FLAGS.attention,
        precision=precision,
    )
    engine = Engine(params, cfg, serve)
    engine.compile_tick()
    return engine


def measure(engine: Engine, rolled: int, capsule_len: int) -> dict:
    """One row: ``rolled`` slots re-seeded every other beat of ``engine`` (all slots live), each
    with a capsule of ``capsule_len`` ids."""
    engine.reset()
    cfg, sessions = engine.cfg, engine.serve.slots
    rng = np.random.default_rng(0)
    rolled = min(rolled, sessions)
    times: dict[bool, list[float]] = {False: [], True: []}
    # Beat k+1 re-seeds the slots after those beat k did, so no slot's context runs out.
    for k in range(FLAGS.warmup + FLAGS.beats):
        beat = engine.empty_beat()
        beat.audio[:] = 0.1 * rng.standard_normal(beat.audio.shape)
        if k == 0:
            beat.admit[:] = True
            beat.key[:] = np.arange(2 * sessions, dtype=np.uint32).reshape(sessions, 2)
        roll = k >= FLAGS.warmup and k % 2 == 1
        if roll or (k < FLAGS.warmup and k % 2 == 1):  # warm-up compiles nothing, runs both
            for j in range(rolled):
                b = (k * rolled + j) % sessions
                beat.reseed[b] = True
                beat.capsule[b] = rng.integers(3, cfg.llm.vocab_size, FLAGS.capsule_tokens)
                beat.capsule_len[b] = capsule_len
        t = time.perf_counter()
        jax.block_until_ready(engine.tick(beat))
        if k >= FLAGS.warmup:
            times[roll].append(time.perf_counter() - t)
    plain, roll = times[False], times[True]
    return {
        "model": FLAGS.model,
        "sessions": sessions,
        "rolled": rolled,
        "capsule_tokens": FLAGS.capsule_tokens,
        "capsule_len": capsule_len,
        "ssm_kernel": str(engine.kernels.ssm_kernel),  # as the engine chose them ('auto' made)
        "attention": str(engine.kernels.attention),
        "plain_p50_ms": _ms(plain, 50),
        "plain_p99_ms": _ms(plain, 99),
        "rollover_p50_ms": _ms(roll, 50),
        "rollover_p99_ms": _ms(roll, 99),
        "extra_p50_ms": round(_ms(roll, 50) - _ms(plain, 50), 3),
        "beats": len(plain) + len(roll),
    }


def main(argv) -> None:
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = Precision.fp32() if FLAGS.precision == "fp32" else Precision.reference()
    params = voicechat.init_compiled(jax.random.key(0), cfg, precision, serving=True)
    lens = [FLAGS.capsule_tokens if x == "full" else int(x) for x in FLAGS.capsule_lens]
    log = harness.RowLog(FLAGS.out)
    for s in FLAGS.sessions:
        engine = make_engine(params, cfg, precision, int(s))  # one compile per session count
        for n in lens:
            for r in FLAGS.rolled:
                log.write(measure(engine, int(r), n))
    head = (
        "sessions",
        "capsule_len",
        "rolled",
        "plain_p50_ms",
        "rollover_p50_ms",
        "extra_p50_ms",
        "rollover_p99_ms",
    )
    print(" ".join(f"{h:>16}" for h in head))
    for row in log.rows:
        print(" ".join(f"{row[h]:>16}" for h in head))


if __name__ == "__main__":
    app.run(main)
