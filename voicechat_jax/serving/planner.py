"""The beat planner: who is in which slot, and what the host asks of each beat.

``BeatPlanner.prepare(k)`` is the host's work before tick k, on the beat thread, with no JAX in
it: the sessions that leave (their sources' leaves, failed input, the context cap the writer saw
reached), the sessions that join (asked of every source, admitted by the scheduler, or made to
wait and asked again next beat), the client input of the beat (sources fed in step with the beat,
then one beat of audio per running slot: silence and an underrun where it did not arrive), the
scheduler's plan (which slots run, which compiled bucket, which sessions move) and the roll-over
policy (a roll-over asked a beat ahead, with its conversation capsule). It returns the beat's
``BeatInput`` and a ``fanout.Snapshot`` of who was where; the device side (``Engine``) turns the
beat into its masks by the slot rule and runs it.

Sessions come from sources (``hub.SessionSource``): the ``SessionPlan``s a run is given (a file's
audio, when to join and leave, which beats arrive late) and the hub, the thread-safe front for any
other source (the network). Messages for the writer thread (sessions opened and ended, events) go
out through ``send`` in beat order. What the planner keeps grows with the live sessions only, and
its records of ended sessions are bounded.
"""

from __future__ import annotations

import hashlib
import queue
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from voicechat_jax import state as state_lib
from voicechat_jax.serving.fanout import SHUTDOWN, Ended, Event, Opened, Snapshot
from voicechat_jax.serving.hub import (
    CLIENT_ERROR,
    Join,
    ScriptedSessions,
    SessionHub,
    SessionPlan,
    SessionSource,
)
from voicechat_jax.serving.memory import (
    ConversationMemory,
    MemoryConfig,
    RolloverPolicy,
    TextTokenizer,
    build_capsule,
)
from voicechat_jax.serving.scheduler import Scheduler, retarget
from voicechat_jax.serving.sessions import CapacityError, EndedRecords, InputQueues, SlotTable


def session_key(seed: int, session_id: Hashable) -> np.ndarray:
    """A session's raw sampling key ([2] uint32) from the run seed and the session's id.

    It depends on nothing else (not the slot, not the order of admission), so a session's speech
    is the same whichever slot it lands in and whoever else is served.
    """
    digest = hashlib.sha256(repr(session_id).encode()).digest()
    return np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")]).generate_state(
        2, np.uint32
    )


