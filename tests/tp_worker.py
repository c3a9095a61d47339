"""The tensor-parallel checks of ``tests/test_tensor_parallel.py``, run on a fake 4-device CPU mesh.

As ``tests/mesh_worker.py``: the device count of a JAX process is fixed when its backend starts,
so the test starts this module in a subprocess with ``--xla_force_host_platform_device_count=4``
and asserts on what it writes: ``result.json`` (placements, collectives, compile counts) and
``arrays.npz`` (the beats' outputs and the final LLM state of one device and of each layout).

    python -m tests.tp_worker OUT_DIR

Layouts over the 4 devices: ``(data=2, model=2)`` and ``(data=1, model=4)`` against one device
stepping all 4 slots. The fresh-session template is built cheaply (``cheap_template``): the
speech decoder's speaker-prompt prefill (a 20-60 s compile on this host) is left out, and the
LLM's template state is random, so a template placed in the wrong layout shows in the tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from voicechat_jax import mesh as mesh_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import PAD_ID, ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.model import (
    codec,
    conformer,
    ear_tts,
    gemma,
    llm_shard,
    nano,
    nano_tp,
    rnnt,
    voicechat,
)
from voicechat_jax.precision import Precision

CFG = tiny()
PREC = Precision.fp32()
DEVICES = 4
SLOTS = 4
LAYOUTS = ((2, 2), (1, 4))  # (data, model)
SERVE = ServeConfig(slots=SLOTS, frames_per_tick=2, context_frames=16, precision=PREC)
FIELDS = ("text", "function", "codes", "wav")
TEMPLATE_LENGTH = 3  # LLM positions the random template state has consumed
# beat -> (admitted, released); slot 2 joins late, slot 0 leaves; slot 1 rolls over with a
# capsule at RESEED[0] (the tick's prefill path), slot 3 is held at HOLD[0].
SCRIPT = {0: ((0, 1, 3), ()), 1: ((2,), ()), 3: ((), (0,))}
RESEED = (2, 1, (5, 6, 7))  # beat, slot, capsule token ids
HOLD = (2, 3)  # beat, slot
BEATS = 4


def cheap_template(key: jax.Array) -> voicechat.FrameState:
    """A fresh-session state (batch 1) without the speech decoder's prompt prefill.

    Encoder, RNNT and codec streams as ``voicechat.initial_state`` makes them; the speech decoder
    at position ``prompt_frames`` of an empty cache, its previous codes the mask frame; the LLM's
    SSM, conv and KV state random (KV rows up to ``TEMPLATE_LENGTH``), as after a prompt.
    """
    t = CFG.tts
    llm = nano.init_state(CFG.llm, 1, TEMPLATE_LENGTH + SERVE.context_frames, PREC)
    leaves, treedef = jax.tree_util.tree_flatten(llm)
    keys = jax.random.split(key, len(leaves))
    leaves = [
        jax.random.normal(k, x.shape, x.dtype) if x.dtype == jnp.float32 else x
        for k, x in zip(keys, leaves, strict=True)
    ]
    llm = jax.tree_util.tree_unflatten(treedef, leaves)
    rows = jnp.arange(llm.k[0].shape[2]) < TEMPLATE_LENGTH  # [S]
    llm = llm.replace(
        k=tuple(jnp.where(rows[:, None], x, 0.0) for x in llm.k),
        v=tuple(jnp.where(rows[:, None], x, 0.0) for x in llm.v),
        length=jnp.full((1,), TEMPLATE_LENGTH, jnp.int32),
    )
    cache = gemma.init_cache(t, 2, t.prompt_frames + SERVE.context_frames, PREC)
    tts = ear_tts.TTSState(
        k=tuple(x[None] for x in cache.k),
        v=tuple(x[None] for x in cache.v),
        pos=jnp.full((1,), t.prompt_frames, jnp.int32),
        prev_codes=jnp.full((1, t.n_quantizers), t.codebook_size, jnp.int32),
        frame=jnp.zeros((1,), jnp.int32),
    )
    pad = jnp.full((1,), PAD_ID, jnp.int32)
    return voicechat.FrameState(
        encoder=conformer.init_state(CFG.encoder, 1, PREC),
        llm=llm,
        rnnt=rnnt.init_state(CFG.rnnt, 1, PREC),
        tts=tts,
        codec=codec.init_state(CFG.codec, 1, PREC),
        text_prev=pad,
        func_prev=pad,
        frame=jnp.zeros((1,), jnp.int32),
    )


def beats(engine: Engine) -> list:
    """The scripted NumPy beats (fresh arrays for each engine, the same values)."""
    rng = np.random.default_rng(1)
    out = []
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
        if k == HOLD[0]:
            b.run[HOLD[1]] = False
        out.append(b)
    return out


def _spec(x) -> list:
    """A leaf's PartitionSpec as JSON (a list of axis names or None per dimension)."""
    return [None if a is None else a for a in tuple(x.sharding.spec)]


def _weight_placement(x, shard_shape) -> dict:
    """A weight's spec and shard shape; a weight served one leaf per layer
    (``voicechat.serving_layout``) gives its first layer's, and how many layers it has."""
    if isinstance(x, tuple):
        return {"layers": len(x), **_weight_placement(x[0], shard_shape)}
    return {"spec": _spec(x), "shard": shard_shape(x)}


