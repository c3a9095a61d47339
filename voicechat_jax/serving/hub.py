"""Where sessions come from: one interface for every source of calls, consumed by the beat thread.

At every beat ``Server.prepare`` asks each *source* (``SessionSource``) which of its sessions leave
and which join, lets it feed the beat's audio, and tells it what became of each request: admitted
into a slot, refused, ended. Two sources:

- ``ScriptedSessions``: ``SessionPlan``s (a file's audio, when to join and leave, which beats come
  late); it pushes each beat's audio itself, on the beat thread, so that a file run is the same
  whatever else the server is doing.
- ``SessionHub``: the thread-safe front for every other source (the network, ``serving.net``):
  ``admit`` returns a ``concurrent.futures.Future`` that the beat thread resolves with the slot
  or a ``CapacityError``; ``release`` ends a session at the next beat; ``push`` queues audio
  (straight into the server's ``InputQueues``, any thread, any time). Each admitted session's
  output goes to the ``writer.OutputStream`` given at admission: the server's writer thread fills
  it beat by beat, bounded, never blocking; the consumer drains it.

Nothing here waits on a consumer: the beat thread only takes what is queued.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
from collections.abc import Hashable, Iterable
from typing import Protocol

import numpy as np
from absl import logging

from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving.sessions import CapacityError, InputQueues
from voicechat_jax.serving.writer import OutputStream

SessionId = Hashable
CLIENT_ERROR = "client error"  # why a network call ended that its client ended badly


@dataclasses.dataclass
class SessionPlan:
    """A scripted client: its audio, and when it joins and leaves (tick indices)."""

    id: Hashable
    audio: np.ndarray  # [n] float32 at 16 kHz; silence is sent after it ends
    join: int = 0
    leave: int | None = None  # released before this tick; None: stays to the end of the run
    late: frozenset[int] = frozenset()  # beats whose audio arrives one tick late
    vanish: int | None = None  # the client stops sending at this beat of its session (tests)
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Join:
    """A session asking for a slot."""

    id: SessionId
    source: str = ""  # where its input comes from ("file:...", "ws:127.0.0.1:5000")
    stream: OutputStream | None = None  # where its output goes, beyond the server's files/memory
    record: bool = True  # write its files when the server has an ``output_dir``


@dataclasses.dataclass(frozen=True)
class Leave:
    """A session to release before a beat: ``why`` as in the metrics, ``detail`` for people."""

    id: SessionId
    why: str = "left"
    detail: str = "left"


class SessionSource(Protocol):
    """A source of sessions, as the beat thread sees it (every method runs on the beat thread)."""

    def leaves(self, tick: int) -> Iterable[Leave]:
        """Sessions of this source that leave before ``tick``."""

    def joins(self, tick: int) -> Iterable[Join]:
        """Sessions that ask for a slot before ``tick``."""

    def admitted(self, join: Join, slot: int, tick: int) -> None: ...

    def refused(self, join: Join, error: Exception, tick: int) -> None: ...

    def feed(self, tick: int, queues: InputQueues) -> None:
        """Pushes the beat's audio of sessions fed in step with the beat (scripted ones). Called
        again for the same tick (ahead of the beat, then in it), it pushes nothing twice."""

    def ended(self, session: SessionId, why: str, detail: str, tick: int) -> None:
        """One of this source's sessions was released (its slot is free)."""

    def retained(self) -> dict[str, int]:
        """Sizes of what the source keeps (for the server's bounded-memory checks)."""


# ---------------------------------------------------------------------------------------------
# Scripted sessions (file mode)


