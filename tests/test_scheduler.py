"""The host-side scheduler (``serving.scheduler``) and slot buckets (``buckets``), tiny model.

Policies are checked on the host alone (plans, moves, admission), then on the engine: the default
policy serves exactly what the server served before schedulers (the tick driven by hand the old
way), a held slot stays bit-identical and its session's output is only delayed, and a move between
buckets leaves a session's output as it would have been without the move. Offline clock throughout.
"""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest

from tests import shared
from voicechat_jax import buckets as buckets_lib
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.precision import Precision
from voicechat_jax.serving import runner
from voicechat_jax.serving import scheduler as sched
from voicechat_jax.serving.hub import Join
from voicechat_jax.serving.server import Server, SessionPlan, session_key
from voicechat_jax.serving.sessions import CapacityError, InputQueues, SlotTable

CFG = tiny()
PREC = Precision.fp32()
SERVE = ServeConfig(slots=2, frames_per_tick=2, context_frames=32, precision=PREC)
BEAT = 2 * 1280
SEED = 7


def _speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    tone = np.sin(2 * np.pi * (150 + 100 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 2 * t))
    return (0.3 * tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _queues(table: SlotTable) -> InputQueues:
    q = InputQueues(table.n_slots, BEAT, max_backlog_beats=None)
    for s in table.sessions():
        q.open(s)
    return q


# ---- policies on the host ---------------------------------------------------------------------


def test_lockstep_admits_lowest_free_and_runs_every_slot():
    table = SlotTable(3)
    policy = sched.Lockstep()
    assert [policy.admit(table, s, tick=0) for s in "abc"] == [0, 1, 2]
    with pytest.raises(CapacityError, match="server full: 3 of 3 slots in use; session d refused"):
        policy.admit(table, "d", tick=1)
    table.release("b")
    plan = policy.plan(2, table, _queues(table))
    assert plan.run.tolist() == [True] * 3
    assert (plan.bucket, plan.moves) == (3, ())
    assert policy.buckets == ()


def test_round_robin_takes_turns_and_holds_the_rest():
    table = SlotTable(4)
    for s in "abc":
        table.admit(s)
    policy = sched.RoundRobin(batch=1)
    q = _queues(table)
    runs = [np.flatnonzero(policy.plan(k, table, q).run).tolist() for k in range(4)]
    assert runs == [[0], [1], [2], [0]]
    assert policy.held_session_beats == 4 * 2
    two = sched.RoundRobin(batch=2)
    # Turns c, a (slots 2, 0), then b, c: the cursor goes on past the last one run.
    assert [np.flatnonzero(two.plan(k, table, q).run).tolist() for k in range(3)] == [
        [0, 1],
        [0, 2],
        [1, 2],
    ]
    plan = two.plan(3, table, q)
    assert plan.held(table.slot_sessions()) == ["c"]


def test_waiting_window_holds_late_input_at_most_window_beats():
    table = SlotTable(2)
    table.admit("on_time")
    table.admit("late")
    q = _queues(table)
    policy = sched.WaitingWindow(window_beats=2)
    runs = []
    for _ in range(4):
        q.push("on_time", np.zeros(BEAT, np.float32))  # "late" never sends
        runs.append(policy.plan(0, table, q).run.tolist())
        q.take_beat(
            [s if r else None for s, r in zip(table.slot_sessions(), runs[-1], strict=True)]
        )
    # Held twice (the window), then run with silence; held again for the next window.
    assert runs == [[True, False], [True, False], [True, True], [True, False]]
    assert policy.held_session_beats == 3
    assert sched.WaitingWindow(0).plan(0, table, q).run.all()


def test_slot_buckets_grow_at_once_and_shrink_after_a_while_compacting():
    table = SlotTable(8)
    policy = sched.SlotBuckets((2, 4, 8), shrink_after=2)
    q = _queues(table)
    for s in "abc":
        policy.admit(table, s, tick=0)
    assert policy.plan(0, table, q).bucket == 4  # three sessions: the 4-slot bucket at once
    for s in "defgh":
        policy.admit(table, s, tick=1)
    assert policy.plan(1, table, q).bucket == 8
    for s in "abcdeg":
        table.release(s)  # f (slot 5) and h (slot 7) are left
    plans = [policy.plan(k, table, q) for k in (2, 3)]
    assert [p.bucket for p in plans] == [8, 2]  # hysteresis: one beat fitting is not enough
    assert plans[1].moves == (sched.Move("f", 5, 0), sched.Move("h", 7, 1))
    assert table.slot_sessions() == ["f", "h"] + [None] * 6
    assert (policy.moves, policy.resizes) == (2, 3)
    assert (policy.bucket_for(3), policy.bucket_for(9)) == (4, 8)


def test_admission_control_queues_first_come_first_served_then_refuses():
    table = SlotTable(2)
    policy = sched.AdmissionControl(sched.Lockstep(), queue_beats=2)
    policy.admit(table, "a", tick=0)
    policy.admit(table, "b", tick=0)
    assert policy.admit(table, "c", tick=0) is None  # waits
    table.release("a")
    assert policy.admit(table, "d", tick=1) is None  # a slot is free, but c has waited longer
    assert policy.admit(table, "c", tick=1) == 0
    assert policy.admit(table, "d", tick=2) is None
    with pytest.raises(CapacityError, match="session d refused after waiting 2 beats"):
        policy.admit(table, "d", tick=3)
    assert (policy.queued, policy.waited_beats, table.refused) == (2, 3, 1)
    assert table.drain_events()[-1]["event"] == "refused"
    limited = sched.AdmissionControl(sched.Lockstep(), max_live=1)
    limited.admit(t := SlotTable(4), "x", tick=0)
    with pytest.raises(CapacityError, match="limit 1"):
        limited.admit(t, "y", tick=0)


def test_build_engine_wraps_the_policy_in_admission_control_only_when_asked(monkeypatch):
    """``runner.build_engine``: lockstep or buckets, behind ``AdmissionControl`` when
    ``max_live`` or ``admission_queue_s`` is set (the queue rounded up to whole beats), the plain
    policy otherwise. The engines are stand-ins: only the policy is under test."""

    class FakeEngine:
        def __init__(self, params, cfg, serve, **kw):
            self.serve, self.kw = serve, kw

    monkeypatch.setattr(runner, "Engine", FakeEngine)
    serve = ServeConfig(slots=8, frames_per_tick=2)

    def policy(**kw):
        options = runner.RunOptions(serve=serve, **kw)
        return runner.build_engine(options, None, CFG, serve)[1]

    assert type(policy()) is sched.Lockstep
    assert type(policy(scheduler="buckets")) is sched.SlotBuckets
    wrapped = policy(max_live=6)
    assert isinstance(wrapped, sched.AdmissionControl)
    assert type(wrapped.inner) is sched.Lockstep
    assert (wrapped.max_live, wrapped.queue_beats, wrapped.name) == (6, 0, "lockstep+admission")
    wrapped = policy(scheduler="buckets", buckets=(4, 8), admission_queue_s=10.0)
    assert isinstance(wrapped, sched.AdmissionControl)
    assert type(wrapped.inner) is sched.SlotBuckets
    assert wrapped.buckets == (4, 8)  # the bucket engine compiles the inner policy's buckets
    assert (wrapped.max_live, wrapped.queue_beats) == (None, 63)  # 10 s / 160 ms, rounded up
    assert runner.RunOptions(serve=serve, admission_queue_s=0.32).admission_queue_beats == 2


def test_net_options_wait_for_the_admission_queue():
    """With a queue, the front waits for an admission's answer longer than the queue lasts."""
    serve = ServeConfig(slots=8, frames_per_tick=2)
    net = {"idle_timeout_s": 3.0}
    assert runner.net_options(runner.RunOptions(serve=serve, net=net)) == net
    assert runner.net_options(runner.RunOptions(serve=serve, net=net, max_live=4)) == net
    queued = runner.net_options(runner.RunOptions(serve=serve, net=net, admission_queue_s=30.0))
    assert queued["idle_timeout_s"] == 3.0
    assert queued["admit_timeout_s"] == pytest.approx(188 * 0.16 + 10.0)  # 188 beats, + 10 s


def test_source_slots_and_retarget():
    # Shrink 4 -> 2 moving the session in slot 3 to slot 1: slot 0 kept, slot 1 takes slot 3.
    assert buckets_lib.source_slots(4, 2, [(3, 1)]).tolist() == [0, 3]
    # Grow 2 -> 4: the old slots kept, the new ones fresh.
    assert buckets_lib.source_slots(2, 4, []).tolist() == [0, 1, -1, -1]
    # A move inside the bucket leaves its source fresh.
    assert buckets_lib.source_slots(4, 4, [(3, 0)]).tolist() == [3, 1, 2, -1]
    with pytest.raises(ValueError, match="outside"):
        buckets_lib.source_slots(2, 1, [(1, 1)])
    admit = np.array([False, False, True])
    release = np.array([True, False, False])
    key = np.array([[0, 0], [0, 0], [5, 6]], np.uint32)
    sched.retarget([sched.Move("s", 2, 0)], admit, release, key)
    assert admit.tolist() == [True, False, False]
    assert release.tolist() == [False] * 3
    assert key[0].tolist() == [5, 6]


# ---- on the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    return shared.params(PREC)


@pytest.fixture(scope="module")
def engine(params):
    engine = Engine(params, CFG, SERVE)  # its programs are shared with the buckets
    engine.compile_tick()
    return engine


@pytest.fixture(scope="module")
def bucket_engine(params, engine):
    """Buckets of 1 and 2 slots; the 2-slot programs are the fixed engine's (compiles saved)."""
    e = Engine(
        params, CFG, SERVE, buckets=(1, 2), template=engine.template,
        programs={2: engine.programs()},
    )  # fmt: skip
    e.compile_tick()
    return e


def _serve(engine, plans, n_ticks, scheduler=None, **kw) -> Server:
    engine.reset()
    kw.setdefault("loop", "dispatch")  # the engine's programs this file shares
    server = Server(engine, clock="offline", seed=SEED, warmup_ticks=0, scheduler=scheduler, **kw)
    server.run(plans, n_ticks)
    return server


def _same(a: dict, b: dict, keys=("text", "function", "codes", "wav")) -> None:
    for k in keys:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _old_server_drive(engine, plans, n_ticks) -> dict:
    """Each session's frames when the tick is driven by hand as the server drove it before there
    were schedulers: lowest free slot, every slot runs (``run`` left at the empty beat's ones)."""
    engine.reset()
    table = SlotTable(engine.serve.slots)
    joined, got = {}, {p.id: {"text": [], "function": [], "codes": [], "wav": []} for p in plans}
    for k in range(n_ticks):
        beat = engine.empty_beat()
        for p in plans:
            if p.leave == k and p.id in joined:
                beat.release[table.release(p.id).slot] = True
                del joined[p.id]
        for p in plans:
            if p.join == k:
                slot = table.admit(p.id)
                beat.admit[slot], beat.release[slot] = True, False
                beat.key[slot] = session_key(SEED, p.id)
                joined[p.id] = (p, k)
        for sid, (p, j) in joined.items():
            chunk = p.audio[(k - j) * BEAT : (k - j + 1) * BEAT]
            beat.audio[table.slot_of(sid), : chunk.size] = chunk
        out = jax.device_get(engine.tick(beat))
        for sid in joined:
            b = table.slot_of(sid)
            assert out.ran[b]
            for name in ("text", "function", "codes", "wav"):
                got[sid][name].append(getattr(out.frames, name)[b])
    return {sid: {n: np.concatenate(v) for n, v in d.items()} for sid, d in got.items()}


def test_default_scheduler_gives_todays_outputs_bit_for_bit(engine):
    plans = [
        SessionPlan(id="a", audio=_speech(1.5, 1), join=0, leave=4),
        SessionPlan(id="b", audio=_speech(1.5, 2), join=1),
        SessionPlan(id="c", audio=_speech(1.5, 3), join=4),  # into the slot a left
    ]
    want = _old_server_drive(engine, plans, 8)
    for scheduler in (None, sched.Lockstep()):
        server = _serve(engine, plans, 8, scheduler)
        for p in plans:
            _same(server.logs[p.id].arrays(), want[p.id])


def test_held_slot_is_bit_identical(engine):
    """A live slot the scheduler holds keeps every leaf, bit for bit, while its neighbour runs."""
    engine.reset()
    beat = engine.empty_beat()
    beat.admit[:] = True
    beat.key[:] = [[1, 2], [3, 4]]
    beat.audio[:] = np.stack([_speech(0.16, 5), _speech(0.16, 6)])
    engine.tick(beat)
    before = jax.device_get(engine.state)
    beat = engine.empty_beat().replace(
        audio=np.stack([_speech(0.16, 7), _speech(0.16, 8)]), run=np.array([True, False])
    )
    out = jax.device_get(engine.tick(beat))
    after = jax.device_get(engine.state)
    row = functools.partial(jax.tree_util.tree_map, lambda x: x[1])
    chex.assert_trees_all_equal(row(before), row(after))
    assert out.ran.tolist() == [True, False]
    assert after.model.frame.tolist() == [4, 2]


def test_round_robin_delays_each_session_without_changing_it(engine):
    """Batch-1 round robin: each of two sessions runs every other beat, and what it produces is
    exactly the first half of what it produces when every slot runs every beat."""
    plans = [SessionPlan(id=s, audio=_speech(1.5, i)) for i, s in enumerate("xy")]
    lockstep = _serve(engine, plans, 4)
    rr = sched.RoundRobin(batch=1)
    held = _serve(engine, plans, 8, rr, max_backlog_beats=None)
    assert rr.held_session_beats == 8
    for p in plans:
        assert held.queues.underruns == 0
        _same(held.logs[p.id].arrays(), lockstep.logs[p.id].arrays())


def test_bucket_move_preserves_the_sessions_output(engine, bucket_engine):
    """b joins next to a (bucket 1 -> 2); a leaves, b moves from slot 1 to slot 0 (bucket 2 -> 1).
    Its output is bit for bit the one it gets in the same buckets without a move, and its tokens
    and codes those of a fixed 2-slot engine (the waveform to XLA's per-batch-size rounding)."""
    b = _speech(2, 2)
    moved_plans = [
        SessionPlan(id="a", audio=_speech(2, 1), join=0, leave=5),
        SessionPlan(id="b", audio=b, join=2),
    ]
    policy = sched.SlotBuckets((1, 2), shrink_after=1)
    moved = _serve(bucket_engine, moved_plans, 9, policy)
    assert (policy.moves, policy.resizes, bucket_engine.bucket) == (1, 2, 1)
    assert moved.slots.slot_of("b") == 0
    # The same buckets for b, but b admitted into slot 0 (a placeholder held it till then).
    still_plans = [
        SessionPlan(id="p", audio=_speech(2, 3), join=0, leave=2),
        SessionPlan(id="a", audio=_speech(2, 1), join=0, leave=5),
        SessionPlan(id="b", audio=b, join=2),
    ]
    still_policy = sched.SlotBuckets((1, 2), shrink_after=1)
    still = _serve(bucket_engine, still_plans, 9, still_policy)
    assert (still_policy.moves, still.slots.slot_of("b")) == (0, 0)
    _same(moved.logs["b"].arrays(), still.logs["b"].arrays())
    fixed = _serve(engine, moved_plans, 9)
    _same(moved.logs["b"].arrays(), fixed.logs["b"].arrays(), keys=("text", "function", "codes"))
    np.testing.assert_allclose(
        moved.logs["b"].arrays()["wav"], fixed.logs["b"].arrays()["wav"], rtol=0, atol=1e-5
    )
    assert bucket_engine.compiles == 4  # the 1-slot tick, its output pad, two resizes


def test_resize_copies_kept_slots_bit_for_bit(bucket_engine):
    e = bucket_engine
    e.reset()
    e.place(sched.BeatPlan(run=np.ones(2, bool), bucket=2))
    beat = e.empty_beat()
    beat.admit[:] = True
    beat.key[:] = [[1, 2], [3, 4]]
    beat.audio[:] = np.stack([_speech(0.16, 5), _speech(0.16, 6)])
    beat.prefill[:] = True  # both slots' next roll-overs prefilled behind the tick
    beat.capsule[:, :3] = [[1, 2, 3], [5, 6, 7]]
    beat.capsule_len[:] = 3
    e.tick(beat)
    assert e.prefilled == (0, 1)
    before = jax.device_get(e.state)
    e.place(sched.BeatPlan(run=np.ones(2, bool), bucket=1, moves=(sched.Move("s", 1, 0),)))
    assert e.prefilled == (0,)  # slot 1's lane moved with it; slot 0's, not kept, dropped
    assert e._lanes[0].holds(np.array([5, 6, 7]))
    after = jax.device_get(e.state)
    chex.assert_trees_all_equal(
        jax.tree_util.tree_map(lambda x: x[1:2], before), jax.tree_util.tree_map(np.asarray, after)
    )
    e.place(sched.BeatPlan(run=np.ones(2, bool), bucket=2))  # grow: slot 1 fresh and free
    grown = jax.device_get(e.state)
    chex.assert_trees_all_equal(
        jax.tree_util.tree_map(lambda x: x[1:2], grown.model), jax.device_get(e.template)
    )
    assert grown.active.tolist() == [True, False]


def test_queued_session_is_admitted_when_a_slot_frees(engine):
    plans = [
        SessionPlan(id="a", audio=_speech(1, 1), join=0, leave=3),
        SessionPlan(id="b", audio=_speech(1, 2), join=0),
        SessionPlan(id="c", audio=_speech(1, 3), join=1),  # waits two beats, then a's slot
        SessionPlan(id="d", audio=_speech(1, 4), join=1),  # waits behind c, then times out
    ]
    policy = sched.AdmissionControl(sched.Lockstep(), queue_beats=3)
    server = _serve(engine, plans, 6, policy)
    events = server.metrics.summary()["events"]
    assert (events["admitted"], events["refused"]) == (3, 1)
    assert "session d refused after waiting 3 beats" in server.failures["d"]
    assert server.slots.session("c").admitted_tick == 3
    assert server.logs["c"].arrays()["text"].size == 3 * 2


def test_a_caller_who_hangs_up_in_the_queue_holds_no_place(engine):
    """A scripted caller whose leave comes while it waits is refused then (it never takes a slot),
    and the queue forgets it: a later caller gets the free slot at once, with no one ahead."""
    plans = [
        SessionPlan(id="a", audio=_speech(1, 1), join=0, leave=4),
        SessionPlan(id="b", audio=_speech(1, 2), join=0),
        SessionPlan(id="c", audio=_speech(1, 3), join=1, leave=3),  # hangs up while it waits
        SessionPlan(id="d", audio=_speech(1, 4), join=5),  # a's slot is free since beat 4
    ]
    policy = sched.AdmissionControl(sched.Lockstep(), queue_beats=10)
    server = _serve(engine, plans, 7, policy)
    assert "session c left while waiting for a slot" in server.failures["c"]
    assert server.slots.session("d").admitted_tick == 5
    events = server.metrics.summary()["events"]
    assert (events["admitted"], events.get("refused", 0)) == (3, 0)  # c left; nobody refused
    assert (policy.queued, policy.waited_beats) == (1, 2)  # c waited at beats 1 and 2
    assert "c" not in {s.id for s in server.slots.sessions()}


def _two_callers_and_a_queue(engine, *, a_leaves: int) -> tuple[list[SessionPlan], Server]:
    """Scripted a (leaving before beat ``a_leaves``) and b fill both slots; a server behind
    ``AdmissionControl`` with a 10-beat queue, for network callers to wait in."""
    plans = [
        SessionPlan(id="a", audio=_speech(1, 1), join=0, leave=a_leaves),
        SessionPlan(id="b", audio=_speech(1, 2), join=0),
    ]
    engine.reset()
    policy = sched.AdmissionControl(sched.Lockstep(), queue_beats=10)
    return plans, Server(
        engine, clock="offline", loop="dispatch", seed=SEED, warmup_ticks=0, scheduler=policy
    )


def test_a_network_caller_who_hangs_up_in_the_queue_holds_no_place(engine):
    """The hub's path: net-1 waits from beat 0 and hangs up at beat 2; net-2 asks at beat 3 and
    gets a's slot when a leaves at beat 4 (before the withdrawal, net-1 stayed "ahead" of it)."""
    plans, server = _two_callers_and_a_queue(engine, a_leaves=4)
    hub, leaves, asked = server.hub, server.hub.leaves, {}

    def leaves_at(tick):  # the client side of the hub, in step with the beat
        if tick == 2:
            hub.release("net-1")  # still waiting: its leave comes at this beat
        if tick == 3:
            asked["net-2"] = hub.admit(Join("net-2"))
        return leaves(tick)

    hub.leaves = leaves_at
    first = hub.admit(Join("net-1"))
    server.run(plans, 6)
    with pytest.raises(CapacityError, match="net-1 left while waiting"):
        first.result(timeout=0)
    assert asked["net-2"].result(timeout=0) == 0  # a's slot, at beat 4
    assert server.slots.session("net-2").admitted_tick == 4


def test_withdraw_forgets_a_waiting_session():
    table = SlotTable(1)
    policy = sched.AdmissionControl(sched.Lockstep(), queue_beats=5)
    policy.admit(table, "a", tick=0)
    assert policy.admit(table, "b", tick=0) is None
    policy.withdraw("b")
    table.release("a")
    assert policy.admit(table, "c", tick=1) == 0  # no one ahead of c any more
    sched.Lockstep().withdraw("x")  # policies with no queue: nothing to forget
    sched.SlotBuckets((1, 2)).withdraw("x")


def test_network_session_waits_in_the_queue_then_is_admitted(engine):
    """A hub (network) session that finds the slots full waits: its future resolves with a slot
    once one frees; one still waiting when the run ends is refused, not left hanging."""
    plans, server = _two_callers_and_a_queue(engine, a_leaves=3)
    early = server.hub.admit(Join("net-1"))  # asks before tick 0: both slots go to a and b
    late = server.hub.admit(Join("net-2"))
    server.run(plans, 5)
    assert early.result(timeout=0) == 0  # a's slot, at tick 3
    assert server.slots.session("net-1").admitted_tick == 3
    with pytest.raises(CapacityError, match="server stopped: net-2 refused"):
        late.result(timeout=0)
    assert server.scheduler.queued == 2


def test_buckets_need_a_bucket_engine(engine):
    with pytest.raises(ValueError, match="need an engine compiled for them"):
        Server(engine, clock="offline", scheduler=sched.SlotBuckets((1, 2)))
    with pytest.raises(ValueError, match="end at 2"):
        Engine(engine.params, CFG, SERVE, buckets=(1, 4), template=engine.template)
