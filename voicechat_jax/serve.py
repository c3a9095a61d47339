r"""voicechat-serve: serve full-duplex voice sessions on the beat clock.

With no flags it runs the embedded default: the ``tiny`` model with random weights, the bundled
speech recording, 4 sessions for 10 s on the real-time clock. It prints the latency and miss table
and writes, per session, ``output.wav`` (22.05 kHz), ``frames.jsonl`` and, where a tokenizer is
available, ``transcript.txt``; plus ``metrics.jsonl`` for the run.

  voicechat-serve --checkpoint=checkpoints/voicechat_11b --slots=32 --sessions=32 --seconds=80
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from voicechat_jax.serving import runner

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "A converted checkpoint directory (voicechat-convert).")
flags.DEFINE_string("model", "tiny", "Preset used without --checkpoint (random weights).")
flags.DEFINE_integer("slots", 4, "Slots the state is sized for (capacity).")
flags.DEFINE_integer("sessions", 4, "Scripted sessions to run (over --slots are refused).")
flags.DEFINE_float("seconds", 10.0, "Length of the run.")
flags.DEFINE_integer("frames_per_tick", 2, "Model frames per beat (2 = 160 ms).")
flags.DEFINE_integer("context_frames", 1500, "Per-session context cap in frames.")
flags.DEFINE_multi_string("input_wav", None, "16 kHz mono WAV(s); sessions take them in turn.")
flags.DEFINE_string("output_dir", "runs/serve", "Where per-session outputs and metrics go.")
flags.DEFINE_enum(
    "loop",
    "dispatch",
    ["resident", "dispatch"],
    "How the tick is driven (dispatch had the lighter tail on an H200: experiments/beat_latency).",
)
flags.DEFINE_enum("clock", "realtime", ["realtime", "offline"], "Beat clock.")
flags.DEFINE_enum(
    "speech_sampling", "faithful", ["faithful", "deterministic"], "Speech decoder sampler."
)
flags.DEFINE_bool("churn", False, "Sessions join and leave at random times.")
flags.DEFINE_integer("seed", 0, "Seed for random weights, churn and sampling keys.")
flags.DEFINE_enum("precision", "reference", ["reference", "fp32"], "Dtype policy.")
flags.DEFINE_integer("warmup_ticks", 3, "Ticks reported as warm-up, apart from steady state.")
flags.DEFINE_enum(
    "ssm_kernel", "xla", ["xla", "pallas"], "Mamba-2 decode SSM update (pallas: in place)."
)


def main(argv: list[str]) -> None:
    del argv
    options = runner.RunOptions(
        checkpoint=FLAGS.checkpoint,
        model=FLAGS.model,
        slots=FLAGS.slots,
        sessions=FLAGS.sessions,
        seconds=FLAGS.seconds,
        frames_per_tick=FLAGS.frames_per_tick,
        context_frames=FLAGS.context_frames,
        input_wavs=tuple(FLAGS.input_wav or ()),
        output_dir=FLAGS.output_dir,
        loop=FLAGS.loop,
        clock=FLAGS.clock,
        speech_sampling=FLAGS.speech_sampling,
        churn=FLAGS.churn,
        seed=FLAGS.seed,
        precision=FLAGS.precision,
        warmup_ticks=FLAGS.warmup_ticks,
        ssm_kernel=FLAGS.ssm_kernel,
    )
    logging.info("serving with %s", options)
    result = runner.run(options)
    print(result.table)  # the CLI's report; the library itself never prints
    print(f"outputs: {os.path.abspath(options.output_dir)}")


def run() -> None:
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
