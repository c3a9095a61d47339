"""Sessions on the host: slot admission, per-session input queues, and the session record.

``SlotTable`` maps live sessions to the fixed slots of the device state (docs/serving.md §1): a new
session takes the lowest free slot, session ``N + 1`` is refused with a ``CapacityError``, closing
a session frees only its slot. ``InputQueues`` holds each session's incoming audio, pushed by any
source (a file reader, a network handler) from any thread, and hands the tick exactly one beat per
session (docs/serving.md §2; §5, gates 4 and 6):

- Audio not arrived by the tick start becomes silence and counts one *input underrun*.
- Partial beat: the samples that arrived are used at the start of the beat, the rest of the beat
  is silence, and it counts one underrun. (Holding the partial back would insert a whole beat of
  silence instead of part of one, and delay what did arrive.) Audio that arrives late is not
  discarded: it is played in the next beat, so an underrun delays that session's input by what was
  filled with silence, up to the backlog bound below.
- Never a burst: at most one beat leaves a queue per tick, however much is queued.
- Backlog bound: a queue holds at most ``max_backlog_beats`` beats; beyond that the oldest samples
  are dropped and counted (``dropped_samples``). A client that sends too fast costs bounded memory
  and bounded added delay.
- Skipped ticks: the input of a tick the server skipped (its own lateness) is discarded and counted
  apart (``skipped_samples``), so that a client is never told it sent too fast for the server's
  fault.
- Bad input fails its session alone: the session is marked failed with the error's message, its
  queue is emptied, it is fed silence (not counted as underruns) until the engine releases it; every
  other queue is untouched.

No JAX here: this module runs in the host's threads and in the device loop's ``io_callback``,
which must return NumPy only.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import threading
from collections.abc import Hashable, Sequence

import numpy as np
from absl import logging

from voicechat_jax.serving import audio

SessionId = Hashable


class CapacityError(RuntimeError):
    """Every slot is in use: the session is refused (docs/serving.md §5, gate 1)."""


# ---------------------------------------------------------------------------------------------
# The session record


@dataclasses.dataclass
class Session:
    """One live call's host-side record (its output goes to the writer: ``writer.SessionSink``)."""

    id: SessionId
    slot: int
    admitted_tick: int
    source: str = ""  # where its input comes from, e.g. "file:speech_16k.wav", "ws:10.0.0.7"
    underruns: int = 0  # ticks whose beat was not (fully) there at the tick start
    dropped_samples: int = 0  # input dropped by the backlog bound (sent faster than real time)
    skipped_samples: int = 0  # input of ticks the server skipped (the server's lateness)
    failure: str | None = None  # why it failed (bad input, vanished client), None while healthy
    released_tick: int | None = None


class EndedRecords(collections.abc.MutableMapping):
    """A mapping that keeps at most ``limit`` entries, dropping the oldest inserted first.

    For records of sessions that ended (why they ended, why they failed) in a server that runs
    for hours: the newest ``limit`` are kept, ``dropped`` counts the rest. Not thread-safe: one
    owner thread writes it (see ``server.Server``).
    """

    def __init__(self, limit: int = 1024):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._d: collections.OrderedDict = collections.OrderedDict()
        self.dropped = 0

    def __setitem__(self, key, value) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)
            self.dropped += 1

    def __getitem__(self, key):
        return self._d[key]

    def __delitem__(self, key) -> None:
        del self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"EndedRecords({dict(self._d)!r}, dropped={self.dropped})"


# ---------------------------------------------------------------------------------------------
# Slots


