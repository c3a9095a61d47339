"""Batching policy on the host: who is admitted where, which slots run, which compiled tick.

The device side is a mechanism (``step.tick``: admit and release slots, advance the slots in
``BeatInput.run``, hold every other slot bit-identical). A ``Scheduler`` is the policy, asked by
the server's beat thread before each beat (docs/serving.md §7, "mechanism apart from policy"):

- ``admit(slots, session, tick=, source=)``: the slot a joining session goes into, or None (it
  waits for a slot: the caller asks again next beat); or it raises ``CapacityError`` (refused,
  recorded in the ``SlotTable``).
- ``plan(tick, slots, queues)``: a ``BeatPlan``: the run mask, the slot bucket (which compiled tick
  runs: an ``Engine`` with ``buckets`` holds one per bucket, compiled before the clock starts) and
  the sessions moved between slots with a bucket change. The scheduler applies the moves to the
  ``SlotTable`` itself; the engine moves the device state (``Engine.place``).

Policies:

- ``Lockstep`` (the default): the lowest free slot, every slot runs every beat, one compiled tick
  of ``n_slots``. The server's behaviour before schedulers existed, bit for bit.
- ``RoundRobin(batch)``: at most ``batch`` live sessions run per beat, taken in turn; the others
  are held. ``batch=1`` is per-session stepping on the beat clock: each session advances one beat
  in every ``live`` beats (so only one session is served in real time; the cost of real batch-1
  stepping, one session after another inside a beat, is measured in
  ``experiments/batching_policy``).
- ``WaitingWindow(window_beats)``: request-style dynamic batching on the beat clock: a session runs
  once its beat of input is there; one whose input is late is held (not fed silence) for up to
  ``window_beats`` beats, then run with what there is. ``window_beats=0`` is ``Lockstep``.
- ``SlotBuckets(buckets)``: lockstep in the smallest compiled bucket that holds the live sessions:
  grows at once when a session joins past the bucket; shrinks, compacting sessions into the low
  slots, once the live count has fitted a smaller bucket for ``shrink_after`` beats.
- ``AdmissionControl(inner, max_live, queue_beats)``: admission threshold and queue-with-timeout
  in front of any policy.

Policies are stateful (a cursor, a bucket, a queue): one instance per serving run. No JAX here:
this module runs in the beat thread and in the resident loop's callback.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from voicechat_jax.serving.sessions import CapacityError, InputQueues, SessionId, SlotTable


@dataclasses.dataclass(frozen=True)
class Move:
    """A live session moved from slot ``src`` to slot ``dst`` before a beat."""

    session: SessionId
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class BeatPlan:
    """What one beat runs.

    ``run`` is ``BeatInput.run`` ([B] bool, ``B = SlotTable.n_slots``, the largest bucket): a live
    slot with ``run`` off is held (its state bit-identical, its input left queued). Slots at and
    above ``bucket`` are empty and not on the device this beat. ``moves`` were applied to the slot
    table by the scheduler; the engine applies them to the state with the bucket change.
    """

    run: np.ndarray  # [B] bool
    bucket: int  # slot count of the compiled tick this beat uses
    moves: tuple[Move, ...] = ()

    def __post_init__(self):
        if self.run.ndim != 1 or self.run.dtype != np.bool_:
            raise ValueError(f"run must be a [B] bool mask, got {self.run.dtype}{self.run.shape}")
        if not 1 <= self.bucket <= self.run.shape[0]:
            raise ValueError(f"bucket {self.bucket} outside [1, {self.run.shape[0]}]")

    def running(self, live: Sequence[SessionId | None]) -> list[SessionId | None]:
        """``live`` ([B] session or None) with the held sessions left out (None): the slots
        whose input this beat takes (``InputQueues.take_beat``); a held one's stays queued."""
        return [s if r else None for s, r in zip(live, self.run, strict=True)]

    def held(self, live: Sequence[SessionId | None]) -> list[SessionId]:
        """The live sessions this plan holds."""
        return [s for s, r in zip(live, self.run, strict=True) if s is not None and not r]


