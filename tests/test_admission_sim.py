"""The admission experiment's burst replay (experiments/admission_overload/burst_replay.py) and the
simulator's per-tick cache fill (``sim.simulate_lockstep``'s ``context_frac`` as a function)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments.admission_overload import burst_replay as br
from experiments.policy_sim import sim

_REPO = pathlib.Path(__file__).resolve().parents[1]
_HERE = _REPO / "experiments" / "admission_overload"
H200_ROWS = _HERE / "results" / "h200_voicechat_11b.jsonl"


def _burst_rows() -> list[dict]:
    with open(H200_ROWS) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "burst"]


def test_live_and_fill_by_hand():
    # Call 0 admitted at beat 0, released before beat 3; call 1 admitted at beat 2, never
    # released. Two frames a beat, four slots (free ones hold 0 frames).
    live, fill = br.live_and_fill([(0, 3), (2, None)], 5, 4)
    np.testing.assert_array_equal(live, [1, 1, 2, 1, 1])
    # frames held: beat 0: 0; 1: 2; 2: 4 + 0; 3: 2 (call 1); 4: 4 (call 1)
    np.testing.assert_allclose(fill, np.asarray([0, 2, 4, 2, 4]) / 4)
    _, capped = br.live_and_fill([(0, None)], 4, 1, context_frames=3)
    np.testing.assert_allclose(capped, [0, 2, 3, 3])


def test_replay_queue_by_hand():
    # Two slots; calls (join, leave): 0 and 1 take the slots at beat 0, 2 finds them full at beat
    # 0, 3 at beat 1; 1 leaves before beat 3.
    schedule = [(0, 5), (0, 3), (0, 4), (1, 6)]
    at_once = br.replay_burst(schedule, slots=2, queue_beats=0, ticks=8)
    assert (at_once.refused, at_once.queued, at_once.waited_beats) == (2, 0, 0)
    assert at_once.admitted_at == {0: 0, 1: 0}
    np.testing.assert_array_equal(at_once.live, [2, 2, 2, 1, 1, 0, 0, 0])
    # A 2-beat queue: call 2 waits beats 0 and 1 and is refused at 2 (still full); call 3 waits
    # beats 1 and 2 and takes call 1's slot at beat 3 (no one asked before it is still waiting).
    queued = br.replay_burst(schedule, slots=2, queue_beats=2, ticks=8)
    assert (queued.refused, queued.queued, queued.waited_beats) == (1, 2, 4)
    assert queued.admitted_at == {0: 0, 1: 0, 3: 3}
    assert queued.ended_at == {1: 3, 0: 5, 3: 6}
    np.testing.assert_array_equal(queued.live, [2, 2, 2, 2, 2, 1, 0, 0])
    # call 0 holds 2 (k - 0) frames, call 3 from beat 3 holds 2 (k - 3)
    np.testing.assert_allclose(queued.fill_frames[3:6], [(6 + 0) / 2, (8 + 2) / 2, 4 / 2])


def test_replay_of_a_call_whose_leave_comes_while_it_waits():
    # One slot; call 1 (leave 2) waits from beat 0. Today's server withdraws it at beat 2, before
    # it is asked again: refused then (not counted in ``refused``), its two waited beats kept.
    rep = br.replay_burst([(0, 3), (0, 2)], slots=1, queue_beats=5, ticks=6)
    assert rep.admitted_at == {0: 0}
    assert (rep.withdrawn, rep.refused, rep.queued, rep.waited_beats) == (1, 0, 1, 2)
    np.testing.assert_array_equal(rep.live, [1, 1, 1, 0, 0, 0])
    # The server of the H200 rows (b7b4b9a) dropped that leave: call 1 took call 0's slot at
    # beat 3 and was never released within the run.
    rep = br.replay_burst([(0, 3), (0, 2)], slots=1, queue_beats=5, ticks=6,
                          withdraw_at_leave=False)  # fmt: skip
    assert rep.admitted_at == {0: 0, 1: 3}
    assert rep.ended_at == {0: 3}
    assert rep.withdrawn == 0
    np.testing.assert_array_equal(rep.live, [1, 1, 1, 1, 1, 1])
    assert rep.live_at_end_waits == [3]
    # sim.admit_calls lets the call last its 2 beats from its admission instead
    calls = br.admit_calls_counts([(0, 3), (0, 2)], slots=1, queue_beats=5, ticks=6, warmup=0)
    assert calls["session_beats"] == 5


def test_replay_refuses_runs_that_reach_the_context_cap():
    with pytest.raises(ValueError, match="context cap"):
        br.replay_burst([(0, 5)], slots=1, queue_beats=0, ticks=40, context_frames=64)


def test_burst_schedule_draws_as_the_engine_part_did():
    # The engine part's draws before the schedule was factored out (run.burst_plans, seed 5).
    rng = np.random.default_rng(5)
    old = []
    for _ in range(112):
        join = int(rng.integers(0, 10))
        old.append((join, join + 1 + int(rng.exponential(150))))
    assert br.burst_schedule(112, 10, 150) == old


@pytest.mark.skipif(not H200_ROWS.exists(), reason="no committed H200 burst rows")
def test_replay_reproduces_the_h200_rows():
    rows = _burst_rows()
    assert {r["queue_beats"] for r in rows} == {0, 60}
    for r in rows:
        setup = {k: r.get(k, v) for k, v in br.FIRST_ROWS_SETUP.items()}
        schedule = br.burst_schedule(r["offered"], setup["burst_beats"], setup["mean_call_beats"])
        warmup = setup["ticks"] - r["steady_ticks"]
        rep = br.replay_burst(schedule, slots=r["slots"], queue_beats=r["queue_beats"],
                              ticks=setup["ticks"],
                              withdraw_at_leave=r.get("withdraw_at_leave", False))  # fmt: skip
        assert (rep.refused, rep.queued, rep.waited_beats) == (
            r["refused"], r["queued"], r["waited_beats"]
        )  # fmt: skip
        assert rep.admitted == r["events"]["admitted"]
        assert rep.ended == r["events"]["ended"]
        assert rep.session_beats(warmup) == r["session_beats"]
        assert rep.live_at_end_waits == sorted(r["live_at_end_waits"])
        calls = br.admit_calls_counts(schedule, slots=r["slots"], queue_beats=r["queue_beats"],
                                      ticks=setup["ticks"], warmup=warmup)  # fmt: skip
        if r["queue_beats"] == 0:  # no wait: the same calls, the same lengths
            assert calls["refused"] == r["refused"]
            assert calls["session_beats"] == r["session_beats"]
        else:  # a call's length from its admission, not to its scripted leave: one refusal fewer
            assert (calls["refused"], calls["queued"]) == (34, 55)


def test_context_frac_function_matches_the_number():
    cost = sim.StepCost(a_ms=20.0, b_ms=0.2, c_ms=0.5)
    tail = sim.Tail(log_sigma0=1.0, log_sigma1=0.0, host_ms=4.0)
    runs = [
        sim.simulate_lockstep(
            cost, 200, 40, slots=56, tail=tail, rng=np.random.default_rng(3), context_frac=frac
        )
        for frac in (0.3, lambda k: 0.3)
    ]
    np.testing.assert_array_equal(runs[0].latency_ms, runs[1].latency_ms)
    assert runs[0].busy_ms == runs[1].busy_ms


def test_context_frac_function_sets_each_tick():
    # No jitter, no host: each tick's latency is its own device time at that tick's fill.
    cost = sim.StepCost(a_ms=10.0, b_ms=0.0, c_ms=1.0)
    fill = np.linspace(0.0, 1.0, 20)
    res = sim.simulate_lockstep(cost, 20, 10, slots=10, context_frac=lambda k: float(fill[k]))
    np.testing.assert_allclose(res.latency_ms, 2 * (10 + 10 * fill))


def _sim_rows(tmp_path: pathlib.Path, *extra: str) -> list[dict]:
    out = tmp_path / "sim.jsonl"
    subprocess.run(
        [sys.executable, str(_HERE / "run.py"), "--parts=sim", "--max_live=56",
         "--poisson_erlangs=60", "--queue_s=0", "--span_s=30", f"--sim_out={out}", "--plot=",
         *extra],
        check=True, capture_output=True, cwd=_REPO,
        env={**os.environ, "PYTHONPATH": str(_REPO), "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    with open(out) as f:
        return [json.loads(line) for line in f]


@pytest.mark.skipif(not H200_ROWS.exists(), reason="no committed H200 burst rows")
def test_sim_part_writes_the_burst_check(tmp_path):
    rows = _sim_rows(tmp_path)
    adm = [r for r in rows if r["kind"] == "burst_admission"]
    val = [r for r in rows if r["kind"] == "burst_validation"]
    assert [r["queue_beats"] for r in adm] == [0, 60]
    assert all(r["replay_matches"] for r in adm)
    assert [r["admit_calls_matches"] for r in adm] == [True, False]
    # the measured rows named as input; the rows' own provenance: a simulation's
    assert {(r["input_commit"], r["input_device"], r["device"]) for r in adm + val} == {
        ("b7b4b9a", "NVIDIA H200", "simulation")
    }
    assert sorted((r["queue_beats"], r["case"]) for r in val) == [
        (q, c) for q in (0, 60) for c in ("auto_fill", "auto_full", "tick_line")
    ]
    by = {(r["queue_beats"], r["case"]): r for r in val}
    for q in (0, 60):  # young calls: the fill makes the tick cheaper than at full caches
        assert by[q, "auto_fill"]["sim_p50_ms"] < by[q, "auto_full"]["sim_p50_ms"]
    # the history fits are not of this engine: no check there
    hist = _sim_rows(tmp_path, "--capacity_config=xla_tts")
    assert not [r for r in hist if r["kind"].startswith("burst")]
