"""The mesh checks of ``tests/test_mesh.py``, run in a subprocess on a fake 4-device CPU mesh.

The device count of a JAX process is fixed when its backend starts, and the rest of the suite runs
on one device, so ``test_mesh`` starts this module with ``--xla_force_host_platform_device_count=4``
and asserts on what it writes: ``result.json`` (facts: shardings, collectives, trace counts) and
``arrays.npz`` (the outputs of the one-device and the mesh engine, beat by beat and per session).

    python -m tests.mesh_worker OUT_DIR [--checkpoint DIR]

With ``--checkpoint`` it only restores that converted checkpoint onto the mesh and reports the
leaves' placement and whether they equal a one-device restore.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from voicechat_jax import checkpoint as ckpt
from voicechat_jax import mesh as mesh_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving.server import Server, SessionPlan

CFG = tiny()
PREC = Precision.fp32()
DEVICES = 4
SLOTS = 8  # 2 per device: slots 2d and 2d+1 live on device d
SERVE = ServeConfig(slots=SLOTS, frames_per_tick=2, context_frames=64, precision=PREC)
FIELDS = ("text", "function", "codes", "wav")

# The scripted beats of the engine-level check: beat -> (slots admitted, slots released).
# Sessions join on every device; slot 1 (device 0) and slot 6 (device 3) are released and taken
# again; slot 4 (device 2) joins late. Slot 7 (device 3) rolls over with a capsule at beat
# RESEED[0]; slot 3 (device 1) is held (``run`` off) at beat HOLD[0].
SCRIPT = {
    0: ((0, 3, 7), ()),
    1: ((6,), ()),
    2: ((1, 4), (0,)),
    3: ((0,), (6,)),
    4: ((), (1,)),
    5: ((1, 6), ()),
}
RESEED = (4, 7, (5, 6, 7))  # beat, slot, capsule token ids
# Slot 4 (device 2) rolls over at beat LANE[0] from a lane: its capsule asked a beat ahead
# (``prefill``), prefilled behind that beat's tick and swapped in (``mesh.make_staged``'s ``lane``
# and ``swap``).
LANE = (6, 4, (8, 9))  # beat, slot, capsule token ids
HOLD = (6, 3)  # beat, slot
BEATS = 8

# The server-level check: lowest-free-slot admission over the 2-per-device layout puts these on
# every device, and the late joiners reuse slots that sessions on other devices left.
PLANS = (
    ("a", 0, None),
    ("b", 0, 4),
    ("c", 1, None),
    ("d", 1, 6),
    ("e", 2, None),
    ("f", 2, 5),
    ("g", 3, None),
    ("h", 5, None),
    ("i", 6, None),
)
SERVER_TICKS = 10


def _speech(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    tone = np.sin(2 * np.pi * (150 + 60 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 2 * t))
    return (0.3 * tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _beats(engine: Engine) -> list:
    """The scripted NumPy beats (fresh arrays each: both engines read the same values)."""
    rng = np.random.default_rng(1)
    beats = []
    for k in range(BEATS):
        b = engine.empty_beat()
        b.audio[:] = 0.1 * rng.standard_normal(b.audio.shape).astype(np.float32)
        admit, release = SCRIPT.get(k, ((), ()))
        b.admit[list(admit)] = True
        b.release[list(release)] = True
        b.key[:] = np.arange(2 * SLOTS, dtype=np.uint32).reshape(SLOTS, 2) + 1000 * k + 1
        if k == RESEED[0]:
            slot, capsule = RESEED[1], RESEED[2]
            b.reseed[slot] = True
            b.capsule[slot, : len(capsule)] = capsule
            b.capsule_len[slot] = len(capsule)
        if k in (LANE[0] - 1, LANE[0]):
            slot, capsule = LANE[1], LANE[2]
            b.capsule[slot, : len(capsule)] = capsule
            b.capsule_len[slot] = len(capsule)
            b.prefill[slot] = k == LANE[0] - 1
            b.reseed[slot] = k == LANE[0]
        if k == HOLD[0]:
            b.run[HOLD[1]] = False
        beats.append(b)
    return beats


def _leaf_specs(tree, mesh) -> list[str]:
    """Each leaf's placement: 'data' (split by slot over the whole mesh) or what it is instead."""
    out = []
    for x in jax.tree_util.tree_leaves(tree):
        s = x.sharding
        if isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh and s.spec == P("data"):
            out.append("data")
        else:
            out.append(repr(s))
    return out


