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

**Tensor parallelism of the LLM** (``make_mesh(n, model_parallel=m)``): a 2-D ``(data, model)``
mesh of ``n / m`` x ``m`` devices. The slots split over ``data`` as above; over ``model`` the LLM's
weights and decode state are split Megatron-style (``nano``'s tensor-parallel section: Mamba and
attention heads, MLP columns; one ``psum`` over ``model`` after each row-parallel product, plus
one per Mamba layer for the gated norm when a B/C group spans devices). Each ``model`` group of
m devices steps the same ``B / (n / m)`` slots together: every other part of the tick (encoder,
RNNT, speech decoder, codec, sampler) and the LLM's embedding, norms and heads are replicated over
``model`` and computed by each of the m devices alike. The tick's only collectives are those
all-reduces, each within a ``model`` group (``all_reduce_groups``). A 1-D mesh, or
``model_parallel=1``, is the data-parallel layout above, unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import Kernels, ModelConfig, ServeConfig
from voicechat_jax.model import llm_shard, nano, nano_tp, voicechat
from voicechat_jax.precision import Precision

DATA = "data"  # the mesh axis the slots are split over
MODEL = "model"  # the mesh axis the LLM's heads are split over (tensor parallelism)

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
# An all-reduce's groups of devices: listed (`{{0,1},{2,3}}`) or as an iota (`[2,2]<=[4]`,
# `[2,2]<=[2,2]T(1,0)`: arange over the dims, transposed, reshaped to [groups, size]).
_GROUPS = re.compile(
    r"replica_groups=(?:\{(?P<listed>(?:\{[\d,]*\},?)*)\}"
    r"|\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?)"
)


def make_mesh(
    devices: int | Sequence[jax.Device] | None = None, *, model_parallel: int | None = None
) -> Mesh:
    """A mesh over ``devices``: a count (the first n local devices), a list, or all.

    Without ``model_parallel``, the 1-D ``data`` mesh (slots split over every device). With
    ``model_parallel=m``, the 2-D ``(data, model)`` mesh of ``n / m`` x ``m``: device i at
    ``(i // m, i % m)``, so each ``model`` group is m consecutive devices (``m = 1`` is the
    data-parallel layout with a ``model`` axis of size 1).

    Raises:
      ValueError: more devices than this process has, or ``model_parallel`` not dividing them.
    """
    if devices is None:
        devices = jax.local_devices()
    elif isinstance(devices, int):
        local = jax.local_devices()
        if not 1 <= devices <= len(local):
            raise ValueError(f"asked for {devices} devices; this process has {len(local)}")
        devices = local[:devices]
    devices = np.asarray(list(devices))
    if model_parallel is None:
        return Mesh(devices, (DATA,))
    if model_parallel < 1 or len(devices) % model_parallel:
        raise ValueError(
            f"model_parallel={model_parallel} does not divide the {len(devices)} devices"
        )
    return Mesh(devices.reshape(-1, model_parallel), (DATA, MODEL))


def model_parallel(mesh: Mesh | AbstractMesh) -> int:
    """Devices on the mesh's ``model`` axis (1 without one: data parallelism only)."""
    return dict(mesh.shape).get(MODEL, 1)


