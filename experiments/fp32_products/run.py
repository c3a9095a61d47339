"""The faithful tick's fp32 products under each product algorithm: time, rate and error.

See README.md. For each product shape the faithful policy runs in fp32 (the speech decoder's
backbone and MoG trunk at ``2B`` rows, the encoder's at ``B``), each ``--slots`` count and each
``--algorithms`` choice, a jitted program of ``--layers`` such products over distinct random
weights (as a tick reads them: one layer's weight after another, none cached), timed as the median
of ``--calls`` calls. Rows: ms per product, TFLOP/s, and the error of the first product against a
float64 product of the same fp32 inputs, as the largest difference over the largest reference
value (``max_rel``) and the RMS difference over the reference's RMS (``rms_rel``). ``float32``
(``HIGHEST``) is what the faithful policy runs today; its error is the bar an algorithm must meet
to stand in for it. Rows are appended to ``--out`` as measured, with their provenance.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import harness
from experiments.fp32_products.chunked import chunked_products, chunked_weight
from experiments.fp32_products.shapes import kernel_blocks, selected, shapes
from pallas_kernels.matmul import matmul
from voicechat_jax import config as config_lib
from voicechat_jax.model.common import dense_tf32_pair, tf32_pair

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "slots", ["72", "112"], "Slot counts B (the speech decoder's products see 2B rows)."
)
flags.DEFINE_list(
    "algorithms",
    ["float32", "TF32_TF32_F32_X3"],
    "float32 (HIGHEST), tensorfloat32 (HIGH), a jax.lax.DotAlgorithmPreset name, "
    "pallas_float32 (pallas_kernels.matmul in full fp32), pallas_tf32x3[_rM][_dN] (the same "
    "kernel, three TF32 passes a D step of N rows, compensated sums across steps; row blocks of "
    "M rows), <any of these XLA algorithms>_c<N> (the contraction in steps of N rows, each step "
    "under the algorithm in one batched dot, the steps summed by a compensated add), or "
    "tf32_pair (one "
    "TF32 product by "
    "the weight's [hi | lo] pair, made before the clock: model.common.dense_tf32_pair). The "
    "H100 run of 2026-12-05 had all five of float32, tensorfloat32, TF32_TF32_F32_X3, "
    "BF16_BF16_F32_X6 and BF16_BF16_F32_X9: 80 programs, 7.5 minutes of compiles and autotuning.",
)
flags.DEFINE_list(
    "shapes",
    ["tts", "mog", "enc"],
    "Which products: names from shapes() or their prefixes (tts, mog, enc, codec). The codec's "
    "are not in the default: they ran at 70 % of the H200's fp32 rate in the tick (2026-12-05).",
)
flags.DEFINE_integer("layers", 8, "Distinct weights per timed program (products per call).")
flags.DEFINE_integer("calls", 20, "Timed calls per row (after 3 warm-up calls).")
flags.DEFINE_string("model", "voicechat_11b", "Preset whose shapes are used: voicechat_11b | tiny.")
flags.DEFINE_string("out", None, "JSON-lines output file (appended).")


def precision_of(name: str):
    if name == "float32":
        return jax.lax.Precision.HIGHEST
    if name == "tensorfloat32":
        return jax.lax.Precision.HIGH
    return getattr(jax.lax.DotAlgorithmPreset, name)


def products(x, ws, *, precision):
    """x [R, D] times each of ws (L x [D, F]): L outputs [R, F] in fp32."""
    return tuple(jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32) for w in ws)


def pallas_products(x, ws, *, precision="float32", block_d=None, block_r=None):
    """``products`` through ``pallas_kernels.matmul``: in full fp32 (Triton's IEEE path on the
    FMA units, the faithful policy's math in our own kernel) or as three TF32 passes a tile,
    summed across tiles by a compensated add (``precision='tf32x3'``); the kernel's default
    tiling for the shape, its D step ``block_d`` and row block ``block_r`` where given."""
    interpret = jax.default_backend() == "cpu"
    out = []
    for w in ws:
        blocks = kernel_blocks(
            x.shape[0], *w.shape, w.dtype, precision=precision, block_d=block_d, block_r=block_r
        )
        out.append(
            matmul(
                x, w, precision=precision, out_dtype=jnp.float32, interpret=interpret, blocks=blocks
            )
        )
    return tuple(out)


def pair_products(x, pairs):
    """``products`` as ``dense_tf32_pair`` runs them: each weight given as its TF32 pair."""
    return tuple(dense_tf32_pair(x, p) for p in pairs)


# "<algorithm>_c<N>": the contraction in steps of N rows, each under <algorithm>, the steps
# summed in fp32 by a compensated add (``chunked_products``).
_CHUNKED = re.compile(r"(.+)_c(\d+)")


def program(algo: str):
    """The un-jitted program of ``--layers`` products under ``algo``."""
    if algo == "pallas_float32":
        return pallas_products
    tf32x3 = re.fullmatch(r"pallas_tf32x3(?:_r(\d+))?(?:_d(\d+))?", algo)
    if tf32x3:
        block_r, block_d = (int(g) if g else None for g in tf32x3.groups())
        return functools.partial(
            pallas_products, precision="tf32x3", block_d=block_d, block_r=block_r
        )
    if algo == "tf32_pair":
        return pair_products
    chunked = _CHUNKED.fullmatch(algo)
    if chunked:
        return functools.partial(chunked_products, precision=precision_of(chunked.group(1)))
    return functools.partial(products, precision=precision_of(algo))


def weights_for(algo: str, ws):
    """The weights as ``algo``'s program takes them: TF32 pairs for tf32_pair (made once, as
    the engine would when it lays the params out), the fp32 weights otherwise."""
    if algo == "tf32_pair":
        return tuple(jax.block_until_ready(tf32_pair(w)) for w in ws)
    chunked = _CHUNKED.fullmatch(algo)
    if chunked:
        chunk = int(chunked.group(2))
        return tuple(jax.block_until_ready(chunked_weight(w, chunk)) for w in ws)
    return ws


def errors(y: np.ndarray, ref: np.ndarray) -> dict:
    d = y.astype(np.float64) - ref
    return {
        "max_rel": float(np.abs(d).max() / np.abs(ref).max()),
        "rms_rel": float(np.sqrt((d**2).mean() / (ref**2).mean())),
    }


def main(argv):
    del argv
    cfg = getattr(config_lib, FLAGS.model)()
    log = harness.RowLog(FLAGS.out)
    rng = np.random.default_rng(0)
    table = []
    for name, per_slot, D, F, per_frame in selected(shapes(cfg), FLAGS.shapes):
        ws = tuple(
            jnp.asarray(rng.standard_normal((D, F), np.float32) / np.sqrt(D))
            for _ in range(FLAGS.layers)
        )
        w0 = np.asarray(ws[0], np.float64)
        for B in (int(s) for s in FLAGS.slots):
            R = per_slot * B
            x = jnp.asarray(rng.standard_normal((R, D), np.float32))
            ref = np.asarray(x, np.float64) @ w0
            for algo in FLAGS.algorithms:
                row = {
                    "shape": name,
                    "slots": B,
                    "R": R,
                    "D": D,
                    "F": F,
                    "algorithm": algo,
                    "per_frame": per_frame,
                    "layers": FLAGS.layers,
                }
                try:
                    fn, w_in = jax.jit(program(algo)), weights_for(algo, ws)
                    out = jax.block_until_ready(fn(x, w_in))
                    ms = harness.time_call(
                        functools.partial(fn, x, w_in), calls=FLAGS.calls, warmup=3
                    )
                except Exception as err:  # an algorithm this backend lacks: a row that says so
                    log.write({**row, "error": f"{type(err).__name__}: {err}"[:300]})
                    continue
                per = ms / FLAGS.layers
                row.update(
                    ms_per_product=per,
                    tflop_s=2 * R * D * F / per / 1e9,
                    frame_ms=per * per_frame,
                    **errors(np.asarray(out[0]), ref),
                )
                table.append(log.write(row))
    base = {(r["shape"], r["slots"]): r for r in table if r["algorithm"] == "float32"}
    lines = [
        "| shape | B | algorithm | ms | TFLOP/s | vs float32 | frame ms | max_rel | rms_rel |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        b = base.get((r["shape"], r["slots"]))
        speed = f"{b['ms_per_product'] / r['ms_per_product']:.2f}x" if b else ""
        lines.append(
            f"| {r['shape']} | {r['slots']} | {r['algorithm']} | {r['ms_per_product']:.4f} | "
            f"{r['tflop_s']:.1f} | {speed} | {r['frame_ms']:.2f} | {r['max_rel']:.1e} | "
            f"{r['rms_rel']:.1e} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