class BeatPlanner:
    """The host's side of each beat, before the tick; see the module docstring.

    Args:
      engine: the device side (its ``serve``, ``samples_per_beat``, ``empty_beat`` and
        ``place``).
      slots, queues, hub: the slot table, the per-session input queues and the hub (each
        thread-safe, shared with the network front).
      scheduler: the batching policy.
      rollover, memory, llm_tokenizer, asr_decode: when sessions roll over and what their capsule
        holds (``Server``).
      seed: the run seed of every session's sampling key (``session_key``).
      vanish_beats: a live session with no audio at all for this many beats has vanished; None
        never ends a silent session.
      max_ended: records of ended and failed sessions kept.
      send: to the writer thread, in beat order.
      cap_reached: sessions the writer saw reach the context cap, to release.
    """

    def __init__(
        self,
        engine,
        *,
        slots: SlotTable,
        queues: InputQueues,
        hub: SessionHub,
        scheduler: Scheduler,
        rollover: RolloverPolicy,
        memory: MemoryConfig,
        llm_tokenizer: TextTokenizer | None,
        asr_decode: Callable[[Sequence[int]], str] | None,
        seed: int,
        vanish_beats: int | None,
        max_ended: int,
        send: Callable[[object], None],
        cap_reached: queue.SimpleQueue,
    ):
        self.engine = engine
        self.slots = slots
        self.queues = queues
        self.hub = hub
        self.scheduler = scheduler
        self.rollover = rollover
        self.memory = memory
        self.llm_tokenizer = llm_tokenizer
        self.asr_decode = asr_decode
        self.seed = seed
        self.vanish_beats = vanish_beats
        self.send = send
        self.cap_reached = cap_reached
        self.failures = EndedRecords(max_ended)  # session -> why it failed or was refused
        self.ended = EndedRecords(max_ended)  # session -> why it ended before the run did
        self.failed_sessions = 0  # sessions that failed (bad input, vanished); not refusals
        self.rollovers = 0  # roll-overs the host asked for
        self._scripted = ScriptedSessions(samples_per_beat=engine.samples_per_beat)
        self._waiting: list[tuple[SessionSource, list[Join]]] = []  # joins the scheduler holds
        self._owner: dict[Hashable, SessionSource] = {}  # live session -> its source
        self._silent: dict[Hashable, int] = {}  # consecutive beats with no input at all
        self._context: dict[Hashable, int] = {}  # LLM context frames after the beat prepared last
        self._memories: dict[Hashable, ConversationMemory] = {}
        # Roll-overs asked this beat, applied next beat: session -> their fields and capsule.
        self._rolling: dict[Hashable, dict] = {}

    def load(self, plans: Sequence[SessionPlan]) -> None:
        """The run's scripted sessions."""
        self._scripted = ScriptedSessions(plans, samples_per_beat=self.engine.samples_per_beat)

    @property
    def sources(self) -> tuple[SessionSource, ...]:
        return (self._scripted, self.hub)

    def retained(self) -> dict[str, int]:
        """Sizes of what the planner keeps (the tests hold them flat)."""
        return {
            "failures": len(self.failures),
            "ended": len(self.ended),
            **self._scripted.retained(),
            **self.hub.retained(),
            "owners": len(self._owner),
            "silent": len(self._silent),
            "context": len(self._context),
            "rolling": len(self._rolling),
            "memories": len(self._memories),
        }

    def quiet(self, k: int) -> bool:
        """Whether tick k has nothing to do: no session live or waiting for a slot, no roll-over
        asked, no scripted session due by k, no request from the hub. Nothing is owed for such a
        tick, and the server need not run it (``Server._idle``)."""
        return (
            len(self.slots) == 0
            and not self._waiting
            and not self._rolling
            and self.cap_reached.empty()
            and self._scripted.quiet(k)
            and not self.hub.asked()
        )

    def next_scripted_join(self) -> int | None:
        """The tick at which the next scripted session joins (None: none left)."""
        return self._scripted.next_join()

    def _end(self, sid: Hashable, why: str, detail: str, tick: int) -> None:
        """Bookkeeping for a session whose slot was just released."""
        self.ended[sid] = detail
        owner = self._owner.pop(sid, None)
        if why == "failed" and owner is self.hub:
            why = CLIENT_ERROR  # the client's doing (bad audio, vanished), not the server's
            self.failures.pop(sid, None)
        if owner is not None:
            owner.ended(sid, why, detail, tick)
        self._silent.pop(sid, None)
        self._context.pop(sid, None)
        self._rolling.pop(sid, None)
        self._memories.pop(sid, None)
        if why == "failed":
            self.failed_sessions += 1
            if sid not in self.failures:  # failed by its source (a scripted session's file)
                self.failures[sid] = detail
            self.send(Event({"event": "failed", "session": sid, "tick": tick, "message": detail}))
        # Logged by the writer thread: a log line can block (a full stderr pipe), the beat cannot.
        self.send(Event({"event": "ended", "session": sid, "reason": why, "tick": tick}))
        self.send(Ended(sid, why, detail))

    def feed(self, k: int) -> None:
        """Tick k's audio of the sessions fed in step with the beat (scripted). The server calls
        it before the beat, in the slack while the device runs the last one
        (``Server._feed_ahead``), and ``prepare(k)`` again, which then pushes only the sessions
        it admitted (a source feeds a tick once)."""
        for source in self.sources:
            source.feed(k, self.queues)

    def prepare(self, k: int) -> tuple[state_lib.BeatInput, Snapshot]:
        """The host's work before tick k: membership changes, client input, the beat's arrays;
        returns the beat and who was in which slot for it."""
        B = self.engine.serve.slots
        admit = np.zeros((B,), np.bool_)
        release = np.zeros((B,), np.bool_)
        keys = np.zeros((B, 2), np.uint32)
        # Sessions leaving: their sources' leaves, failed input, context cap reached.
        leaving: dict[Hashable, tuple[str, str]] = {}
        for source in self.sources:
            for leave in source.leaves(k):
                leaving[leave.id] = (leave.why, leave.detail)
        for sid, reason in self.queues.failed().items():
            leaving[sid] = ("failed", f"failed: {reason}")
            self.failures[sid] = reason
        while True:
            try:
                sid = self.cap_reached.get_nowait()
            except queue.Empty:
                break
            leaving.setdefault(sid, ("context cap", "context cap"))
        for sid, (why, detail) in leaving.items():
            try:
                session = self.slots.release(sid, tick=k)
            except KeyError:
                continue
            self.queues.close(sid)
            release[session.slot] = True
            self._end(sid, why, detail, k)
        # Sessions joining; those the scheduler makes wait are asked again next beat, first.
        waiting, self._waiting = self._waiting, []
        for source, joins in [*waiting, *((s, s.joins(k)) for s in self.sources)]:
            for join in joins:
                try:
                    if join.id in leaving:  # it left while it waited
                        self.scheduler.withdraw(join.id)
                        raise CapacityError(f"session {join.id} left while waiting for a slot")
                    slot = self.scheduler.admit(self.slots, join.id, tick=k, source=join.source)
                except CapacityError as e:
                    self.failures[join.id] = str(e)
                    source.refused(join, e, k)
                    continue
                if slot is None:
                    self._waiting.append((source, [join]))
                    continue
                self.queues.open(self.slots.session(join.id))
                admit[slot] = True
                release[slot] = False
                keys[slot] = session_key(self.seed, join.id)
                self._owner[join.id] = source
                self._context[join.id] = 0
                if self.rollover.host_rolls:
                    self._memories[join.id] = ConversationMemory(self.memory)
                source.admitted(join, slot, k)
                self.send(Opened(join.id, join.stream, join.record))
        for event in self.slots.drain_events():
            self.send(Event(event))
        # Sources fed in step with the beat push its audio (scripted: a late beat comes next).
        self.feed(k)
        schedule = self.scheduler.plan(k, self.slots, self.queues)  # moves sessions, if any
        self.engine.place(schedule)  # an engine with buckets moves the state into the beat's
        retarget(schedule.moves, admit, release, keys)
        live = self.slots.slot_sessions()
        silent = {sid: self.queues.backlog(sid) == 0 for sid in live if sid is not None}
        audio, underrun = self.queues.take_beat(schedule.running(live))  # held: input kept
        for sid, nothing in silent.items():
            self._silent[sid] = self._silent.get(sid, 0) + 1 if nothing else 0
            if self.vanish_beats is not None and self._silent[sid] >= self.vanish_beats:
                # Fail it now; the next beat's membership step releases it.
                self.queues.fail(sid, f"client vanished: no audio for {self._silent[sid]} beats")
        beat = self.engine.empty_beat().replace(audio=audio, admit=admit, release=release, key=keys)
        beat.run[:] = schedule.run
        rollovers = self._roll_over(live, beat)
        memories = [None if sid is None else self._memories.get(sid) for sid in live]
        snapshot = Snapshot(live, [live[b] for b in range(B) if underrun[b]], memories, rollovers)
        return beat, snapshot

    def _roll_over(self, live: list, beat: state_lib.BeatInput) -> dict[int, dict]:
        """Sets ``beat``'s roll-overs by the policy; counts each live session's LLM context frames
        through this beat. Returns slot -> the fields of the roll-overs applied in this beat.

        A roll-over is asked a beat ahead: the policy's choice in beat k goes in beat k's
        ``prefill`` with its capsule (the engine prefills it after tick k, in the beat's slack,
        where it can) and in beat k + 1's ``reseed`` (applied before tick k + 1), so that its
        prefill need not lengthen a beat. The session runs beat k on its old context.

        The count is the device's own: every live slot runs ``fpt`` frames each beat it is not
        held in (a held one is not rolled over), and a re-seeded one starts again from its capsule.
        """
        fpt = self.engine.serve.frames_per_tick
        policy = self.rollover
        slot_of = {sid: b for b, sid in enumerate(live) if sid is not None}
        applied: dict[int, dict] = {}
        for sid, asked in self._rolling.items():  # asked last beat (a session that left is gone)
            b = slot_of[sid]
            capsule = asked.pop("capsule")
            n = capsule.shape[0]
            beat.reseed[b] = True
            beat.capsule[b, :n] = capsule
            beat.capsule_len[b] = n
            applied[b] = asked
            self._context[sid] = n
        self._rolling = {}
        running = []  # (slot, context, silent frames) of the sessions that run this beat
        for b, sid in enumerate(live):
            if sid is None or not beat.run[b] or b in applied:
                continue
            context = self._context.get(sid, 0)
            memory = self._memories.get(sid)
            # the pause is read only where the policy looks at it (``RolloverPolicy.due``)
            due = memory is not None and policy.due(context)
            running.append((b, context, memory.silent_frames() if due else 0))
        for b, reason in policy.plan(running):
            sid = live[b]
            memory = self._memories.get(sid)
            capsule = np.zeros((0,), np.int32)
            if policy.capsule_limit and memory is not None:
                capsule = build_capsule(
                    memory.turns(),
                    policy.capsule_limit,
                    llm_tokenizer=self.llm_tokenizer,
                    asr_decode=self.asr_decode,
                )
            n = capsule.shape[0]
            beat.prefill[b] = True
            beat.capsule[b, :n] = capsule
            beat.capsule_len[b] = n
            self._rolling[sid] = {
                "reason": reason,
                "context": self._context.get(sid, 0) + fpt,  # at the roll-over, a beat later
                "capsule_len": n,
                "capsule": capsule,
            }
            self.rollovers += 1
        for b, sid in enumerate(live):
            if sid is not None and beat.run[b]:
                self._context[sid] = self._context.get(sid, 0) + fpt
        return applied

    def end_all(self, tick: int, stopping: bool) -> None:
        """At any end, sessions still waiting for a slot are refused; on a stop request
        (``stopping``) every live session ends with a ``shutdown`` event as well."""
        for source, joins in self._waiting:
            for join in joins:
                source.refused(join, CapacityError(f"server stopped: {join.id} refused"), tick)
        self._waiting.clear()
        if not stopping:
            return
        for session in self.slots.sessions():
            self.slots.release(session.id, tick=tick)
            self.queues.close(session.id)
            self._end(session.id, SHUTDOWN, SHUTDOWN, tick)
        for event in self.slots.drain_events():
            self.send(Event(event))
