"""How much of a full-fp32 product hides behind a memory-bound stream in one kernel?

See README.md. Stand-ins of the faithful tick's two kinds of work (``kernel.py``): a stream of
``--cache_gib`` GiB of fp32 read once (as the speech decoder's attention reads its cache) and
the codec's largest full-fp32 product, ``--rows`` x ``--k`` @ ``--k`` x ``--f`` (its last stage's
ConvNeXt C -> 4C product: 441 steps a code frame and slot, two frames a beat). Each timing is the
median of ``--calls`` calls:

- ``read``, ``product``: each role alone (one launch of ``kernel.two_roles``);
- ``xla_product``: the same product as XLA runs it (``jnp.dot`` at HIGHEST, the tick's way);
- ``serial``: both roles in one program, one launch each (as the tick runs them);
- ``blocked``, ``interleaved``: both roles in one launch (``kernel.ORDERS``).

``hidden`` = (serial - fused) / min(read, product): the share of the shorter part that running
both in one launch took off; ``same``: the fused launch's outputs equal the roles' alone bit for
bit. Rows go to ``--out`` with their provenance; a table is printed last.

    PYTHONPATH=. python3 experiments/role_split/run.py --out=rows.jsonl
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import harness
from experiments.role_split import kernel

FLAGS = flags.FLAGS
flags.DEFINE_float("cache_gib", 8.0, "GiB of fp32 the read role streams.")
flags.DEFINE_integer("columns", 256, "Columns C of the streamed array (its rows follow).")
flags.DEFINE_integer("rows", 86016, "Product rows M (about 96 slots x 2 frames x 441 steps).")
flags.DEFINE_integer("k", 384, "Contracted size K (the codec's last stage: C = 384).")
flags.DEFINE_integer("f", 1536, "Product columns F (4C).")
flags.DEFINE_integer("block_n", 32, "Rows of a read tile.")
flags.DEFINE_integer("read_steps", 32, "Tiles one read program streams.")
flags.DEFINE_integer("block_m", 128, "Product tile rows.")
flags.DEFINE_integer("block_f", 32, "Product tile columns.")
flags.DEFINE_integer("block_k", 32, "Product K step.")
flags.DEFINE_integer("num_warps", 8, "Triton warps a program.")
flags.DEFINE_integer("num_stages", 3, "Triton pipelining stages.")
flags.DEFINE_integer("calls", 10, "Timed calls per timing (median), after 2 warm-up calls.")
flags.DEFINE_bool("interpret", False, "The Pallas interpreter (a CPU check of the script).")
flags.DEFINE_string("label", "default", "The run's name.")
flags.DEFINE_string("out", None, "JSON-lines output file (appended).")


def measure(blocks: kernel.Blocks) -> dict:
    C = FLAGS.columns
    per = blocks.block_n * blocks.read_steps
    N = max(per, int(FLAGS.cache_gib * 2**30 / (4 * C)) // per * per)
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    cache = jax.random.normal(k0, (N, C), jnp.float32)
    x = jax.random.normal(k1, (FLAGS.rows, FLAGS.k), jnp.float32)
    w = jax.random.normal(k2, (FLAGS.k, FLAGS.f), jnp.float32) / np.sqrt(FLAGS.k)
    roles = functools.partial(kernel.two_roles, blocks=blocks, interpret=FLAGS.interpret)
    programs = {
        "read": jax.jit(lambda c: roles(c, None, None)[0]),
        "product": jax.jit(lambda x, w: roles(None, x, w)[1]),
        "xla_product": jax.jit(lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)),
        "serial": jax.jit(lambda c, x, w: (roles(c, None, None)[0], roles(None, x, w)[1])),
        **{o: jax.jit(functools.partial(roles, order=o)) for o in kernel.ORDERS},
    }
    args = {"read": (cache,), "product": (x, w), "xla_product": (x, w)}
    ms, outs = {}, {}
    for name, fn in programs.items():
        a = args.get(name, (cache, x, w))
        outs[name] = fn(*a)
        ms[name] = harness.time_call(lambda fn=fn, a=a: fn(*a), calls=FLAGS.calls)
    alone = (outs["read"], outs["product"])
    same = {
        o: all(bool(jnp.array_equal(u, v)) for u, v in zip(outs[o], alone, strict=True))
        for o in kernel.ORDERS
    }
    err = float(jnp.max(jnp.abs(outs["product"] - outs["xla_product"])))
    shorter = min(ms["read"], ms["product"])
    flops = 2 * FLAGS.rows * FLAGS.k * FLAGS.f
    return {
        "label": FLAGS.label,
        "cache_gib": round(N * C * 4 / 2**30, 3),
        "rows": FLAGS.rows,
        "k": FLAGS.k,
        "f": FLAGS.f,
        "blocks": blocks.__dict__,
        **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
        "read_tbps": round(N * C * 4 / ms["read"] / 1e9, 3),
        "product_tflops": round(flops / ms["product"] / 1e9, 2),
        "xla_product_tflops": round(flops / ms["xla_product"] / 1e9, 2),
        **{f"hidden_{o}": round((ms["serial"] - ms[o]) / shorter, 3) for o in kernel.ORDERS},
        **{f"same_{o}": same[o] for o in kernel.ORDERS},
        "product_vs_xla_max_abs": err,
    }


def main(argv):
    del argv
    blocks = kernel.Blocks(
        block_n=FLAGS.block_n, read_steps=FLAGS.read_steps, block_m=FLAGS.block_m,
        block_f=FLAGS.block_f, block_k=FLAGS.block_k, num_warps=FLAGS.num_warps,
        num_stages=FLAGS.num_stages,
    )  # fmt: skip
    r = harness.RowLog(FLAGS.out).write(measure(blocks))
    print("| label | read ms (TB/s) | product ms (TFLOP/s) | XLA product ms (TFLOP/s) | serial ms "
          "| blocked ms (hidden) | interleaved ms (hidden) | same |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {r['label']} | {r['read_ms']:.2f} ({r['read_tbps']:.2f}) | {r['product_ms']:.2f} "
        f"({r['product_tflops']:.1f}) | {r['xla_product_ms']:.2f} ({r['xla_product_tflops']:.1f}) "
        f"| {r['serial_ms']:.2f} | {r['blocked_ms']:.2f} ({r['hidden_blocked']:.2f}) | "
        f"{r['interleaved_ms']:.2f} ({r['hidden_interleaved']:.2f}) | "
        f"{r['same_blocked'] and r['same_interleaved']} |"
    )


if __name__ == "__main__":
    app.run(main)
