"""Host jitter: does the host lose beats the device finished in time? Before and after, both loops.

One row per (loop, GC policy, competing process): N sessions served on the real-time clock for
``--ticks`` beats; misses by cause (host / device), beat latency p50 / p99 / p99.9 / max over the
steady ticks, the host stages' p99, and the garbage collections seen. With ``--busy=1`` a child
process spins one core for the row's whole length (started and stopped here, and bounded by its own
deadline as well).

"Before" is the code of another checkout (git main at the commit this work started from): run this
same file with ``PYTHONPATH`` pointing at that checkout. The script notices that its ``Server`` has
no host timeline (``legacy`` rows): it then reports what that code measured (misses, skipped ticks,
latency) and counts the collections itself through ``gc.callbacks``, with the misses that had a
collection inside them. Rows are appended to ``--out`` as they are measured, each with its
provenance (``experiments.harness``, from this script's checkout: the "before" run needs it on
``PYTHONPATH`` after the code under test). See README.md beside this file.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving.server import Engine, Server, SessionPlan

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "tiny", ["tiny", "voicechat_11b"], "Model preset (random weights).")
flags.DEFINE_enum(
    "precision", None, ["reference", "fp32"], "Dtype policy (default: fp32 for tiny, reference)."
)
flags.DEFINE_integer("sessions", 8, "Sessions (= slots), all live for the whole run.")
flags.DEFINE_integer("ticks", 2000, "Beats per row (160 ms each), warm-up included.")
flags.DEFINE_integer("warmup_ticks", 10, "Ticks reported apart as warm-up.")
flags.DEFINE_integer("context_frames", 1500, "Context cap in frames.")
flags.DEFINE_enum(
    "at_cap",
    "reset",
    ["end", "rollover", "reset"],
    "At the cap: rollover and reset keep every session live (reset: the host rolls them over one "
    "a beat between the thresholds; rollover: the device, at the cap, all in the same beat).",
)
flags.DEFINE_list("loops", ["dispatch", "resident"], "Loops to measure.")
flags.DEFINE_list("gc_policies", ["slack"], "GC policies: slack (the server's), default (Python).")
flags.DEFINE_list("busy", ["0", "1"], "Rows without (0) and with (1) a process spinning one core.")
flags.DEFINE_enum(
    "ssm_kernel", "auto", [m.value for m in config_lib.SSMKernel], "Mamba-2 decode update."
)
flags.DEFINE_string("label", None, "Names the code under test in the rows (default: after/before).")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")
flags.DEFINE_string("table_from", None, "Only print the table of the rows in this file.")


def _speech(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    x = np.sin(2 * np.pi * (180 + 40 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 1.7 * t))
    return (0.3 * x + 0.03 * rng.standard_normal(n)).astype(np.float32)


def _legacy() -> bool:
    """True for a ``Server`` from before the host timeline (no GC policy, no attribution)."""
    from voicechat_jax.serving import server as server_lib

    if hasattr(server_lib, "ServerConfig"):  # options moved to ServerConfig on 2026-12-05
        return "gc_policy" not in {f.name for f in dataclasses.fields(server_lib.ServerConfig)}
    return "gc_policy" not in inspect.signature(Server.__init__).parameters


class _Collections:
    """Legacy rows: the process's collections, seen through ``gc.callbacks``."""

    def __init__(self):
        self.pauses: list[tuple[float, float, int]] = []
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.monotonic()
        else:
            self.pauses.append((self._t, time.monotonic(), info["generation"]))


