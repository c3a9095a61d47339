"""The slot axis over a device mesh: which loop serves a mesh, and what a mesh buys.

Two kinds of rows (see README.md beside this file):

- ``loop`` rows, for each device count and loop: the compiled program's cross-device collectives
  (counted in its HLO) and the beat period with beats back to back (offline: the next beat starts
  when the last one's output is on the host), over the same scripted beats. Loops:
  ``dispatch`` (one call per beat; on a mesh ``mesh.make_tick`` with each beat placed by slot),
  ``resident`` (``step.make_resident`` on one device; on a mesh the same loop around the sharded
  tick, its ``io_callback``s outside the per-device program), ``resident_per_device`` (mesh only:
  the whole loop inside ``shard_map``, each device calling back for its own slots). Plus
  ``gspmd``: the plain tick compiled over the mesh with the state merely annotated (collectives
  only, it is not run).
- ``capacity`` rows (``--capacity``): the unchanged ``Server`` over an ``Engine(mesh=...)`` on the
  chosen clock, ``slots_per_device x devices`` sessions, p50 / p99 / max beat latency and missed
  beats: 2 GPUs against 1 at twice the sessions.

Random weights. On the CPU ``--cpu_devices`` fakes the devices (they share the host's cores, so
the CPU rows show overheads and collectives, never a speed-up). Rows are appended to ``--out`` as
they are measured, each with its provenance (``experiments.harness``).
"""

from __future__ import annotations

import functools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax import mesh as mesh_lib
from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.engine import Engine
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving.server import Server, SessionPlan
from voicechat_jax.slot_rule import SlotRule

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("devices", ["1", "4"], "Device counts (the first n local devices).")
flags.DEFINE_integer("cpu_devices", None, "Fake this many CPU devices (set before JAX starts).")
flags.DEFINE_integer("slots_per_device", 2, "Slots per device (slots = devices x this).")
flags.DEFINE_list(
    "loops", ["dispatch", "resident", "resident_per_device", "gspmd"], "Loop rows to measure."
)
flags.DEFINE_integer("beats", 40, "Beats per loop row (the first --warmup not timed).")
flags.DEFINE_integer("warmup", 5, "Beats left out of the loop rows' timing.")
flags.DEFINE_integer("context_frames", 256, "Context cap in frames.")
flags.DEFINE_bool("capacity", False, "Also the Server rows (dispatch loop, --clock).")
flags.DEFINE_integer("capacity_ticks", 200, "Beats per capacity row.")
flags.DEFINE_enum("clock", "realtime", ["realtime", "offline"], "Beat clock of capacity rows.")
flags.DEFINE_enum("precision", "reference", ["reference", "fp32"], "Precision policy.")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")


def scripted_beats(engine: Engine, n: int) -> list[state_lib.BeatInput]:
    """Every slot joins at beat 0 (its own key), speech-like audio on every beat."""
    slots, samples = engine.serve.slots, engine.samples_per_beat
    audio = np.stack([harness.speech(n * samples, b) for b in range(slots)]).reshape(
        slots, n, samples
    )
    beats = []
    for k in range(n):
        b = engine.empty_beat()
        b.audio[:] = audio[:, k]
        if k == 0:
            b.admit[:] = True
            b.key[:] = np.arange(2 * slots, dtype=np.uint32).reshape(slots, 2) + 1
        beats.append(b)
    return beats


def _period(stamps: list[float]) -> dict:
    """Beat period (ms) from the output timestamps of the timed beats."""
    gaps = np.diff(np.asarray(stamps[FLAGS.warmup :])) * 1e3
    return {
        "period_ms_mean": round(float(gaps.mean()), 3),
        "period_ms_p50": round(float(np.percentile(gaps, 50)), 3),
        "period_ms_p99": round(float(np.percentile(gaps, 99)), 3),
    }


def _tokens(outs: list) -> np.ndarray:
    return np.stack([np.concatenate([o.frames.text, o.frames.codes[..., 0]], 1) for o in outs])


def run_dispatch(engine: Engine, beats) -> tuple[dict, np.ndarray]:
    engine.reset()
    t = time.perf_counter()
    compiled = engine.compile_tick()
    row = {"compile_s": round(time.perf_counter() - t, 2)}
    row["collectives"] = mesh_lib.collectives(compiled.as_text())
    stamps, outs = [], []
    for b in beats:
        outs.append(jax.device_get(engine.tick(b)))
        stamps.append(time.perf_counter())
    return row | _period(stamps), _tokens(outs)


def _beat_struct(beat, rows: int | None = None):
    def one(x):
        shape = np.shape(x) if rows is None else (rows, *np.shape(x)[1:])
        return jax.ShapeDtypeStruct(shape, np.asarray(x).dtype)

    return jax.tree_util.tree_map(one, beat)


