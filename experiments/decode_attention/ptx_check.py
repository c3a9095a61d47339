"""Compile the decode-attention kernels for sm_90a on a machine without a GPU, and read the result.

What a kernel costs on the H200 is measured by ``run.py`` on the H200. This script answers the
questions that come before, on any machine: does the kernel lower through Pallas's Triton
lowering at the 11B shapes, and what does Triton make of it: registers per thread (which bound
how many programs an SM holds, so how many bytes are in flight), spills, shared memory, layout
conversions inside the row loop (each one a round trip through shared memory with barriers), and
the width of the global loads.

How: jax lowers the jitted call for the ``cuda`` platform without a device
(``.trace(...).lower(lowering_platforms=("cuda",))``); the Triton module that Pallas builds is
captured as text (by wrapping ``lower_jaxpr_to_triton_module``, a jax internal: this script may
need a change when jax moves it), compiled by the ``triton`` Python package (torch's dependency)
for ``cuda:90`` and assembled by the first ``ptxas`` that accepts its PTX (``-v`` reports
registers and spills). The Triton that compiles here is the pip package's, not the one inside the
GPU machine's jaxlib, so the numbers describe the kernel's structure, not its speed.

Rows (one per kernel and tiling) go to ``--out`` as JSON lines as they come, each with its
provenance (``experiments.harness``: ``device`` is this machine's, the target is ``target``); a
table is printed last.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from experiments import harness
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

_CAPTURED: list[str] = []


@contextlib.contextmanager
def _capture_triton_modules():
    """Record the text of every Triton module Pallas builds while lowering."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    original = reg.lowering.lower_jaxpr_to_triton_module

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        _CAPTURED.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = wrapped
    try:
        yield
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original


def triton_module(fn, *args) -> str:
    """The one Triton module of ``jit(fn)(*args)`` lowered for CUDA (args: ShapeDtypeStructs)."""
    _CAPTURED.clear()
    with _capture_triton_modules():
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    if len(_CAPTURED) != 1:
        raise RuntimeError(f"expected one Triton module, got {len(_CAPTURED)}")
    return _CAPTURED[0]


def _ptxas_candidates() -> list[str]:
    import triton

    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = sorted(glob.glob(os.path.join(here, "ptxas*")), reverse=True)  # -blackwell first
    return [*found, "ptxas"]


def compile_sm90(ttir: str, num_warps: int, num_stages: int, workdir: str) -> dict:
    """Compile Triton IR text for sm_90a; registers, spills, shared memory, loop conversions."""
    import triton
    from triton.backends.compiler import GPUTarget

    # jaxlib's Triton prints the eviction policy as a keyword; pip triton parses the attribute.
    ttir = re.sub(r" evictionPolicy = evict_first", " {evictionPolicy = 2 : i32}", ttir)
    ttir = re.sub(r" evictionPolicy = evict_last", " {evictionPolicy = 3 : i32}", ttir)
    path = os.path.join(workdir, "kernel.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    kernel = triton.compile(
        path,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    ptx_path = os.path.join(workdir, "kernel.ptx")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    info = None
    for ptxas in _ptxas_candidates():
        cmd = [ptxas, "-v", "--gpu-name", "sm_90a", ptx_path, "-o", ptx_path + ".cubin"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            continue
        if done.returncode == 0:
            info = done.stderr
            break
    if info is None:
        raise RuntimeError("no ptxas accepted the PTX")
    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    loop = ttgir[ttgir.find("scf.for") :]
    loop = loop[: loop.find("scf.yield")]
    loads: dict[str, int] = {}
    for op in re.findall(r"ld\.global[\w.:]*", ptx):
        loads[op] = loads.get(op, 0) + 1
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spill.group(1)) if spill else None,
        "shared_bytes": kernel.metadata.shared,
        "loop_layout_conversions": loop.count("convert_layout"),
        "loop_barriers_ttgir": loop.count("gpu.barrier") + loop.count("local_alloc"),
        "bar_sync_ptx": ptx.count("bar.sync"),
        "global_loads": loads,
        "ptxas": ptxas_version.strip().splitlines()[-1] if ptxas_version else ptxas,
    }


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
