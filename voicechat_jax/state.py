"""SessionState: every array a live call keeps between beats, in fixed slots (slot axis first).

The model's per-frame state (``voicechat.FrameState``: encoder caches, Mamba SSM and conv states,
both KV caches, previous tokens and codes, codec tails, positions) is held for ``B`` slots at once,
sized once for the context cap. On top of it the engine keeps, per slot, whether it is live and the
session's sampling key. Admission copies a fresh-session *template* (speaker-prompt and
system-prompt prefill, done once at start-up) into a slot, in place; release only clears
``active``.

Layout (11B, cap 1,500 frames, reference precision; per slot): the large leaves are one buffer per
layer in the layout their decode update reads, slot axis first, and the tick updates each where it
lies (the state is donated; every update masks itself by the slots that run):

- ``model.tts.k`` / ``.v``: 28 x [B, 2, K, S, H] fp32, the speech decoder's KV (cond and uncond
  rows), ~0.77 GB: the largest item;
- ``model.llm.ssm``: 27 x [B, N, H, P] fp32, the Mamba-2 SSM state, ~142 MB;
- ``model.llm.k`` / ``.v``: 4 x [B, K, S, H] bf16, the LLM's KV;
- small leaves (encoder caches ~7 MB, the Mamba conv state stacked as [B, L_m, k-1, C], RNNT,
  codec tails, previous tokens and codes, counters), each documented in its module.

The beat's inputs and outputs (``BeatInput``, its ``SlotMasks``, ``BeatOutput``) are the only
arrays that cross between host and device per beat.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from voicechat_jax.model import voicechat


@struct.dataclass
class SessionState:
    """All slots' state. Arrays only; slot axis first."""

    model: voicechat.FrameState  # the network's carried state, [B, ...] leaves
    active: jax.Array  # [B] bool: the slot holds a live session
    key: jax.Array  # [B, 2] uint32: the session's sampling key (raw key data)


@struct.dataclass
class BeatInput:
    """What the host asks of one beat (a scheduler decides ``run`` and ``reseed``); the slot rule
    turns it into the beat's ``SlotMasks``, and the tick reads only ``audio``, ``key`` and
    ``capsule`` of it beside them."""

    audio: jax.Array  # [B, frames_per_tick * 1280] float32, 16 kHz; silence where nothing arrived
    admit: jax.Array  # [B] bool: copy the fresh-session template into these slots first
    release: jax.Array  # [B] bool: these slots end before the beat
    key: jax.Array  # [B, 2] uint32: sampling key of the sessions admitted this beat
    run: jax.Array  # [B] bool: live slots that advance this beat (a held slot stays bit-identical)
    reseed: jax.Array  # [B] bool: roll these sessions over to a fresh context before the beat
    capsule: jax.Array  # [B, U] int32: token ids of a slot's capsule (``reseed``, ``prefill``)
    capsule_len: jax.Array  # [B] int32: its length (0: the system prompt alone)
    # [B] bool: these sessions will be in ``reseed`` next beat with the capsule given here; an
    # engine that can prefills it after this beat's tick, in its slack (``step.CapsuleLane``).
    prefill: jax.Array


@struct.dataclass
class SlotMasks:
    """What the slot rule decided for one beat (``slot_rule.SlotRule.decide``): the tick applies
    these and decides nothing itself."""

    admit: jax.Array  # [B] bool: the fresh-session template is written into these slots first
    # [B] bool: these sessions roll over to a fresh context before the beat (the host's
    # roll-overs, and every live slot at the cap unless ``at_cap='end'``)
    rolled: jax.Array
    capsule_len: jax.Array  # [B] int32: a rolled slot's capsule length (0: the system prompt alone)
    live: jax.Array  # [B] bool: live in the beat (released and admitted slots applied)
    ran: jax.Array  # [B] bool: the slots that advance (a live slot outside it stays bit-identical)
    active: jax.Array  # [B] bool: live after the beat
    at_cap: jax.Array  # [B] bool: live, not rolled over, and with no room: ended at the cap


