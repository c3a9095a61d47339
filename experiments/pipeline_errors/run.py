"""Measured errors of the whole per-frame pipeline against NeMo on the tiny random model (fp32).

Builds the tiny random ``NemotronVoiceChat`` of ``tests.reference.nemo_ref`` on the CPU, loads it
through the release key table, runs NeMo's streaming perception, per-frame LLM loop and EarTTS
loop and ours on 64 frames (5.12 s) of the bundled speech, and prints each relative max error
(max|a-b| / max|b|) and whether the tokens and codes are identical. The tests
(``tests/test_pipeline.py``) assert bounds on the same quantities; this prints the values.

    PYTHONPATH=. python3 experiments/pipeline_errors/run.py
"""

from __future__ import annotations

import functools
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tests.reference import nemo_ref
from voicechat_jax.config import PAD_ID, tiny
from voicechat_jax.keys import load_params
from voicechat_jax.model import char_encoder, conformer, nano, voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving import runner

N_FRAMES, SPF, OUT_SPF = 64, 1280, 1764


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def main() -> None:
    torch.set_num_threads(1)
    cfg, f32 = tiny(), Precision.fp32()
    model = nemo_ref.build_tiny_nemo(cfg, tempfile.mkdtemp(), seed=0)
    chars = char_encoder.char_table(model.release_cfg["model"]["stt"]["model"]["pretrained_llm"])
    params = load_params(cfg, nemo_ref.release_state_dict(model), f32, np.asarray(chars))
    x = audio_lib.read_wav(runner.default_wav())
    n = N_FRAMES * SPF
    noise = 1e-3 * np.random.default_rng(0).standard_normal(max(0, n - x.size))
    x = np.concatenate([x[:n], noise]).astype(np.float32)

    proj, enc = nemo_ref.nemo_streaming_perception(model, x, return_encoder=True)
    listen = nemo_ref.nemo_listen(model, proj)
    speak = nemo_ref.nemo_speak(model, listen["text"])

    # Encoder + proj, one frame per call.
    step = jax.jit(functools.partial(conformer.encoder_step, cfg=cfg.encoder, precision=f32))
    s, our_enc, our_proj = conformer.init_state(cfg.encoder, 1, f32), [], []
    for t in range(N_FRAMES):
        s, e, p = step(params.encoder, s, jnp.asarray(x[None, t * SPF : (t + 1) * SPF]))
        our_enc.append(np.asarray(e[0, 0]))
        our_proj.append(np.asarray(p[0, 0]))
    # The LLM loop fed NeMo's perception.
    frame = jax.jit(functools.partial(voicechat.listen_frame, cfg=cfg))
    ls = nano.init_state(cfg.llm, 1, proj.shape[0], f32)
    tp = fp = jnp.full((1,), PAD_ID, jnp.int32)
    hidden = []
    for t in range(proj.shape[0]):
        ls, tp, fp, h = frame(params, ls, tp, fp, jnp.asarray(proj[t])[None])
        hidden.append(np.asarray(h[0]))
    # The whole model end to end, two frames per call.
    advance = jax.jit(
        functools.partial(voicechat.advance, cfg=cfg, precision=f32, deterministic=True)
    )
    st = voicechat.initial_state(
        params, cfg=cfg, precision=f32, max_len=N_FRAMES, deterministic=True
    )
    text, codes, wav = [], [], []
    for t in range(0, N_FRAMES, 2):
        pcm = jnp.asarray(x[None, t * SPF : (t + 2) * SPF])
        st, out = advance(params, st, pcm, jnp.zeros((1, 2), jnp.uint32))
        text += np.asarray(out.text[0]).tolist()
        codes.append(np.asarray(out.codes[0]))
        wav.append(np.asarray(out.wav[0]))
    wav = np.concatenate(wav)
    ref_wav = speak["wav"][: N_FRAMES * OUT_SPF]
    k = min(wav.size, ref_wav.size) - 14  # stream = offline delayed by 8 samples, past sample 6

    print(f"encoder rel {rel(np.stack(our_enc), enc[:N_FRAMES]):.2e}")
    print(f"proj rel {rel(np.stack(our_proj), proj[:N_FRAMES]):.2e}")
    print(f"LLM hidden rel {rel(np.stack(hidden), listen['hidden']):.2e}")
    print(
        f"text identical on {N_FRAMES} frames: {np.array_equal(text, listen['text'][:N_FRAMES])}"
        f" ({len(set(text))} distinct tokens)"
    )
    print(f"codes identical: {np.array_equal(np.concatenate(codes), speak['codes'][:N_FRAMES])}")
    print(f"waveform rel {rel(wav[14 : 14 + k], ref_wav[6 : 6 + k]):.2e}")


if __name__ == "__main__":
    main()
