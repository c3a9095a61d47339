"""Compile the fused launch for sm_90a on a machine without a GPU: registers, spills, shared memory.

What one launch of ``attention_and_product`` costs in registers decides how many of its programs
an SM holds, so how many of the attention's bytes are in flight. This compiles, for each product
tiling, the fused launch at the 11B shapes (``--slots`` sessions, every cache row full) beside the
codec's last-stage ConvNeXt product of one frame, the product role alone, and the attention alone,
with ``experiments.ptx`` (the pip ``triton``, not the one inside
the GPU machine's jaxlib: the numbers describe the kernels' structure, not their speed). Rows go to
``--out``; a table is printed last.

    PYTHONPATH=. python3 experiments/attention_product/ptx_check.py
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import harness
from experiments.ptx import compile_sm90, triton_module
from pallas_kernels.attention_product import ProductBlocks, attention_and_product, fp32_product
from pallas_kernels.mha_decode_attention import default_blocks, mha_decode_attention
from voicechat_jax import config as config_lib

FLAGS = flags.FLAGS
flags.DEFINE_integer("slots", 96, "Sessions (2 CFG rows each; the product's rows follow).")
flags.DEFINE_list("tiles", ["64:64:32", "64:64:16", "32:64:32", "32:32:32"], "block_m:f:k.")
flags.DEFINE_list("stages", ["2", "3"], "Triton pipelining stages of each compile.")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")

KEYS = ("registers", "spill_store_bytes", "shared_bytes")


def main(argv):
    del argv
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cfg = config_lib.voicechat_11b()
    tts, codec = cfg.tts, cfg.codec
    Bsz, K, H = 2 * FLAGS.slots, tts.n_kv_heads, tts.head_dim
    S = tts.prompt_frames + config_lib.ServeConfig().context_frames
    f32 = jnp.float32
    attn = (
        jax.ShapeDtypeStruct((Bsz, K, 1, H), f32),
        jax.ShapeDtypeStruct((Bsz, K, S, H), f32),
        jax.ShapeDtypeStruct((Bsz, K, S, H), f32),
        jax.ShapeDtypeStruct((Bsz,), jnp.int32),
    )
    C = codec.base_hidden  # the last stage's channels; its rows: slots x a frame's steps
    M = FLAGS.slots * codec.samples_per_frame // codec.hop_length
    prod = (jax.ShapeDtypeStruct((M, C), f32), jax.ShapeDtypeStruct((C, 4 * C), f32))
    log, rows = harness.RowLog(FLAGS.out), []
    warps = default_blocks(f32).num_warps
    with tempfile.TemporaryDirectory() as workdir:
        for stages in (int(n) for n in FLAGS.stages):
            blocks = dataclasses.replace(default_blocks(f32), num_stages=stages)
            fn = functools.partial(mha_decode_attention, scale=1.0, blocks=blocks)
            r = compile_sm90(triton_module(fn, *attn), warps, stages, workdir)
            rows.append(log.write({"kernel": "attention", "tiles": "-", "stages": stages,
                                   **{k: r[k] for k in KEYS}}))  # fmt: skip
            for spec in FLAGS.tiles:
                tiles = ProductBlocks(*(int(n) for n in spec.split(":")))
                for kernel, fn, args in (
                    ("fused", functools.partial(attention_and_product, scale=1.0, product=tiles,
                                                num_stages=stages), (*attn, *prod)),
                    ("product", functools.partial(fp32_product, product=tiles,
                                                  num_stages=stages), prod),
                ):  # fmt: skip
                    r = compile_sm90(triton_module(fn, *args), warps, stages, workdir)
                    rows.append(log.write({"kernel": kernel, "tiles": spec, "stages": stages,
                                           "M": M, "C": C, **{k: r[k] for k in KEYS}}))  # fmt: skip
    print("| kernel | tiles (m:f:k) | stages | registers | spill bytes | shared bytes |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['tiles']} | {r['stages']} | {r['registers']} | "
              f"{r['spill_store_bytes']} | {r['shared_bytes']} |")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
