"""Slot buckets on the device: ticks compiled for a few slot counts, and moving sessions between.

A ``BucketEngine`` is an ``Engine`` whose state lives in one of a small fixed set of slot counts
(``buckets``, the largest being ``ServeConfig.slots``). Every bucket's tick is compiled before the
clock starts (the one tick program of ``step.make_tick``, lowered at each slot count), so a beat
costs what its bucket costs, not what the largest would. The host's scheduler
(``serving.scheduler.SlotBuckets``) picks the bucket each beat and compacts sessions into the low
slots; ``place`` then moves the state into the new bucket with ``resize``, one jitted copy of
every slot that stays (bit for bit) into a state of the new size whose other slots hold the fresh
template.

The host side sees the largest bucket throughout: beats are built for ``ServeConfig.slots`` slots
(the rows of slots past the bucket are empty and dropped before the tick) and the outputs are
padded back to it (``ran`` off in the padding), so the slot table, input queues and output buffers
keep one shape.

Memory: a move allocates the new state before the old one is freed, so the plan checks that the
largest bucket and the next largest fit side by side.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ModelConfig, ServeConfig
from voicechat_jax.engine import Engine, MemoryPlanError, plan_memory
from voicechat_jax.model import voicechat
from voicechat_jax.slot_rule import SlotRule


def resize(
    state: state_lib.SessionState, template: voicechat.FrameState, src: jax.Array, *, slots: int
) -> state_lib.SessionState:
    """A state of ``slots`` slots whose slot ``i`` is slot ``src[i]`` of ``state``.

    Every leaf of a kept slot (model state, live flag, sampling key) is copied bit for bit; a slot
    with ``src[i] < 0`` holds the fresh-session template and is inactive (as in a new engine). The
    new state is allocated once (the template broadcast) and the kept slots are written into it in
    place, one ``dynamic_update_slice`` each, so no second copy of either state is made. Does not
    donate ``state`` (its buffers cannot be reused for another shape).

    Args:
      state: ``[B, ...]`` leaves.
      template: ``[1, ...]`` leaves.
      src: ``[slots]`` int32, a slot of ``state`` or -1; each slot of ``state`` at most once.
    """
    fresh = state_lib.from_template(template, slots)
    kept = src >= 0
    dst = jnp.nonzero(kept, size=slots, fill_value=0)[0]  # the kept new slots first

    def one(i, new):
        d = dst[i]
        s = src[d]

        def put(n, o):
            row = jax.lax.dynamic_slice_in_dim(o, s, 1, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(n, row, d, axis=0)

        return jax.tree_util.tree_map(put, new, state)

    return jax.lax.fori_loop(0, jnp.sum(kept, dtype=jnp.int32), one, fresh)


# One jitted resize; it compiles once per (old, new) slot count pair.
_resize = jax.jit(resize, static_argnames="slots")


def _pad_slots(out: state_lib.BeatOutput, *, slots: int) -> state_lib.BeatOutput:
    """Every leaf of ``out`` ([b, ...]) padded with zeros (``ran`` off) to ``slots`` rows."""

    def pad(x):
        return jnp.pad(x, [(0, slots - x.shape[0])] + [(0, 0)] * (x.ndim - 1))

    return jax.tree_util.tree_map(pad, out)


def source_slots(old_bucket: int, new_bucket: int, moves: Sequence[tuple[int, int]]) -> np.ndarray:
    """``resize``'s ``src`` for a bucket change with ``moves`` ((src, dst) slot pairs).

    A slot below both buckets keeps its row (live or not: an empty slot keeps whatever it held,
    as in a fixed engine); a move's destination takes its source's row; a move's source (if it
    stays inside the new bucket) and every slot past the old bucket get the fresh template.
    """
    src = np.full((new_bucket,), -1, np.int32)
    keep = min(old_bucket, new_bucket)
    src[:keep] = np.arange(keep, dtype=np.int32)
    for s, _ in moves:
        if s < new_bucket:
            src[s] = -1
    for s, d in moves:
        if not (0 <= s < old_bucket and 0 <= d < new_bucket):
            raise ValueError(f"move {s} -> {d} outside the buckets {old_bucket} -> {new_bucket}")
        src[d] = s
    return src


class BucketEngine(Engine):
    """An ``Engine`` with one compiled tick per slot bucket; see the module docstring.

    Args:
      buckets: slot counts; the largest must be ``serve.slots`` (the host's slot table). The state
        starts in the smallest.
      ticks: ticks already compiled for some of the buckets, by slot count: the
        ``compile_tick()`` of an ``Engine(..., staged=False)`` (whose tick admits and rolls over
        in its own program) with this ``cfg``, ``serve`` (but for ``slots``), ``params`` and
        ``template``: one compile saved per bucket (a fixed engine's tick is the largest bucket's).
      Others as ``Engine`` (no mesh: the slot axis is not split).

    Raises:
      MemoryPlanError: the largest bucket's state and the next largest's do not fit side by side.
    """

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        serve: ServeConfig,
        *,
        buckets: Sequence[int],
        template: voicechat.FrameState | None = None,
        memory_limit_bytes: int | None = None,
        ticks: Mapping[int, object] | None = None,
    ):
        b = tuple(sorted(set(int(x) for x in buckets)))
        if not b or b[0] < 1 or b[-1] != serve.slots:
            raise ValueError(f"buckets {tuple(buckets)} must be >= 1 and end at {serve.slots}")
        self.buckets = b
        self.bucket = b[0]  # the state's slot count now
        super().__init__(
            params, cfg, serve, template=template, memory_limit_bytes=memory_limit_bytes,
            staged=False,
        )  # fmt: skip
        if len(b) > 1:
            peak = plan_memory(self.template, b[-1] + b[-2], limit_bytes=memory_limit_bytes)
            if not peak.fits:
                raise MemoryPlanError(
                    f"a move into the largest bucket holds two states at once: {peak.describe()}"
                )
        self.bucket_kernels = {b: serve.kernels(None, b) for b in self.buckets}
        self._given = dict(ticks or {})
        self._ticks: dict[int, object] = {}
        self._pads: dict[int, object] = {}
        self._resizes: dict[tuple[int, int], object] = {}
        self.compiles = 0  # programs compiled: ticks, output pads and resizes
        self.moved_slots = 0  # slots copied by moves (the kept ones)
        self.move_s: list[float] = []  # host seconds to dispatch each resize (not device time)

    def _fresh_state(self) -> state_lib.SessionState:
        return state_lib.from_template(self.template, self.bucket)

    def warm(self) -> float:
        """Not done for buckets (``Engine.warm`` runs one tick on every slot): each bucket's tick
        is first executed while serving, and its first beat may carry one-time costs."""
        return 0.0

    def reset(self) -> None:
        """Every slot back to the fresh template in the smallest bucket (compiled ticks kept)."""
        self.state = None
        self.bucket = self.buckets[0]
        self.state = self._fresh_state()
        self._rule = SlotRule.fresh(self.template, self.serve.slots)

    @property
    def rule(self) -> SlotRule:
        """The slot rule over the host's ``serve.slots`` slots (read back from the bucket's state
        if it was set from outside; the slots past the bucket are free)."""
        if self._rule is None:
            rule = SlotRule.fresh(self.template, self.serve.slots)
            read = SlotRule.read(self.state, self.template)
            for name in ("active", "llm_length", "tts_pos", "tts_frame"):
                getattr(rule, name)[: self.bucket] = getattr(read, name)
            self._rule = rule
        return self._rule

    def _abstract_state(self, slots: int):
        return jax.eval_shape(lambda t: state_lib.from_template(t, slots), self.template)

    def _beat(self, slots: int) -> tuple[state_lib.BeatInput, state_lib.SlotMasks]:
        """An empty beat and its masks, cut to ``slots`` rows (for lowering)."""
        return jax.tree_util.tree_map(lambda x: x[:slots], (self.empty_beat(), self.empty_masks()))

    def compile_tick(self):
        """Compiles every bucket's tick, the output pads and every resize, once (before the
        clock starts); returns the current bucket's tick."""
        if not self._ticks:
            t = time.perf_counter()
            reused = 0
            B = self.serve.slots
            pad = jax.jit(functools.partial(_pad_slots, slots=B))
            for b in self.buckets:
                # Each bucket's own kernels: 'auto' chooses by the slots a program runs.
                jitted = step_lib.make_tick(self.cfg, self.serve, self.bucket_kernels[b])
                state_b = self._abstract_state(b)
                if b in self._given:
                    self._ticks[b] = self._given[b]
                    reused += 1
                else:
                    lowered = jitted.lower(self.params, state_b, self.template, *self._beat(b))
                    self._ticks[b] = lowered.compile()
                if b < B:
                    out_b = jax.eval_shape(
                        jitted, self.params, state_b, self.template, *self._beat(b)
                    )[1]
                    self._pads[b] = pad.lower(out_b).compile()
                for c in self.buckets:
                    if c != b:
                        src = jax.ShapeDtypeStruct((c,), jnp.int32)
                        low = _resize.lower(state_b, self.template, src, slots=c)
                        self._resizes[(b, c)] = low.compile()
            self.compiles = len(self._ticks) - reused + len(self._pads) + len(self._resizes)
            self.compile_s = time.perf_counter() - t
            logging.info(
                "bucket engine: %d ticks (%s slots), %d pads, %d resizes compiled in %.1f s",
                len(self._ticks),
                ",".join(map(str, self.buckets)),
                len(self._pads),
                len(self._resizes),
                self.compile_s,
            )
        return self._ticks[self.bucket]

    def tick(self, beat: state_lib.BeatInput) -> state_lib.BeatOutput:
        """Dispatches one beat in the current bucket; ``beat`` and the outputs have
        ``serve.slots`` rows (rows past the bucket must be empty: no admission there)."""
        b = self.bucket
        self.compile_tick()
        tick = self._ticks[b]
        if b < self.serve.slots and np.any(np.asarray(beat.admit)[b:]):
            raise ValueError(f"admission past the bucket of {b} slots")
        rule = self.rule
        masks = rule.decide(beat, self.serve)
        if b < self.serve.slots:
            beat, masks = jax.tree_util.tree_map(lambda x: x[:b], (beat, masks))
        self._state, out = tick(self.params, self._state, self.template, beat, masks)
        return self._pads[b](out) if b < self.serve.slots else out

    def place(self, plan) -> None:
        """Moves the state into ``plan.bucket`` slots with ``plan.moves`` (a
        ``scheduler.BeatPlan`` whose moves the slot table has had); a no-op if nothing changes."""
        if plan.bucket == self.bucket and not plan.moves:
            return
        if plan.bucket not in self.buckets:
            raise ValueError(f"bucket {plan.bucket} is not compiled: {self.buckets}")
        self.compile_tick()
        src = source_slots(self.bucket, plan.bucket, [(m.src, m.dst) for m in plan.moves])
        t = time.perf_counter()
        rule = self.rule
        if plan.bucket == self.bucket:  # moves inside one bucket: compiled on first use
            self._state = _resize(self._state, self.template, src, slots=plan.bucket)
        else:
            self._state = self._resizes[(self.bucket, plan.bucket)](self._state, self.template, src)
        host_src = np.full((self.serve.slots,), -1, np.int32)
        host_src[: plan.bucket] = src
        rule.move(host_src)
        self.move_s.append(time.perf_counter() - t)
        self.moved_slots += int(np.sum(src >= 0))
        logging.debug("slots %d -> %d, moves %s", self.bucket, plan.bucket, plan.moves)
        self.bucket = plan.bucket

    def compile_resident(self, next_beat, deliver):
        raise ValueError("slot buckets need the dispatch loop (a move happens between two ticks)")