class SlotTable:
    """Which session lives in which of ``n_slots`` fixed slots. Thread-safe.

    Counters ``admitted``, ``released``, ``refused`` and the events from ``drain_events`` (dicts
    with ``event``, ``session``, ``slot``, ``tick`` and, for refusals, ``message``; pass each to
    ``MetricsRecorder.record_event(**event)``) feed the metrics report.
    """

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        self.n_slots = n_slots
        self._slots: list[Session | None] = [None] * n_slots
        self._by_id: dict[SessionId, Session] = {}
        self._lock = threading.Lock()
        self.admitted = 0
        self.released = 0
        self.refused = 0
        self._events: list[dict] = []

    def admit(
        self, session_id: SessionId, *, tick: int = 0, source: str = "", slot: int | None = None
    ) -> int:
        """Puts a new session in ``slot`` (default: the lowest free slot) and returns the slot.

        Raises ``CapacityError`` when every slot is taken and ``ValueError`` for an id already live
        or a ``slot`` that is out of range or taken (a scheduler's bug, not a refusal).
        """
        with self._lock:
            if session_id in self._by_id:
                raise ValueError(f"session {session_id!r} is already admitted")
            free = next((b for b, s in enumerate(self._slots) if s is None), None)
            if free is None:
                message = (
                    f"server full: {self.n_slots} of {self.n_slots} slots in use; "
                    f"session {session_id} refused"
                )
                raise self._refuse(session_id, tick, message)
            if slot is not None:
                if not 0 <= slot < self.n_slots or self._slots[slot] is not None:
                    raise ValueError(f"slot {slot} is not a free slot of {self.n_slots}")
                free = slot
            session = Session(id=session_id, slot=free, admitted_tick=tick, source=source)
            self._slots[free] = session
            self._by_id[session_id] = session
            self.admitted += 1
            self._events.append(
                {"event": "admitted", "session": session_id, "slot": free, "tick": tick}
            )
            return free

    def refuse(self, session_id: SessionId, *, tick: int, message: str) -> CapacityError:
        """Counts and records a refusal decided elsewhere (an admission policy's threshold or
        queue timeout); returns the ``CapacityError`` to raise."""
        with self._lock:
            return self._refuse(session_id, tick, message)

    def _refuse(self, session_id: SessionId, tick: int, message: str) -> CapacityError:
        self.refused += 1
        self._events.append(
            {"event": "refused", "session": session_id, "tick": tick, "message": message}
        )
        logging.warning(message)
        return CapacityError(message)

    def move(self, session_id: SessionId, slot: int) -> int:
        """Moves a live session to the free ``slot`` (a scheduler compacting the slots); returns
        the slot it left. The device state must be moved with it (``Engine.place``, slot
        buckets)."""
        with self._lock:
            session = self._by_id.get(session_id)
            if session is None:
                raise KeyError(f"session {session_id!r} is not admitted")
            if not 0 <= slot < self.n_slots or self._slots[slot] is not None:
                raise ValueError(f"slot {slot} is not a free slot of {self.n_slots}")
            old = session.slot
            self._slots[old], self._slots[slot] = None, session
            session.slot = slot
            return old

    def release(self, session_id: SessionId, *, tick: int | None = None) -> Session:
        """Frees the session's slot (only that one) and returns its record."""
        with self._lock:
            session = self._by_id.pop(session_id, None)
            if session is None:
                raise KeyError(f"session {session_id!r} is not admitted")
            self._slots[session.slot] = None
            session.released_tick = tick
            self.released += 1
            event = {"event": "released", "session": session_id, "slot": session.slot, "tick": tick}
            if session.failure is not None:
                event["failure"] = session.failure
            self._events.append(event)
            return session

    def drain_events(self) -> list[dict]:
        """The admission events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def slot_of(self, session_id: SessionId) -> int:
        with self._lock:
            if session_id not in self._by_id:
                raise KeyError(f"session {session_id!r} is not admitted")
            return self._by_id[session_id].slot

    def session(self, session_id: SessionId) -> Session:
        with self._lock:
            if session_id not in self._by_id:
                raise KeyError(f"session {session_id!r} is not admitted")
            return self._by_id[session_id]

    def sessions(self) -> list[Session]:
        """Live sessions, in slot order."""
        with self._lock:
            return [s for s in self._slots if s is not None]

    def slot_sessions(self) -> list[SessionId | None]:
        """Per slot, the id of the session in it or None; length ``n_slots``."""
        with self._lock:
            return [None if s is None else s.id for s in self._slots]

    def active_mask(self) -> np.ndarray:
        """bool [B]: which slots hold a live session."""
        with self._lock:
            return np.array([s is not None for s in self._slots], np.bool_)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)


# ---------------------------------------------------------------------------------------------
# Input


class _Inbox:
    """One session's FIFO of float32 samples: chunks plus a read offset into the first one."""

    def __init__(self, session: Session):
        self.session = session
        self.chunks: collections.deque[np.ndarray] = collections.deque()
        self.head = 0  # samples of chunks[0] already taken
        self.size = 0  # samples queued

    def put(self, samples: np.ndarray) -> None:
        self.chunks.append(samples)
        self.size += samples.shape[0]

    def drop_oldest(self, n: int) -> int:
        """Drops up to ``n`` samples from the front; returns how many were dropped."""
        dropped = 0
        while dropped < n and self.chunks:
            first = self.chunks[0]
            k = min(n - dropped, first.shape[0] - self.head)
            self.head += k
            dropped += k
            if self.head == first.shape[0]:
                self.chunks.popleft()
                self.head = 0
        self.size -= dropped
        return dropped

    def take_into(self, out: np.ndarray) -> int:
        """Moves up to ``len(out)`` samples into ``out``; returns how many."""
        n = 0
        while n < out.shape[0] and self.chunks:
            first = self.chunks[0]
            k = min(out.shape[0] - n, first.shape[0] - self.head)
            out[n : n + k] = first[self.head : self.head + k]
            self.head += k
            n += k
            if self.head == first.shape[0]:
                self.chunks.popleft()
                self.head = 0
        self.size -= n
        return n

    def clear(self) -> None:
        self.chunks.clear()
        self.head = 0
        self.size = 0


