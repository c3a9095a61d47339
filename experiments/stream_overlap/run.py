"""Does a second GPU stream hide the compute-bound codec behind the memory-bound speech decoder?

See README.md. At ``--slots`` B, one program runs a speech-decoder backbone step of 2B rows over
full fp32 KV caches (``gemma.forward``, T = 1: its attention reads every cached position, bound
by memory) and, independent of it, the codec decoder's step of B slots x ``--frames`` frames
(``codec.decode_step``: full-fp32 products, bound by compute). Four timings in one process, each
the median of ``--calls`` calls with its states threaded through (donated):

- ``decoder``: the backbone step alone; ``codec``: the codec step alone;
- ``serial``: both in one program, on the one stream XLA uses;
- ``streams``: both in one program, the codec inside ``compute_on('gpu_stream:1')``, which XLA
  puts on a stream of its own when ``--xla_gpu_experimental_stream_annotation=true`` is in
  ``XLA_FLAGS`` (read once per process: run once with it and once without, ``--label`` naming
  the run).

``hidden`` is how much of the shorter part the overlap took off the serial program:
``(serial - streams) / min(decoder, codec)``. The outputs of ``streams`` must equal ``serial``'s
bit for bit (``same``): a stream changes where a kernel runs, not what it computes. Rows go to
``--out``, with their provenance.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax.model import codec, gemma
from voicechat_jax.model.streams import inlined, on_stream
from voicechat_jax.precision import Precision

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "voicechat_11b", "Preset: voicechat_11b | tiny.")
flags.DEFINE_list("slots", ["40", "72"], "Slot counts B.")
flags.DEFINE_integer("frames", 2, "Code frames the codec decodes per slot and call (a beat's).")
flags.DEFINE_integer("context_frames", 1500, "Cached positions per row (the cap: every one read).")
flags.DEFINE_integer("calls", 10, "Timed calls per row (median), after 2 warm-up calls.")
flags.DEFINE_string("label", "default", "The run's name (say which XLA_FLAGS it had).")
flags.DEFINE_string("out", None, "JSON-lines output file (appended).")

PREC = Precision.reference()


def both(tp, cache, x, cp, cstate, codes, *, tcfg, ccfg, streams: bool):
    """The backbone step, and beside it (no data between them) the codec step:
    ((cache, codec state), (h, wav))."""
    cache, h = gemma.forward(tp, cache, x, cfg=tcfg)
    # inlined in both programs (``on_stream`` inlines), so that the stream is their one difference
    decode = functools.partial(codec.decode_step, cfg=ccfg)
    place = functools.partial(on_stream, stream=1) if streams else inlined
    cstate, wav = place(decode)(cp, cstate, codes)
    return (cache, cstate), (h, wav)


def timed(fn, state, calls: int):
    """Median ms of ``fn(state) -> (state, outputs)`` over ``calls`` calls (2 warm-up), the
    state threaded through; returns (ms, the last call's outputs)."""
    times, out = [], None
    for i in range(2 + calls):
        t = time.perf_counter()
        state, out = jax.block_until_ready(fn(state))
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times)), out


def measure(B: int, tp, cp, cfg) -> dict:
    """The four timings at ``B`` slots, and whether the two programs' outputs agree."""
    t, c, S = cfg.tts, cfg.codec, FLAGS.context_frames
    rng = np.random.default_rng(B)
    x = jnp.asarray(rng.standard_normal((2 * B, 1, t.d_model), np.float32))
    codes = jnp.asarray(rng.integers(0, c.codebook_size, (B, FLAGS.frames, c.n_quantizers)))

    def fresh_cache():
        cache = gemma.init_cache(t, 2 * B, S, PREC)
        return cache.replace(pos=jnp.full((2 * B,), S - 1, jnp.int32))  # full: read it all

    dec = jax.jit(functools.partial(gemma.forward, cfg=t), donate_argnums=(1,))
    cod = jax.jit(functools.partial(codec.decode_step, cfg=c), donate_argnums=(1,))
    ms = {}
    ms["decoder"], _ = timed(lambda ca: dec(tp, ca, x), fresh_cache(), FLAGS.calls)
    ms["codec"], _ = timed(lambda st: cod(cp, st, codes), codec.init_state(c, B, PREC), FLAGS.calls)
    outs = {}
    for name, streams in (("serial", False), ("streams", True)):
        fn = jax.jit(
            functools.partial(both, tcfg=t, ccfg=c, streams=streams), donate_argnums=(1, 4)
        )
        start = (fresh_cache(), codec.init_state(c, B, PREC))
        ms[name], out = timed(lambda s, fn=fn: fn(tp, s[0], x, cp, s[1], codes), start, FLAGS.calls)
        outs[name] = [np.asarray(a) for a in out]  # h and wav
    same = all(np.array_equal(a, b) for a, b in zip(*outs.values(), strict=True))
    hidden = (ms["serial"] - ms["streams"]) / min(ms["decoder"], ms["codec"])
    row = {"label": FLAGS.label, "slots": B, "frames": FLAGS.frames, "context": S}
    return row | {f"{k}_ms": v for k, v in ms.items()} | {"hidden": hidden, "same": same}


def main(argv):
    del argv
    cfg = getattr(config_lib, FLAGS.model)()
    tp = jax.jit(lambda k: gemma.init(k, cfg.tts, PREC))(jax.random.key(0))
    cp = jax.jit(lambda k: codec.init(k, cfg.codec, PREC))(jax.random.key(1))
    log = harness.RowLog(FLAGS.out)
    print("| label | B | decoder ms | codec ms | serial ms | streams ms | hidden | same |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for B in (int(s) for s in FLAGS.slots):
        r = log.write(measure(B, tp, cp, cfg))
        print(
            f"| {r['label']} | {B} | {r['decoder_ms']:.2f} | {r['codec_ms']:.2f} | "
            f"{r['serial_ms']:.2f} | {r['streams_ms']:.2f} | {r['hidden']:.2f} | {r['same']} |"
        )


if __name__ == "__main__":
    app.run(main)
