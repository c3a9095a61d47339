"""Small-batch projections at the 11B shapes: XLA's dot against the weight-streaming Pallas kernel.

For each projection of a decode step (shapes read from the ``voicechat_11b`` preset: the LLM's MLP
``up``/``down`` and Mamba ``in_proj``/``out_proj`` in bf16, its text/function head with fp32
logits, and the speech decoder's MLP in fp32 under each ``--tts_precisions`` policy), each row
count R and each implementation (``voicechat_jax.model.projection.matmul``'s 'xla', i.e.
``common.dense`` as the model calls it, and 'pallas', ``pallas_kernels.matmul``): one jitted call
multiplies the same x [R, D] by ``--layers`` distinct weights of a stacked [L, D, F] array in turn,
each picked by a static layer index as the model's unrolled layers pick theirs, timed as the median
of ``--repeats`` calls, each blocked on. Reports ms per layer, the achieved TB/s on the weight's
bytes (the only large operand), XLA's time over the kernel's, and the kernel's error against XLA.
A plain device copy is timed in the same process for scale. Then a sweep of the kernel's tiling
(``--sweep_blocks``) at ``--sweep_shapes`` and ``--sweep_rows``. Rows go to ``--out`` as JSON lines
as they are measured, each with its provenance (``experiments.harness``); a table is printed last.
A configuration that fails to compile or run is recorded as a row with its error and the run goes
on.

``--small`` runs the tiny preset's shapes on the CPU (the kernel in the Pallas interpreter): a
check that the script works, not a measurement. See README.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import harness
from experiments.beat_profile.components import device_copy_tbps, rel_err, time_calls
from pallas_kernels.matmul import MatmulBlocks, default_blocks, matmul
from voicechat_jax import config as config_lib
from voicechat_jax.model.common import dense

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "16", "32", "56", "112"], "Row counts R (slots, or 2 x slots).")
flags.DEFINE_list(
    "shapes",
    ["mlp_up", "mlp_down", "mamba_in", "mamba_out", "heads", "tts_up", "tts_down"],
    "Projections to measure (see SHAPES in the source).",
)
flags.DEFINE_list(
    "tts_precisions",
    ["float32", "tensorfloat32"],
    "fp32 product policies for the speech decoder's shapes (Precision.matmul).",
)
flags.DEFINE_integer("layers", 4, "Distinct stacked weights multiplied per timed call.")
flags.DEFINE_integer("repeats", 20, "Timed calls per row (median), after 2 warm-up calls.")
flags.DEFINE_list("sweep_shapes", ["mlp_down", "mamba_in"], "Shapes of the tiling sweep.")
flags.DEFINE_list("sweep_rows", ["1", "56", "112"], "Row counts of the tiling sweep.")
flags.DEFINE_list(
    "sweep_blocks",
    ["64:64:1:4:3", "64:64:5:4:3", "64:64:7:4:3", "64:64:0:4:4", "64:64:0:8:3", "128:64:0:4:3",
     "128:64:0:8:3", "256:32:0:8:3", "32:128:0:4:3"],
    "Tilings block_f:block_d:split_d:num_warps:num_stages (split_d 0: the default's).",
)  # fmt: skip
flags.DEFINE_float("copy_gib", 4.0, "Size of the device-copy reference (0: skip).")
flags.DEFINE_bool("small", False, "Tiny shapes on the CPU, kernel interpreted (checks the script).")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")

F32, BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Shape:
    """One projection: x [R, D] (dtype x) @ w [L, D, F] (dtype w) -> out dtype, L in the model."""

    name: str
    D: int
    F: int
    x: str
    w: str
    out: str
    model_layers: int


def shapes(cfg: config_lib.ModelConfig) -> dict[str, Shape]:
    """The projections of one decode step, from the preset's sizes (dtypes of ``Precision``)."""
    llm, tts = cfg.llm, cfg.tts
    L_m, L_f = len(llm.layers_of("M")), len(llm.layers_of("-"))
    bf, f32 = "bfloat16", "float32"
    out = [
        Shape("mlp_up", llm.d_model, llm.mlp_dim, bf, bf, bf, L_f),
        Shape("mlp_down", llm.mlp_dim, llm.d_model, bf, bf, bf, L_f),
        Shape("mamba_in", llm.d_model, llm.in_proj_dim, bf, bf, bf, L_m),
        Shape("mamba_out", llm.d_inner, llm.d_model, bf, bf, bf, L_m),
        Shape("heads", llm.d_model, llm.vocab_size, bf, bf, f32, 2),  # text + function head
        Shape("tts_up", tts.d_model, tts.mlp_dim, f32, f32, f32, 2 * tts.n_layers),  # gate, up
        Shape("tts_down", tts.mlp_dim, tts.d_model, f32, f32, f32, tts.n_layers),
    ]
    return {s.name: s for s in out}


