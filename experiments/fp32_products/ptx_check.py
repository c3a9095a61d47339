"""Compile ``pallas_kernels.matmul``'s fp32 products for sm_90a on a machine without a GPU.

For each of the faithful tick's fp32 product shapes at ``--slots`` sessions (``shapes.py``), the
kernel under ``--precisions`` with its default tiling and, for 'tf32x3', each D step of
``--block_d`` and each row block of ``--block_r``: registers a thread, spills, shared memory,
and the matrix-unit instructions of the PTX (``wgmma`` on Hopper's warp groups, ``mma.sync``
otherwise). Compiled by the pip ``triton`` (``experiments.ptx``), not the one inside the GPU
machine's jaxlib: the numbers describe the kernels' structure, not their speed. Rows go to
``--out``; a table is printed last.

    PYTHONPATH=. python3 experiments/fp32_products/ptx_check.py --shapes=tts,codec_pw
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import harness
from experiments.fp32_products.shapes import kernel_blocks, selected, shapes
from experiments.ptx import compile_sm90, triton_module
from pallas_kernels.matmul import matmul
from voicechat_jax import config as config_lib

FLAGS = flags.FLAGS
flags.DEFINE_integer("slots", 96, "Sessions B (the speech decoder's products see 2B rows).")
flags.DEFINE_list("shapes", ["tts", "mog", "enc", "codec"], "Names or prefixes (shapes.py).")
flags.DEFINE_list("precisions", ["float32", "tf32x3"], "The kernel's fp32 precisions.")
flags.DEFINE_list("block_d", ["16"], "Extra D steps compiled for 'tf32x3' (default tiling too).")
flags.DEFINE_list("block_r", ["64"], "Extra row blocks compiled for 'tf32x3' (default D step).")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")


def main(argv):
    del argv
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cfg = config_lib.voicechat_11b()
    f32 = jnp.float32
    log, rows = harness.RowLog(FLAGS.out), []
    with tempfile.TemporaryDirectory() as workdir:
        for name, per_slot, D, F, _ in selected(shapes(cfg), FLAGS.shapes):
            R = per_slot * FLAGS.slots
            args = (jax.ShapeDtypeStruct((R, D), f32), jax.ShapeDtypeStruct((D, F), f32))
            for precision in FLAGS.precisions:
                tilings = [(None, None)]
                if precision == "tf32x3":
                    tilings += [(int(d), None) for d in FLAGS.block_d]
                    tilings += [(None, int(r)) for r in FLAGS.block_r]
                for block_d, block_r in tilings:
                    blocks = kernel_blocks(
                        R, D, F, f32, precision=precision, block_d=block_d, block_r=block_r
                    )
                    fn = functools.partial(matmul, precision=precision, blocks=blocks)
                    module = triton_module(fn, *args)
                    r = compile_sm90(module, blocks.num_warps, blocks.num_stages, workdir)
                    ptx = pathlib.Path(workdir, "kernel.ptx").read_text()
                    rows.append(log.write({
                        "shape": name, "R": R, "D": D, "F": F, "precision": precision,
                        "block_f": blocks.block_f, "block_d": blocks.block_d,
                        "split_d": blocks.split_d, "num_warps": blocks.num_warps,
                        "block_r": blocks.rows_per_block(R),
                        "registers": r["registers"], "spill_store_bytes": r["spill_store_bytes"],
                        "shared_bytes": r["shared_bytes"],
                        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                        "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
                    }))  # fmt: skip
    print("| shape | R x D x F | precision | block r / f / d / split | warps | registers | "
          "spills | shared | wgmma | mma.sync |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['R']} x {r['D']} x {r['F']} | {r['precision']} | "
              f"{r['block_r']} / {r['block_f']} / {r['block_d']} / {r['split_d']} | "
              f"{r['num_warps']} | "
              f"{r['registers']} | {r['spill_store_bytes']} | {r['shared_bytes']} | "
              f"{r['wgmma']} | {r['mma_sync']} |")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
