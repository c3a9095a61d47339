"""The tick: one beat for every slot, pure and jitted once; and the two ways to drive it.

``tick(params, state, template, beat)`` admits and releases sessions (the fresh-session template
written into each admitted slot in place), advances every slot by ``frames_per_tick`` frames, and
keeps inactive slots bit-identical: every update masks itself, nothing selects between two whole
states, so the donated state is updated where it lies. Both drivers call the same tick, so they
produce the same outputs bit for bit:

- ``resident_loop``: one jitted ``lax.while_loop`` for the whole serving run. Each iteration takes
  the beat's input from the host and hands the beat's output back through ordered ``io_callback``s;
  the host decides when to stop.
- dispatch (``make_tick``): one donated jitted call per beat; the host reads beat k's output while
  beat k+1 runs (``serving.server``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from voicechat_jax.config import ModelConfig, ServeConfig
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.state import BeatInput, BeatOutput, SessionState

# Incremented each time the tick is traced: tests assert the server compiles it exactly once.
TRACE_COUNT = {"tick": 0}


def insert(model: voicechat.FrameState, template: voicechat.FrameState, mask: jax.Array):
    """The slots in ``mask`` [B] set to the fresh-session template, in place; others untouched.

    A loop over the masked slots writes the template ([1, ...] leaves) into each with
    ``dynamic_update_slice`` (maxtext's ``insert``): the carried state is updated where it lies
    and a beat where nobody joins runs the loop zero times.
    """
    B = mask.shape[0]
    slots = jnp.nonzero(mask, size=B, fill_value=0)[0]  # the masked slots first

    def one(i, m):
        def put(x, t):
            return jax.lax.dynamic_update_slice_in_dim(x, t.astype(x.dtype), slots[i], axis=0)

        return jax.tree_util.tree_map(put, m, template)

    return jax.lax.fori_loop(0, jnp.sum(mask, dtype=jnp.int32), one, model)


def tick(
    params,
    state: SessionState,
    template: voicechat.FrameState,
    beat: BeatInput,
    *,
    cfg: ModelConfig,
    serve: ServeConfig,
    precision: Precision,
) -> tuple[SessionState, BeatOutput]:
    """Advance every slot by one beat, in place. Donates ``state`` when jitted (``make_tick``).

    Args:
      params: ``voicechat.ModelParams``.
      state: all slots, ``[B, ...]``.
      template: the fresh-session state, ``[1, ...]`` leaves.
      beat: the host's input for this beat.

    Returns:
      The new state and the beat's outputs. A slot that is inactive, or would pass the context
      cap (``at_cap='end'``), does not advance and its state is returned bit-identical; with
      ``at_cap='rollover'`` a session at the cap is re-seeded from the template and runs its beat.
      No select over the whole state: admission writes the template into the admitted slots, and
      every update in ``voicechat.advance`` masks itself by the slots that run.
    """
    TRACE_COUNT["tick"] += 1
    fpt = serve.frames_per_tick
    active = (state.active & ~beat.release) | beat.admit
    model = insert(state.model, template, beat.admit)
    key = jnp.where(beat.admit[:, None], beat.key, state.key)

    room = model.frame + fpt <= serve.context_frames
    at_cap = active & ~room
    if serve.at_cap == "rollover":
        # Re-seed a session at the cap from the template before its beat; it keeps its sampling
        # key and loses no audio.
        model = insert(model, template, at_cap)
        ran = active
    else:
        ran = active & room
        active = active & ~at_cap
    model, frames = voicechat.advance(
        params,
        model,
        beat.audio,
        key,
        ran,
        cfg=cfg,
        precision=precision,
        deterministic=serve.deterministic,
        attention=serve.attention,
        ssm_kernel=serve.ssm_kernel,
    )
    new_state = SessionState(model=model, active=active, key=key)
    out = BeatOutput(frames=frames, ran=ran, active=active, at_cap=at_cap, frame=model.frame)
    return new_state, out


def make_tick(cfg: ModelConfig, serve: ServeConfig, precision: Precision) -> Callable:
    """The jitted tick for one server configuration; argument 1 (the state) is donated."""
    return jax.jit(_in_scope(tick, cfg=cfg, serve=serve, precision=precision), donate_argnums=(1,))


def _in_scope(fn: Callable, **kw) -> Callable:
    """``fn`` with ``kw`` bound, traced inside the precision policy's matmul scope."""
    precision = kw["precision"]

    @functools.wraps(fn)
    def scoped(*args):
        with precision.scope():
            return fn(*args, **kw)

    return scoped


def resident_loop(
    params,
    state: SessionState,
    template: voicechat.FrameState,
    first_beat: BeatInput,
    *,
    next_beat: Callable[[np.ndarray], tuple],
    deliver: Callable[..., None],
    cfg: ModelConfig,
    serve: ServeConfig,
    precision: Precision,
) -> SessionState:
    """Run ticks on the device until the host says stop; returns the final state.

    ``next_beat(k) -> (audio, admit, release, key, stop)`` (NumPy) gives beat k+1's input;
    ``deliver(k, out)`` receives beat k's ``BeatOutput`` with NumPy leaves. Both run on the host
    through ordered ``io_callback``s: the device waits for them, and they never call JAX.
    """
    beat_struct = (
        jax.ShapeDtypeStruct(first_beat.audio.shape, jnp.float32),
        jax.ShapeDtypeStruct(first_beat.admit.shape, jnp.bool_),
        jax.ShapeDtypeStruct(first_beat.release.shape, jnp.bool_),
        jax.ShapeDtypeStruct(first_beat.key.shape, jnp.uint32),
        jax.ShapeDtypeStruct((), jnp.bool_),
    )

    def body(carry):
        k, s, beat, _ = carry
        s, out = tick(params, s, template, beat, cfg=cfg, serve=serve, precision=precision)
        leaves, treedef = jax.tree_util.tree_flatten(out)

        def deliver_host(kk, *host_leaves):
            deliver(int(kk), jax.tree_util.tree_unflatten(treedef, host_leaves))
            return np.zeros((), np.int32)

        token = io_callback(
            deliver_host, jax.ShapeDtypeStruct((), jnp.int32), k, *leaves, ordered=True
        )
        audio, admit, release, key, stop = io_callback(
            lambda kk, _tok: next_beat(int(kk)), beat_struct, k, token, ordered=True
        )
        nb = BeatInput(audio=audio, admit=admit, release=release, key=key)
        return k + 1, s, nb, stop

    def cond(carry):
        return ~carry[3]

    carry = (jnp.zeros((), jnp.int32), state, first_beat, jnp.zeros((), jnp.bool_))
    _, state, _, _ = jax.lax.while_loop(cond, body, carry)
    return state


def make_resident(cfg: ModelConfig, serve: ServeConfig, precision: Precision, next_beat, deliver):
    """The jitted resident loop; the state (argument 1) is donated."""
    fn = _in_scope(
        resident_loop,
        next_beat=next_beat,
        deliver=deliver,
        cfg=cfg,
        serve=serve,
        precision=precision,
    )
    return jax.jit(fn, donate_argnums=(1,))