def local_config(cfg: ModelConfig, serve: ServeConfig, mesh: Mesh | AbstractMesh) -> ModelConfig:
    """The model config one device runs: ``cfg`` with the LLM's ``llm_shard.shard_config``.

    ``cfg`` itself without tensor parallelism. Raises ``ValueError`` (one line) when the
    ``model`` axis cannot split the LLM (``llm_shard.shard_config``), or for the fused Mamba kernel
    with B/C groups split over devices.
    """
    m = model_parallel(mesh)
    if m == 1:
        return cfg
    llm = llm_shard.shard_config(cfg.llm, m, MODEL)
    if serve.ssm_kernel == "fused" and llm.norm_ranks > 1:
        raise ValueError(
            f"ssm_kernel='fused' needs the LLM's n_groups={cfg.llm.n_groups} to divide by "
            f"model_parallel={m} (each device normalises whole groups)"
        )
    return dataclasses.replace(cfg, llm=llm)


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


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _named(specs, mesh: Mesh):
    """A tree (or tree prefix) of ``PartitionSpec`` as ``NamedSharding`` over ``mesh``."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def param_specs(cfg: ModelConfig, mesh: Mesh | AbstractMesh):
    """A ``ModelParams`` prefix of ``PartitionSpec`` for the serving layout
    (``voicechat.serving_layout``): all replicated, but the LLM's split over ``model``
    (``nano_tp.partition_specs``, tensor-parallel layout) when the mesh has that axis."""
    if model_parallel(mesh) == 1:
        return P()
    llm = nano.per_layer_specs(nano_tp.partition_specs(MODEL), cfg.llm)
    return voicechat.ModelParams(encoder=P(), llm=llm, rnnt=P(), tts=P(), codec=P())


def _frame_specs(cfg: ModelConfig, mesh: Mesh | AbstractMesh, batch: str | None):
    """A ``FrameState`` prefix: slot axis over ``batch``; the LLM's heads over ``model``."""
    if model_parallel(mesh) == 1:
        return P(batch)
    b = P(batch)
    llm = nano_tp.state_partition_specs(cfg.llm, MODEL, batch)
    return voicechat.FrameState(
        encoder=b, llm=llm, rnnt=b, tts=b, codec=b, text_prev=b, func_prev=b, frame=b
    )


def state_specs(cfg: ModelConfig, mesh: Mesh | AbstractMesh):
    """A ``SessionState`` prefix of ``PartitionSpec``: slots over ``data``, LLM heads over
    ``model`` (``nano_tp.state_partition_specs``)."""
    if model_parallel(mesh) == 1:
        return P(DATA)
    return state_lib.SessionState(model=_frame_specs(cfg, mesh, DATA), active=P(DATA), key=P(DATA))


def template_specs(cfg: ModelConfig, mesh: Mesh | AbstractMesh):
    """The fresh-session template's (``[1, ...]`` leaves): replicated, LLM heads over ``model``."""
    return _frame_specs(cfg, mesh, None)


def put_params(
    params: voicechat.ModelParams, cfg: ModelConfig, mesh: Mesh, precision: Precision | None = None
):
    """The params placed for ``mesh`` in the serving layout (``voicechat.serving_layout``):
    replicated, the LLM's in the tensor-parallel layout (``nano_tp.to_tensor_parallel``) and split
    over ``model`` when the mesh has that axis.

    The one-device params go in, in either layout (as restored or built); only the LLM's leaves
    are rebuilt. ``precision``: the policy served (``voicechat.serving_layout``'s).
    """
    params = put_replicated(voicechat.serving_layout(params, precision), mesh)
    m = model_parallel(mesh)
    if m == 1:
        return params
    specs = _named(param_specs(cfg, mesh).llm, mesh)
    to_tp = jax.jit(
        functools.partial(nano_tp.to_tensor_parallel, cfg=cfg.llm, m=m), out_shardings=specs
    )
    return params.replace(llm=to_tp(params.llm))


def put_template(template: voicechat.FrameState, cfg: ModelConfig, mesh: Mesh):
    """The fresh-session template placed for ``mesh`` (one-device layout in): replicated, its
    LLM state in the tensor-parallel layout and split over ``model`` when the mesh has that axis."""
    template = put_replicated(template, mesh)
    m = model_parallel(mesh)
    if m == 1:
        return template
    specs = _named(nano_tp.state_partition_specs(cfg.llm, MODEL, None), mesh)
    fn = functools.partial(nano_tp.state_to_tensor_parallel, cfg=cfg.llm, m=m)
    return template.replace(llm=jax.jit(fn, out_shardings=specs)(template.llm))


def put_beat(beat, mesh: Mesh):
    """The beat's leaves (a ``BeatInput``, its ``SlotMasks``, or both; NumPy, slot axis first)
    split over ``data``: each device gets its rows."""
    return jax.device_put(beat, slot_sharding(mesh))


def state_from_template(
    template: voicechat.FrameState, slots: int, mesh: Mesh
) -> state_lib.SessionState:
    """``state.from_template`` built sharded: each device materialises only its own slots.

    Each state leaf splits like its template leaf (``put_template``), with the slot axis over
    ``data``: the LLM's heads stay split over ``model`` on a tensor-parallel mesh.
    """
    check_slots(slots, mesh)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    specs = tuple(_slot_spec(x, mesh) for x in leaves)
    return _state_builder(slots, mesh, treedef, specs)(template)