def _blocks(spec: str) -> MatmulBlocks:
    f, d, s, w, st = (int(v) for v in spec.split(":"))
    return MatmulBlocks(block_f=f, block_d=d, split_d=s or None, num_warps=w, num_stages=st)


def _label(b: MatmulBlocks) -> str:
    return f"{b.block_f}:{b.block_d}:{b.split_d or 0}:{b.num_warps}:{b.num_stages}"


def layered(impl: str, sh: Shape, layers: int, precision: str | None, blocks, interpret: bool):
    """jit(x, w [L, D, F]) -> one [R, F] output per layer j < layers, ``x @ w[j]`` in turn."""
    out_dtype = jnp.dtype(sh.out)

    def one(x, w, j):
        if impl == "pallas":
            return matmul(
                x,
                w,
                layer=j,
                out_dtype=out_dtype,
                precision=precision,
                interpret=interpret,
                blocks=blocks,
            )
        if out_dtype == x.dtype:
            return dense(x, w[j])  # the model's call (MLP, Mamba, speech decoder)
        # the heads' call: bf16 operands, fp32 logits (nano.heads)
        return jnp.einsum("rd,df->rf", x, w[j].astype(x.dtype), preferred_element_type=out_dtype)

    def fn(x, w):
        with jax.default_matmul_precision(precision or "float32"):
            return tuple(one(x, w, j) for j in range(layers))

    return jax.jit(fn)


@functools.cache
def _rows() -> harness.RowLog:
    return harness.RowLog(FLAGS.out)


