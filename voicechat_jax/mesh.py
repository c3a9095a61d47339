"""The slot axis over a device mesh: one server process stepping the slots of every local device.

Slots are independent sessions, so data parallelism needs no collective at all: the ``data`` mesh
axis splits the slot axis (the first axis of every state, beat and output leaf) into one contiguous
block of ``B / n`` slots per device, and the weights and the fresh-session template are replicated.
The tick is wrapped in ``jax.shard_map``: each device runs ``step.tick`` on its own slots, exactly
the program one device runs on ``B / n`` slots (admission, ``step.insert``, is a masked in-place
write over the local slots, so a session joins on whichever device holds its slot). Compiled with
GSPMD instead (the state merely annotated), the tiny tick gets dozens of collectives (58 over 4
CPU devices: the KV scatters, the cond/uncond concatenate, the top-p scatter, the mel FFT, ...);
under ``shard_map`` it gets none, and ``collectives`` counts them in the compiled HLO to keep it
so.

Placement is explicit: params and template with ``replicated``, the state built sharded where it
lies (``state_from_template``; never a replicated full copy first), and each beat put with
``slot_sharding`` before its dispatch. The jitted tick names the same shardings as its
``in_shardings``, so an argument placed otherwise is an error, not a silent transfer.

The mesh loop is the dispatch loop (``Engine.tick``): the resident loop's ``io_callback``s get a
maximal sharding on device 0, so on a mesh every output leaf is all-gathered to device 0 and every
beat broadcast from it, each beat (``experiments/mesh/README.md`` has what was measured).
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ModelConfig, ServeConfig
from voicechat_jax.model import voicechat

DATA = "data"  # the mesh axis the slots are split over

# HLO opcodes that move data between devices; the sharded tick must contain none of them.
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
    "reduce-scatter",
)
# An opcode is a whole word right before its operand list (`%x = f32[2]{0} all-reduce(...)`),
# never part of an instruction's name (`%all-reduce.3`, `%fusion.all-gather-like`); the async
# forms `all-reduce-start` / `-done` are counted once, by their `-start`.
_OPCODE = re.compile(r"(?<![\w.%-])(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def make_mesh(devices: int | Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``data`` mesh over ``devices``: a count (the first n local devices), a list, or all."""
    if devices is None:
        devices = jax.local_devices()
    elif isinstance(devices, int):
        local = jax.local_devices()
        if not 1 <= devices <= len(local):
            raise ValueError(f"asked for {devices} devices; this process has {len(local)}")
        devices = local[:devices]
    return Mesh(np.asarray(list(devices)), (DATA,))


def shard_map(f: Callable, *, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``jax.shard_map`` (jax >= 0.7), else the older ``jax.experimental.shard_map.shard_map``.

    Without the varying-manual-axes check (``check_vma``, formerly ``check_rep``): the model's
    loops start their carries from constants (unvarying) and end them varying over ``data``, which
    the check refuses; it only matters for replicated outputs and autodiff, and every output of the
    tick is split over ``data``.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def slot_sharding(mesh: Mesh) -> NamedSharding:
    """The first (slot) axis split over ``data``; the other axes whole on each device."""
    return NamedSharding(mesh, P(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of ``mesh`` (weights, template)."""
    return NamedSharding(mesh, P())


def check_slots(slots: int, mesh: Mesh | AbstractMesh) -> int:
    """Slots per device; raises ``ValueError`` unless ``slots`` splits evenly over the mesh."""
    n = mesh.shape[DATA]
    if slots % n:
        raise ValueError(f"{slots} slots do not split evenly over {n} devices")
    return slots // n


def put_replicated(tree, mesh: Mesh):
    """``tree`` with every leaf replicated over ``mesh`` (a no-op for leaves already so)."""
    return jax.device_put(tree, replicated(mesh))


def put_beat(beat: state_lib.BeatInput, mesh: Mesh) -> state_lib.BeatInput:
    """The beat's leaves (NumPy, slot axis first) split over ``data``: each device gets its rows."""
    return jax.device_put(beat, slot_sharding(mesh))


def state_from_template(
    template: voicechat.FrameState, slots: int, mesh: Mesh
) -> state_lib.SessionState:
    """``state.from_template`` built sharded: each device materialises only its own slots."""
    check_slots(slots, mesh)
    return _state_builder(slots, mesh)(template)


@functools.cache
def _state_builder(slots: int, mesh: Mesh) -> Callable:
    """The jitted, slot-sharded ``from_template`` of a slot count and mesh (``reset`` reuses it)."""
    return jax.jit(
        functools.partial(state_lib.from_template, slots=slots), out_shardings=slot_sharding(mesh)
    )


def make_tick(cfg: ModelConfig, serve: ServeConfig, mesh: Mesh) -> Callable:
    """The tick over ``mesh``: ``tick(params, state, template, beat)``, argument 1 donated.

    Each device runs ``step.tick`` on its ``B / n`` slots with the replicated weights and
    template; nothing crosses between devices. Arguments must already be placed (params and
    template ``replicated``, state and beat ``slot_sharding``); the outputs are slot-sharded.
    """
    check_slots(serve.slots, mesh)

    def tick(params, state, template, beat):  # the name step.CompileCounter("tick") counts
        with serve.precision.scope():
            return step_lib.tick(params, state, template, beat, cfg=cfg, serve=serve)

    per_device = shard_map(
        tick,
        mesh=mesh,
        in_specs=(P(), P(DATA), P(), P(DATA)),
        out_specs=(P(DATA), P(DATA)),
    )
    rep, slots = replicated(mesh), slot_sharding(mesh)
    return jax.jit(
        per_device,
        in_shardings=(rep, slots, rep, slots),
        out_shardings=(slots, slots),
        donate_argnums=(1,),
    )


def collectives(hlo_text: str) -> dict[str, int]:
    """Cross-device ops in an HLO module's text (``compiled.as_text()``), by opcode."""
    return dict(collections.Counter(m.group(1) for m in _OPCODE.finditer(hlo_text)))
