"""How far each precision policy moves the model's outputs from the faithful one. See README.md.

One engine per policy, the same random weights (drawn in fp32, then cast by each policy), the
bundled speech as every session's input, the faithful sampler with the same session keys. Every
policy runs ``--frames`` frames; the outputs are compared frame by frame with the ``reference``
policy's: agreement of text and function tokens and of audio codes, and the waveform's relative
error. Rows are appended to ``--out`` as JSON lines as they are measured, each with its provenance
(``experiments.harness``); a table is printed last.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from absl import app, flags

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax.engine import Engine
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision, policy
from voicechat_jax.serving import audio as audio_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list(
    "policies",
    "reference,tf32,bf16_tts_kv,tf32_bf16_tts_kv,tf32_codec,bf16_tts_kv_tf32_codec",
    "Policies.",
)
flags.DEFINE_integer("frames", 120, "Frames per session (>= 100).")
flags.DEFINE_integer("sessions", 2, "Sessions (slots) per run.")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")

SPEECH = os.path.join(os.path.dirname(voicechat.__file__), "..", "assets", "speech_16k.wav")


def run_policy(params32, cfg, precision: Precision) -> dict[str, np.ndarray]:
    """All outputs of ``--frames`` frames for ``--sessions`` sessions under ``precision``."""
    params = jax.tree_util.tree_map(
        lambda a, r: a.astype(r.dtype), params32, _abstract(cfg, precision)
    )
    serve = config_lib.ServeConfig(
        slots=FLAGS.sessions,
        frames_per_tick=2,
        context_frames=FLAGS.frames + 2,
        precision=precision,
    )
    engine = Engine(params, cfg, serve)
    speech = audio_lib.read_wav(SPEECH)
    n = FLAGS.frames * 1280
    speech = np.pad(speech, (0, max(0, n - speech.size)))[:n]
    outs = {"text": [], "function": [], "codes": [], "wav": []}
    beat = engine.empty_beat()
    beat.admit[:] = True
    beat.key[:] = np.arange(2 * FLAGS.sessions, dtype=np.uint32).reshape(-1, 2) + 7
    for k in range(FLAGS.frames // 2):
        beat.audio[:] = speech[k * 2560 : (k + 1) * 2560]
        out = jax.device_get(engine.tick(beat))
        beat.admit[:] = False
        for name in ("text", "function", "codes", "wav"):
            outs[name].append(np.asarray(getattr(out.frames, name)))
    return {k: np.concatenate(v, axis=1) for k, v in outs.items()}


def _abstract(cfg, precision):
    return jax.eval_shape(lambda: voicechat.init(jax.random.key(0), cfg, precision))


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    params32 = jax.jit(lambda k: voicechat.init(k, cfg, Precision.fp32()))(jax.random.key(0))
    base = run_policy(params32, cfg, policy("reference"))
    log = harness.RowLog(FLAGS.out)
    for name in FLAGS.policies:
        got = base if name == "reference" else run_policy(params32, cfg, policy(name))
        wav_err = float(np.linalg.norm(got["wav"] - base["wav"]) / np.linalg.norm(base["wav"]))
        row = {
            "model": FLAGS.model,
            "policy": name,
            "frames": FLAGS.frames,
            "sessions": FLAGS.sessions,
            "text_agree": float(np.mean(got["text"] == base["text"])),
            "function_agree": float(np.mean(got["function"] == base["function"])),
            "codes_agree": float(np.mean(got["codes"] == base["codes"])),
            "frames_all_codes_agree": float(np.mean(np.all(got["codes"] == base["codes"], -1))),
            "wav_rel_err": wav_err,
        }
        log.write(row)
    rows = log.rows
    print(
        f"{FLAGS.model} on {rows[0]['device']}: {FLAGS.frames} frames x {FLAGS.sessions} sessions"
    )
    print(f"{'policy':18} {'text':>6} {'func':>6} {'codes':>6} {'frames':>6} {'wav err':>9}")
    for r in rows:
        print(
            f"{r['policy']:18} {r['text_agree']:6.3f} {r['function_agree']:6.3f} "
            f"{r['codes_agree']:6.3f} {r['frames_all_codes_agree']:6.3f} {r['wav_rel_err']:9.2e}"
        )


if __name__ == "__main__":
    app.run(main)