def _write(row: dict) -> dict:
    """``row`` with its provenance, appended to ``--out``."""
    logging.info("%s", row)
    return _rows().write(row)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random(key, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    """A random array made on the device (no host transfer of gigabytes)."""
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


def measure(sh, R, impl, w, precision, blocks, layers, base, interpret, reference) -> dict:
    """One row: ``impl`` at R rows over ``layers`` weights; ``reference`` holds XLA's output.

    ``base`` is copied into the row (``sweep`` for the tiling sweep)."""
    x = _random(jax.random.key(R), (R, sh.D), jnp.dtype(sh.x), 1.0)
    label = ""
    if impl == "pallas":
        label = _label(blocks or default_blocks(R, sh.D, sh.F, jnp.dtype(sh.w)))
    row = dict(base, shape=sh.name, D=sh.D, F=sh.F, R=R, impl=impl, layers=layers)
    row.update(precision=precision or "", blocks=label, x=sh.x, w=sh.w, out=sh.out)
    fn = layered(impl, sh, layers, precision, blocks, interpret)
    try:
        times, first_s, out = time_calls(fn, (x, w), 1 if FLAGS.small else FLAGS.repeats)
    except Exception as e:  # any compile or run failure is recorded, and the run goes on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return _write(row)
    ms = float(np.median(times)) * 1e3 / layers
    weight_bytes = sh.D * sh.F * jnp.dtype(sh.w).itemsize
    row.update(
        ms=ms,
        ms_p10=float(np.percentile(times, 10)) * 1e3 / layers,
        ms_p90=float(np.percentile(times, 90)) * 1e3 / layers,
        first_call_s=first_s,
        weight_MB=weight_bytes / 1e6,
        TBps=weight_bytes / (ms * 1e-3) / 1e12,
    )
    key = (sh.name, R, precision)
    if impl == "xla":
        reference[key] = np.asarray(out[0], np.float32)
    elif key in reference:
        row["err_vs_xla"] = rel_err(out[0], reference[key])
    return _write(row)


def _table(rows: list[dict], title: str) -> None:
    print(title)
    print(
        f"{'shape':>9} {'D':>6} {'F':>6} {'prec':>13} {'R':>4} {'impl':>6} {'blocks':>14} "
        f"{'ms/layer':>9} {'TB/s':>5} {'xla/this':>8} {'err':>8}"
    )
    xla = {(r["shape"], r["R"], r["precision"]): r["ms"] for r in rows if r["impl"] == "xla"}
    for r in rows:
        start = (
            f"{r['shape']:>9} {r['D']:>6} {r['F']:>6} {r['precision'] or '-':>13} {r['R']:>4} "
            f"{r['impl']:>6} {r['blocks']:>14}"
        )
        if "ms" not in r:
            print(f"{start}  {r.get('error')}")
            continue
        ref = xla.get((r["shape"], r["R"], r["precision"]))
        ratio = f"{ref / r['ms']:.2f}x" if ref else ""
        err = f"{r['err_vs_xla']:.1e}" if "err_vs_xla" in r else ""
        print(f"{start} {r['ms']:>9.4f} {r['TBps']:>5.2f} {ratio:>8} {err:>8}")


def main(argv):
    del argv
    cfg = config_lib.tiny() if FLAGS.small else config_lib.voicechat_11b()
    all_shapes = shapes(cfg)
    rows_list = [1, 3] if FLAGS.small else [int(r) for r in FLAGS.rows]
    sweep_rows = [3] if FLAGS.small else [int(r) for r in FLAGS.sweep_rows]
    interpret = jax.default_backend() == "cpu"
    device = jax.devices()[0]
    copy = device_copy_tbps(FLAGS.copy_gib) if FLAGS.copy_gib > 0 and not FLAGS.small else None
    logging.info("device %s, jax %s, copy %s TB/s", device.device_kind, jax.__version__, copy)
    if copy is not None:
        _write({"device_copy_TBps": copy})
    rows, sweep, reference = [], [], {}
    for name in FLAGS.shapes:
        sh = all_shapes[name]
        layers = min(2 if FLAGS.small else FLAGS.layers, sh.model_layers)
        w = _random(jax.random.key(7), (layers, sh.D, sh.F), jnp.dtype(sh.w), sh.D**-0.5)
        precisions = FLAGS.tts_precisions if sh.w == "float32" else [None]
        for precision in precisions:
            for R in rows_list:
                for impl in ("xla", "pallas"):
                    rows.append(measure(sh, R, impl, w, precision, None, layers, {}, interpret,
                                        reference))  # fmt: skip
        if name in FLAGS.sweep_shapes:
            for R in sweep_rows:
                for spec in FLAGS.sweep_blocks[: 2 if FLAGS.small else None]:
                    blocks = _blocks(spec)
                    if blocks.split_d is None:
                        split = default_blocks(R, sh.D, sh.F, jnp.dtype(sh.w)).split_d
                        blocks = dataclasses.replace(blocks, split_d=split)
                    sweep.append(measure(sh, R, "pallas", w, precisions[0], blocks, layers,
                                         {"sweep": True}, interpret, reference))  # fmt: skip
        del w
    print(
        f"projections, {device.device_kind}, jax {jax.__version__}, device copy "
        f"{'-' if copy is None else f'{copy:.2f}'} TB/s; ms per layer (median), TB/s on the "
        "weight's bytes, xla/this = XLA's time over this row's"
    )
    _table(rows, "default tiling:")
    if sweep:
        _table(
            [
                r
                for r in rows
                if r["impl"] == "xla" and r["shape"] in FLAGS.sweep_shapes and r["R"] in sweep_rows
            ]
            + sweep,
            "tiling sweep (blocks = block_f:block_d:split_d:num_warps:num_stages):",
        )


if __name__ == "__main__":
    app.run(main)