def _collective_probe(mesh) -> dict[str, int]:
    """Collectives counted in a program that surely has some (the counter's own check)."""

    def body(x):
        return jax.lax.psum(x, "data") + jax.lax.all_gather(x, "data", tiled=True)[:1]

    f = jax.jit(mesh_lib.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    return mesh_lib.collectives(f.lower(jnp.zeros((DEVICES,), jnp.float32)).compile().as_text())


def _placement(sharded: Engine, mesh, result: dict) -> None:
    """The compiled mesh tick's collectives and aliasing, and where params and state lie."""
    compiled = sharded.compile_tick()
    result["collectives"] = mesh_lib.collectives(compiled.as_text())
    result["probe_collectives"] = _collective_probe(mesh)
    m = compiled.memory_analysis()
    result["alias_bytes"] = None if m is None else int(m.alias_size_in_bytes)
    result["state_bytes_per_device"] = sum(
        s.data.nbytes
        for x in jax.tree_util.tree_leaves(sharded.state)
        for s in x.addressable_shards
        if s.device == mesh.devices.flat[0]
    )
    params = jax.tree_util.tree_leaves(sharded.params)
    result["params_specs"] = sorted({repr(x.sharding.spec) for x in params})
    result["params_devices"] = sorted({len(x.sharding.device_set) for x in params})


def _scripted(one: Engine, sharded: Engine, mesh, result: dict, arrays: dict) -> None:
    """The same NumPy beats into both engines; the mesh state's placement after each."""
    specs, donated = [], []
    for k, (b1, bm) in enumerate(zip(_beats(one), _beats(sharded), strict=True)):
        o1 = jax.device_get(one.tick(b1))
        before = jax.tree_util.tree_leaves(sharded.state)
        om = sharded.tick(bm)
        jax.block_until_ready(om)
        if k == LANE[0] - 1:
            result["prefilled"] = {"one": one.prefilled, "mesh": sharded.prefilled}
        donated.append(all(x.is_deleted() for x in before))
        specs.append(sorted(set(_leaf_specs(sharded.state, mesh))))
        if k == 0:
            result["output_specs"] = sorted(set(_leaf_specs(om, mesh)))
        om = jax.device_get(om)
        for name in FIELDS:
            arrays[f"beat{k}/one/{name}"] = np.asarray(getattr(o1.frames, name))
            arrays[f"beat{k}/mesh/{name}"] = np.asarray(getattr(om.frames, name))
        for name in ("ran", "active", "frame", "reseeded"):
            arrays[f"beat{k}/one/{name}"] = np.asarray(getattr(o1, name))
            arrays[f"beat{k}/mesh/{name}"] = np.asarray(getattr(om, name))
    result["state_specs"] = specs
    result["donated"] = donated


def _per_device(one: Engine, local: Engine, arrays: dict) -> None:
    """Each device's rows of the script, stepped by one device holding only those slots."""
    for d in range(DEVICES):
        rows = slice(d * SLOTS // DEVICES, (d + 1) * SLOTS // DEVICES)
        local.reset()
        for k, b in enumerate(_beats(one)):
            o = jax.device_get(local.tick(jax.tree_util.tree_map(lambda x, r=rows: x[r], b)))
            for name in FIELDS:
                arrays[f"beat{k}/local{d}/{name}"] = np.asarray(getattr(o.frames, name))
            arrays[f"beat{k}/local{d}/ran"] = np.asarray(o.ran)


def _served(one: Engine, sharded: Engine, result: dict, arrays: dict) -> None:
    """Server level: admission by the host's slot table, churn across devices."""
    samples = SERVER_TICKS * one.samples_per_beat
    plans = [
        SessionPlan(id=sid, audio=_speech(samples, i), join=join, leave=leave)
        for i, (sid, join, leave) in enumerate(PLANS)
    ]
    logs = {}
    for name, engine in (("one", one), ("mesh", sharded)):
        engine.reset()
        server = Server(engine, clock="offline", loop="dispatch", warmup_ticks=1, seed=3)
        server.run(plans, SERVER_TICKS)
        logs[name] = {sid: server.logs[sid].arrays() for sid in server.logs}
        result[f"server_{name}_failures"] = dict(server.failures)
    result["server_sessions"] = {k: sorted(v) for k, v in logs.items()}
    for sid in logs["mesh"]:
        for name in FIELDS:
            for which in ("one", "mesh"):
                arrays[f"session/{sid}/{which}/{name}"] = np.asarray(logs[which][sid][name])


def engine_checks(out_dir: str) -> None:
    result: dict = {"devices": len(jax.devices()), "jax": jax.__version__}
    arrays: dict[str, np.ndarray] = {}
    mesh = mesh_lib.make_mesh(DEVICES)
    params = voicechat.init_compiled(jax.random.key(0), CFG, PREC)
    one = Engine(params, CFG, SERVE)
    one.compile_tick()
    local = Engine(
        params, CFG, dataclasses.replace(SERVE, slots=SLOTS // DEVICES), template=one.template
    )
    local.compile_tick()
    with step_lib.CompileCounter("tick") as compiles:  # the one-device ticks are compiled
        sharded = Engine(params, CFG, SERVE, template=one.template, mesh=mesh)
        _placement(sharded, mesh, result)
        _scripted(one, sharded, mesh, result, arrays)
        _per_device(one, local, arrays)
        _served(one, sharded, result, arrays)
    result["compiles"] = compiles.count
    try:
        sharded.compile_resident(lambda k: None, lambda k, out: None)
        result["resident_refused"] = None
    except ValueError as e:
        result["resident_refused"] = str(e)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    np.savez(os.path.join(out_dir, "arrays.npz"), **arrays)


def restore_checks(out_dir: str, directory: str) -> None:
    mesh = mesh_lib.make_mesh(DEVICES)
    _, on_mesh, _ = ckpt.restore(directory, PREC, sharding=mesh_lib.replicated(mesh))
    _, on_one, _ = ckpt.restore(directory, PREC)
    leaves = jax.tree_util.tree_leaves(on_mesh)
    result = {
        "devices": len(jax.devices()),
        "leaves": len(leaves),
        "replicated_on_mesh": sum(
            isinstance(x.sharding, jax.sharding.NamedSharding)
            and x.sharding.mesh == mesh
            and x.sharding.is_fully_replicated
            for x in leaves
        ),
        "equal_to_one_device": all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(leaves, jax.tree_util.tree_leaves(on_one), strict=True)
        ),
    }
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    if len(jax.devices()) != DEVICES:
        raise SystemExit(f"expected {DEVICES} CPU devices, got {len(jax.devices())}")
    if args.checkpoint:
        restore_checks(args.out_dir, args.checkpoint)
    else:
        engine_checks(args.out_dir)


if __name__ == "__main__":
    main()