class ScriptedSessions:
    """``SessionPlan``s as a source (beat thread only): joins, leaves, and each beat's audio."""

    def __init__(self, plans: Iterable[SessionPlan] = (), *, samples_per_beat: int = 2560):
        self.samples_per_beat = samples_per_beat
        self._by_join: dict[int, list[SessionPlan]] = {}
        self._by_leave: dict[int, list[SessionPlan]] = {}
        self._plans: dict[SessionId, SessionPlan] = {}  # asked for a slot, not yet answered
        self._live: dict[SessionId, tuple[SessionPlan, int]] = {}  # (plan, tick joined)
        self._late_buffer: dict[SessionId, list[np.ndarray]] = {}
        self._fed: dict[SessionId, int] = {}  # the last tick whose audio each live plan pushed
        for plan in plans:
            self._by_join.setdefault(plan.join, []).append(plan)
            if plan.leave is not None:
                self._by_leave.setdefault(plan.leave, []).append(plan)

    def leaves(self, tick: int) -> list[Leave]:
        """Plans leaving at ``tick``: live ones, and those still waiting for a slot (they hang up
        in the queue, and the server refuses them)."""
        return [Leave(p.id) for p in self._by_leave.pop(tick, ())
                if p.id in self._live or p.id in self._plans]  # fmt: skip

    def quiet(self, tick: int) -> bool:
        """No plan is live, asking for a slot, or due to join at or before ``tick``."""
        due = self.next_join()
        return not (self._live or self._plans or (due is not None and due <= tick))

    def next_join(self) -> int | None:
        """The tick of the next plan to join (None: none left)."""
        return min(self._by_join, default=None)

    def joins(self, tick: int) -> list[Join]:
        plans = self._by_join.pop(tick, ())
        for plan in plans:
            self._plans[plan.id] = plan
        return [Join(p.id, source=p.source) for p in plans]

    def admitted(self, join: Join, slot: int, tick: int) -> None:
        self._live[join.id] = (self._plans.pop(join.id), tick)

    def refused(self, join: Join, error: Exception, tick: int) -> None:
        self._plans.pop(join.id, None)

    def feed(self, tick: int, queues: InputQueues) -> None:
        """Each live plan's audio for ``tick`` (a late beat arrives with the next one), once: a
        plan already fed for ``tick`` (ahead of the beat, ``Server._feed_ahead``) is skipped."""
        for sid, (plan, joined) in self._live.items():
            if self._fed.get(sid, -1) >= tick:
                continue
            self._fed[sid] = tick
            if plan.vanish is not None and tick - joined >= plan.vanish:
                continue
            chunk = self._beat_audio(plan, tick, joined)
            held = self._late_buffer.setdefault(sid, [])
            try:
                if (tick - joined) in plan.late:
                    held.append(chunk)
                else:
                    for c in [*held, chunk]:
                        queues.push(sid, c)
                    held.clear()
            except audio_lib.AudioInputError as e:
                logging.warning("session %s failed: %s", sid, e)

    def _beat_audio(self, plan: SessionPlan, beat: int, joined: int) -> np.ndarray:
        n = self.samples_per_beat
        i = (beat - joined) * n
        chunk = plan.audio[i : i + n]
        if chunk.size < n:
            chunk = np.pad(chunk, (0, n - chunk.size))
        return chunk.astype(np.float32, copy=False)  # the queue copies what it keeps

    def ended(self, session: SessionId, why: str, detail: str, tick: int) -> None:
        self._live.pop(session, None)
        self._late_buffer.pop(session, None)
        self._fed.pop(session, None)

    def retained(self) -> dict[str, int]:
        return {
            "plans_pending": sum(map(len, self._by_join.values())),
            "leaves_pending": sum(map(len, self._by_leave.values())),
            "live": len(self._live),
            "late_buffer": len(self._late_buffer),
            "fed": len(self._fed),
        }


# ---------------------------------------------------------------------------------------------
# The thread-safe hub (network sessions)


class HubClosedError(RuntimeError):
    """The server is draining or has stopped: no new session is admitted."""