def run_resident(engine: Engine, beats, *, per_device: bool) -> tuple[dict, np.ndarray]:
    """The resident loop over ``engine``'s devices; on a mesh built here around the sharded tick."""
    engine.reset()
    cfg, serve, mesh = engine.cfg, engine.serve, engine.mesh
    n = len(beats)
    lock = threading.Lock()
    stamps: list[float] = []
    got: dict[tuple[int, int], object] = {}
    n_dev = 1 if mesh is None else mesh.shape[mesh_lib.DATA]
    rows = serve.slots // n_dev if per_device else serve.slots
    rule = SlotRule.fresh(engine.template, serve.slots)  # the script's masks, decided up front
    decided = [(b, rule.decide(b, serve)) for b in beats]

    def next_beat(k: int, d: int = 0):
        b, m = decided[min(k + 1, n - 1)]
        if per_device:
            b, m = jax.tree_util.tree_map(lambda x: x[d * rows : (d + 1) * rows], (b, m))
        return b, m, np.asarray(k + 1 >= n)

    def deliver(k: int, out, d: int = 0):
        with lock:
            got[(k, d)] = out
            if len([key for key in got if key[0] == k]) == (n_dev if per_device else 1):
                stamps.append(time.perf_counter())

    t = time.perf_counter()
    if mesh is None:
        fn = step_lib.make_resident(cfg, serve, next_beat, deliver)
        args = (engine.params, engine.state, engine.template, *decided[0])
    else:
        fn = _mesh_resident(engine, next_beat, deliver, per_device=per_device, rows=rows)
        first = mesh_lib.put_beat(decided[0], mesh)
        args = (engine.params, engine.state, engine.template, *first)
    compiled = fn.lower(*args).compile()
    row = {"compile_s": round(time.perf_counter() - t, 2)}
    row["collectives"] = mesh_lib.collectives(compiled.as_text())
    engine.state = compiled(*args)
    jax.block_until_ready(engine.state)
    outs = []
    for k in range(n):
        parts = [got[(k, d)] for d in range(n_dev if per_device else 1)]
        outs.append(jax.tree_util.tree_map(lambda *xs: np.concatenate(xs, 0), *parts))
    return row | _period(stamps), _tokens(outs)


def _mesh_resident(engine: Engine, next_beat, deliver, *, per_device: bool, rows: int):
    """``step.resident_loop``'s shape over a mesh: global callbacks, or one loop per device."""
    cfg, serve, precision, mesh = engine.cfg, engine.serve, engine.precision, engine.mesh
    beat_struct = _beat_struct((engine.empty_beat(), engine.empty_masks()), rows)
    stop_struct = jax.ShapeDtypeStruct((), jnp.bool_)

    def local_tick(params, s, template, beat, masks):
        return step_lib.tick(params, s, template, beat, masks, cfg=cfg, serve=serve)

    specs = (P(), P(mesh_lib.DATA), P(), P(mesh_lib.DATA), P(mesh_lib.DATA))
    tick = (
        local_tick
        if per_device
        else mesh_lib.shard_map(
            local_tick, mesh=mesh, in_specs=specs, out_specs=(P(mesh_lib.DATA), P(mesh_lib.DATA))
        )
    )

    def loop(params, state, template, first_beat, first_masks):
        d = jax.lax.axis_index(mesh_lib.DATA) if per_device else jnp.zeros((), jnp.int32)

        def body(carry):
            k, s, beat, masks, _ = carry
            s, out = tick(params, s, template, beat, masks)
            leaves, treedef = jax.tree_util.tree_flatten(out)

            def deliver_host(kk, dd, *host_leaves):
                deliver(int(kk), jax.tree_util.tree_unflatten(treedef, host_leaves), int(dd))
                return np.zeros((), np.int32)

            token = io_callback(
                deliver_host, jax.ShapeDtypeStruct((), jnp.int32), k, d, *leaves, ordered=True
            )
            nb, nm, stop = io_callback(
                lambda kk, dd, _tok: next_beat(int(kk), int(dd)),
                (*beat_struct, stop_struct),
                k,
                d,
                token,
                ordered=True,
            )
            return k + 1, s, nb, nm, stop

        stop = jnp.zeros((), jnp.bool_)
        carry = (jnp.zeros((), jnp.int32), state, first_beat, first_masks, stop)
        return jax.lax.while_loop(lambda c: ~c[4], body, carry)[1]

    if per_device:
        loop = mesh_lib.shard_map(loop, mesh=mesh, in_specs=specs, out_specs=P(mesh_lib.DATA))
    rep, slots = mesh_lib.replicated(mesh), mesh_lib.slot_sharding(mesh)

    def scoped(*args):
        with precision.scope():
            return loop(*args)

    return jax.jit(
        scoped,
        in_shardings=(rep, slots, rep, slots, slots),
        out_shardings=slots,
        donate_argnums=(1,),
    )


