"""Where each millisecond of a beat goes: serving latency, whole-tick device time and every
component against its byte floor, for several slot counts, in one process. See README.md.

Per slot count B (one engine, the state allocated once): (1) the real-time server for each loop in
``--loops`` (``experiments/beat_latency``'s ``measure``: p50/p99/max, misses, memory); (2) the
dispatch tick's device time back to back; (3) admission; (4) every component alone on the
engine's own state (``components.profile``, which consumes the state). Rows go to ``--out`` as JSON
lines as they are measured, each with its provenance (``experiments.harness``); a short table is
printed last.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from absl import app, flags

from experiments import harness
from experiments.beat_latency import run as beat_latency
from experiments.beat_profile import components
from voicechat_jax import config as config_lib
from voicechat_jax.precision import Precision

FLAGS = flags.FLAGS
flags.DEFINE_list("slots", ["1", "16", "32", "56", "112"], "Slot counts (sessions = slots).")
flags.DEFINE_integer("repeats", 10, "Timed calls per component (median).")
flags.DEFINE_integer("tick_repeats", 10, "Back-to-back ticks timed for the device tick time.")
flags.DEFINE_list("serve_slots", ["16", "32", "56", "112"], "Slot counts also served on the clock.")


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = Precision.reference()
    params = harness.random_params(cfg, precision, FLAGS.model)
    copy = components.device_copy_tbps(gib=4.0 if jax.default_backend() == "gpu" else 0.25)
    beat_latency.write_row({"kind": "copy", "tbps": copy})
    template = None
    served, profiles = [], []
    for B in (int(x) for x in FLAGS.slots):
        try:
            engine = beat_latency.make_engine(params, cfg, precision, B, template)
        except Exception as e:  # a slot count that does not fit is a result, not a crash
            beat_latency.write_row(
                {"kind": "error", "slots": B, "error": str(e).splitlines()[0][:300]}
            )
            continue
        template = engine.template
        if str(B) in FLAGS.serve_slots:
            for loop in FLAGS.loops:
                row = beat_latency.measure(engine, loop) | {"kind": "serve"}
                served.append(beat_latency.write_row(row))
        engine.compile_tick()
        ticks = harness.tick_ms(engine, FLAGS.tick_repeats, warmup=2).tolist()
        tick_ms = float(np.median(ticks)) / engine.serve.frames_per_tick
        beat_latency.write_row(
            {"kind": "tick", "slots": B, "ms_per_frame_step": tick_ms, "ms": ticks}
        )
        rows = [
            components.admission_ms(engine, repeats=FLAGS.repeats),
            components.reseed_ms(engine, repeats=FLAGS.repeats),
        ]
        rows += components.profile(engine, repeats=FLAGS.repeats)
        for r in rows:
            d = {"kind": "component", **r.__dict__, "tbps": r.tbps, "copy_tbps": copy}
            d["share"] = r.ms / tick_ms
            beat_latency.write_row(d)
        profiles.append((B, tick_ms, rows))
        del engine
    if served:
        beat_latency.print_table(served)
    print(f"device copy {copy:.2f} TB/s")
    for B, tick_ms, rows in profiles:
        total = sum(r.ms for r in rows)
        print(f"B={B}: tick {tick_ms:.2f} ms per frame-step, components sum {total:.2f} ms")
        for r in rows:
            print(
                f"  {r.component:44} {r.ms:8.3f} ms {r.bytes / 1e9:8.3f} GB "
                f"{r.tbps:5.2f} TB/s {100 * r.ms / tick_ms:5.1f} %"
            )


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