def _slot_spec(x, mesh: Mesh) -> P:
    """A template leaf's spec with its (size-1) slot axis over ``data``."""
    s = getattr(x, "sharding", None)
    rest = tuple(s.spec)[1:] if isinstance(s, NamedSharding) and s.mesh == mesh else ()
    return P(DATA, *rest)


@functools.cache
def _state_builder(slots: int, mesh: Mesh, treedef, specs: tuple[P, ...]) -> Callable:
    """The jitted, sharded ``from_template`` of a slot count, mesh and template layout (``reset``
    reuses it)."""
    template = jax.tree_util.tree_unflatten(treedef, [NamedSharding(mesh, s) for s in specs])
    out = state_lib.SessionState(
        model=template, active=slot_sharding(mesh), key=slot_sharding(mesh)
    )
    return jax.jit(functools.partial(state_lib.from_template, slots=slots), out_shardings=out)


@functools.lru_cache(maxsize=step_lib.PROGRAMS_KEPT)
def make_tick(
    cfg: ModelConfig, serve: ServeConfig, mesh: Mesh, kernels: Kernels | None = None
) -> Callable:
    """The tick over ``mesh``: ``tick(params, state, template, beat, masks)``, argument 1 donated.

    Each device runs ``step.tick`` on its ``B / n`` slots with the replicated weights and
    template; on a 1-D ``data`` mesh nothing crosses between devices. On a ``(data, model)``
    mesh each device runs it with ``local_config``'s LLM (its share of the heads), adding the
    row-parallel partial sums over its ``model`` group. Arguments must already be placed
    (``put_params``, ``put_template``, ``state_from_template``, ``put_beat`` for the beat and its
    masks); the outputs are
    slot-sharded, the state as it came in.

    Raises:
      ValueError: slots that do not split over ``data``, or an LLM that ``model`` cannot split.
    """
    check_slots(serve.slots, mesh)
    return _tick_program(cfg, serve, mesh, kernels, staged=False)


def _program(fn: Callable, mesh: Mesh, in_specs, out_specs, donate: tuple[int, ...] = ()):
    """``fn`` run on each device of ``mesh`` (``shard_map``), jitted with the specs' shardings."""
    return jax.jit(
        shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
        in_shardings=_named(in_specs, mesh),
        out_shardings=_named(out_specs, mesh),
        donate_argnums=donate,
    )


def _tick_program(
    cfg: ModelConfig, serve: ServeConfig, mesh: Mesh, kernels: Kernels | None, *, staged: bool
) -> Callable:
    """``step.tick`` (``staged`` as given) over ``mesh``, the state donated (``make_tick``)."""
    local = local_config(cfg, serve, mesh)

    def tick(params, state, template, beat, masks):  # step.CompileCounter("tick") counts it
        with serve.precision.scope():
            return step_lib.tick(
                params, state, template, beat, masks, cfg=local, serve=serve, kernels=kernels,
                staged=staged,
            )  # fmt: skip

    ss = state_specs(cfg, mesh)
    in_specs = (param_specs(cfg, mesh), ss, template_specs(cfg, mesh), P(DATA), P(DATA))
    return _program(tick, mesh, in_specs, (ss, P(DATA)), donate=(1,))


def _local_slot(slot: jax.Array, per_device: int) -> tuple[jax.Array, jax.Array]:
    """Inside ``shard_map``: the host's slot index as this device's row, clamped into its
    ``per_device`` rows, and whether this device holds the slot."""
    local = slot - jax.lax.axis_index(DATA) * per_device
    owned = (local >= 0) & (local < per_device)
    return jnp.clip(local, 0, per_device - 1), owned