def _spinner(seconds: float) -> subprocess.Popen:
    """A child process that keeps one core busy for at most ``seconds``."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n pass"
    return subprocess.Popen([sys.executable, "-c", code])


def measure(engine: Engine, loop: str, gc_policy: str, busy: bool) -> dict:
    engine.reset()
    samples = FLAGS.ticks * engine.samples_per_beat
    plans = [SessionPlan(id=f"s{i}", audio=_speech(samples, i)) for i in range(FLAGS.sessions)]
    legacy = _legacy()
    out_dir = tempfile.mkdtemp(prefix="host_jitter_")
    # After: outputs streamed to files as voicechat-serve does. Before: kept in memory (its only
    # way; it wrote files after the run, outside the timing).
    kwargs = {"gc_policy": gc_policy, "keep_outputs": False, "output_dir": out_dir}
    kwargs = {} if legacy else kwargs
    server = Server(engine, clock="realtime", loop=loop, warmup_ticks=FLAGS.warmup_ticks, **kwargs)
    watcher = _Collections()
    spinner = _spinner(FLAGS.ticks * 0.16 + 180.0) if busy else None
    load0 = os.getloadavg()[0]
    gc.callbacks.append(watcher)
    t = time.perf_counter()
    try:
        server.run(plans, FLAGS.ticks)
    finally:
        gc.callbacks.remove(watcher)
        if spinner is not None:
            spinner.terminate()
            spinner.wait()
        shutil.rmtree(out_dir, ignore_errors=True)
    wall = time.perf_counter() - t
    s = server.metrics.summary()
    lat = s["latency_ms"]
    row = {
        "code": FLAGS.label or ("before" if legacy else "after"),
        "preset": FLAGS.preset,
        "python": sys.version.split()[0],
        "loop": loop,
        "gc_policy": "python default" if legacy else gc_policy,
        "busy_core": busy,
        "sessions": FLAGS.sessions,
        "context_frames": FLAGS.context_frames,
        "at_cap": FLAGS.at_cap,
        "steady_ticks": s["ticks"],
        "p50_ms": lat["p50"],
        "p99_ms": lat["p99"],
        "p99.9_ms": lat["p99.9"],
        "max_ms": lat["max"],
        "missed_ticks": s["missed_ticks"],
        "skipped_ticks": s["ticks_skipped"],
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(wall, 1),
        "compile_s": round(next(iter(s["compile_s"].values())), 2),
    }
    if legacy:
        # Which steady misses had a collection inside [start, readable or the next tick's start].
        steady = [r for r in server.metrics.ticks if r.phase == "steady"]
        with_gc = 0
        for r in (r for r in steady if r.missed):
            end = r.readable if r.readable is not None else r.start + 0.16
            with_gc += any(a < end and b > r.start for a, b, _ in watcher.pauses)
        row["missed_with_gc_pause"] = with_gc
        row["gc_gen2"] = sum(g == 2 for *_, g in watcher.pauses)
        row["gc_max_pause_ms"] = 1e3 * max((b - a for a, b, _ in watcher.pauses), default=0.0)
    else:
        row["missed_by_cause"] = s["missed_by_cause"]
        row["skipped_by_cause"] = s["skipped_by_cause"]
        row["host_misses"] = s["missed_by_cause"]["host"] + s["skipped_by_cause"]["host"]
        row["device_misses"] = s["missed_by_cause"]["device"] + s["skipped_by_cause"]["device"]
        row["stage_p99_ms"] = {k: v["p99"] for k, v in s["host_stages_ms"].items()}
        row["stage_max_ms"] = {k: v["max"] for k, v in s["host_stages_ms"].items()}
        row["gc"] = s["gc"]
        row["gc_gen2"] = s["gc"]["policy"][2] + s["gc"]["automatic"][2]
        row["gc_max_pause_ms"] = max(s["gc"]["max_pause_ms"])
    return row


def _cell(row: dict) -> str:
    if "host_misses" in row:
        return f"{row['host_misses']:>4} {row['device_misses']:>6}"
    return f"{'n/a':>4} {'n/a':>6}"


def main(argv):
    del argv
    if FLAGS.table_from:
        with open(FLAGS.table_from) as f:
            _print_table([json.loads(line) for line in f])
        return
    cfg = config_lib.PRESETS[FLAGS.preset]()
    precision_name = FLAGS.precision or ("fp32" if FLAGS.preset == "tiny" else "reference")
    precision = Precision.fp32() if precision_name == "fp32" else Precision.reference()
    serve_kwargs = {"ssm_kernel": FLAGS.ssm_kernel, "at_cap": FLAGS.at_cap}
    serve = config_lib.ServeConfig(
        slots=FLAGS.sessions,
        context_frames=FLAGS.context_frames,
        precision=precision,
        **serve_kwargs,
    )
    t = time.perf_counter()
    params = voicechat.init_compiled(jax.random.key(0), cfg, precision, serving=True)
    jax.block_until_ready(params)
    engine = Engine(params, cfg, serve)
    logging.info("engine built in %.1f s", time.perf_counter() - t)
    log = harness.RowLog(FLAGS.out)
    policies = ["python default"] if _legacy() else FLAGS.gc_policies
    for loop in FLAGS.loops:
        for policy in policies:
            for busy in (x == "1" for x in FLAGS.busy):
                row = measure(engine, loop, policy, busy)
                row["precision"] = precision_name
                logging.info("%s", log.write(row))
    _print_table(log.rows)


def _print_table(rows: list[dict]) -> None:
    first = rows[0]
    print(
        f"{first['preset']} ({first['precision']}) on {first['device']}, jax {first['jax']}, "
        f"{first['sessions']} sessions, {first['steady_ticks']} steady ticks of 160 ms, "
        f"cap {first['context_frames']} ({first['at_cap']})"
    )
    print(
        f"{'code':8} {'loop':9} {'gc':14} {'busy':>4} {'miss':>4} {'skip':>4} {'host':>4} "
        f"{'device':>6} {'p50':>6} {'p99':>6} {'p99.9':>6} {'max':>6} {'gc2':>4} {'gcmax':>6}"
    )
    for r in rows:
        print(
            f"{r['code']:8} {r['loop']:9} {r['gc_policy']:14} {int(r['busy_core']):>4} "
            f"{r['missed_ticks']:>4} {r['skipped_ticks']:>4} {_cell(r)} {r['p50_ms']:>6.1f} "
            f"{r['p99_ms']:>6.1f} {r['p99.9_ms']:>6.1f} {r['max_ms']:>6.1f} {r['gc_gen2']:>4} "
            f"{r['gc_max_pause_ms']:>6.1f}"
        )


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    app.run(main)