class InputQueues:
    """Per-session input FIFOs feeding the tick one beat at a time; see the module docstring.

    Args:
      n_slots: ``B``, the slot count of the device state.
      samples_per_beat: input samples per tick (``frames_per_tick * frame_len``).
      frame_len: samples per 80 ms frame; a push must be whole frames.
      max_backlog_beats: queued beats kept per session before the oldest are dropped; None
        means unbounded (offline file runs only: a live client must not grow memory).
    """

    def __init__(
        self,
        n_slots: int,
        samples_per_beat: int,
        *,
        frame_len: int = audio.FRAME_LEN,
        max_backlog_beats: int | None = 4,
    ):
        if samples_per_beat % frame_len:
            raise ValueError(f"a beat ({samples_per_beat}) must be whole frames of {frame_len}")
        if max_backlog_beats is not None and max_backlog_beats < 1:
            raise ValueError(f"max_backlog_beats must be >= 1 or None, got {max_backlog_beats}")
        self.n_slots = n_slots
        self.samples_per_beat = samples_per_beat
        self.frame_len = frame_len
        self.max_backlog = (
            None if max_backlog_beats is None else max_backlog_beats * samples_per_beat
        )
        self._inboxes: dict[SessionId, _Inbox] = {}
        self._lock = threading.Lock()
        self.underruns = 0
        self.dropped_samples = 0
        self.skipped_samples = 0

    def open(self, session: Session) -> None:
        """Starts a queue for ``session``; its counters are kept in the record itself."""
        with self._lock:
            if session.id in self._inboxes:
                raise ValueError(f"session {session.id!r} already has an input queue")
            self._inboxes[session.id] = _Inbox(session)

    def close(self, session_id: SessionId) -> None:
        """Drops the session's queue and whatever is still in it."""
        with self._lock:
            self._inboxes.pop(session_id, None)

    def push(self, session_id: SessionId, samples: np.ndarray) -> None:
        """Queues whole frames of audio for one session (any thread).

        ``samples``: float32 [n] in [-1, 1] or int16 [n], n a positive multiple of ``frame_len``.
        Invalid audio fails this session (see ``fail``) and raises ``AudioInputError``; so does a
        push to a session that has already failed. Unknown sessions raise ``KeyError``.
        """
        with self._lock:
            inbox = self._inbox(session_id)
            if inbox.session.failure is not None:
                raise audio.AudioInputError(
                    f"session {session_id}",
                    f"input refused: failed earlier ({inbox.session.failure})",
                )
            try:
                samples = audio.validate_samples(
                    samples, frame_len=self.frame_len, source=f"session {session_id}"
                )
            except audio.AudioInputError as e:
                self._fail(inbox, str(e))
                raise
            # Own the data: a caller may reuse its buffer for the next frame.
            inbox.put(np.array(samples, np.float32, copy=True))
            if self.max_backlog is not None and inbox.size > self.max_backlog:
                self._drop(inbox, inbox.size - self.max_backlog)

    def fail(self, session_id: SessionId, reason: str) -> None:
        """Marks a session failed (bad message, vanished client); its queue is emptied."""
        with self._lock:
            self._fail(self._inbox(session_id), reason)

    def failed(self) -> dict[SessionId, str]:
        """Failed sessions still open, with their reasons: the engine releases them."""
        with self._lock:
            return {
                sid: ib.session.failure
                for sid, ib in self._inboxes.items()
                if ib.session.failure is not None
            }

    def backlog(self, session_id: SessionId) -> int:
        """Samples queued for the session."""
        with self._lock:
            return self._inbox(session_id).size

    def take_beat(self, slot_sessions: Sequence[SessionId | None]) -> tuple[np.ndarray, np.ndarray]:
        """Takes at most one beat per slot for this tick.

        Args:
          slot_sessions: [B] the session id in each slot, None for a free slot
            (``SlotTable.slot_sessions()``).

        Returns:
          audio: float32 [B, samples_per_beat]; zeros where nothing (or not all) arrived, for free
            slots and for failed sessions.
          underrun: bool [B]; True for a live, healthy session whose beat was not complete.
        """
        if len(slot_sessions) != self.n_slots:
            raise ValueError(f"expected {self.n_slots} slot entries, got {len(slot_sessions)}")
        out = np.zeros((self.n_slots, self.samples_per_beat), np.float32)
        underrun = np.zeros((self.n_slots,), np.bool_)
        with self._lock:
            for b, sid in enumerate(slot_sessions):
                if sid is None:
                    continue
                inbox = self._inbox(sid)
                if inbox.session.failure is not None:
                    continue
                if inbox.take_into(out[b]) < self.samples_per_beat:
                    underrun[b] = True
                    inbox.session.underruns += 1
                    self.underruns += 1
        return out, underrun

    def discard_beats(self, n: int = 1) -> None:
        """Drops up to ``n`` beats from every queue: the input of ticks the server skipped."""
        with self._lock:
            for inbox in self._inboxes.values():
                skipped = inbox.drop_oldest(n * self.samples_per_beat)
                inbox.session.skipped_samples += skipped
                self.skipped_samples += skipped

    def _inbox(self, session_id: SessionId) -> _Inbox:
        inbox = self._inboxes.get(session_id)
        if inbox is None:
            raise KeyError(f"session {session_id!r} has no input queue (not open or closed)")
        return inbox

    def _drop(self, inbox: _Inbox, n: int) -> None:
        dropped = inbox.drop_oldest(n)
        inbox.session.dropped_samples += dropped
        self.dropped_samples += dropped

    def _fail(self, inbox: _Inbox, reason: str) -> None:
        if inbox.session.failure is None:
            inbox.session.failure = reason
            logging.warning("session %s failed: %s", inbox.session.id, reason)
        inbox.clear()