@runtime_checkable
class Scheduler(Protocol):
    """A batching policy; see the module docstring."""

    name: str

    @property
    def buckets(self) -> tuple[int, ...]:
        """Slot counts whose ticks the engine must compile before the clock starts; () for the
        engine's one tick of ``n_slots``."""
        ...

    def admit(
        self, slots: SlotTable, session_id: SessionId, *, tick: int, source: str = ""
    ) -> int | None:
        """Admits ``session_id`` into ``slots`` and returns its slot, or None: it waits (ask
        again next beat). Raises ``CapacityError`` when it is refused (recorded in ``slots``)."""
        ...

    def withdraw(self, session_id: SessionId) -> None:
        """``session_id``, made to wait by ``admit``, left before it got a slot: forget it."""
        ...

    def plan(self, tick: int, slots: SlotTable, queues: InputQueues) -> BeatPlan:
        """The plan of beat ``tick``, after this beat's leaves, joins and client input."""
        ...


def _all_run(n: int) -> np.ndarray:
    return np.ones((n,), np.bool_)


class Lockstep:
    """Every slot, every beat, one compiled tick; the lowest free slot (the server's own way)."""

    name = "lockstep"
    buckets: tuple[int, ...] = ()  # the engine's one compiled tick

    def admit(self, slots: SlotTable, session_id: SessionId, *, tick: int, source: str = "") -> int:
        return slots.admit(session_id, tick=tick, source=source)

    def withdraw(self, session_id: SessionId) -> None:
        del session_id  # nobody waits: admit answers at once

    def plan(self, tick: int, slots: SlotTable, queues: InputQueues) -> BeatPlan:
        del tick, queues
        return BeatPlan(run=_all_run(slots.n_slots), bucket=slots.n_slots)


class RoundRobin(Lockstep):
    """At most ``batch`` live sessions run per beat, in turn (slot order, from a cursor).

    Sessions not chosen are held: their state stays bit-identical and their input stays queued
    (give the server ``max_backlog_beats=None`` or input is dropped as the backlog grows).
    ``held_session_beats`` counts the live session-beats held.
    """

    def __init__(self, batch: int = 1) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batch = batch
        self.name = f"round_robin_{batch}"
        self._cursor = 0  # the slot after the last one run
        self.held_session_beats = 0

    def plan(self, tick: int, slots: SlotTable, queues: InputQueues) -> BeatPlan:
        del tick, queues
        B = slots.n_slots
        live = slots.slot_sessions()
        order = [(self._cursor + i) % B for i in range(B)]
        chosen = [b for b in order if live[b] is not None][: self.batch]
        run = np.zeros((B,), np.bool_)
        run[chosen] = True
        if chosen:
            self._cursor = (chosen[-1] + 1) % B
        self.held_session_beats += sum(s is not None for s in live) - len(chosen)
        return BeatPlan(run=run, bucket=B)


class WaitingWindow(Lockstep):
    """Dynamic batching with a waiting window, on the beat clock.

    A live session whose beat of input is complete runs. One whose input is not is held for up to
    ``window_beats`` consecutive beats waiting for it (its output comes later, but no silence is
    put into its stream), then runs with what there is (an underrun). A held session does not
    catch up (one beat per tick at most), so every beat held adds one beat of delay to it for as
    long as its backlog lasts. ``window_beats = 0`` is ``Lockstep``.
    """

    def __init__(self, window_beats: int = 1) -> None:
        if window_beats < 0:
            raise ValueError(f"window_beats must be >= 0, got {window_beats}")
        self.window_beats = window_beats
        self.name = f"waiting_window_{window_beats}"
        self._waited: dict[SessionId, int] = {}  # live sessions held in a row so far
        self.held_session_beats = 0

    def plan(self, tick: int, slots: SlotTable, queues: InputQueues) -> BeatPlan:
        del tick
        B = slots.n_slots
        live = slots.slot_sessions()
        run = _all_run(B)
        waited: dict[SessionId, int] = {}
        for b, sid in enumerate(live):
            if sid is None:
                continue
            n = self._waited.get(sid, 0)
            if queues.backlog(sid) < queues.samples_per_beat and n < self.window_beats:
                run[b] = False
                waited[sid] = n + 1
                self.held_session_beats += 1
        self._waited = waited  # sessions that ran or left are forgotten: bounded by the live
        return BeatPlan(run=run, bucket=B)