@functools.lru_cache(maxsize=step_lib.PROGRAMS_KEPT)
def make_staged(
    cfg: ModelConfig, serve: ServeConfig, mesh: Mesh, kernels: Kernels | None = None
) -> step_lib.StagedPrograms:
    """``step.make_staged``'s programs over ``mesh``: the staged tick (``make_tick``'s layout)
    and its one-slot programs.

    A one-slot program runs on every device with the host's slot index: the device holding the
    slot writes it, the others write the slot's row of their own back (``step._put_slot``'s
    ``owned``), so no state crosses between devices. A capsule's prefill (``reseed``, ``lane``) runs
    with ``local_config``'s LLM on every ``data`` device alike (its ``model`` group splits it), so a
    lane is replicated over ``data`` and swaps in wherever its slot lies. Arguments placed as for
    ``make_tick``; the slot, capsule and its length replicated.
    """
    per = check_slots(serve.slots, mesh)
    local = local_config(cfg, serve, mesh)
    precision = serve.precision
    ps, ss, ts = param_specs(cfg, mesh), state_specs(cfg, mesh), template_specs(cfg, mesh)
    llm = P() if model_parallel(mesh) == 1 else ts.llm  # a lane's LLM state, as the template's
    lane_specs = step_lib.CapsuleLane(llm=llm, slot=P(), ids=P(), n=P())

    def admit(state, template, slot):
        return step_lib.admit_slot(state, template, *_local_slot(slot, per))

    def reseed(params, state, template, slot, capsule, n):
        b, owned = _local_slot(slot, per)
        with precision.scope():
            return step_lib.reseed_slot(params, state, template, b, capsule, n, owned, cfg=local)

    def restart(state, template, slot):
        return step_lib.restart_slot(state, template, *_local_slot(slot, per))

    def swap(state, template, slot, lane_llm):
        b, owned = _local_slot(slot, per)
        return step_lib.swap_slot(state, template, b, lane_llm, owned)

    def lane(params, template, capsule, n, slot):
        with precision.scope():
            return step_lib.prefill_lane(params, template, capsule, n, slot, cfg=local)

    return step_lib.StagedPrograms(
        admit=_program(admit, mesh, (ss, ts, P()), ss, donate=(0,)),
        reseed=_program(reseed, mesh, (ps, ss, ts, P(), P(), P()), ss, donate=(1,)),
        restart=_program(restart, mesh, (ss, ts, P()), ss, donate=(0,)),
        swap=_program(swap, mesh, (ss, ts, P(), llm), ss, donate=(0,)),
        lane=_program(lane, mesh, (ps, ts, P(), P(), P()), lane_specs),
        tick=_tick_program(cfg, serve, mesh, kernels, staged=True),
    )


def collectives(hlo_text: str) -> dict[str, int]:
    """Cross-device ops in an HLO module's text (``compiled.as_text()``), by opcode."""
    return dict(collections.Counter(m.group(1) for m in _OPCODE.finditer(hlo_text)))


def all_reduce_groups(hlo_text: str) -> dict[frozenset[tuple[int, ...]], int]:
    """The all-reduces of an HLO module's text, counted by their device groups.

    A group is a tuple of partition ids (positions in the mesh's ``devices.flat``; one process,
    one replica); a combined (variadic) all-reduce counts once.
    """
    found: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        ops = [m.group(1) for m in _OPCODE.finditer(line)]
        if "all-reduce" not in ops:
            continue
        m = _GROUPS.search(line)
        if m is None:
            raise ValueError(f"an all-reduce without replica_groups: {line.strip()[:200]}")
        if m.group("listed") is not None:
            groups = re.findall(r"\{([\d,]*)\}", m.group("listed"))
            ids = [tuple(int(i) for i in g.split(",") if i) for g in groups]
        else:
            shape = [int(i) for i in m.group("shape").split(",")]
            dims = [int(i) for i in m.group("dims").split(",")]
            perm = [int(i) for i in m.group("perm").split(",")] if m.group("perm") else None
            grid = np.arange(int(np.prod(dims))).reshape(dims)
            grid = grid if perm is None else grid.transpose(perm)
            ids = [tuple(int(i) for i in row) for row in grid.reshape(shape)]
        found[frozenset(ids)] += 1
    return dict(found)


def model_groups(mesh: Mesh) -> frozenset[tuple[int, ...]]:
    """The ``model`` groups of a ``(data, model)`` mesh as partition ids (``all_reduce_groups``)."""
    return frozenset(
        tuple(int(i) for i in row) for row in np.arange(mesh.size).reshape(mesh.devices.shape)
    )
