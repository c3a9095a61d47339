"""What the host spends inside the tick's call (the host timeline's ``dispatch`` stage), taken
apart. See README.md.

For one engine of ``--slots`` slots, every slot live (the model, kernels and cap come from
``experiments/beat_latency``'s flags), rows to ``--out`` as JSON lines, each with its provenance
(``experiments.harness``):

1. ``program``: the argument leaves of the tick (params, state, template, beat) and, as a proxy for
   its kernel launches, the fusions and custom calls in its optimized HLO (a loop's body counted
   once);
2. ``tick``: ``--ticks`` plain beats (beat_latency's flag), each waited for before the next.
   Host ms until the compiled tick's call returns and until its output is ready; the same for
   ``Engine.tick`` (which adds the host's mirror and the dispatch of admissions and roll-overs:
   none on plain beats);
3. ``synthetic``: a jitted program over N small argument arrays (N in ``--leaves``) that reads one
   of them: the host ms of its call, the per-argument cost of a call apart from any model.

XLA flags are read once per process: run once per variant (say, with command buffers) with
``XLA_FLAGS`` set and ``--label`` naming it.
"""

from __future__ import annotations

import os
import re
import time

import jax
import numpy as np
from absl import app, flags

from experiments import harness
from experiments.beat_latency import run as beat_latency
from voicechat_jax import config as config_lib
from voicechat_jax import state as state_lib
from voicechat_jax.precision import policy

FLAGS = flags.FLAGS
flags.DEFINE_integer("slots", 16, "Slots, every one live.")
flags.DEFINE_string("policy", "reference", "Precision policy (voicechat_jax.precision).")
flags.DEFINE_list("leaves", ["1", "100", "1000", "3000"], "Argument counts of the synthetic call.")
flags.DEFINE_integer("synthetic_calls", 200, "Calls timed per synthetic argument count.")
flags.DEFINE_string("label", "default", "Names the variant (the XLA_FLAGS of this process).")


def _stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"p50": float(np.median(a)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def launches(compiled) -> dict:
    """Fusions and custom calls in the optimized HLO: a lower bound on kernels per execution
    (loop bodies are counted once, library calls and copies not at all)."""
    text = compiled.as_text()
    return {
        "fusions": len(re.findall(r"= [^=]*\bfusion\(", text)),
        "custom_calls": len(re.findall(r"\bcustom-call\(", text)),
        "whiles": len(re.findall(r"\bwhile\(", text)),
    }


def time_tick(engine, program, ticks: int) -> dict:
    """Host ms of the compiled tick ``program``'s call and of ``Engine.tick``, each beat waited
    for."""
    engine.reset()
    beat = engine.empty_beat()
    beat.admit[:] = True
    jax.block_until_ready(engine.tick(beat))  # every slot live
    plain = engine.empty_beat()
    masks = state_lib.masks_of(plain)  # every slot live with room: what the rule decides
    raw_call, raw_ready, call, ready = [], [], [], []
    for _ in range(ticks):
        state = engine.state
        engine.state = None
        t0 = time.perf_counter()
        state, out = program(engine.params, state, engine.template, plain, masks)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        engine.state = state
        raw_call.append(1e3 * (t1 - t0))
        raw_ready.append(1e3 * (t2 - t0))
    for _ in range(ticks):
        t0 = time.perf_counter()
        out = engine.tick(plain)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        call.append(1e3 * (t1 - t0))
        ready.append(1e3 * (t2 - t0))
    return {
        "program_call_ms": _stats(raw_call),
        "program_ready_ms": _stats(raw_ready),
        "engine_call_ms": _stats(call),
        "engine_ready_ms": _stats(ready),
    }


def time_synthetic(n: int, calls: int) -> dict:
    """Host ms of a call of a program with n small arguments, one of them read."""
    xs = [jax.device_put(np.full((16,), i, np.float32)) for i in range(n)]
    f = jax.jit(lambda xs: xs[0] + 1.0, keep_unused=True)
    jax.block_until_ready(f(xs))
    call, ready = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = f(xs)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        call.append(1e3 * (t1 - t0))
        ready.append(1e3 * (time.perf_counter() - t0))
    return {"args": n, "call_ms": _stats(call), "ready_ms": _stats(ready)}


def main(argv):
    del argv
    base = {"label": FLAGS.label, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    rows = []
    for n in (int(x) for x in FLAGS.leaves):
        row = base | {"kind": "synthetic"} | time_synthetic(n, FLAGS.synthetic_calls)
        rows.append(beat_latency.write_row(row))
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = policy(FLAGS.policy)
    params = harness.random_params(cfg, precision, FLAGS.model)
    engine = beat_latency.make_engine(params, cfg, precision, FLAGS.slots)
    program = engine.stages.tick if engine.staged else engine.compile_tick()
    leaves = {
        "params": len(jax.tree.leaves(engine.params)),
        "state": len(jax.tree.leaves(engine.state)),
        "template": len(jax.tree.leaves(engine.template)),
        "beat": len(jax.tree.leaves(engine.empty_beat())),
    }
    row = (
        base
        | {"kind": "program", "model": FLAGS.model, "slots": FLAGS.slots, "staged": engine.staged}
        | {"leaves": leaves, "compile_s": engine.compile_s}
        | launches(program)
    )
    rows.append(beat_latency.write_row(row))
    timed = time_tick(engine, program, FLAGS.ticks)
    rows.append(beat_latency.write_row(base | {"kind": "tick", "slots": FLAGS.slots} | timed))

    print(f"{FLAGS.label} on {rows[0]['device']} (XLA_FLAGS={base['xla_flags'] or 'none'})")
    for r in rows:
        if r["kind"] == "synthetic":
            c = r["call_ms"]
            print(f"synthetic {r['args']:>5} args: call p50 {c['p50']:.3f} ms, p99 {c['p99']:.3f}")
    p = rows[-2]
    print(
        f"{FLAGS.model} tick, {FLAGS.slots} slots: {sum(p['leaves'].values())} argument leaves "
        f"{p['leaves']}, {p['fusions']} fusions, {p['custom_calls']} custom calls"
    )
    t = rows[-1]
    for what in ("program_call_ms", "program_ready_ms", "engine_call_ms", "engine_ready_ms"):
        s = t[what]
        print(f"{what:18} p50 {s['p50']:8.2f}  p99 {s['p99']:8.2f}  max {s['max']:8.2f}")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    app.run(main)