class SlotBuckets:
    """Lockstep in the smallest of a few compiled slot buckets that holds the live sessions.

    Needs an ``Engine`` with ``buckets`` with the same buckets (the largest is ``n_slots``).
    Admission takes the lowest free slot; a session admitted past the current bucket grows it at
    once (to the smallest bucket that holds the highest live slot). The bucket shrinks to the
    smallest that holds the live count once it has done so for ``shrink_after`` beats in a row
    (hysteresis: a move copies whole session states); sessions above the new bucket move into its
    free slots, lowest first. ``moves`` and ``resizes`` count what it did.
    """

    name = "slot_buckets"

    def __init__(self, buckets: Sequence[int], shrink_after: int = 25) -> None:
        b = tuple(sorted(set(int(x) for x in buckets)))
        if not b or b[0] < 1:
            raise ValueError(f"buckets must be positive slot counts, got {tuple(buckets)}")
        if shrink_after < 1:
            raise ValueError(f"shrink_after must be >= 1, got {shrink_after}")
        self._buckets = b
        self.shrink_after = shrink_after
        self.bucket = b[0]
        self._fits_smaller = 0  # beats in a row the live count fitted a smaller bucket
        self.moves = 0
        self.resizes = 0

    @property
    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def bucket_for(self, n: int) -> int:
        """The smallest bucket of at least ``n`` slots (the largest if none is)."""
        return next((b for b in self._buckets if b >= n), self._buckets[-1])

    def admit(self, slots: SlotTable, session_id: SessionId, *, tick: int, source: str = "") -> int:
        return slots.admit(session_id, tick=tick, source=source)

    def withdraw(self, session_id: SessionId) -> None:
        del session_id  # nobody waits: admit answers at once

    def plan(self, tick: int, slots: SlotTable, queues: InputQueues) -> BeatPlan:
        del tick, queues
        if slots.n_slots != self._buckets[-1]:
            raise ValueError(
                f"the slot table has {slots.n_slots} slots, the largest bucket {self._buckets[-1]}"
            )
        live = slots.slot_sessions()
        occupied = [b for b, s in enumerate(live) if s is not None]
        bucket = max(self.bucket, self.bucket_for(occupied[-1] + 1 if occupied else 0))
        target = self.bucket_for(len(occupied))
        moves: list[Move] = []
        self._fits_smaller = self._fits_smaller + 1 if target < bucket else 0
        if self._fits_smaller >= self.shrink_after:
            free = iter(b for b in range(target) if live[b] is None)
            for src in (b for b in occupied if b >= target):
                dst = next(free)
                slots.move(live[src], dst)
                moves.append(Move(live[src], src, dst))
            bucket = target
            self._fits_smaller = 0
        if bucket != self.bucket:
            self.resizes += 1
        self.moves += len(moves)
        self.bucket = bucket
        return BeatPlan(run=_all_run(slots.n_slots), bucket=bucket, moves=tuple(moves))