class SessionHub:
    """Admissions, releases and audio from any thread; a ``SessionSource`` for the beat thread.

    Args:
      queues: the server's input queues (``push`` goes straight to them).
      id_prefix: prefix of the session ids ``new_id`` hands out.

    Threads: ``admit``, ``release``, ``push``, ``close`` and ``live`` from any thread; the
    ``SessionSource`` methods from the beat thread. ``_pending``, ``_answering``, ``_releases``,
    ``_live`` and ``_closed`` are guarded by one lock; futures are resolved outside it.
    """

    def __init__(self, queues: InputQueues, *, id_prefix: str = "rt"):
        self.queues = queues
        self.id_prefix = id_prefix
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._asked = threading.Condition(self._lock)  # a request came (``wait_for_request``)
        self._pending: collections.OrderedDict[
            SessionId, tuple[Join, concurrent.futures.Future]
        ] = collections.OrderedDict()
        self._answering: dict[SessionId, concurrent.futures.Future] = {}  # taken, not answered
        self._releases: list[Leave] = []
        self._live: set[SessionId] = set()
        self._closed: str | None = None

    def new_id(self) -> str:
        """A session id not used before in this process's hub (ids never repeat: a reconnecting
        client is a new session)."""
        return f"{self.id_prefix}-{next(self._ids):06d}"

    # ---- any thread --------------------------------------------------------------------------

    def admit(self, join: Join) -> concurrent.futures.Future:
        """Asks for a slot at the next beat; the future resolves with the slot, or fails with
        ``CapacityError`` (every slot in use) or ``HubClosedError`` (the server is draining)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed is not None:
                future.set_exception(HubClosedError(self._closed))
                return future
            if join.id in self._pending or join.id in self._live:
                raise ValueError(f"session {join.id!r} is already admitted or waiting")
            self._pending[join.id] = (join, future)
            self._asked.notify_all()
        return future

    def release(self, session: SessionId, why: str = "left", detail: str = "left") -> None:
        """Ends the session at the next beat (a session still waiting for a slot is withdrawn)."""
        with self._lock:
            waiting = self._pending.pop(session, None)
            if waiting is None:
                if session in self._live or session in self._answering:
                    self._releases.append(Leave(session, why, detail))
                    self._asked.notify_all()
                return
        waiting[1].cancel()

    def push(self, session: SessionId, samples: np.ndarray) -> None:
        """Queues whole 80 ms frames of 16 kHz audio (see ``InputQueues.push``)."""
        self.queues.push(session, samples)

    def fail(self, session: SessionId, reason: str) -> None:
        """Fails the session (bad input); the next beat releases it as failed."""
        self.queues.fail(session, reason)

    def close(self, reason: str) -> None:
        """No admission from now on; sessions still waiting are refused with ``HubClosedError``."""
        with self._lock:
            self._closed = reason
            waiting = list(self._pending.values())
            self._pending.clear()
        for _, future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(HubClosedError(reason))

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed is not None

    def live(self) -> int:
        with self._lock:
            return len(self._live)

    def waiting(self) -> int:
        with self._lock:
            return len(self._pending)

    def asked(self) -> bool:
        """Whether a request waits for the next beat: a session asking for a slot, a release."""
        with self._lock:
            return self._requested()

    def wait_for_request(self, timeout: float) -> bool:
        """Blocks until a request waits for the next beat (``asked``), for at most ``timeout``
        s; returns whether one came. For an idle server's beat thread (a closed hub takes no
        request: its caller also watches its own stop)."""
        with self._asked:
            return self._asked.wait_for(self._requested, max(0.0, timeout))

    def _requested(self) -> bool:  # under the lock
        return bool(self._pending or self._releases)

    # ---- the beat thread (SessionSource) -----------------------------------------------------

    def leaves(self, tick: int) -> list[Leave]:
        with self._lock:
            leaves, self._releases = self._releases, []
        return leaves

    def joins(self, tick: int) -> list[Join]:
        with self._lock:
            waiting = list(self._pending.values())
            self._pending.clear()
            joins = []
            for join, future in waiting:
                # Running from here on: a consumer can no longer cancel it; the beat thread answers.
                if future.set_running_or_notify_cancel():
                    self._answering[join.id] = future
                    joins.append(join)
        return joins

    def admitted(self, join: Join, slot: int, tick: int) -> None:
        with self._lock:
            self._live.add(join.id)
            future = self._answering.pop(join.id)
        future.set_result(slot)

    def refused(self, join: Join, error: Exception, tick: int) -> None:
        with self._lock:
            future = self._answering.pop(join.id)
        future.set_exception(error)

    def feed(self, tick: int, queues: InputQueues) -> None:
        del tick, queues  # network sessions push their audio as it arrives

    def ended(self, session: SessionId, why: str, detail: str, tick: int) -> None:
        with self._lock:
            self._live.discard(session)

    def retained(self) -> dict[str, int]:
        with self._lock:
            return {
                "hub_pending": len(self._pending),
                "hub_releases": len(self._releases),
                "hub_live": len(self._live),
            }


__all__ = [
    "CapacityError",
    "HubClosedError",
    "Join",
    "Leave",
    "ScriptedSessions",
    "SessionHub",
    "SessionPlan",
    "SessionSource",
]
