"""Conversation memory per session, the continuation capsule, and when to roll a session over.

The checkpoint is trained on about two minutes of context. A session that is to go on past that
is *rolled over* (``step.reseed``): its LLM context restarts from the system prompt followed by a
*capsule* of at most ``ServeConfig.capsule_tokens`` (U) token ids that tell the model what was
said, while the encoder, RNNT and codec streams and the audio go on. This module is the host's
part of it (no JAX):

- ``ConversationMemory``: one session's recent turns, fed beat by beat with the session's outputs
  (the writer thread) and read when a capsule is built (the beat thread; a lock between them).
  The *agent's* side is the LLM text channel (text ids other than PAD/BOS/EOS: LLM vocabulary);
  the *caller's* side is the RNNT transcript (the RNNT head's own vocabulary). A side's turn ends
  after ``MemoryConfig.turn_gap_frames`` frames with no new token on that side. Bounded: at most
  ``max_turns`` closed turns and ``max_turn_tokens`` ids per turn (the most recent kept).
- ``build_capsule``: at most U LLM token ids from the most recent turns. The model has no chat
  template for this, so the capsule is plain text, two ways:

  * with an LLM tokenizer (``TextTokenizer``): ``DIRECTIVE`` then one line per turn, oldest first,
    ``"User: ..."`` / ``"Agent: ..."``, encoded by the LLM tokenizer. A caller's turn is text
    only through the RNNT tokenizer (``asr_decode``: RNNT ids -> text); without one, the caller's
    turns are left out. The directive (as NVIDIA's TensorRT-Model-Connect runtime does) tells the
    model the call goes on and not to greet again.
  * without an LLM tokenizer (the tiny test model): the agent's turns only (the caller's ids are
    in another vocabulary and cannot be re-tokenized), as raw text-channel ids, each turn framed
    ``BOS ids EOS`` as the system prompt is framed. No directive (it would need a tokenizer).

  Either way whole turns are taken newest first while they fit; the newest turn that does not fit
  whole is cut to its most recent ids only when nothing else is in the capsule. The capsule also
  leaves room in the context: it is at most ``max_tokens`` ids (``RolloverPolicy.capsule_limit``).
- ``RolloverPolicy``: the mode (``end`` | ``rollover`` | ``reset`` | ``memory``) and the soft and
  hard thresholds in frames of the session's LLM context (positions after the system prompt:
  capsule plus frames since the last seed). Defaults 1,125 and 1,375 frames, as the
  TensorRT-Model-Connect runtime; scaled to a smaller cap (75 % and 92 % of it, and the hard one
  at least two beats below the cap: the server asks for a roll-over a beat before it is applied,
  ``Server._roll_over``, and the session runs that beat on its old context).
  ``decide`` rolls a session over between the thresholds when both sides have been silent for
  ``pause_frames`` frames, and at the hard threshold regardless.
  ``plan`` picks a beat's roll-overs from all its sessions: at most ``max_per_beat`` of them,
  because each one with a capsule costs the device a prefill of U positions (on an H200 with
  the 11B preset, ``experiments/rollover_cost``: +10.6 ms a roll-over at 16 sessions with the
  staged tick, 16 in one beat took it from 75 to 258 ms; an empty capsule skips the prefill,
  +0.8 ms). Asked a beat ahead, the prefill runs after the asking beat's tick, in its slack.
  Sessions that started together would otherwise reach the hard threshold together; ``plan``
  spreads them, rolling one early ("spread", between the thresholds) whenever those past the soft
  threshold could not all be rolled by the hard one at ``max_per_beat`` a beat. The ``rollover``
  mode has no host side: sessions that reach the cap in the same beat roll over in it together.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID

USER = "user"
AGENT = "agent"
DIRECTIVE = "The call continues; do not greet the caller again. Recent turns:"
PREFIXES = {USER: "User: ", AGENT: "Agent: "}

# Modes of ``ServeConfig.at_cap`` (and the CLI's ``--at_cap``).
END = "end"  # the session ends at the cap, with an event
ROLLOVER = "rollover"  # the device's fallback only: at the cap, an empty capsule (no thresholds)
RESET = "reset"  # the host rolls over between the thresholds, with an empty capsule
MEMORY = "memory"  # the host rolls over between the thresholds, with the conversation's capsule
MODES = (END, ROLLOVER, RESET, MEMORY)


class TextTokenizer(Protocol):
    """The LLM's text tokenizer, as far as the capsule needs it."""

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """How a session's turns are split and bounded."""

    turn_gap_frames: int = 6  # a side's turn ends after this many frames with no new token
    max_turns: int = 8  # closed turns kept (both sides together), the oldest dropped first
    max_turn_tokens: int = 96  # ids kept per turn (its most recent)
    skip_ids: frozenset[int] = frozenset({PAD_ID, BOS_ID, EOS_ID})  # text ids that are not words

    def __post_init__(self):
        if self.turn_gap_frames < 1 or self.max_turns < 1 or self.max_turn_tokens < 1:
            raise ValueError(f"memory bounds must be >= 1: {self}")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One side's turn: its token ids (agent: LLM ids; user: RNNT ids) and its first frame."""

    role: str  # USER | AGENT
    ids: tuple[int, ...]
    start: int  # the session frame of its first token


