"""Pallas kernels compiled for sm_90a on a machine without a GPU, and what Triton made of them.

Shared by the experiments' compile checks (``experiments/decode_attention/ptx_check.py``,
``experiments/attention_product/ptx_check.py``): jax lowers a jitted call for the ``cuda``
platform without a device (``.trace(...).lower(lowering_platforms=("cuda",))``); the Triton
module that Pallas builds is captured as text (by wrapping ``lower_jaxpr_to_triton_module``, a jax
internal: this may need a change when jax moves it), compiled by the ``triton`` Python package
(torch's dependency) for ``cuda:90`` and assembled by the first ``ptxas`` that accepts its PTX
(``-v`` reports registers and spills). The Triton that compiles here is the pip package's, not
the one inside the GPU machine's jaxlib, so the numbers describe a kernel's structure, not its
speed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import subprocess

import jax

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