class AdmissionControl:
    """An admission threshold and a queue with a timeout in front of another policy.

    A session that finds ``max_live`` sessions live (default: every slot) waits (``admit``
    returns None; the server asks again each beat) for up to ``queue_beats`` beats; then it is
    refused. Waiting sessions are admitted first come, first served (the server asks in that
    order), and a session never jumps one that waits longer: while anyone waits, a newcomer
    queues. ``queue_beats = 0``
    refuses at once. ``queued`` counts sessions that waited, ``waited_beats`` the beats they
    waited in all (admitted or not).
    """

    def __init__(
        self, inner: Scheduler, *, max_live: int | None = None, queue_beats: int = 0
    ) -> None:
        if max_live is not None and max_live < 1:
            raise ValueError(f"max_live must be >= 1, got {max_live}")
        if queue_beats < 0:
            raise ValueError(f"queue_beats must be >= 0, got {queue_beats}")
        self.inner = inner
        self.max_live = max_live
        self.queue_beats = queue_beats
        self.name = f"{inner.name}+admission"
        self._first_asked: dict[SessionId, int] = {}  # sessions waiting now: bounded by arrivals
        self.queued = 0
        self.waited_beats = 0

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.inner.buckets

    def admit(
        self, slots: SlotTable, session_id: SessionId, *, tick: int, source: str = ""
    ) -> int | None:
        limit = slots.n_slots if self.max_live is None else min(self.max_live, slots.n_slots)
        first = self._first_asked.get(session_id)
        ahead = any(t < (tick if first is None else first) for t in self._first_asked.values())
        if len(slots) < limit and not ahead:
            self._first_asked.pop(session_id, None)
            return self.inner.admit(slots, session_id, tick=tick, source=source)
        if first is None:
            first = self._first_asked[session_id] = tick
            if self.queue_beats:
                self.queued += 1
        if tick - first < self.queue_beats:
            self.waited_beats += 1
            return None
        del self._first_asked[session_id]
        waited = f" after waiting {tick - first} beats" if self.queue_beats else ""
        raise slots.refuse(
            session_id,
            tick=tick,
            message=f"server full: {len(slots)} sessions live (limit {limit}); "
            f"session {session_id} refused{waited}",
        )

    def withdraw(self, session_id: SessionId) -> None:
        """A waiting session that left no longer holds its place: those behind it move up."""
        self._first_asked.pop(session_id, None)
        self.inner.withdraw(session_id)

    def plan(self, tick: int, slots: SlotTable, queues: InputQueues) -> BeatPlan:
        return self.inner.plan(tick, slots, queues)


def retarget(
    moves: Sequence[Move], admit: np.ndarray, release: np.ndarray, key: np.ndarray
) -> None:
    """This beat's admission flags follow the sessions ``moves`` moved, in place.

    A move's destination row is replaced by its source's state, so a release the host set there
    (for the session that left it this beat) no longer applies; an admission (and its key) set on
    the source goes with the session. Arrays are ``BeatInput``'s ``admit``, ``release``, ``key``.
    """
    for m in moves:
        admit[m.dst], key[m.dst], release[m.dst] = admit[m.src], key[m.src], False
        admit[m.src] = False


class Policy(enum.StrEnum):
    """The policies ``voicechat-serve --scheduler`` offers."""

    LOCKSTEP = "lockstep"
    BUCKETS = "buckets"


def default_buckets(slots: int) -> tuple[int, ...]:
    """Powers of two from ``slots / 8`` up, below ``slots``, and ``slots`` itself: four buckets
    or fewer (56 slots: 8, 16, 32, 56), so compiles stay few."""
    low = 1 << max(0, math.ceil(math.log2(max(slots / 8, 1))))
    return (*(b for b in (low << i for i in range(8)) if b < slots), slots)


def make(policy: Policy | str, *, buckets: Sequence[int] = (), shrink_after: int = 25) -> Scheduler:
    """A scheduler by name (``Policy``); ``buckets`` for ``buckets``."""
    policy = Policy(policy)
    if policy == Policy.BUCKETS:
        return SlotBuckets(buckets, shrink_after=shrink_after)
    return Lockstep()


__all__ = [
    "AdmissionControl",
    "BeatPlan",
    "CapacityError",
    "Lockstep",
    "Move",
    "Policy",
    "RoundRobin",
    "Scheduler",
    "SlotBuckets",
    "WaitingWindow",
    "default_buckets",
    "make",
    "retarget",
]