class _Side:
    def __init__(self, role: str, limit: int):
        self.role = role
        self.ids: collections.deque[int] = collections.deque(maxlen=limit)
        self.start = 0
        self.quiet = 1 << 30  # frames since this side's last token (none yet: long ago)


class ConversationMemory:
    """One session's recent turns on both sides (see the module docstring). Thread-safe."""

    def __init__(self, config: MemoryConfig | None = None):
        self.config = config or MemoryConfig()
        self._lock = threading.Lock()
        self._turns: collections.deque[Turn] = collections.deque(maxlen=self.config.max_turns)
        self._sides = {
            AGENT: _Side(AGENT, self.config.max_turn_tokens),
            USER: _Side(USER, self.config.max_turn_tokens),
        }
        self.frames = 0  # frames observed

    def observe(
        self,
        text: np.ndarray,
        transcript: np.ndarray | None = None,
        n_transcript: np.ndarray | None = None,
    ) -> None:
        """T frames of the session: text ids [T], RNNT ids [T, M] with ``n_transcript`` [T]."""
        skip = self.config.skip_ids
        with self._lock:
            for t in range(text.shape[0]):
                tok = int(text[t])
                self._frame(self._sides[AGENT], () if tok in skip else (tok,))
                user = () if transcript is None else transcript[t, : int(n_transcript[t])].tolist()
                self._frame(self._sides[USER], user)
                self.frames += 1

    def _frame(self, side: _Side, ids: Sequence[int]) -> None:
        if ids:
            if not side.ids:
                side.start = self.frames
            side.ids.extend(int(i) for i in ids)
            side.quiet = 0
            return
        side.quiet += 1
        if side.ids and side.quiet >= self.config.turn_gap_frames:
            self._turns.append(Turn(side.role, tuple(side.ids), side.start))
            side.ids.clear()

    def silent_frames(self) -> int:
        """Frames for which both sides have said nothing (the pause so far)."""
        with self._lock:
            return min(s.quiet for s in self._sides.values())

    def turns(self) -> list[Turn]:
        """The kept turns, closed and still open, in order of their first frame."""
        with self._lock:
            turns = list(self._turns)
            for side in self._sides.values():
                if side.ids:
                    turns.append(Turn(side.role, tuple(side.ids), side.start))
        return sorted(turns, key=lambda t: t.start)

    def retained(self) -> int:
        """Token ids kept (bounded by ``max_turns + 2`` turns of ``max_turn_tokens``)."""
        with self._lock:
            return sum(len(t.ids) for t in self._turns) + sum(
                len(s.ids) for s in self._sides.values()
            )


def _fit(pieces: list[list[int]], room: int) -> list[list[int]]:
    """The newest pieces (last in ``pieces``) that fit whole in ``room``, in their order; the
    newest alone, cut to its last ids, when not even it fits."""
    kept: list[list[int]] = []
    for piece in reversed(pieces):
        if len(piece) <= room:
            kept.append(piece)
            room -= len(piece)
        elif not kept and room > 0:
            kept.append(piece[len(piece) - room :])
            room = 0
        else:
            break
    return kept[::-1]


def build_capsule(
    turns: Sequence[Turn],
    max_tokens: int,
    *,
    llm_tokenizer: TextTokenizer | None = None,
    asr_decode: Callable[[Sequence[int]], str] | None = None,
    directive: str = DIRECTIVE,
) -> np.ndarray:
    """At most ``max_tokens`` LLM token ids [n] int32 from ``turns`` (see the module docstring)."""
    if max_tokens <= 0:
        return np.zeros((0,), np.int32)
    if llm_tokenizer is None:
        pieces = [[BOS_ID, *t.ids, EOS_ID] for t in turns if t.role == AGENT and t.ids]
        return np.asarray([i for piece in _fit(pieces, max_tokens) for i in piece], np.int32)
    pieces = []
    for t in turns:
        if t.role == AGENT:
            words = llm_tokenizer.decode(list(t.ids))
        elif asr_decode is not None:
            words = asr_decode(list(t.ids))
        else:
            continue  # the caller's ids are in the RNNT's vocabulary: no text without its tokenizer
        words = words.strip()
        if words:
            pieces.append(list(llm_tokenizer.encode("\n" + PREFIXES[t.role] + words)))
    head = list(llm_tokenizer.encode(directive)) if directive else []
    if len(head) >= max_tokens:
        head = []  # no room for the directive and a turn: the turns matter more
    body = [i for piece in _fit(pieces, max_tokens - len(head)) for i in piece]
    return np.asarray((head + body) if body else [], np.int32)


