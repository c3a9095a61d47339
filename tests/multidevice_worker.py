"""Every check of the suite that needs a fake 4-device CPU mesh, in one process.

The device count of a JAX process is fixed when its backend starts, so ``tests/test_mesh.py``
starts this module once, with ``--xla_force_host_platform_device_count=4``, and asserts on what it
writes under ``OUT_DIR``:

- ``mesh/``: the slot axis over a 4-device ``data`` mesh (``tests/mesh_worker.py``);
- ``restore/``: a converted checkpoint restored onto the mesh (``--checkpoint``);
- ``tp/``: tensor parallelism of the LLM over a ``model`` axis (``tests/tp_worker.py``);
- ``serve/d1``, ``serve/d4``: the run ``voicechat-serve --devices=N`` makes (``runner.run``) with
  one device and with four, the same sessions;
- ``flags.json``: ``voicechat-serve``'s refusals of device and model-parallel flags it cannot
  serve here (``cli.serve.main`` called with each flag set, exit status and stderr).

    python -m tests.multidevice_worker OUT_DIR [--checkpoint DIR] [--serve_flags JSON]

One process instead of one per check: the suite paid the interpreter, JAX's start, the tiny
model's init and the shared programs' compiles once per worker, five times over.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time

import jax

from tests import mesh_worker, tp_worker

DEVICES = mesh_worker.DEVICES
SERVE_SESSIONS = 4


def serve_runs(out_dir: str) -> None:
    """``voicechat-serve --devices=N`` for N = 1 and 4 in the mesh checks' configuration
    (``mesh_worker.SERVE``: 8 slots, 2 per device, fp32, a 64-frame cap, NeMo's sampler): 4
    sessions, 2 joining late and leaving early (churn), 5 beats on the offline clock. Run after
    the mesh checks, so that both runs serve the programs those compiled
    (``step.PROGRAMS_KEPT``)."""
    from voicechat_jax.serving import runner

    for n in (1, DEVICES):
        options = runner.RunOptions(
            serve=mesh_worker.SERVE,
            sessions=SERVE_SESSIONS,
            churn=True,
            seconds=0.8,
            clock="offline",
            devices=n,
            loop="dispatch",  # one loop for both counts (auto picks resident on one device)
            output_dir=os.path.join(out_dir, f"d{n}"),
        )
        os.makedirs(options.output_dir, exist_ok=True)
        result = runner.run(options)
        if result.failed:
            raise SystemExit(f"--devices={n}: {result.failed} session(s) failed")


def serve_flags(out_path: str, cases: list[list[str]]) -> None:
    """``cli.serve.main`` with each case's flags: its exit status and what it wrote on stderr."""
    from voicechat_jax.cli import serve

    rows = []
    for argv in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = serve.main(serve._parse_flags(["voicechat-serve", *argv]))
            except SystemExit as e:  # a refusal: its status, its line on stderr
                code = e.code
        rows.append({"argv": argv, "code": code, "stderr": err.getvalue()})
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--serve_flags", default="[]", help="JSON: a list of argv lists")
    args = parser.parse_args()
    if len(jax.devices()) != DEVICES:
        raise SystemExit(f"expected {DEVICES} CPU devices, got {len(jax.devices())}")
    out = {name: os.path.join(args.out_dir, name) for name in ("mesh", "restore", "tp", "serve")}
    for path in out.values():
        os.makedirs(path, exist_ok=True)
    steps = [
        ("flags", lambda: serve_flags(os.path.join(args.out_dir, "flags.json"),
                                      json.loads(args.serve_flags))),
        ("mesh", lambda: mesh_worker.engine_checks(out["mesh"])),
        ("restore", lambda: args.checkpoint
         and mesh_worker.restore_checks(out["restore"], args.checkpoint)),
        ("tp", lambda: tp_worker.run(out["tp"])),
        ("serve", lambda: serve_runs(out["serve"])),
    ]  # fmt: skip
    seconds = {}
    for name, step in steps:
        t = time.perf_counter()
        step()
        seconds[name] = round(time.perf_counter() - t, 2)
    with open(os.path.join(args.out_dir, "seconds.json"), "w") as f:
        json.dump(seconds, f)


if __name__ == "__main__":
    main()