def _llm_placement(engine: Engine, mesh) -> dict:
    """Specs and per-device shard shapes of the LLM's state and params, and the rest's specs."""
    llm = engine.state.model.llm
    dev0 = mesh.devices.flat[0]

    def shard_shape(x):
        return next(list(s.data.shape) for s in x.addressable_shards if s.device == dev0)

    named = {
        "ssm": llm.ssm[0],
        "conv": llm.conv[0],
        "k": llm.k[0],
        "v": llm.v[0],
        "length": llm.length,
    }
    others = engine.state.replace(model=engine.state.model.replace(llm=None))
    p = engine.params.llm
    weights = {
        "in_proj": p.mamba.in_proj,
        "conv_w": p.mamba.conv_w,
        "A_log": p.mamba.A_log,
        "gate_norm": p.mamba.gate_norm,
        "out_proj": p.mamba.out_proj,
        "q": p.attn.q,
        "k": p.attn.k,
        "o": p.attn.o,
        "up": p.mlp.up,
        "down": p.mlp.down,
        "embed": p.embed,
        "lm_head": p.lm_head,
        "norm_f": p.norm_f,
    }
    non_llm_params = engine.params.replace(llm=None)
    return {
        "state": {n: {"spec": _spec(x), "shard": shard_shape(x)} for n, x in named.items()},
        "state_leaves_sharded_over_model": sum(
            "model" in _spec(x) for x in jax.tree_util.tree_leaves(llm)
        ),
        "state_leaves_llm": len(jax.tree_util.tree_leaves(llm)),
        "other_state_specs": sorted({str(_spec(x)) for x in jax.tree_util.tree_leaves(others)}),
        "params": {n: _weight_placement(x, shard_shape) for n, x in weights.items()},
        "other_params_specs": sorted(
            {str(_spec(x)) for x in jax.tree_util.tree_leaves(non_llm_params)}
        ),
    }


def run(out_dir: str) -> None:
    result: dict = {"devices": len(jax.devices()), "jax": jax.__version__}
    arrays: dict[str, np.ndarray] = {}
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    params = voicechat.init_compiled(jax.random.key(0), CFG, PREC)
    template = jax.jit(cheap_template)(jax.random.key(7))
    one = Engine(params, CFG, SERVE, template=template)
    one.compile_tick()
    seconds["one"] = time.perf_counter() - t
    engines = {"one": one}
    for data, model in LAYOUTS:
        name = f"d{data}m{model}"
        t = time.perf_counter()
        mesh = mesh_lib.make_mesh(DEVICES, model_parallel=model)
        with step_lib.CompileCounter("tick") as compiles:
            engine = Engine(params, CFG, SERVE, template=template, mesh=mesh)
            hlo = engine.compile_tick().as_text()
            donated = []
            for b in beats(engine):
                before = jax.tree_util.tree_leaves(engine.state)
                jax.block_until_ready(engine.tick(b))
                donated.append(all(x.is_deleted() for x in before))
            engine.reset()  # a second run of the script: the compiled tick is reused
            for b in beats(engine):
                engine.tick(b)
        seconds[name] = time.perf_counter() - t
        llm = llm_shard.shard_config(CFG.llm, model)
        groups = mesh_lib.all_reduce_groups(hlo)
        reseed = engine.stages.reseed.as_text()  # the roll-over's capsule prefill, its own program
        reseed_groups = mesh_lib.all_reduce_groups(reseed)
        result[name] = {
            "mesh_shape": dict(mesh.shape),
            "compiles": compiles.count,
            "collectives": mesh_lib.collectives(hlo),
            "all_reduce_groups": sorted([sorted(g), n] for g, n in groups.items()),
            "reseed_collectives": mesh_lib.collectives(reseed),
            "reseed_all_reduce_groups": sorted([sorted(g), n] for g, n in reseed_groups.items()),
            "model_groups": sorted(mesh_lib.model_groups(mesh)),
            "norm_ranks": llm.norm_ranks,
            "donated": donated,
            **_llm_placement(engine, mesh),
        }
        engines[name] = engine
    for name, engine in engines.items():
        engine.reset()
        for k, b in enumerate(beats(engine)):
            o = jax.device_get(engine.tick(b))
            for f in FIELDS:
                arrays[f"{name}/beat{k}/{f}"] = np.asarray(getattr(o.frames, f))
            for f in ("ran", "active", "frame", "reseeded"):
                arrays[f"{name}/beat{k}/{f}"] = np.asarray(getattr(o, f))
        model = 1 if name == "one" else int(name.split("m")[1])
        llm = nano_tp.state_from_tensor_parallel(
            jax.device_get(engine.state.model.llm), CFG.llm, model
        )
        for i, x in enumerate(jax.tree_util.tree_leaves(llm)):
            arrays[f"{name}/llm_state/{i}"] = np.asarray(x)
    result["seconds"] = {k: round(v, 2) for k, v in seconds.items()}
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    np.savez(os.path.join(out_dir, "arrays.npz"), **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    args = parser.parse_args()
    if len(jax.devices()) != DEVICES:
        raise SystemExit(f"expected {DEVICES} CPU devices, got {len(jax.devices())}")
    run(args.out_dir)


if __name__ == "__main__":
    main()
