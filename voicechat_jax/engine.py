"""The device side of a serving run: parameters, the fresh-session template, the slot state and
the compiled tick (``Engine``). The host side that drives it on the beat clock is
``serving.server.Server``.

Memory. The state is allocated once, ``slots`` copies of the template, and updated in place by
the donated tick (no second copy), so a server needs: the weights, the state, and the tick's
scratch (the beat's activations, which grow with the slot count but not with the state). Before the
state is allocated the engine checks that the requested slots fit in what the device has left
(``plan_memory``) and refuses with the bytes needed and the largest slot count that fits. On a GPU,
JAX takes a fixed share of device memory up front (75 % unless ``XLA_PYTHON_CLIENT_MEM_FRACTION``
says otherwise); a server that should use the whole card sets ``XLA_PYTHON_CLIENT_MEM_FRACTION``
(0.95 on an H200 leaves room for the CUDA context and cuBLAS/cuDNN workspaces).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from voicechat_jax import buckets as buckets_lib
from voicechat_jax import callback_cache
from voicechat_jax import mesh as mesh_lib
from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ModelConfig, ServeConfig
from voicechat_jax.model import voicechat
from voicechat_jax.slot_rule import SlotRule

GIB = 2**30
# Scratch kept free beside the state: the tick's activations, cuBLAS/cuDNN workspaces, the
# autotuner's buffers (programs compiled after the state exists), the beat's I/O. A fixed part and
# a part per slot, above every peak measured on a GPU (docs/gpu-notes.md "Memory"): the peak
# over state and weights was 1.6 GiB at 40 faithful slots (H100, serving, `c778a5e`), 1.26 and
# 1.40 at 72 and 96 (H200, a profiled tick, `a6cb770`); the compiled ticks' own scratch 0.82-0.91
# GiB at 72-80 faithful, 1.07 for the resident loop at 80, 1.99 at 112 with the bf16 cache.
# Beside it the autotuner's copy of the largest weight (``plan_memory``'s ``params``): at 52
# faithful slots on an H100 (2026-12-06, `0ced39c`) the tick did not compile, the autotuner
# failing to allocate 1.11 GiB for its copy of the LLM's output head (1.09 GiB of bf16).
SCRATCH_FIXED_BYTES = 5 * GIB // 4
SCRATCH_SLOT_BYTES = 20 * 2**20


class MemoryPlanError(RuntimeError):
    """The requested slots do not fit in device memory (the message says what would)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a server's state costs on its device, decided before anything is allocated."""

    slots: int
    slot_bytes: int  # one slot's state (the template's bytes, plus its live flag and key)
    state_bytes: int  # slots * slot_bytes
    limit_bytes: int | None  # the device allocator's limit (None: unknown, e.g. the CPU)
    in_use_bytes: int  # already allocated (weights, template) when the plan was made
    # kept free for the tick's scratch and a capsule prefilled a beat ahead: a fixed part, and a
    # part per slot
    scratch_fixed_bytes: int
    scratch_slot_bytes: int

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_fixed_bytes + self.slots * self.scratch_slot_bytes

    @property
    def free_bytes(self) -> int | None:
        if self.limit_bytes is None:
            return None
        return self.limit_bytes - self.in_use_bytes - self.scratch_bytes

    @property
    def max_slots(self) -> int | None:
        """The most slots whose state and scratch fit beside what is in use."""
        if self.limit_bytes is None:
            return None
        free = self.limit_bytes - self.in_use_bytes - self.scratch_fixed_bytes
        return max(0, free // (self.slot_bytes + self.scratch_slot_bytes))

    @property
    def fits(self) -> bool:
        free = self.free_bytes
        return free is None or self.state_bytes <= free

    def describe(self) -> str:
        need = f"{self.slots} slots x {self.slot_bytes / 2**20:.1f} MiB = "
        need += f"{self.state_bytes / GIB:.2f} GiB of state"
        if self.limit_bytes is None:
            return need + " (device memory limit unknown: not checked)"
        return (
            f"{need}; the device has {self.limit_bytes / GIB:.2f} GiB, "
            f"{self.in_use_bytes / GIB:.2f} GiB in use (weights, template), "
            f"{self.scratch_bytes / GIB:.2f} GiB kept for scratch "
            f"({self.scratch_slot_bytes / 2**20:.0f} MiB of it a slot): "
            f"at most {self.max_slots} slots fit"
        )


COPY_TBPS = 3.7  # an H200's plain device copy (docs/serving.md §3): the floor's bandwidth


def _tree_bytes(tree) -> int:
    """Bytes of every leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``s)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))


def frame_step_bytes(template: voicechat.FrameState) -> int:
    """Bytes one slot moves in one frame-step with its caches full (``docs/serving.md`` §3).

    Its whole state is read (at the cap every attention reads its whole cache; the SSM, conv,
    encoder and codec states are read) and its Mamba-2 SSM state is written back; the rows a step
    appends to its caches are left out. Read from the template's own leaves, so the policy's
    dtypes count (at the 11B's cap: 1.120 GB with the fp32 speech-decoder cache, 0.723 GB with
    the bf16 one). ``template``: ``[1, ...]`` leaves, or their ``jax.ShapeDtypeStruct``s.
    """
    return _tree_bytes(template) + _tree_bytes(template.llm.ssm)


def byte_floor_ms(
    params,
    template: voicechat.FrameState,
    slots: int,
    *,
    frames: int = 2,
    tbps: float = COPY_TBPS,
) -> float:
    """The byte floor of a beat in ms (``docs/serving.md`` §3): ``frames`` frame-steps, each
    reading every parameter once (26.03 GB at the 11B) and moving ``frame_step_bytes(template)``
    for each of ``slots`` slots, at ``tbps`` TB/s. ``params`` and ``template``: arrays or their
    ``jax.ShapeDtypeStruct``s (``voicechat.abstract``, ``jax.eval_shape``)."""
    moved = _tree_bytes(params) + slots * frame_step_bytes(template)
    return frames * moved / (tbps * 1e9)


def _device_memory(device) -> tuple[int | None, int]:
    """(allocator limit, bytes in use) of ``device``; (None, 0) where it reports none (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None, 0
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def plan_memory(
    template: voicechat.FrameState,
    slots: int,
    *,
    limit_bytes: int | None = None,
    in_use_bytes: int | None = None,
    device=None,
    params=None,
) -> MemoryPlan:
    """The memory plan of ``slots`` copies of ``template`` on ``device`` (default: the first).

    ``limit_bytes`` / ``in_use_bytes`` override what the device reports (tests; a budget smaller
    than the card). ``params``: the served weights, whose largest leaf the scratch keeps room for
    (XLA's GPU autotuner copies a product's operands when it compiles the tick, after the state
    exists).
    """
    per_slot = _tree_bytes(template)
    per_slot += 1 + 2 * 4  # the live flag and the raw sampling key
    dev_limit, dev_in_use = _device_memory(device or jax.devices()[0])
    limit = dev_limit if limit_bytes is None else limit_bytes
    in_use = dev_in_use if in_use_bytes is None else in_use_bytes
    # Scratch: the tick's (``SCRATCH_FIXED_BYTES`` and ``SCRATCH_SLOT_BYTES`` a slot), and one
    # roll-over's capsule prefilled a beat ahead (an LLM state).
    known = limit is not None
    leaves = jax.tree_util.tree_leaves(params)
    autotune = max((_tree_bytes(x) for x in leaves), default=0)
    fixed = SCRATCH_FIXED_BYTES + _tree_bytes(template.llm) + autotune if known else 0
    return MemoryPlan(
        slots=slots,
        slot_bytes=per_slot,
        state_bytes=slots * per_slot,
        limit_bytes=limit,
        in_use_bytes=in_use,
        scratch_fixed_bytes=fixed,
        scratch_slot_bytes=SCRATCH_SLOT_BYTES if known else 0,
    )


@dataclasses.dataclass(frozen=True)
class _Lane:
    """A staged engine's capsule prefilled a beat ahead (``step.prefill_lane``), for one slot."""

    ids: np.ndarray  # the capsule's ids (its length is the capsule's)
    llm: object  # the LLM state it rolls over to ([1, ...] leaves, on the device)

    def holds(self, ids: np.ndarray) -> bool:
        return self.ids.shape == ids.shape and bool(np.all(self.ids == ids))


class BucketPrograms:
    """One bucket's programs: its tick, its one-slot programs when staged, its outputs' pad.

    The tick and the pad are compiled when the bucket is; the one-slot programs (``admit``,
    ``reseed``, ``restart``, ``swap``, ``lane``: ``step.StagedPrograms``) each on first use, or all
    at once by ``compile_stages`` (``Engine.compile_tick``, before a server's clock starts), so a
    program a run never calls is never compiled.
    """

    STAGES = ("admit", "reseed", "restart", "swap", "lane")

    def __init__(self, tick, pad=None, jitted: step_lib.StagedPrograms | None = None, args=None):
        self.tick = tick
        self.pad = pad  # bucket below the host's slots: its outputs padded to them; else None
        self.staged = jitted is not None
        self._jitted, self._args = jitted, args or {}
        self._compiled: dict[str, object] = {}

    def stage(self, name: str):
        """The compiled one-slot program ``name`` (compiled now if it was not)."""
        program = self._compiled.get(name)
        if program is None:
            program = getattr(self._jitted, name).lower(*self._args[name]).compile()
            self._compiled[name] = program
        return program

    def compile_stages(self) -> None:
        for name in self.STAGES if self.staged else ():
            self.stage(name)

    @property
    def stages(self) -> step_lib.StagedPrograms | None:
        """Every one-slot program and the tick, compiled (None: the tick runs the whole beat)."""
        if not self.staged:
            return None
        self.compile_stages()
        return step_lib.StagedPrograms(tick=self.tick, **self._compiled)


class Engine:
    """The device side: params, template, slot state, the slot rule and the compiled programs.

    Its modes are data: the slot counts it compiles (``buckets``: one, or a few that a
    ``scheduler.SlotBuckets`` moves the sessions between), the mesh its slots split over (the
    programs' shardings), whether a beat's admissions and roll-overs run as their own programs
    (``staged``) and the kernels each program runs (``Kernels``, per bucket). Each bucket's
    programs are one ``BucketPrograms``, and one ``tick`` drives them whatever the modes.
    """

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        serve: ServeConfig,
        *,
        template: voicechat.FrameState | None = None,
        memory_limit_bytes: int | None = None,
        mesh: Mesh | None = None,
        staged: bool | None = None,
        buckets: Sequence[int] | None = None,
        programs: Mapping[int, BucketPrograms] | None = None,
    ):
        """Builds the template (unless given), checks the memory plan, allocates the state.

        Args:
          params: the model's params, stored or already in the serving layout; the engine keeps
            them in the serving layout (``voicechat.serving_layout``: the products one leaf per
            layer, some fused). Params already in it are kept as they are; from stored ones a
            caller that drops its own reference frees the stacked copy.
          template: a fresh-session state already built for this ``cfg`` and ``serve``
            (several engines of one process can share it); default: built here.
          memory_limit_bytes: the memory budget to plan against, instead of the device's own limit.
          mesh: a ``data`` mesh (``mesh.make_mesh``) to split the slots over: params and template
            replicated on its devices, the state split by slot, the tick ``mesh.make_tick``, each
            beat placed by ``tick``; the memory plan is then per device (``slots / devices``).
            A ``(data, model)`` mesh also splits the LLM's weights and state over ``model``
            (``mesh.put_params``; a given ``template`` is in the one-device layout).
            The dispatch loop only (``compile_resident`` refuses a mesh). Default: one device.
          staged: the dispatch loop runs each beat's admissions and roll-overs as their own
            one-slot programs, dispatched only for the slots that need them (the beat's masks),
            before a tick with no loop whose trip count the device
            decides (``step.make_staged``; over a mesh ``mesh.make_staged``). On a GPU the tick's
            call then returns without waiting for the device, so the host's dispatch stage
            measures the host alone. Same outputs bit for bit. Default (None): staged, on one
            device or a mesh, in every bucket; False runs the whole beat as one program (the
            resident loop's body), for comparison.
          buckets: slot counts to compile a tick for, the largest ``serve.slots`` (the host's slot
            table); the state starts in the smallest, and ``place`` moves it between them (one
            device). Default: ``serve.slots`` alone. See ``voicechat_jax.buckets``.
          programs: programs already compiled for some of the buckets, by slot count: the
            ``programs()`` of an engine with the same ``staged``, ``cfg``, ``params``,
            ``template`` and ``serve`` but for ``slots`` (the compiles saved per bucket).

        Raises:
          MemoryPlanError: the slots do not fit; the message names the bytes needed and the
            largest slot count that fits.
        """
        b = (serve.slots,) if not buckets else tuple(sorted({int(x) for x in buckets}))
        if b[0] < 1 or b[-1] != serve.slots:
            raise ValueError(f"buckets {tuple(buckets)} must be >= 1 and end at {serve.slots}")
        if len(b) > 1 and mesh is not None:
            raise ValueError("slot buckets serve one device (a mesh splits one bucket)")
        self.buckets = b
        self.bucket = b[0]  # the state's slot count now
        self.mesh = mesh
        self.staged = True if staged is None else bool(staged)
        per_device = serve.slots if mesh is None else mesh_lib.check_slots(serve.slots, mesh)
        platform = None if mesh is None else mesh.devices.flat[0].platform
        # The kernels each bucket's programs run ('auto' made once, for one device's slots).
        self.bucket_kernels = {
            x: serve.kernels(platform, per_device if mesh is not None else x) for x in b
        }
        self.kernels = self.bucket_kernels[serve.slots]
        logging.info("kernels: %s", self.kernels.row())
        if mesh is not None:
            params = mesh_lib.put_replicated(params, mesh)
        # In the serving layout (on a mesh: ``mesh_lib.put_params`` below).
        self.params = (
            params if mesh is not None else voicechat.serving_layout(params, serve.precision)
        )
        self.cfg = cfg
        self.serve = serve
        self.precision = serve.precision  # the policy lives in ``serve``; kept here to read
        t = time.perf_counter()
        if template is None:
            template = build_template(self.params, cfg, serve)
        if mesh is not None:
            # On a (data, model) mesh the LLM's weights and template state split over ``model``.
            template = mesh_lib.put_template(template, cfg, mesh)
            self.params = mesh_lib.put_params(params, cfg, mesh, serve.precision)
        self.template = template
        jax.block_until_ready(self.template)
        self.template_s = time.perf_counter() - t
        self.memory = plan_memory(
            self.template,
            per_device,
            limit_bytes=memory_limit_bytes,
            device=None if mesh is None else mesh.devices.flat[0],
            params=self.params,
        )
        if not self.memory.fits:
            raise MemoryPlanError(f"the state does not fit: {self.memory.describe()}")
        if len(b) > 1:
            peak = plan_memory(
                self.template, b[-1] + b[-2], limit_bytes=memory_limit_bytes, params=self.params
            )
            if not peak.fits:
                raise MemoryPlanError(
                    f"a move into the largest bucket holds two states at once: {peak.describe()}"
                )
        logging.info("memory plan: %s", self.memory.describe())
        self.state = self._fresh_state()
        # The slot rule and the host's copy of every slot's fills (None: read back from the
        # device at the next beat, after the state was set from outside).
        self._rule: SlotRule | None = SlotRule.fresh(self.template, serve.slots)
        self.samples_per_beat = serve.frames_per_tick * cfg.encoder.mel.samples_per_frame
        self._given = dict(programs or {})
        self._programs: dict[int, BucketPrograms] = {}  # bucket -> its compiled programs
        self._resizes: dict[tuple[int, int], object] = {}  # (bucket, bucket) -> the move
        self.compiles = 0  # bucketed: programs compiled (ticks, pads, resizes)
        self.moved_slots = 0  # slots copied by moves (the kept ones)
        self.move_s: list[float] = []  # host seconds to dispatch each move (not device time)
        self._lanes: dict[int, _Lane] = {}  # staged: slot -> its capsule, prefilled last beat
        self._warmed = False
        # While ``warm_resident`` runs: the warm-up beats still to feed (the host's callbacks
        # stand aside); None otherwise.
        self._warming_resident: list | None = None
        self.compile_s: float | None = None
        # The compiled resident loop and the host callbacks it calls (``compile_resident``).
        self._resident = None
        self._resident_host: tuple[Callable, Callable] | None = None

    @property
    def state(self) -> state_lib.SessionState:
        """Every slot's state on the device; replaced by every beat (the old one is donated)."""
        return self._state

    @state.setter
    def state(self, state: state_lib.SessionState | None) -> None:
        # A state set from outside (a benchmark swapping states, the resident loop's result):
        # the slot rule's copy of it is read back from the device at the next beat.
        self._state = state
        self._rule = None
        self._lanes = {}

    def reset(self) -> None:
        """Every slot back to the fresh template, none live, in the smallest bucket (the compiled
        programs are kept)."""
        self.state = None  # drop the old state first: two states need not fit side by side
        self.bucket = self.buckets[0]
        self.state = self._fresh_state()
        self._rule = SlotRule.fresh(self.template, self.serve.slots)

    def _fresh_state(self) -> state_lib.SessionState:
        if self.mesh is None:
            return state_lib.from_template(self.template, self.bucket)
        return mesh_lib.state_from_template(self.template, self.serve.slots, self.mesh)

    def empty_beat(self) -> state_lib.BeatInput:
        return state_lib.empty_beat(
            self.serve.slots, self.samples_per_beat, self.serve.capsule_tokens
        )

    def _lowering_args(self, slots: int) -> tuple:
        """(params, state, template, beat, masks) to lower a tick of ``slots`` slots with."""
        beat, masks = jax.tree_util.tree_map(
            lambda x: x[:slots], (self.empty_beat(), self.empty_masks())
        )
        if slots == self.bucket:
            state = self.state  # as placed (a mesh's shardings)
        else:
            state = jax.eval_shape(lambda t: state_lib.from_template(t, slots), self.template)
        return self.params, state, self.template, beat, masks

    def compile_tick(self):
        """Compiles every bucket's programs before the clock starts (each tick and, staged, its
        one-slot programs; below the slots, its outputs' pad; bucketed: every move); returns the
        current bucket's tick."""
        programs = self.programs()
        t = time.perf_counter()
        for p in self._programs.values():
            p.compile_stages()
        self.compile_s += time.perf_counter() - t
        return programs.tick

    def programs(self) -> BucketPrograms:
        """The current bucket's programs; every bucket's tick, pad and move compiled on first call
        (the one-slot programs on first use: ``BucketPrograms``)."""
        if not self._programs:
            t = time.perf_counter()
            for b in self.buckets:
                self._programs[b] = self._given.get(b) or self._compile_bucket(b)
            if len(self.buckets) > 1:
                for b in self.buckets:
                    state_b = self._lowering_args(b)[1]
                    for c in self.buckets:
                        if c != b:
                            src = jax.ShapeDtypeStruct((c,), jnp.int32)
                            low = buckets_lib.resize_jit.lower(state_b, self.template, src, slots=c)
                            self._resizes[(b, c)] = low.compile()
                made = [p for b, p in self._programs.items() if b not in self._given]
                pads = sum(p.pad is not None for p in made)
                self.compiles = len(made) + pads + len(self._resizes)
            self.compile_s = time.perf_counter() - t
            if len(self.buckets) > 1:
                logging.info(
                    "bucket engine: %d ticks (%s slots), %d pads, %d resizes compiled in %.1f s",
                    len(self._programs),
                    ",".join(map(str, self.buckets)),
                    sum(p.pad is not None for p in self._programs.values()),
                    len(self._resizes),
                    self.compile_s,
                )
        return self._programs[self.bucket]

    def _compile_bucket(self, b: int) -> BucketPrograms:
        """Bucket ``b``'s tick (below the slots, with its outputs' pad), compiled; staged, its
        one-slot programs made, to be compiled on first use."""
        args = self._lowering_args(b)
        kernels = self.bucket_kernels[b]
        jitted, stage_args = None, None
        if self.staged:
            if self.mesh is None:
                jitted = step_lib.make_staged(self.cfg, self.serve, kernels)
            else:
                jitted = mesh_lib.make_staged(self.cfg, self.serve, self.mesh, kernels)
            slot = jax.ShapeDtypeStruct((), np.int32)
            capsule = jax.ShapeDtypeStruct((self.serve.capsule_tokens,), np.int32)
            state, template = args[1], self.template
            stage_args = {
                "admit": (state, template, slot),
                "reseed": (self.params, state, template, slot, capsule, slot),
                "restart": (state, template, slot),
                "swap": (state, template, slot, template.llm),
                "lane": (self.params, template, capsule, slot, slot),
            }
            tick = jitted.tick
        elif self.mesh is None:
            tick = step_lib.make_tick(self.cfg, self.serve, kernels)
        else:
            tick = mesh_lib.make_tick(self.cfg, self.serve, self.mesh, kernels)
        lowered = tick.lower(*args)
        compiled = lowered.compile()
        _log_compiled(f"tick ({b} slots)", compiled, self.memory)
        pad = None
        if b < self.serve.slots:
            out_b = lowered.out_info[1]  # the bucket's outputs, as traced for its tick
            jitted_pad = jax.jit(functools.partial(buckets_lib.pad_slots, slots=self.serve.slots))
            pad = jitted_pad.lower(out_b).compile()
        return BucketPrograms(compiled, pad, jitted, stage_args)

    def place(self, plan) -> None:
        """Moves the state into ``plan.bucket`` slots with ``plan.moves`` (a
        ``scheduler.BeatPlan`` whose moves the slot table has had); a no-op if nothing changes.
        The slot rule's copy moves with it."""
        if plan.bucket == self.bucket and not plan.moves:
            return
        if plan.bucket not in self.buckets:
            raise ValueError(
                f"a plan of bucket {plan.bucket} with {len(plan.moves)} move(s) needs an engine "
                f"compiled for that bucket; this one has {self.buckets}"
            )
        if len(self.buckets) == 1:
            raise ValueError(f"moves need an engine with slot buckets; this one has {self.buckets}")
        self.programs()
        src = buckets_lib.source_slots(
            self.bucket, plan.bucket, [(m.src, m.dst) for m in plan.moves]
        )
        t = time.perf_counter()
        rule = self.rule
        if plan.bucket == self.bucket:  # moves inside one bucket: compiled on first use
            self._state = buckets_lib.resize_jit(self._state, self.template, src, slots=plan.bucket)
        else:
            move = self._resizes[(self.bucket, plan.bucket)]
            self._state = move(self._state, self.template, src)
        host_src = np.full((self.serve.slots,), -1, np.int32)
        host_src[: plan.bucket] = src
        rule.move(host_src)
        # A capsule prefilled for a slot moves with it (a slot not kept drops its lane).
        self._lanes = {
            int(new): self._lanes[int(old)]
            for new, old in enumerate(host_src)
            if old >= 0 and int(old) in self._lanes
        }
        self.move_s.append(time.perf_counter() - t)
        self.moved_slots += int(np.sum(src >= 0))
        logging.debug("slots %d -> %d, moves %s", self.bucket, plan.bucket, plan.moves)
        self.bucket = plan.bucket

    def empty_masks(self) -> state_lib.SlotMasks:
        """The masks of ``empty_beat`` on a fresh engine (nothing live, nothing changes): the
        masks' shapes, for lowering, and a beat that is never run."""
        return SlotRule.fresh(self.template, self.serve.slots).decide(self.empty_beat(), self.serve)

    @property
    def rule(self) -> SlotRule:
        """The slot rule with the host's copy of every slot's live flag and fills (over the
        host's ``serve.slots``: those past the bucket are free), as the next beat will find them
        (read back from the device if the state was set from outside)."""
        if self._rule is None:
            rule = SlotRule.fresh(self.template, self.serve.slots)
            read = SlotRule.read(self._state, self.template)
            for name in ("active", "llm_length", "tts_pos", "tts_frame"):
                getattr(rule, name)[: self.bucket] = getattr(read, name)
            self._rule = rule
        return self._rule

    def decide(self, beat: state_lib.BeatInput) -> state_lib.SlotMasks:
        """The masks of ``beat`` by the slot rule; the rule's copy moves past the beat."""
        return self.rule.decide(beat, self.serve)

    @property
    def stages(self) -> step_lib.StagedPrograms | None:
        """The current bucket's compiled admission, roll-over and tick programs of a staged
        engine; None otherwise."""
        return self.programs().stages

    def warm(self) -> float:
        """Runs the compiled dispatch tick once down every path, then ``reset``; returns seconds.

        A beat that admits every slot and rolls each over with a one-id capsule executes the
        admission and roll-over loops' bodies too, so that no later beat pays a first
        execution's one-time costs (on an H200 the first beats of every run in
        ``experiments/beat_latency`` and ``capacity`` took 0.7-1.3 s against 50-150 ms after).
        Done once per engine; a server calls it before its clock starts. Not done with slot
        buckets (the warm beats admit every slot, which the smallest bucket does not hold): each
        bucket's tick is first executed while serving, and its first beat may carry one-time
        costs.
        """
        if self._warmed or len(self.buckets) > 1:
            return 0.0
        t = time.perf_counter()
        for beat in self._warm_beats():
            jax.block_until_ready(self.pack(self.tick(beat)))
        self.reset()
        jax.block_until_ready(self.state)
        self._warmed = True
        return time.perf_counter() - t

    def _warm_beats(self) -> tuple[state_lib.BeatInput, state_lib.BeatInput]:
        """Two beats down every path: every slot admitted and rolled over with a one-id capsule
        (prefilled in the beat), slot 0's next roll-over prefilled after the tick (a lane); then
        slot 0 rolled over from its lane and every other slot with an empty capsule (no prefill:
        ``step.restart_slot``)."""
        first = self.empty_beat()
        first.admit[:] = True
        first.reseed[:] = True
        first.capsule_len[:] = 1
        first.prefill[0] = True
        first.key[:] = np.arange(first.key.size, dtype=np.uint32).reshape(first.key.shape)
        second = self.empty_beat()
        second.reseed[:] = True
        second.capsule_len[0] = 1
        return first, second

    def pack(self, out: state_lib.BeatOutput) -> jax.Array:
        """``out`` as one flat array (``state.pack_output``, dispatched): what the dispatch loop
        copies back to the host, one copy a beat. Compiled by ``warm``."""
        return _pack_output(out)

    def tick(self, beat: state_lib.BeatInput) -> state_lib.BeatOutput:
        """Dispatches one beat (asynchronously); the state is donated and replaced.

        The slot rule decides the beat's masks on the host (``decide``); the programs apply them.
        Staged: first one admission program per admitted slot and one roll-over program per slot
        rolled over (the host's requests, and the at-cap fallback; without a prefill when the
        capsule is empty, from the lane when it was prefilled last beat), then the tick, then
        the next beat's capsules prefilled into lanes behind it. A bucket below the host's slots
        ticks its own rows and pads its outputs; a mesh places the beat's rows on their devices.
        """
        return self._tick(beat, pack=False)[0]

    def _tick(self, beat: state_lib.BeatInput, *, pack: bool):
        programs = self.programs()
        b, slots = self.bucket, self.serve.slots
        if b < slots and np.any(np.asarray(beat.admit)[b:]):
            raise ValueError(f"admission past the bucket of {b} slots")
        rule = self.rule
        self._rule = None  # until every program of the beat is dispatched
        masks = rule.decide(beat, self.serve)
        if programs.staged:
            self._stage_slots(programs, beat, masks)
        rows = (beat, masks)
        if b < slots:  # the rows past the bucket are free: not on the device this beat
            rows = jax.tree_util.tree_map(lambda x: x[:b], rows)
        if self.mesh is not None:  # each device gets its slots' rows
            rows = mesh_lib.put_beat(rows, self.mesh)
        self._state, out = programs.tick(self.params, self._state, self.template, *rows)
        self._rule = rule
        out = out if programs.pad is None else programs.pad(out)
        packed = None if not pack else self.pack(out)
        if programs.staged:
            self._prefill_lanes(programs, beat)
        return out, packed

    def tick_packed(self, beat: state_lib.BeatInput) -> tuple[state_lib.BeatOutput, jax.Array]:
        """``tick``, and its outputs packed into one array (``pack``) dispatched right behind
        the tick, ahead of the lanes prefilled for the next beat's roll-overs: the dispatch
        loop's copy back then waits on the tick alone, not on a capsule's prefill queued behind
        it. With the pack behind the lanes (`cc24fc3` to `69f4165`) the roll-over beats ran
        5.1-9.8 ms over the plain ones at p99 on an H100 (84 bf16 and 51 faithful sessions,
        2026-12-06), against 0.7-1.7 ms before the packed pickup; with it ahead, 2.24 ms (51
        faithful, `94d43d0`)."""
        return self._tick(beat, pack=True)

    def _stage_slots(self, programs: BucketPrograms, beat, masks) -> None:
        """The beat's admissions and roll-overs, one program per slot, before its tick."""
        lanes, self._lanes = self._lanes, {}
        for s in np.flatnonzero(masks.admit):
            self._state = programs.stage("admit")(self._state, self.template, np.int32(s))
        for s in np.flatnonzero(masks.rolled):
            n, slot = int(masks.capsule_len[s]), np.int32(s)
            if n == 0:  # nothing to prefill: the template's LLM state as it is
                self._state = programs.stage("restart")(self._state, self.template, slot)
            elif (lane := lanes.get(s)) is not None and lane.holds(beat.capsule[s, :n]):
                self._state = programs.stage("swap")(self._state, self.template, slot, lane.llm)
            else:
                self._state = programs.stage("reseed")(
                    self.params, self._state, self.template, slot, beat.capsule[s], np.int32(n)
                )

    def _prefill_lanes(self, programs: BucketPrograms, beat) -> None:
        """Next beat's roll-overs: their capsules prefilled now, behind the tick on the device."""
        for s in np.flatnonzero(np.asarray(beat.prefill) & (np.asarray(beat.capsule_len) > 0)):
            n = int(beat.capsule_len[s])
            llm = programs.stage("lane")(
                self.params, self.template, beat.capsule[s], np.int32(n), np.int32(s)
            ).llm
            self._lanes[s] = _Lane(np.array(beat.capsule[s, :n]), llm)

    @property
    def prefilled(self) -> tuple[int, ...]:
        """Slots whose next roll-over's capsule is prefilled (staged engines: asked by the last
        beat's ``prefill``)."""
        return tuple(sorted(int(b) for b in self._lanes))

    def compile_resident(self, next_beat, deliver):
        """The resident loop bound to these host callbacks; returns the executable.

        It is compiled once per engine: the loop's io_callbacks call whichever ``next_beat`` and
        ``deliver`` the latest call gave (one run at a time drives an engine), so a second run
        on the same engine (a server run again, a test) does not compile it again. A program
        with host callbacks is not kept by JAX's persistent compilation cache; where that cache
        is on, ``callback_cache`` keeps this one beside it, so that the next process loads it
        (bound to that process's callbacks). While ``warm_resident`` runs it, the callbacks are
        not called: the loop runs the warm-up beats, its output dropped, and stops.
        """
        if self.mesh is not None:
            raise ValueError(
                "the resident loop serves one device (its io_callbacks would route every beat "
                "through device 0); on a mesh use the dispatch loop"
            )
        if len(self.buckets) > 1:
            raise ValueError(
                "slot buckets need the dispatch loop (a move happens between two ticks)"
            )
        self._resident_host = (next_beat, deliver)
        if self._resident is not None:
            return self._resident
        t = time.perf_counter()

        def next_or_stop(i):
            # The host's next beat, and its masks by the slot rule (on the callback thread).
            rest = self._warming_resident
            if rest is not None:
                beat, stop = (rest.pop(0), False) if rest else (self.empty_beat(), True)
            else:
                beat, stop = self._resident_host[0](i)
            if stop:  # never run: masks that move nothing
                return beat, self.empty_masks(), np.asarray(True)
            return beat, self.decide(beat), np.asarray(False)

        def deliver_unless_warming(i, out):
            if self._warming_resident is None:
                self._resident_host[1](i, out)

        fn = step_lib.make_resident(
            self.cfg, self.serve, next_or_stop, deliver_unless_warming, self.kernels
        )
        args = (self.params, self.state, self.template, self.empty_beat(), self.empty_masks())
        with callback_cache.kept(_callback_cache_dir()):
            compiled = fn.lower(*args).compile()
        self.compile_s = time.perf_counter() - t
        _log_compiled("resident loop", compiled, self.memory)
        self._resident = compiled
        return compiled

    def warm_resident(self, compiled) -> float:
        """Runs a compiled resident loop down every path (``warm``'s two beats), then ``reset``;
        returns seconds.

        As ``warm`` for the dispatch tick: the first iteration of each compiled loop pays a first
        execution's one-time costs (1.3 s for the first beat at 56 sessions on an H200, where the
        beat is 130 ms), which a clock already running would count as skipped beats. The host's
        callbacks are not called (``compile_resident``). A server calls it before its clock starts.
        """
        t = time.perf_counter()
        first, *rest = self._warm_beats()
        self._warming_resident = rest  # the beats after the first; then the loop stops
        try:
            self.run_resident(compiled, first)
        finally:
            self._warming_resident = None
        self.reset()
        jax.block_until_ready(self.state)
        return time.perf_counter() - t

    def run_resident(self, compiled, first_beat: state_lib.BeatInput) -> None:
        """Runs the whole serving run as one on-device loop; the state is donated and replaced.
        Each beat's masks are the slot rule's, decided on the host (the first one here)."""
        masks = self.decide(first_beat)
        self.state = compiled(self.params, self.state, self.template, first_beat, masks)
        jax.block_until_ready(self.state)


_pack_output = jax.jit(state_lib.pack_output)


def _callback_cache_dir() -> str | None:
    """Where the resident loop is kept: beside JAX's persistent cache, when that is on."""
    root = jax.config.jax_compilation_cache_dir
    return os.path.join(root, "host_callbacks") if root else None


def _log_compiled(name: str, compiled, plan: MemoryPlan) -> None:
    """Logs the compiled program's memory: the state should be aliased, the scratch small."""
    try:
        m = compiled.memory_analysis()
    except (AttributeError, NotImplementedError):  # some backends report nothing
        return
    if m is None:
        return
    logging.info(
        "%s compiled: scratch %.1f MiB, %.1f MiB of arguments aliased to outputs (state %.1f MiB)",
        name,
        m.temp_size_in_bytes / 2**20,
        m.alias_size_in_bytes / 2**20,
        plan.state_bytes / 2**20,
    )


_ONE_USE_COMPILE = {"xla_gpu_autotune_level": 0}  # programs run once: no kernel timing


def build_template(params, cfg: ModelConfig, serve: ServeConfig):
    """The fresh-session state (batch 1) for a server configuration, jitted.

    Jitted because op by op the 11B template took ~60 s on an H200, mostly per-op compiles.
    Compiled without XLA's GPU autotuning (``xla_gpu_autotune_level=0``): the program runs once
    per process, so timing candidate GEMM and convolution kernels for it buys nothing (with the
    reference policy's fp32 products its compile took 314 s on a fresh H200 with autotuning on).
    Any algorithm XLA picks computes the same fp32 products; the tick keeps full autotuning.
    """

    return _template_program(cfg, serve)(params)


@functools.lru_cache(maxsize=step_lib.PROGRAMS_KEPT)
def _template_program(cfg: ModelConfig, serve: ServeConfig) -> Callable:
    """``build_template``'s jitted program, one per configuration (``step.PROGRAMS_KEPT``)."""
    return jax.jit(template_fn(cfg, serve), compiler_options=_ONE_USE_COMPILE)


def template_fn(cfg: ModelConfig, serve: ServeConfig) -> Callable:
    """params -> the fresh-session state for ``serve``, traced in its policy's matmul scope (what
    ``build_template`` compiles; traceable, e.g. by ``jax.eval_shape``)."""
    precision = serve.precision
    serve.check_model(cfg)  # ids past the vocabulary would read past the embedding table

    def initial(p):
        with precision.scope():
            return voicechat.initial_state(
                p,
                cfg=cfg,
                precision=precision,
                max_len=serve.context_frames,
                system_prompt=serve.system_prompt,
                deterministic=serve.deterministic,
                codec_frame_behind=serve.codec_frame_behind,
            )

    return initial
