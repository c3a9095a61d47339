"""The host's beat preparation alone: ``Server.prepare`` at N live sessions, no tick run.

For each count in ``--sessions``: a tiny engine of that many slots (``at_cap=memory``, so the
roll-over policy runs), every slot taken by a scripted session of random audio, and
``Server.prepare(k)`` called for ``--beats`` beats back to back (the first ``--skip`` left out):
membership, the scripted sessions' audio checked and queued, the schedule, one beat of audio per
slot taken, the roll-over policy. It is the work ``voicechat-serve`` does on the beat thread
between a tick's start and its dispatch; what the device does is not in it. One row per count
(``experiments.harness``: commit, device, jax version, command).

    PYTHONPATH=. python3 experiments/host_path/run.py --sessions=32,64,96 --out=rows.jsonl
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from experiments import harness
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving.server import Server, SessionPlan

FLAGS = flags.FLAGS
flags.DEFINE_list("sessions", ["32", "64", "96"], "Live sessions (slots = sessions).")
flags.DEFINE_integer("beats", 300, "Beats prepared per count.")
flags.DEFINE_integer("skip", 5, "First beats left out.")
flags.DEFINE_integer("context_frames", 1500, "The context cap.")
flags.DEFINE_string("out", None, "Rows (JSON lines), appended.")


def main(argv):
    del argv
    import jax

    rows = harness.RowLog(FLAGS.out)
    precision = Precision.fp32()
    cfg = tiny()
    params = voicechat.init_compiled(jax.random.key(0), cfg, precision, serving=True)
    rng = np.random.default_rng(0)
    for n in (int(x) for x in FLAGS.sessions):
        serve = ServeConfig(slots=n, context_frames=FLAGS.context_frames, precision=precision,
                            at_cap="memory")  # fmt: skip
        engine = Engine(params, cfg, serve)
        seconds = FLAGS.beats * serve.beat_ms / 1000 + 1
        audio = (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)
        plans = [SessionPlan(id=f"s{i:03d}", audio=audio) for i in range(n)]
        server = Server(engine, clock="offline", loop="dispatch", keep_outputs=False)
        server.planner.load(plans)
        ms = []
        for k in range(FLAGS.beats):
            t = time.perf_counter()
            server.prepare(k)
            ms.append(1e3 * (time.perf_counter() - t))
        ms = np.asarray(ms[FLAGS.skip :])
        row = rows.write({
            "kind": "prepare", "sessions": n, "beats": int(ms.size),
            "context_frames": FLAGS.context_frames, "p50_ms": float(np.median(ms)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
        })  # fmt: skip
        print(f"{n:4d} sessions: prepare p50 {row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} "
              f"max {row['max_ms']:.2f} ms over {row['beats']} beats")  # fmt: skip
        del server, engine


if __name__ == "__main__":
    app.run(main)
