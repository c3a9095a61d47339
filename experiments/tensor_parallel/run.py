"""Beat time of the LLM tensor-parallel layouts against data parallelism on the same devices.

For each layout of ``--devices`` devices (``--layouts``: the model-axis sizes m; m = 1 is data
parallelism over all of them, ``mesh.make_mesh(n)``; m > 1 the ``(n / m, m)`` mesh of
``mesh.make_mesh(n, model_parallel=m)``) and each live-session count (``--sessions``), an
``Engine`` sized to the sessions (slots: the session count rounded up to a multiple of the
``n / m`` slot groups, every slot live) and three measurements:

- ``dispatch_ms``: host time of ``Engine.tick`` (the beat placed by slot, the call enqueued);
- ``period_ms``: ticks back to back, each beat's output fetched to the host before the next
  beat is dispatched (the time from one output on the host to the next);
- real time (``--realtime_ticks``): the unchanged ``Server`` (dispatch loop) on the real-time
  clock, its beat latency p50 / p99 and missed beats.

Plus the compiled tick's collectives and whether the layout's text tokens equal the first
layout's (same sessions, same keys and audio). Random weights. On the CPU ``--cpu_devices``
fakes the devices; they share the host's cores, so CPU rows measure overheads, never a speed-up.
Rows are appended to ``--out`` as they are measured, each with its provenance
(``experiments.harness``).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from absl import app, flags, logging

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax import engine as engine_lib
from voicechat_jax import mesh as mesh_lib
from voicechat_jax.engine import Engine
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving.server import Server, SessionPlan

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_integer("devices", 4, "Devices the layouts use (the first n local devices).")
flags.DEFINE_integer("cpu_devices", None, "Fake this many CPU devices (set before JAX starts).")
flags.DEFINE_list("layouts", ["1", "2", "4"], "Model-axis sizes m (1: data parallelism only).")
flags.DEFINE_list("sessions", ["1", "2", "4"], "Live-session counts.")
flags.DEFINE_integer("beats", 40, "Back-to-back beats per row (the first --warmup not timed).")
flags.DEFINE_integer("warmup", 5, "Beats left out of the timings.")
flags.DEFINE_integer("realtime_ticks", 100, "Beats of the real-time Server row (0: none).")
flags.DEFINE_integer("context_frames", 256, "Context cap in frames.")
flags.DEFINE_enum("precision", "reference", ["reference", "fp32"], "Precision policy.")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")
flags.DEFINE_string("label", "", "Free text stored in every row (e.g. 'CPU smoke').")


def _speech(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    x = np.sin(2 * np.pi * (180 + 40 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 1.7 * t))
    return (0.3 * x + 0.03 * rng.standard_normal(n)).astype(np.float32)


def _slots(sessions: int, groups: int) -> int:
    """The smallest slot count >= ``sessions`` that splits over ``groups`` slot groups."""
    return -(-sessions // groups) * groups


def scripted_beats(engine: Engine, sessions: int, n: int) -> list:
    """The first ``sessions`` slots join at beat 0 (keys by session), speech-like audio each beat;
    the same values for every layout (slots past ``sessions`` stay empty)."""
    samples = engine.samples_per_beat
    audio = np.stack([_speech(n * samples, s) for s in range(sessions)])
    audio = audio.reshape(sessions, n, samples)
    beats = []
    for k in range(n):
        b = engine.empty_beat()
        b.audio[:sessions] = audio[:, k]
        if k == 0:
            b.admit[:sessions] = True
            b.key[:sessions] = np.arange(2 * sessions, dtype=np.uint32).reshape(sessions, 2) + 1
        beats.append(b)
    return beats


def _stats(name: str, ms: np.ndarray) -> dict:
    return {
        f"{name}_mean": round(float(ms.mean()), 3),
        f"{name}_p50": round(float(np.percentile(ms, 50)), 3),
        f"{name}_p99": round(float(np.percentile(ms, 99)), 3),
    }


def back_to_back(engine: Engine, beats: list, sessions: int) -> tuple[dict, np.ndarray]:
    """Dispatch time and beat period with each beat's output on the host before the next."""
    engine.reset()
    dispatch, done, text = [], [], []
    for b in beats:
        t = time.perf_counter()
        out = engine.tick(b)
        dispatch.append(time.perf_counter() - t)
        out = jax.device_get(out)
        done.append(time.perf_counter())
        text.append(np.asarray(out.frames.text)[:sessions])
    w = FLAGS.warmup
    row = _stats("dispatch_ms", np.asarray(dispatch[w:]) * 1e3)
    row |= _stats("period_ms", np.diff(np.asarray(done[w:])) * 1e3)
    return row, np.stack(text)


