"""Live calls per GPU at the two-minute cap: the real-time server per precision policy, and the
batch-1 baseline of a request server. See README.md.

For each policy in ``--policies`` and each session count in ``--sessions`` (slots = sessions, every
session live for the whole run): the dispatch tick's device time back to back (``--probe_ticks``),
then, unless that probe already misses the beat at its median, the real-time server for
``--ticks`` beats per loop in ``--loops``. A point holds when it has zero missed ticks; the
capacity of a policy is its largest holding session count. The batch-1 baseline advances one
session alone per call (a 1-slot engine, one state per session, one call after another within a
beat) and reports how many such calls fit in a beat at their p99.

Every attention in the XLA path reads its whole cache whatever the fill, so these rows are the
worst case of a full two-minute context on every tick. Rows go to ``--out`` as JSON lines as they
are measured, each with its provenance (``experiments.harness``).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from absl import app, flags

from experiments import harness
from experiments.beat_latency import run as beat_latency
from voicechat_jax import config as config_lib
from voicechat_jax.engine import byte_floor_ms
from voicechat_jax.precision import CODEC_MATMUL, policy

FLAGS = flags.FLAGS
flags.DEFINE_list("policies", ["reference"], "Precision policies (voicechat_jax.precision).")
flags.DEFINE_integer(
    "probe_ticks", 20, "Back-to-back ticks timed before serving a point.", lower_bound=1
)
flags.DEFINE_integer("baseline_ticks", 200, "Ticks timed for the batch-1 baseline (0: skip).")
flags.DEFINE_enum(
    "codec_matmul",
    None,
    list(CODEC_MATMUL),
    "The codec decoder's products (Precision.codec_matmul) in every policy (default: its own).",
)


def baseline(params, cfg, precision, template, ticks: int) -> dict:
    """A request server's way: one session per call. The 1-slot tick's time decides the count."""
    engine = beat_latency.make_engine(params, cfg, precision, 1, template)
    engine.compile_tick()
    times = harness.tick_ms(engine, ticks, warmup=0)
    period = engine.serve.beat_ms
    p99 = float(np.percentile(times, 99))
    return {
        "kind": "baseline",
        **engine.kernels.row(),
        "ms_p50": float(np.median(times)),
        "ms_p99": p99,
        "sessions_held": int(period // p99),
    }


def main(argv):
    del argv
    cfg = config_lib.PRESETS[FLAGS.model]()
    rows = []
    for name in FLAGS.policies:
        precision = policy(name)
        if FLAGS.codec_matmul:
            precision = dataclasses.replace(precision, codec_matmul=FLAGS.codec_matmul)
        tag = {  # every row of this policy says which configuration it measured
            "policy": name,
            "codec_matmul": precision.codec_matmul,
            "hold_full": FLAGS.hold_full,
        }
        params = harness.random_params(cfg, precision, FLAGS.model)
        template = None
        if FLAGS.baseline_ticks:
            template = beat_latency.make_engine(params, cfg, precision, 1).template
            row = baseline(params, cfg, precision, template, FLAGS.baseline_ticks)
            rows.append(beat_latency.write_row(row | tag))
        for n in (int(x) for x in FLAGS.sessions):
            try:
                engine = beat_latency.make_engine(params, cfg, precision, n, template)
            except Exception as e:  # a count that does not fit is a result
                kernels = beat_latency.serve_config(precision, n).kernels().row()
                beat_latency.write_row(
                    {"kind": "error", **tag, **kernels, "sessions": n, "error": str(e)[:300]}
                )
                continue
            template = engine.template
            engine.compile_tick()
            times = harness.tick_ms(engine, FLAGS.probe_ticks, warmup=0)
            beat_ms = float(np.median(times))
            # Two frame-steps at 3.7 TB/s; a slot's bytes from its state under this policy.
            floor_ms = byte_floor_ms(params, engine.template, n)
            point = {
                "kind": "probe",
                **tag,
                **engine.kernels.row(),
                "sessions": n,
                "tick_ms_p50": beat_ms,
                "tick_ms_max": float(times.max()),
                "floor_ms": floor_ms,
                "gpu_s_per_conversation_hour_busy": 3600.0 * beat_ms / engine.serve.beat_ms / n,
                "gpu_s_per_conversation_hour_reserved": 3600.0 / n,
            }
            rows.append(beat_latency.write_row(point))
            if beat_ms >= engine.serve.beat_ms:
                del engine
                continue  # it cannot hold at its median: no need to serve it
            for loop in FLAGS.loops:
                row = beat_latency.measure(engine, loop) | {"kind": "serve", **tag}
                rows.append(beat_latency.write_row(row))
            engine.state = None
            del engine
        del params, template
    served = [r for r in rows if r["kind"] == "serve"]
    if served:
        beat_latency.print_table(served)
    for name in FLAGS.policies:
        held = [r["sessions"] for r in served if r["policy"] == name and r["missed_ticks"] == 0]
        base = [r for r in rows if r["kind"] == "baseline" and r["policy"] == name]
        print(
            f"{name}: capacity {max(held) if held else 0} sessions with zero misses"
            + (f"; batch-1 baseline holds {base[0]['sessions_held']}" if base else "")
        )


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