@struct.dataclass
class BeatOutput:
    """What the host picks up after one beat."""

    frames: voicechat.FrameOutputs  # text, function, codes, wav, transcript of the beat's frames
    ran: jax.Array  # [B] bool: the slot advanced this beat (its frames are valid)
    active: jax.Array  # [B] bool: live after the beat
    at_cap: jax.Array  # [B] bool: the session reached the context cap this beat
    reseeded: jax.Array  # [B] bool: the session rolled over to a fresh context this beat
    frame: jax.Array  # [B] int32: frames the session has done after the beat

    def named(self) -> dict[str, jax.Array]:
        """The leaves by the host's names (``serving.writer.HostBeat``'s fields, in its order)."""
        f = self.frames
        return {
            "text": f.text,
            "function": f.function,
            "codes": f.codes,
            "wav": f.wav,
            "transcript": f.transcript,
            "n_transcript": f.n_transcript,
            "ran": self.ran,
            "active": self.active,
            "at_cap": self.at_cap,
            "reseeded": self.reseeded,
            "frame": self.frame,
        }


def pack_output(out: BeatOutput) -> jax.Array:
    """``out``'s leaves in one flat uint32 array, in ``BeatOutput.named``'s order: 4-byte leaves
    bitcast, bools as 0 / 1 (``serving.writer.HostBeat.fill_packed`` reads it back exactly).

    The dispatch loop copies this one array back to the host each beat instead of the 11 leaves:
    on the H200's host the pickup of the 11 was 2.1-2.3 ms at p99 (2026-12-05, ``a6cb770``),
    where every device-to-host copy and its completion is a call of its own."""
    parts = []
    for name, v in out.named().items():
        if v.dtype == jnp.bool_:
            v = v.astype(jnp.uint32)
        elif v.dtype.itemsize == 4:
            v = jax.lax.bitcast_convert_type(v, jnp.uint32)
        else:
            raise TypeError(f"pack_output packs 4-byte and bool leaves: {name} is {v.dtype}")
        parts.append(v.reshape(-1))
    return jnp.concatenate(parts)


def empty_beat(slots: int, samples: int, capsule_tokens: int = 96) -> BeatInput:
    """A beat with no audio, no admission, release or roll-over, every live slot running."""
    # NumPy on purpose: building a beat on the host must not compile or run anything on device.
    return BeatInput(
        audio=np.zeros((slots, samples), np.float32),
        admit=np.zeros((slots,), np.bool_),
        release=np.zeros((slots,), np.bool_),
        key=np.zeros((slots, 2), np.uint32),
        run=np.ones((slots,), np.bool_),
        reseed=np.zeros((slots,), np.bool_),
        capsule=np.zeros((slots, capsule_tokens), np.int32),
        capsule_len=np.zeros((slots,), np.int32),
        prefill=np.zeros((slots,), np.bool_),
    )


def masks_of(beat: BeatInput) -> SlotMasks:
    """Benchmarks and kernel tests that step every slot of a fresh state: the masks of ``beat``
    when every slot it runs is live with room, i.e. ``run`` live, nothing admitted or rolled."""
    run = np.asarray(beat.run, np.bool_)
    none = np.zeros_like(run)
    zero = np.zeros(run.shape, np.int32)
    return SlotMasks(
        admit=none, rolled=none, capsule_len=zero, live=run, ran=run, active=run, at_cap=none
    )


@functools.partial(jax.jit, static_argnums=1)
def from_template(template: voicechat.FrameState, slots: int) -> SessionState:
    """All ``slots`` slots holding the fresh-session template, none active.

    One program per template layout and slot count: op by op, each leaf's broadcast and copy
    compiled on its own, some 600 small programs over a suite run (2026-12-06), each too quick
    for the persistent cache to keep, so every process compiled them again.
    """
    model = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (slots, *x.shape[1:])), template)
    return SessionState(
        model=model,
        active=jnp.zeros((slots,), bool),
        key=jnp.zeros((slots, 2), jnp.uint32),
    )