def gspmd_collectives(engine: Engine) -> dict:
    """Collectives of the plain tick compiled over the mesh, the state only annotated."""
    cfg, serve, precision, mesh = engine.cfg, engine.serve, engine.precision, engine.mesh
    fn = functools.partial(step_lib.tick, cfg=cfg, serve=serve)

    def scoped(*args):
        with precision.scope():
            return fn(*args)

    rep, slots = mesh_lib.replicated(mesh), mesh_lib.slot_sharding(mesh)
    jitted = jax.jit(
        scoped, in_shardings=(rep, slots, rep, slots, slots), out_shardings=(slots, slots)
    )
    t = time.perf_counter()
    beat = engine.empty_beat()
    compiled = jitted.lower(
        engine.params, engine.state, engine.template, beat, engine.empty_masks()
    )
    compiled = compiled.compile()
    return {
        "compile_s": round(time.perf_counter() - t, 2),
        "collectives": mesh_lib.collectives(compiled.as_text()),
    }


def capacity_row(engine: Engine) -> dict:
    engine.reset()
    ticks, slots = FLAGS.capacity_ticks, engine.serve.slots
    samples = ticks * engine.samples_per_beat
    plans = [SessionPlan(id=f"s{i}", audio=harness.speech(samples, i)) for i in range(slots)]
    server = Server(engine, clock=FLAGS.clock, loop="dispatch", warmup_ticks=FLAGS.warmup)
    server.run(plans, ticks)
    s = server.metrics.summary()
    lat = s["latency_ms"]
    return {
        "clock": FLAGS.clock,
        "sessions": slots,
        "steady_ticks": s["ticks"],
        "p50_ms": lat["p50"],
        "p99_ms": lat["p99"],
        "max_ms": lat["max"],
        "missed_ticks": s["missed_ticks"],
    }


def print_table(rows: list[dict]) -> None:
    print(
        f"{FLAGS.model} on {rows[0]['device']} ({FLAGS.precision}), jax {jax.__version__}, "
        f"{FLAGS.slots_per_device} slots per device, {FLAGS.beats} beats "
        f"({FLAGS.warmup} untimed), beats back to back"
    )
    print(
        f"{'dev':>3} {'slots':>5} {'loop':20} {'compile s':>9} {'mean ms':>8} {'p99 ms':>8} "
        f"{'same':>5}  collectives"
    )
    for r in rows:
        if r["kind"] == "loop":
            mean = f"{r['period_ms_mean']:>8.2f}" if "period_ms_mean" in r else f"{'-':>8}"
            p99 = f"{r['period_ms_p99']:>8.2f}" if "period_ms_p99" in r else f"{'-':>8}"
            same = {True: "yes", False: "NO", None: "-"}[r.get("same_tokens")]
            coll = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "none"
            print(
                f"{r['devices']:>3} {r['slots']:>5} {r['loop']:20} {r['compile_s']:>9.1f} "
                f"{mean} {p99} {same:>5}  {coll}"
            )
    cap = [r for r in rows if r["kind"] == "capacity"]
    if cap:
        print(f"capacity (Server, dispatch loop, {FLAGS.clock} clock)")
        print(f"{'dev':>3} {'sessions':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'missed':>6}")
        for r in cap:
            print(
                f"{r['devices']:>3} {r['sessions']:>8} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                f"{r['max_ms']:>8.1f} {r['missed_ticks']:>6}"
            )


def main(argv):
    del argv
    if FLAGS.cpu_devices:
        jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
    cfg = config_lib.PRESETS[FLAGS.model]()
    precision = Precision.fp32() if FLAGS.precision == "fp32" else Precision.reference()
    t = time.perf_counter()
    params = voicechat.init_compiled(jax.random.key(0), cfg, precision, serving=True)
    jax.block_until_ready(params)
    logging.info("random %s params in %.1f s", FLAGS.model, time.perf_counter() - t)
    log, template, reference = harness.RowLog(FLAGS.out), None, {}
    for n in (int(x) for x in FLAGS.devices):
        serve = config_lib.ServeConfig(
            slots=n * FLAGS.slots_per_device,
            frames_per_tick=2,
            context_frames=FLAGS.context_frames,
            precision=precision,
        )
        mesh = None if n == 1 else mesh_lib.make_mesh(n)
        engine = Engine(params, cfg, serve, template=template, mesh=mesh)
        if template is None:
            template = engine.template
        beats = scripted_beats(engine, FLAGS.beats)
        base = {
            "model": FLAGS.model,
            "platform": jax.devices()[0].platform,
            "precision": FLAGS.precision,
            "devices": n,
            "slots": serve.slots,
        }
        for loop in FLAGS.loops:
            if loop == "resident_per_device" and mesh is None:
                continue
            if loop == "gspmd":
                if mesh is not None:
                    log.write(base | {"kind": "loop", "loop": loop} | gspmd_collectives(engine))
                continue
            if loop == "dispatch":
                row, tokens = run_dispatch(engine, beats)
            else:
                row, tokens = run_resident(engine, beats, per_device=loop == "resident_per_device")
            # Every loop over these devices must give what the first one (dispatch) gave.
            ref = reference.setdefault(n, tokens)
            row["same_tokens"] = bool(np.array_equal(ref, tokens))
            logging.info("%s", log.write(base | {"kind": "loop", "loop": loop} | row))
        if FLAGS.capacity:
            log.write(base | {"kind": "capacity"} | capacity_row(engine))
        del engine
    print_table(log.rows)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
