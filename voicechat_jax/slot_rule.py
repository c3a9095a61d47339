"""The slot rule, written once: what a beat does to every slot, decided on the host.

``SlotRule`` keeps, per slot, what the host knows without asking the device: whether a session is
live, how full its two attention caches are and the speech decoder's frame count, as the tick
leaves them. ``decide(beat)`` applies the rule to the host's request for a beat (``BeatInput``:
admissions, releases, the scheduler's run mask, roll-overs with their capsules) and returns the
beat's ``SlotMasks``, moving its copy past the tick. Every tick (the dispatch loop's, staged or
one program, on one device or a mesh; the resident loop's, whose host callback decides each
beat; each bucket's) takes those masks and decides nothing itself (maxtext's ``insert`` and
``generate`` take decided inputs), so the rule lives here and nowhere else:

- a released slot is free before the beat; an admitted one holds the fresh-session template and
  is live (admission wins over a release of the same slot);
- a live slot the host rolls over (``reseed``) starts again from the template's context with its
  capsule; unless ``at_cap='end'``, a live slot whose caches have no room for another beat rolls
  over too, with an empty capsule (the fallback at the cap);
- ``hold_full`` (benchmarks) sets every live slot's caches one beat short of full;
- a live slot without room after that has reached the cap: it ends (``at_cap='end'``);
- a live slot with room runs when the scheduler lets it (``run``) and advances its caches by the
  beat's frames (the speech decoder's first frame stores nothing).

The device's own state says the same, beat by beat: ``tests/test_slot_rule.py`` drives random
beats through the engines and checks this copy against the device after every one.
"""

from __future__ import annotations

import numpy as np

from voicechat_jax.config import ServeConfig
from voicechat_jax.model import voicechat
from voicechat_jax.state import BeatInput, SessionState, SlotMasks


class SlotRule:
    """The host's copy of every slot's live flag and cache fills, and the rule that moves it.

    Kept by ``Engine`` beside its state; read back from the device (``read``) when the state was
    replaced from outside.
    """

    def __init__(self, active, llm_length, tts_pos, tts_frame, template: voicechat.FrameState):
        self.active = np.array(active, np.bool_)
        self.llm_length = np.array(llm_length, np.int32)
        self.tts_pos = np.array(tts_pos, np.int32)
        # The speech decoder skips its first frame (frame 0), which stores nothing in its cache.
        self.tts_frame = np.array(tts_frame, np.int32)
        self.fresh_llm = int(np.asarray(template.llm.length)[0])
        self.fresh_tts = int(np.asarray(template.tts.pos)[0])
        self.fresh_frame = int(np.asarray(template.tts.frame)[0])
        self.llm_rows = template.llm.k[0].shape[2]
        self.tts_rows = template.tts.k[0].shape[3]

    @classmethod
    def fresh(cls, template: voicechat.FrameState, slots: int) -> SlotRule:
        """A new engine's slots: none live, every one holding the template."""
        t = template
        llm, tts = np.asarray(t.llm.length), np.asarray(t.tts.pos)
        frame = np.asarray(t.tts.frame)
        return cls(np.zeros(slots, bool), *(np.repeat(x, slots) for x in (llm, tts, frame)), t)

    @classmethod
    def read(cls, state: SessionState, template: voicechat.FrameState) -> SlotRule:
        """The copy of ``state`` as it is on the device (waits for it)."""
        m = state.model
        arrays = (state.active, m.llm.length, m.tts.pos, m.tts.frame)
        return cls(*(np.asarray(x) for x in arrays), template)

    @property
    def slots(self) -> int:
        return self.active.shape[0]

    def _room(self, fpt: int) -> np.ndarray:
        return (self.llm_length + fpt <= self.llm_rows) & (self.tts_pos + fpt <= self.tts_rows)

    def decide(self, beat: BeatInput, serve: ServeConfig) -> SlotMasks:
        """The beat's masks (NumPy) for ``beat``, the host's request; the copy moves past the tick.

        ``rolled`` holds the host's roll-overs of live slots and, unless ``at_cap='end'``, every
        live slot at the cap (with ``capsule_len`` 0).
        """
        fpt = serve.frames_per_tick
        admit = np.asarray(beat.admit, bool)
        live = (self.active & ~np.asarray(beat.release, bool)) | admit
        self.llm_length[admit] = self.fresh_llm
        self.tts_pos[admit] = self.fresh_tts
        self.tts_frame[admit] = self.fresh_frame
        rolled = live & np.asarray(beat.reseed, bool)
        capsule_len = np.where(rolled, np.asarray(beat.capsule_len, np.int32), 0).astype(np.int32)
        if serve.at_cap != "end":
            rolled |= live & ~self._room(fpt)
        self.llm_length[rolled] = self.fresh_llm + capsule_len[rolled]
        self.tts_pos[rolled] = self.fresh_tts
        self.tts_frame[rolled] = 1  # a rolled-over voice goes on: no skipped frame
        if serve.hold_full:
            self.llm_length[live] = self.llm_rows - fpt
            self.tts_pos[live] = self.tts_rows - fpt
        room = self._room(fpt)
        active = live & room
        ran = active & np.asarray(beat.run, bool)
        self.llm_length += fpt * ran
        self.tts_pos += ran * (fpt - (self.tts_frame == 0))  # frame 0 stores nothing
        self.tts_frame += fpt * ran
        self.active = active
        return SlotMasks(
            admit=admit.copy(),
            rolled=rolled,
            capsule_len=capsule_len,
            live=live,
            ran=ran,
            active=active.copy(),
            at_cap=live & ~room & ~rolled,
        )

    def move(self, src: np.ndarray) -> None:
        """Slots moved as ``buckets.resize`` moves them: slot ``i`` takes what slot ``src[i]``
        held (-1: a free slot holding the template); slots past ``src`` are free. The slot count
        is kept (a bucket engine's host side always sees its largest bucket)."""
        src = np.asarray(src)
        keep = np.flatnonzero(src >= 0)
        fills = {
            "active": False,
            "llm_length": self.fresh_llm,
            "tts_pos": self.fresh_tts,
            "tts_frame": self.fresh_frame,
        }
        for name, fresh in fills.items():
            old = getattr(self, name)
            new = np.full_like(old, fresh)
            new[keep] = old[src[keep]]
            setattr(self, name, new)
