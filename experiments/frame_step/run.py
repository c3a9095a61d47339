"""CPU time of one frame of the tiny model: the listening half, the speaking half, the whole frame.

Jitted, after warm-up; the median of --reps calls, one slot (B=1) and B=8. See README.md.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from voicechat_jax import config as config_lib
from voicechat_jax.config import PAD_ID
from voicechat_jax.model import codec, conformer, ear_tts, rnnt, voicechat
from voicechat_jax.precision import Precision

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset.")
flags.DEFINE_integer("reps", 50, "Timed calls per row.")
flags.DEFINE_list("batch", ["1", "8"], "Slot counts.")


def _time(fn, state, *args) -> float:
    """Median seconds per call of fn(state, *args) -> (state, out), state threaded through."""
    state, out = fn(state, *args)
    jax.block_until_ready(out)
    times = []
    for _ in range(FLAGS.reps):
        t = time.perf_counter()
        state, out = fn(state, *args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    prec = Precision.fp32()
    params = voicechat.init(jax.random.key(0), cfg, prec)
    template = voicechat.initial_state(params, cfg=cfg, precision=prec, max_len=256)
    rows = []
    for B in (int(b) for b in FLAGS.batch):
        st = jax.tree_util.tree_map(lambda x, B=B: jnp.repeat(x, B, axis=0), template)
        audio = jnp.asarray(np.random.default_rng(0).standard_normal((B, 1280)) * 0.1, jnp.float32)
        key = jnp.zeros((B, 2), jnp.uint32)
        pad = jnp.full((B,), PAD_ID, jnp.int32)

        @jax.jit
        def listen(s, a):
            enc_s, enc, proj = conformer.encoder_step(
                params.encoder, s.encoder, a, cfg=cfg.encoder, precision=prec
            )
            rnnt_s, tok, n = rnnt.rnnt_step(params.rnnt, s.rnnt, enc, cfg=cfg.rnnt)
            llm_s, text, func, _ = voicechat.listen_frame(
                params, s.llm, s.text_prev, s.func_prev, proj[:, 0], cfg=cfg
            )
            return s.replace(encoder=enc_s, rnnt=rnnt_s, llm=llm_s), (text, func, tok, n)

        @jax.jit
        def speak(s, text, key=key):
            tts_s, codes, dec = ear_tts.tts_step(
                params.tts,
                s.tts.replace(frame=s.tts.frame + 1),
                text,
                key,
                cfg=cfg,
                deterministic=False,
            )
            codec_s, wav = codec.decode_step(params.codec, s.codec, dec[:, None], cfg=cfg.codec)
            return s.replace(tts=tts_s, codec=codec_s), (codes, wav)

        whole = jax.jit(
            functools.partial(
                voicechat.advance, params, cfg=cfg, precision=prec, deterministic=False
            )
        )
        rows.append(
            (
                B,
                _time(listen, st, audio) * 1e3,
                _time(speak, st, pad) * 1e3,
                _time(lambda s, a, whole=whole, key=key: whole(s, a, key), st, audio) * 1e3,
            )
        )
    print(
        f"{FLAGS.model}, fp32, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"median of {FLAGS.reps}"
    )
    print(f"{'B':>3} {'listen ms':>10} {'speak ms':>10} {'frame ms':>10}")
    for B, lt, sp, wh in rows:
        print(f"{B:>3} {lt:>10.2f} {sp:>10.2f} {wh:>10.2f}")


if __name__ == "__main__":
    app.run(main)