def realtime(engine: Engine, sessions: int) -> dict:
    """The unchanged Server on the real-time clock with ``sessions`` live sessions."""
    engine.reset()
    ticks = FLAGS.realtime_ticks
    samples = ticks * engine.samples_per_beat
    plans = [SessionPlan(id=f"s{i}", audio=_speech(samples, i)) for i in range(sessions)]
    server = Server(engine, clock="realtime", loop="dispatch", warmup_ticks=FLAGS.warmup)
    server.run(plans, ticks)
    s = server.metrics.summary()
    lat = s["latency_ms"]
    return {
        "rt_steady_ticks": s["ticks"],
        "rt_p50_ms": lat["p50"],
        "rt_p99_ms": lat["p99"],
        "rt_max_ms": lat["max"],
        "rt_missed_ticks": s["missed_ticks"],
    }


def print_table(rows: list[dict]) -> None:
    r0 = rows[0]
    print(
        f"{FLAGS.model} on {FLAGS.devices} x {r0['device']} ({FLAGS.precision}), jax "
        f"{jax.__version__}, context {FLAGS.context_frames}, {FLAGS.beats} beats back to back "
        f"({FLAGS.warmup} untimed){'; ' + FLAGS.label if FLAGS.label else ''}"
    )
    print(
        f"{'layout':>14} {'sess':>4} {'slots':>5} {'disp ms':>8} {'period ms':>9} {'p99 ms':>8} "
        f"{'rt p50':>7} {'rt p99':>7} {'missed':>6} {'same':>4}  collectives"
    )
    for r in rows:
        layout = f"data {r['data']} x model {r['model_parallel']}"
        coll = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "none"
        rt = (
            f"{r['rt_p50_ms']:>7.1f} {r['rt_p99_ms']:>7.1f} {r['rt_missed_ticks']:>6}"
            if "rt_p50_ms" in r
            else f"{'-':>7} {'-':>7} {'-':>6}"
        )
        same = {True: "yes", False: "NO", None: "-"}[r["same_tokens"]]
        print(
            f"{layout:>14} {r['sessions']:>4} {r['slots']:>5} {r['dispatch_ms_mean']:>8.2f} "
            f"{r['period_ms_mean']:>9.2f} {r['period_ms_p99']:>8.2f} {rt} {same:>4}  {coll}"
        )


def main(argv):
    del argv
    if FLAGS.cpu_devices:
        jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = Precision.fp32() if FLAGS.precision == "fp32" else Precision.reference()
    n = FLAGS.devices
    t = time.perf_counter()
    params = voicechat.init_compiled(jax.random.key(0), cfg, precision, serving=True)
    base_serve = config_lib.ServeConfig(
        slots=1, frames_per_tick=2, context_frames=FLAGS.context_frames, precision=precision
    )
    template = engine_lib.build_template(params, cfg, base_serve)  # the one-device layout
    jax.block_until_ready(template)
    logging.info("random %s params and template in %.1f s", FLAGS.model, time.perf_counter() - t)
    log, reference = harness.RowLog(FLAGS.out), {}
    for m in (int(x) for x in FLAGS.layouts):
        mesh = mesh_lib.make_mesh(n) if m == 1 else mesh_lib.make_mesh(n, model_parallel=m)
        groups = n // m
        for sessions in (int(x) for x in FLAGS.sessions):
            serve = config_lib.ServeConfig(
                slots=_slots(sessions, groups),
                frames_per_tick=2,
                context_frames=FLAGS.context_frames,
                precision=precision,
            )
            t = time.perf_counter()
            engine = Engine(params, cfg, serve, template=template, mesh=mesh)
            compiled = engine.compile_tick()
            row = {
                "preset": FLAGS.model,
                "label": FLAGS.label,
                "platform": jax.devices()[0].platform,
                "precision": FLAGS.precision,
                "context_frames": FLAGS.context_frames,
                "devices": n,
                "data": groups,
                "model_parallel": m,
                "sessions": sessions,
                "slots": serve.slots,
                "beats": FLAGS.beats,
                "warmup": FLAGS.warmup,
                "compile_s": round(time.perf_counter() - t, 2),
                "collectives": mesh_lib.collectives(compiled.as_text()),
            }
            beats = scripted_beats(engine, sessions, FLAGS.beats)
            timing, text = back_to_back(engine, beats, sessions)
            ref = reference.setdefault(sessions, text)
            row |= timing | {"same_tokens": bool(np.array_equal(ref, text))}
            if FLAGS.realtime_ticks:
                row |= realtime(engine, sessions)
            logging.info("%s", log.write(row))
            del engine, compiled
    print_table(log.rows)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