@dataclasses.dataclass(frozen=True)
class RolloverPolicy:
    """When the server rolls a session over (see the module docstring)."""

    mode: str = END
    soft_frames: int = 1125
    hard_frames: int = 1375
    pause_frames: int = 4  # both sides silent this long between the thresholds: roll over now
    capsule_tokens: int = 96  # U, the device's capsule room
    max_per_beat: int = 1  # roll-overs in one beat at most (each costs the beat a U prefill)
    frames_per_tick: int = 2  # frames a session's context grows per beat

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"at_cap must be one of {'|'.join(MODES)}, got {self.mode!r}")
        if not 0 < self.soft_frames <= self.hard_frames:
            raise ValueError(f"need 0 < soft <= hard: {self.soft_frames}, {self.hard_frames}")
        if self.max_per_beat < 1 or self.frames_per_tick < 1:
            raise ValueError(
                f"max_per_beat and frames_per_tick must be >= 1: {self.max_per_beat}, "
                f"{self.frames_per_tick}"
            )

    @classmethod
    def for_cap(
        cls,
        mode: str,
        context_frames: int,
        frames_per_tick: int,
        *,
        capsule_tokens: int = 96,
        soft_frames: int = 1125,
        hard_frames: int = 1375,
        pause_frames: int = 4,
        max_per_beat: int = 1,
    ) -> RolloverPolicy:
        """The thresholds scaled to the cap: at most 75 % / 92 % of it, hard two beats below it
        (a roll-over asked at it is applied a beat later)."""
        hard = min(hard_frames, round(0.92 * context_frames), context_frames - 2 * frames_per_tick)
        hard = max(hard, 1)
        soft = max(1, min(soft_frames, round(0.75 * context_frames), hard))
        return cls(mode, soft, hard, pause_frames, capsule_tokens, max_per_beat, frames_per_tick)

    @property
    def host_rolls(self) -> bool:
        """The host rolls sessions over itself (``reset`` and ``memory``)."""
        return self.mode in (RESET, MEMORY)

    @property
    def capsule_limit(self) -> int:
        """The most ids a capsule may take: U, and at most half the soft threshold (so that a
        rolled-over session has room to talk before the next roll-over)."""
        return 0 if self.mode != MEMORY else min(self.capsule_tokens, self.soft_frames // 2)

    def due(self, context: int) -> bool:
        """A session with ``context`` frames may be rolled over this beat: past the soft
        threshold, where its pause is read (``plan`` looks at no other)."""
        return self.host_rolls and context >= self.soft_frames

    def decide(self, context: int, silent_frames: int) -> str | None:
        """``"hard"``, ``"pause"`` or None for a session with ``context`` frames in its LLM
        context whose two sides have been silent for ``silent_frames`` frames."""
        if not self.host_rolls:
            return None
        if context >= self.hard_frames:
            return "hard"
        if context >= self.soft_frames and silent_frames >= self.pause_frames:
            return "pause"
        return None

    def plan(self, sessions: Sequence[tuple[int, int, int]]) -> list[tuple[int, str]]:
        """This beat's roll-overs: at most ``max_per_beat`` ``(slot, reason)`` pairs.

        Args:
          sessions: ``(slot, context frames, silent frames)`` of every session that runs this beat.

        In order: sessions past the hard threshold (most context first), then those past the soft
        one at a pause, then, with room left, ``"spread"`` roll-overs of the most advanced of the
        rest while the rest could not all be rolled by the hard threshold at ``max_per_beat`` a
        beat (the one at place ``j`` of the rest, most context first, waits ``1 + j //
        max_per_beat`` beats; it must not wait past the beat in which it turns hard).
        """
        if not self.host_rolls:
            return []
        due = sorted((s for s in sessions if self.due(s[1])), key=lambda s: -s[1])
        reasons = [(b, self.decide(c, q)) for b, c, q in due]  # most context first, both lists
        hard = [(b, r) for b, r in reasons if r == "hard"]
        pause = [(b, r) for b, r in reasons if r == "pause"]
        chosen = (hard + pause)[: self.max_per_beat]
        taken = {b for b, _ in chosen}
        rest = [(b, c) for b, c, _ in due if b not in taken]
        k, fpt = self.max_per_beat, self.frames_per_tick

        def fits(waiting: list[tuple[int, int]]) -> bool:
            # beats until each turns hard (ceil), against the beat its place lets it roll in
            return all(
                1 + j // k <= -(-(self.hard_frames - c) // fpt) for j, (_, c) in enumerate(waiting)
            )

        while len(chosen) < k and rest and not fits(rest):
            chosen.append((rest.pop(0)[0], "spread"))
        return chosen
