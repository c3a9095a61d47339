"""The batching-policy simulator (experiments/policy_sim/sim.py) on hand-made cases."""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "policy_sim"))
import sim

from voicechat_jax.serving.clock import BeatClock

FLAT = sim.StepCost(a_ms=25.0, b_ms=0.0, c_ms=0.0)  # a 50 ms tick whatever the batch


def _real_clock_ticks(work_ms: dict[int, float], n: int, period_ms: float = 160.0) -> list[int]:
    """Which ticks the real BeatClock runs when the host is busy ``work_ms[k]`` after tick k."""
    t = [0.0]
    clock = BeatClock(period_ms / 1e3, now=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    clock.begin(0.0)
    ran, last = [], None
    while (k := clock.next_tick(last)) < n:
        clock.wait_for_tick(k)
        ran.append(k)
        last = k
        t[0] += work_ms.get(k, 0.0) / 1e3
    return ran


def test_host_stall_skips_like_the_real_clock():
    # A 350 ms stall after tick 3's dispatch: the host wakes at 830 ms, in tick 5's slot (800).
    # Tick 4 is skipped; tick 5 starts 30 ms late, so its latency is 30 + 50 ms of device time.
    res = sim.simulate_lockstep(FLAT, 10, 4, slots=4, stalls=[(3, 350.0)])
    ran = [k for k in range(10) if not np.isnan(res.latency_ms[k])]
    assert ran == _real_clock_ticks({3: 350.0}, 10) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert res.skipped == 1
    assert res.missed.tolist() == [k == 4 for k in range(10)]
    np.testing.assert_allclose(res.latency_ms[5], 80.0)
    np.testing.assert_allclose(np.delete(res.latency_ms, [4, 5]), 50.0)
    assert res.live[4] == 4  # the skipped beat is missed for its live sessions


def test_device_slower_than_the_beat_skips_at_max_inflight():
    # 200 ms ticks on a 160 ms beat, two in flight at most (computed by hand): tick k ends at
    # 200 * (k + 1) until tick 6 comes due at 960 ms with ticks 4 and 5 still on the device; it is
    # skipped, and so every fifth tick after. Latencies climb 200, 240, ..., 400, then 280 ...
    res = sim.simulate_lockstep(FLAT, 22, 1, slots=1, device_ms=lambda k: 200.0)
    skipped = [k for k in range(22) if np.isnan(res.latency_ms[k])]
    assert skipped == [6, 11, 16, 21]
    np.testing.assert_allclose(res.latency_ms[:6], [200, 240, 280, 320, 360, 400])
    np.testing.assert_allclose(res.latency_ms[7:11], [280, 320, 360, 400])
    assert res.missed.all()


def test_lockstep_costs_the_compiled_slots_not_the_live_sessions():
    cost = sim.StepCost(a_ms=20.0, b_ms=1.0, c_ms=0.0)  # tick = 40 + 2*B ms
    fixed = sim.simulate_lockstep(cost, 5, 3, slots=32)
    np.testing.assert_allclose(fixed.latency_ms, 40 + 64)
    bucketed = sim.simulate_lockstep(cost, 5, 3, slots=32, buckets=[8, 16, 32])
    np.testing.assert_allclose(bucketed.latency_ms, 40 + 16)  # the 8-slot bucket
    assert sim.bucket_for(9, [8, 16, 32]) == 16
    assert sim.bucket_for(40, [8, 16, 32]) == 32


def test_batch1_capacity_by_hand():
    # A 50 ms tick per session, one after another: 3 sessions fit a 160 ms beat (150 ms), 4 do not
    # (the 4th request would start at 150 ms and end at 200 ms: dropped or late every beat).
    three = sim.simulate_requests(FLAT, 3, 20, window_ms=0, max_batch=1).summary()
    assert three["missed"] == 0
    assert three["max_ms"] == pytest.approx(150.0)
    assert three["launches"] == 60
    four = sim.simulate_requests(FLAT, 4, 20, window_ms=0, max_batch=1).summary()
    assert four["missed"] > 0


def test_request_batching_window_by_hand():
    # Two sessions at phases 0 and 30 ms. Window 50 ms: both go in one batch launched at 50 ms
    # (50 ms device) and end at 100: latencies 100 and 70. Window 0: two launches, at 0 and at 50
    # (the device frees at 50): latencies 50 and 70.
    cost = FLAT
    w50 = sim.simulate_requests(cost, 2, 3, window_ms=50, max_batch=8, phases_ms=[0, 30])
    np.testing.assert_allclose(w50.latency_ms, [100, 70] * 3)
    assert w50.launches == 3
    w0 = sim.simulate_requests(cost, 2, 3, window_ms=0, max_batch=8, phases_ms=[0, 30])
    np.testing.assert_allclose(w0.latency_ms, [50, 70] * 3)
    assert w0.launches == 6


def test_fit_reproduces_its_training_points():
    truth = sim.StepCost(a_ms=25.0, b_ms=0.2, c_ms=0.4)
    B = [16, 32, 56, 112]
    y = [truth.frame_step_ms(b) for b in B]
    fit = sim.fit_step_cost(B, y, context_share=0.4 / 0.6)
    np.testing.assert_allclose([fit.frame_step_ms(b) for b in B], y, rtol=2e-3)
    np.testing.assert_allclose([fit.a_ms, fit.b_ms, fit.c_ms], [25.0, 0.2, 0.4], rtol=1e-2)
    # Context scaling: the context part halves with the cap.
    assert fit.frame_step_ms(10, 0.5) == pytest.approx(25.0 + 10 * (0.2 + 0.2), rel=1e-2)
    loo = sim.leave_one_out(B, y, context_share=0.4 / 0.6)
    np.testing.assert_allclose(loo, y, rtol=5e-3)  # a line is recovered from any three points


def test_fit_of_the_h200_rows_within_tolerance():
    # The measured tick rows (ms per frame-step, cap 1,500): the fit's error at each is < 2 %.
    B = [16, 32, 56, 112]
    y = [34.147, 44.172, 57.691, 90.019]
    fit = sim.fit_step_cost(B, y, context_share=0.7)
    err = [abs(fit.frame_step_ms(b) / m - 1) for b, m in zip(B, y, strict=True)]
    assert max(err) < 0.02


def test_jitter_fit_and_draws():
    u, v = sim.fit_jitter([10, 50], [2.0, 20.0])
    tail = sim.Tail(log_sigma0=u, log_sigma1=v)
    assert tail.p99_minus_p50_ms(10) == pytest.approx(2.0, rel=1e-2)
    assert tail.p99_minus_p50_ms(50) == pytest.approx(20.0, rel=1e-2)
    rng = np.random.default_rng(0)
    x = np.array([tail.draw_ms(50, rng) for _ in range(200_000)])
    assert np.median(x) == 0.0
    assert np.percentile(x, 99) == pytest.approx(20.0, rel=0.05)
    assert sim.Tail().draw_ms(50, rng) == 0.0


def test_poisson_traffic_router_and_refusals():
    rng = np.random.default_rng(3)
    tr = sim.poisson_traffic(rng, rate_per_s=2.0, mean_duration_s=30.0, max_duration_s=60.0,
                             n_beats=3000, engines=3, slots=10)  # fmt: skip
    assert tr.live.max() <= 10
    assert tr.refused > 0  # 60 Erlangs offered to 30 slots
    # Least-loaded spreads the calls: the engines' live counts never differ by more than a few.
    assert np.abs(tr.live.max(axis=0) - tr.live.min(axis=0)).mean() < 3
    ff = sim.poisson_traffic(np.random.default_rng(3), rate_per_s=0.05, mean_duration_s=30.0,
                             max_duration_s=60.0, n_beats=3000, engines=3, slots=10,
                             router="first_fit")  # fmt: skip
    assert ff.live[1:].sum() == 0  # 1.5 Erlangs never fill engine 0
    assert math.isclose(ff.refused, 0)


def test_one_group_is_lockstep_and_two_groups_share_the_device():
    cost = sim.StepCost(a_ms=25.0, b_ms=1.0, c_ms=0.0)  # tick = 50 + 2*B ms
    one = sim.simulate_groups(cost, 6, [8], [0.0])[0]
    lock = sim.simulate_lockstep(cost, 6, 8, slots=8)
    np.testing.assert_allclose(one.latency_ms, lock.latency_ms)
    # Two groups of 4 half a beat apart: each tick 58 ms, alone on the device: latency 58.
    two = sim.simulate_groups(cost, 6, [4, 4], [0.0, 80.0])
    for g in two:
        np.testing.assert_allclose(g.latency_ms, 58.0)
    # 100 ms ticks half a beat apart collide (computed by hand): group 0's tick 0 ends at 100,
    # group 1's (due 80) waits for it and ends at 200 (120 ms), group 0's tick 1 (due 160) at
    # 300 (140 ms): the queue grows by 40 ms a beat.
    slow = sim.StepCost(a_ms=50.0, b_ms=0.0, c_ms=0.0)
    g0, g1 = sim.simulate_groups(slow, 2, [1, 1], [0.0, 80.0])
    np.testing.assert_allclose(g0.latency_ms, [100.0, 140.0])
    np.testing.assert_allclose(g1.latency_ms, [120.0, 160.0])
    assert g1.missed.tolist() == [False, False]  # 160 is not past the deadline


def test_admission_queue_by_hand():
    # One slot; calls at 0, 1, 2 s lasting 3, 10, 10 s. With a 5 s queue the second waits from 1
    # to 3 and runs to 13; the third would wait past 7 and is refused. Without a queue both are.
    arr, dur = np.array([0.0, 1.0, 2.0]), np.array([3.0, 10.0, 10.0])
    q = sim.admit_calls(arr, dur, max_live=1, queue_s=5.0, n_beats=100)
    assert (q.offered, q.refused) == (3, 1)
    np.testing.assert_allclose(q.waited_s, [0.0, 2.0])
    assert q.live.max() == 1
    assert q.live[int(12.9 / 0.16)] == 1
    assert q.live[int(13.1 / 0.16) + 1] == 0
    no = sim.admit_calls(arr, dur, max_live=1, queue_s=0.0, n_beats=100)
    assert no.refused == 2


def test_arrival_rates():
    rng = np.random.default_rng(0)
    a = sim.arrival_times(rng, 2.0, 1000.0)
    assert abs(a.size - 2000) < 3 * math.sqrt(2000)
    assert np.all(np.diff(a) >= 0)
    assert a.max() < 1000.0
    b = sim.arrival_times(rng, lambda t: np.where(t < 500, 4.0, 0.0), 1000.0, peak_per_s=4.0)
    assert b.max() < 500
    assert abs(b.size - 2000) < 3 * math.sqrt(2000)


def test_period_and_tick_cost_override():
    res = sim.simulate_lockstep(FLAT, 5, 2, slots=2, period_ms=80.0, tick_cost=lambda B: 90.0)
    np.testing.assert_allclose(res.latency_ms[:2], [90.0, 100.0])  # the device falls behind
    assert res.missed[:2].tolist() == [True, True]
    assert res.summary()["busy_frac"] == pytest.approx(res.busy_ms / 400.0)


def test_resize_cost_is_paid_on_a_bucket_change():
    live = [3, 3, 12, 12, 3]
    res = sim.simulate_lockstep(FLAT, 5, lambda k: live[k], slots=16, buckets=[4, 16],
                                resize_ms=lambda a, b: 7.0)  # fmt: skip
    np.testing.assert_allclose(res.latency_ms, [50.0, 50.0, 57.0, 50.0, 57.0])
