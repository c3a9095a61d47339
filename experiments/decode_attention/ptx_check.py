"""Compile the decode-attention kernels for sm_90a on a machine without a GPU, and read the result.

What a kernel costs on the H200 is measured by ``run.py`` on the H200. This script answers the
questions that come before, on any machine: does the kernel lower through Pallas's Triton
lowering at the 11B shapes, and what does Triton make of it: registers per thread (which bound
how many programs an SM holds, so how many bytes are in flight), spills, shared memory, layout
conversions inside the row loop (each one a round trip through shared memory with barriers), and
the width of the global loads.

How: ``experiments.ptx`` (the Triton module Pallas builds, lowered for ``cuda`` without a device,
compiled by the pip ``triton`` for ``cuda:90`` and assembled by ``ptxas``): the numbers describe
the kernel's structure, not its speed.

Rows (one per kernel and tiling) go to ``--out`` as JSON lines as they come, each with its
provenance (``experiments.harness``: ``device`` is this machine's, the target is ``target``); a
table is printed last.
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from experiments import harness
from experiments.ptx import compile_sm90, triton_module
from pallas_kernels.decode_attention import DecodeAttentionBlocks, decode_attention
from pallas_kernels.mha_decode_attention import MHABlocks, mha_decode_attention
from voicechat_jax import config as config_lib

FLAGS = flags.FLAGS
flags.DEFINE_integer("slots", 56, "Sessions (2 CFG rows each).")
flags.DEFINE_list("kv", ["float32", "bfloat16"], "Speech-decoder cache dtypes.")
flags.DEFINE_list(
    "mha_blocks",
    [
        "64:1:auto:4",
        "32:1:auto:4",
        "32:2:auto:4",
        "128:1:auto:8",
        "2:32:auto:4",
        "64:1:one:4",
        "64:1:auto:4:w16",
        "32:1:auto:4:w16",
        "64:1:auto:4:w128",
        "32:1:auto:4:w128",
    ],
    "G = 1 kernel tilings (MHABlocks.label()'s block_s:heads:split:num_warps[:sN][:wN]).",
)
flags.DEFINE_bool("gqa", True, "Also compile the grouped-query kernel at G = 1 (default tiling).")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")


def main(argv):
    del argv
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    tts = config_lib.voicechat_11b().tts
    Bsz, K, H = 2 * FLAGS.slots, tts.n_kv_heads, tts.head_dim
    S = tts.prompt_frames + config_lib.ServeConfig().context_frames
    scale = tts.query_pre_attn_scalar**-0.5
    import triton

    base = {"triton": triton.__version__, "target": "cuda:90 (sm_90a)"}
    log = harness.RowLog(FLAGS.out)
    with tempfile.TemporaryDirectory() as workdir:
        for kv in FLAGS.kv:
            args = (
                jax.ShapeDtypeStruct((Bsz, K, 1, H), jnp.float32),
                jax.ShapeDtypeStruct((Bsz, K, S, H), jnp.dtype(kv)),
                jax.ShapeDtypeStruct((Bsz, K, S, H), jnp.dtype(kv)),
                jax.ShapeDtypeStruct((Bsz,), jnp.int32),
            )
            plans = [("mha", spec) for spec in FLAGS.mha_blocks]
            if FLAGS.gqa:
                plans.append(("gqa", "default"))
            for kernel, spec in plans:
                if kernel == "mha":
                    blocks = MHABlocks.parse(spec)
                    warps, stages, label = blocks.num_warps, blocks.num_stages, blocks.label()

                    def fn(q, k, v, n, blocks=blocks):
                        return mha_decode_attention(q, k, v, n, scale=scale, blocks=blocks)
                else:
                    gqa = DecodeAttentionBlocks()
                    warps, stages = gqa.num_warps, gqa.num_stages
                    label = f"{gqa.block_s}:{gqa.split_s}:{gqa.num_warps}"

                    def fn(q, k, v, n):
                        return decode_attention(q, k, v, n, scale=scale)

                row = dict(base, kernel=kernel, blocks=label, kv_dtype=kv, B=Bsz, S=S)
                try:
                    ttir = triton_module(fn, *args)
                    row.update(compile_sm90(ttir, warps, stages, workdir))
                except Exception as e:  # recorded, and the sweep goes on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                logging.info("%s", row)
                log.write(row)
    print(
        f"sm_90a compile check, speech decoder G = 1, {FLAGS.slots} slots, S {S}, H {H} "
        "(structure only, no timing)"
    )
    print(
        f"{'kernel':>6} {'blocks':>14} {'kv':>8} {'regs':>5} {'spill':>5} {'smem':>6} "
        f"{'loop cvt':>8}  loads"
    )
    for r in log.rows:
        start = f"{r['kernel']:>6} {r['blocks']:>14} {r['kv_dtype']:>8}"
        if "error" in r:
            print(f"{start}  {r['error']}")
            continue
        loads = " ".join(
            f"{op.removeprefix('ld.global.')}x{n}" for op, n in r["global_loads"].items()
        )
        print(
            f"{start} {r['registers']:>5} {r['spill_store_bytes']:>5} {r['shared_bytes']:>6} "
            f"{r['loop_layout_conversions']:>8}  {loads}"
        )


if __name__ == "__main__":
    app.run(main)
