"""The codec decoder's products per precision: beat time at B sessions and waveform error.

See README.md. For each ``--sessions`` count and each ``--matmuls`` choice
(``precision.CODEC_MATMUL``), ``codec.decode_step`` over ``--beats`` beats of two code frames a
slot, as the tick runs it: jitted, its state donated, random valid codes (the same for every
choice). Rows: median and p90 ms of a beat's decode, the decoder's FLOPs counted from its shapes
and the rate they imply, and the waveform's error against ``float32`` (the faithful choice) over
every beat, relative (``|wav - ref| / |ref|`` over the whole run) and as the largest sample
difference over the largest reference sample. A choice that fails to compile or run is a row with
its ``error``; the run goes on. Rows are appended to ``--out`` as they are measured, each with its
provenance (``experiments.harness``).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax.model import codec
from voicechat_jax.precision import CODEC_MATMUL, Precision

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "voicechat_11b", "Preset whose codec runs: voicechat_11b | tiny.")
flags.DEFINE_list("sessions", ["16", "64", "96"], "Session counts (B).")
flags.DEFINE_list("matmuls", list(CODEC_MATMUL), "Product precisions (precision.CODEC_MATMUL).")
flags.DEFINE_integer("beats", 30, "Timed beats per row (after 3 untimed).")
flags.DEFINE_integer("frames_per_tick", 2, "Code frames a slot decodes per beat.")
flags.DEFINE_string("out", None, "JSON-lines output file (appended).")

WARMUP = 3


def decoder_gflop(cfg: config_lib.CodecConfig) -> float:
    """GFLOP of one session-frame's decode: its matrix products, counted from their shapes
    (up-projection, the ConvNeXt blocks' two pointwise products, the output projection)."""
    p = jax.eval_shape(lambda: codec.init(jax.random.key(0), cfg, Precision.reference()))
    steps, flop = 1, 0
    for stage in p.decoder.stages:
        d_in, C, r = stage.up.shape
        flop += 2 * steps * d_in * C * r
        steps *= r
        L, _, _, F = stage.blocks.pw1.shape
        flop += L * 2 * (2 * steps * C * F)
    _, C, out = p.decoder.out.shape
    flop += 2 * steps * C * out
    return flop / 1e9


def run_choice(params, cfg, B: int, matmul: str, codes: np.ndarray) -> tuple[dict, np.ndarray]:
    """Times ``decode_step`` under ``matmul`` over ``codes`` [beats, B, T, Q]; returns the row's
    timing fields and the waveform [beats, B, T * spf]."""
    step = jax.jit(
        functools.partial(codec.decode_step, cfg=cfg, matmul=matmul), donate_argnums=(1,)
    )
    state = codec.init_state(cfg, B, Precision.reference())
    t0 = time.perf_counter()
    compiled = step.lower(params, state, jnp.asarray(codes[0])).compile()
    compile_s = time.perf_counter() - t0
    times, wavs = [], []
    for i in range(codes.shape[0]):
        c = jnp.asarray(codes[i])
        t = time.perf_counter()
        state, wav = compiled(params, state, c)
        wav.block_until_ready()
        if i >= WARMUP:
            times.append(1e3 * (time.perf_counter() - t))
        wavs.append(np.asarray(wav))
    times = np.asarray(times)
    row = {
        "compile_s": round(compile_s, 2),
        "ms_p50": float(np.median(times)),
        "ms_p90": float(np.percentile(times, 90)),
    }
    return row, np.stack(wavs)


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]().codec
    params = jax.jit(lambda k: codec.init(k, cfg, Precision.reference()))(jax.random.key(0))
    gflop = decoder_gflop(cfg)
    device = jax.devices()[0].device_kind
    T = FLAGS.frames_per_tick
    log = harness.RowLog(FLAGS.out)
    for B in (int(x) for x in FLAGS.sessions):
        rng = np.random.default_rng(B)
        shape = (WARMUP + FLAGS.beats, B, T, cfg.n_quantizers)
        codes = rng.integers(0, cfg.codebook_size, shape, dtype=np.int32)
        ref = None
        for matmul in FLAGS.matmuls:
            row = {"model": FLAGS.model, "sessions": B, "frames_per_tick": T, "matmul": matmul}
            try:
                timing, wav = run_choice(params, cfg, B, matmul, codes)
            except Exception as e:  # a choice the platform refuses is a result
                row["error"] = str(e)[:300]
                _write(log, row)
                continue
            if matmul == "float32":
                ref = wav
            row |= timing
            row["gflop_per_beat"] = gflop * B * T
            row["tflops"] = gflop * B * T / timing["ms_p50"]
            if ref is not None:
                diff = wav.astype(np.float64) - ref
                row["wav_rel_err"] = float(np.linalg.norm(diff) / np.linalg.norm(ref))
                row["wav_max_err"] = float(np.abs(diff).max() / np.abs(ref).max())
            _write(log, row)
    print(f"codec decode on {device}, {FLAGS.model}, {gflop:.3g} GFLOP a session-frame, {T} frames")
    head = ("B", "matmul", "ms p50", "TFLOP/s", "wav rel err", "max err")
    print("{:>4} {:>14} {:>8} {:>8} {:>12} {:>9}".format(*head))
    for r in log.rows:
        if "error" in r:
            print(f"{r['sessions']:4d} {r['matmul']:>14} error: {r['error'][:60]}")
            continue
        rel, mx = r.get("wav_rel_err"), r.get("wav_max_err")
        print(
            f"{r['sessions']:4d} {r['matmul']:>14} {r['ms_p50']:8.3f} {r['tflops']:8.1f} "
            + (f"{rel:12.2e} {mx:9.2e}" if rel is not None else f"{'(no ref)':>12}")
        )


def _write(log: harness.RowLog, row: dict) -> None:
    logging.info("%s", row)
    log.write(row)


if __name__ == "__main__":
    app.run(main)
