"""Slot buckets on the device: the moves between slot counts an ``Engine`` compiled.

An ``Engine`` with ``buckets`` (a small fixed set of slot counts, the largest being
``ServeConfig.slots``) compiles a tick for each before the clock starts, so a beat costs what its
bucket costs, not what the largest would. The host's scheduler (``serving.scheduler.SlotBuckets``)
picks the bucket each beat and compacts sessions into the low slots; ``Engine.place`` then moves
the state into the new bucket with ``resize``, one jitted copy of every slot that stays (bit for
bit) into a state of the new size whose other slots hold the fresh template (``source_slots``
says which slot each comes from).

The host side sees the largest bucket throughout: beats are built for ``ServeConfig.slots`` slots
(the rows of slots past the bucket are empty and dropped before the tick) and the outputs are
padded back to it (``pad_slots``: ``ran`` off in the padding), so the slot table, input queues and
output buffers keep one shape.

Memory: a move allocates the new state before the old one is freed, so the engine's plan checks
that the largest bucket and the next largest fit side by side.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from voicechat_jax import state as state_lib
from voicechat_jax.model import voicechat


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
resize_jit = jax.jit(resize, static_argnames="slots")


def pad_slots(out: state_lib.BeatOutput, *, slots: int) -> state_lib.BeatOutput:
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
