"""The batching-policy simulator (experiments/policy_sim/sim.py) on hand-made cases."""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments.policy_sim import sim
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


# ---- the fit to the current engine's capacity rows ----------------------------------------------

# Component bytes (growth from 16 to 32 slots): 100 context-sized of 150, so c / (b + c) = 2/3.
_COMPONENTS = [
    {"component": "LLM attention", "slots": 16, "bytes": 100},
    {"component": "LLM attention", "slots": 32, "bytes": 200},
    {"component": "SSM state", "slots": 16, "bytes": 50},
    {"component": "SSM state", "slots": 32, "bytes": 100},
]


def _capacity_rows(a_ms: float = 20.0, slope_ms: float = 0.8, host_ms: float = 4.0) -> list[dict]:
    """Synthetic ``experiments/capacity`` rows of a tick ``2 * (a + slope * B)`` ms, with the
    distractors the real file has: an older probe without a commit, a non-hold_full serving row,
    a resident-loop row, a probe with no serving row, another policy and an older baseline."""

    def tick(n: int) -> float:
        return 2 * (a_ms + slope_ms * n)

    def serve(n: int, commit: str, missed: int, **kw) -> dict:
        p50 = tick(n) + (8.0 if n == 72 else host_ms)  # the top row's host share grows
        row = {"kind": "serve", "policy": "reference", "loop": "dispatch", "sessions": n,
               "p50_ms": p50, "p99_ms": p50 + 3.0, "p99.9_ms": p50 + 4.0, "max_ms": p50 + 6.0,
               "missed_ticks": missed, "steady_ticks": 1000, "hold_full": True,
               "commit": commit}  # fmt: skip
        return row | kw

    def probe(n: int, commit: str | None, ms: float | None = None, **kw) -> dict:
        row = {"kind": "probe", "policy": "reference", "sessions": n,
               "tick_ms_p50": tick(n) if ms is None else ms}  # fmt: skip
        return row | ({"commit": commit} if commit else {}) | kw

    return [
        probe(56, None, ms=999.0),  # an older run: no commit
        {k: v for k, v in serve(56, "old", 0).items() if k not in ("hold_full", "commit")},
        probe(56, "A"),
        serve(56, "A", 2),
        serve(56, "A", 3, loop="resident"),
        {
            "kind": "baseline",
            "policy": "reference",
            "ms_p50": tick(1),
            "ms_p99": tick(1) + 3.0,
            "sessions_held": 3,
            "commit": "B",
        },
        {
            "kind": "baseline",
            "policy": "reference",
            "ms_p50": 999.0,
            "ms_p99": 999.0,
            "sessions_held": 0,
            "commit": "old",
        },
        probe(64, "B"),
        serve(64, "B", 0),
        probe(72, "B"),
        serve(72, "B", 700),
        probe(80, "B", ms=999.0),  # no serving row at 80
        probe(64, "B", ms=999.0, policy="bf16_tts_kv"),
        # the same commit and count with another kernel or codec products: another configuration
        probe(64, "B", ms=999.0, tts_attention="pallas_mha"),
        serve(64, "B", 0, tts_attention="pallas_mha", p50_ms=999.0),
        probe(72, "B", ms=999.0, codec_matmul="tf32_x3"),
    ]


def test_capacity_rows_are_selected_by_hold_full_loop_and_commit():
    sel = sim.select_capacity_rows(_capacity_rows(), config="xla_tts")
    assert [(r["sessions"], r["commit"], r["loop"]) for r in sel.serves] == [
        (56, "A", "dispatch"), (64, "B", "dispatch"), (72, "B", "dispatch"),
    ]  # fmt: skip
    assert [(r["sessions"], r["commit"]) for r in sel.probes] == [(56, "A"), (64, "B"), (72, "B")]
    assert all(r["tick_ms_p50"] < 999 for r in sel.probes)
    assert [r["commit"] for r in sel.baselines] == ["B"]
    resident = sim.select_capacity_rows(_capacity_rows(), loop="resident", config="xla_tts")
    assert [r["sessions"] for r in resident.serves] == [56]
    assert [r["commit"] for r in resident.probes] == ["A"]
    assert resident.baselines == []  # no resident row at commit B


def test_fit_capacity_recovers_the_line_the_host_and_the_stalls():
    fit = sim.fit_capacity(_capacity_rows(a_ms=20.0, slope_ms=0.8), _COMPONENTS, config="xla_tts")
    assert (fit.source, fit.config) == ("capacity", "xla_tts")
    # B = 1 from the baseline, then the probes; ms per frame-step (half a two-frame tick).
    np.testing.assert_allclose(fit.step_points, [(1, 20.8), (56, 64.8), (64, 71.2), (72, 77.6)])
    np.testing.assert_allclose(fit.cost.a_ms, 20.0, rtol=1e-2)
    np.testing.assert_allclose(fit.cost.b_ms + fit.cost.c_ms, 0.8, rtol=1e-2)
    assert fit.share == pytest.approx(2 / 3)
    assert fit.cost.c_ms / (fit.cost.b_ms + fit.cost.c_ms) == pytest.approx(2 / 3)
    loo = sim.leave_one_out(*zip(*fit.step_points, strict=True), context_share=fit.share)
    np.testing.assert_allclose(loo, [m for _, m in fit.step_points], rtol=5e-3)
    # Host ms from the rows the server kept up with (p50 < 160: not 72), minus their probes.
    assert fit.host_each == pytest.approx({56: 4.0, 64: 4.0})
    assert fit.tick_of == pytest.approx({56: 129.6, 64: 142.4, 72: 155.2})
    assert fit.tail.host_ms == pytest.approx(4.0)
    # Jitter: the two kept serving rows and the baseline, all p99 - p50 = 3 ms: a flat scale.
    assert sorted(b for b, _ in fit.jitter_points) == [1, 56, 64]
    for b in (1, 30, 64, 100):
        assert fit.tail.p99_minus_p50_ms(b) == pytest.approx(3.0, rel=2e-2)
    assert fit.tail.sigma_batch_max == 64
    # Stalls: 2 missed ticks in the 2,000 of the quiet rows (56, 64); none in the quiet tail.
    assert fit.tail.stall_prob == pytest.approx(2 / 2000)
    assert fit.quiet.stall_prob == 0.0


def test_validate_on_the_capacity_fit():
    # The simulated p50 is the tick plus the other rows' host ms; at 72 the row's host share (8 ms)
    # is not in the model: the simulated p50 is ~4 ms short and most of the real misses are lost.
    fit = sim.fit_capacity(_capacity_rows(), _COMPONENTS, config="xla_tts")
    val = {v["sessions"]: v for v in sim.validate(fit, seeds=2)}
    assert sorted(val) == [56, 64, 72]
    for n in (56, 64):
        assert val[n]["sim_p50_ms"] == pytest.approx(fit.tick_of[n] + 4.0, abs=0.3)
    assert val[72]["sim_p50_ms"] == pytest.approx(155.2 + 4.0, abs=0.5)
    assert val[72]["real_p50_ms"] - val[72]["sim_p50_ms"] == pytest.approx(4.0, abs=0.5)
    assert val[72]["sim_missed"] < val[72]["real_missed"] / 2


def test_fit_capacity_needs_a_matching_probe():
    rows = [r for r in _capacity_rows() if r["kind"] != "probe" or "commit" not in r]
    with pytest.raises(ValueError, match="no probe"):
        sim.fit_capacity(rows, _COMPONENTS, config="xla_tts")


def test_auto_config_is_the_kernels_auto_picks_at_each_row_slot_count():
    # The engine's GPU default: the kernels from their thresholds on, XLA on the 1-slot baseline.
    kernels = {"ssm_kernel": "pallas", "attention": "pallas", "tts_attention": "pallas_mha"}
    xla = {"ssm_kernel": "xla", "attention": "xla", "tts_attention": "xla"}
    assert sim.auto_config(1) == xla | {"codec_matmul": "float32"}
    assert sim.auto_config(64) == kernels | {"codec_matmul": "float32"}
    # the rows of commit B (no kernel named) as the auto engine writes them, with its distractors
    # (a probe with no serving row, another policy, other codec products)
    rows = [r | (xla if r["kind"] == "baseline" else kernels) for r in _capacity_rows()
            if r.get("commit") == "B" and "tts_attention" not in r]  # fmt: skip
    serve64 = next(r for r in rows if r["kind"] == "serve" and r["sessions"] == 64)
    base = next(r for r in rows if r["kind"] == "baseline")
    # the xla_tts engine at the same commit: XLA's speech-decoder attention at 64, and
    # a baseline with a kernel that auto does not pick at one slot
    older = serve64 | {"tts_attention": "xla", "p50_ms": 999.0}
    rows += [older, base | {"ssm_kernel": "pallas", "ms_p50": 999.0}]
    sel = sim.select_capacity_rows(rows)  # config="auto", the default
    assert [(r["sessions"], r["tts_attention"]) for r in sel.serves] == [
        (64, "pallas_mha"), (72, "pallas_mha"),
    ]  # fmt: skip
    assert [r["sessions"] for r in sel.probes] == [64, 72]
    assert all(r["tick_ms_p50"] < 999 for r in sel.probes)
    assert sel.baselines == [base]
    # the same rows under the xla_tts configuration: only its own serving row
    assert sim.select_capacity_rows(rows, config="xla_tts").serves == [older]
    fit = sim.fit_capacity(rows, _COMPONENTS)
    assert fit.config == "auto"
    np.testing.assert_allclose([b for b, _ in fit.step_points], [1, 64, 72])


_RUN = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "policy_sim" / "run.py"
_TINY = ["--capacity_beats=20", "--seeds=1", "--hour_beats=100", "--erlangs=20", "--gpus=1",
         "--windows_ms=0", "--plot="]  # fmt: skip


def _run(tmp_path: pathlib.Path, fit: str, *extra: str) -> list[dict]:
    """``run.py --fit=<fit>`` on the committed rows with tiny loads; returns its rows."""
    out = tmp_path / f"{fit}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(_RUN.parents[2]), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(_RUN), f"--fit={fit}", f"--out={out}", *_TINY, *extra],
                   check=True, env=env, capture_output=True, timeout=120)  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("config", ["auto", "xla_tts"])
def test_run_fits_the_capacity_rows(tmp_path, config):
    rows = _run(tmp_path, "capacity", f"--capacity_config={config}")
    by = collections.defaultdict(list)
    for r in rows:
        by[r["kind"]].append(r)
    assert (by["model"][0]["source"], by["model"][0]["config"]) == ("capacity", config)
    fit = by["fit"]
    assert (fit[0]["row"], fit[0]["slots"]) == ("baseline", 1)  # the 1-slot engine's tick
    assert {r["row"] for r in fit[1:]} == {"probe"}
    assert {r["input_commit"] for r in fit} == ({"8593914", "727777b"} if config == "auto"
                                                else {"d846496", "5386a4f"})  # fmt: skip
    for r in rows:  # each row with its provenance; the device: a simulation's
        assert r["device"] == "simulation"
        assert all(r[k] for k in ("commit", "jax", "measured_at"))
        assert "run.py" in r["command"]
    assert {r["sessions"] for r in by["validation"]} >= {56, 64, 72}
    for r in fit:  # the line fits every point within a few per cent
        assert abs(r["fit_ms"] / r["measured_ms"] - 1) < 0.05
    for r in fit[1:]:  # and every probe left out (the baseline left out is an extrapolation)
        assert abs(r["loo_ms"] / r["measured_ms"] - 1) < 0.05
    assert "context_check" not in by  # the older engine's cap-256 rows are not compared
    (base,) = by["baseline_check"]
    assert base["rule_held"] == base["measured_held"]
    caps = {r["policy"]: r["capacity"] for r in by["capacity"]}
    assert caps["batch1"] == base["sim_batch1_capacity"]
    assert caps["lockstep_host_max"] <= caps["lockstep"]


def test_run_still_fits_the_beat_profile_rows(tmp_path):
    rows = _run(tmp_path, "beat_profile")
    model = next(r for r in rows if r["kind"] == "model")
    assert model["source"] == "beat_profile"
    assert [r["slots"] for r in rows if r["kind"] == "fit"] == [16, 32, 56, 112]
    assert [r["sessions"] for r in rows if r["kind"] == "validation"] == [16, 32, 56, 112]
    assert any(r["kind"] == "context_check" for r in rows)
    assert not any(r["kind"] in ("baseline_check", "validation_own_host") for r in rows)


def test_engine_rows_reach_the_file_as_they_are_measured(tmp_path):
    """A run cut short keeps the rows it measured: ``run_parts`` writes each as it is appended."""
    from experiments.policy_sim import engine_runs

    out = tmp_path / "rows.jsonl"

    def engine_part(rows):
        rows.append({"kind": "tick", "frames_per_tick": 1})
        rows += [{"kind": "serve", "frames_per_tick": 1}]
        assert [r["kind"] for r in engine_runs.read_rows(out)] == ["tick", "serve"]
        raise TimeoutError("the call's time ran out")

    with pytest.raises(TimeoutError):
        engine_runs.run_parts(["engine"], out=str(out), sim_out=str(tmp_path / "sim.jsonl"),
                              plot_path=None, engine_part=engine_part, sim_part=list,
                              plot=None, print_tables=None)  # fmt: skip
    written = engine_runs.read_rows(out)
    assert [r["kind"] for r in written] == ["tick", "serve"]
    for r in written:  # each with its provenance (experiments.harness)
        assert all(r[k] for k in ("commit", "device", "jax", "command", "measured_at")), r


def test_tick_check_on_the_committed_rows(tmp_path):
    """``tick_check.py``: the capacity fit is low on the multi-slot ticks below 56 slots, and one
    line through every multi-slot point fits them all."""
    out = tmp_path / "check.jsonl"
    env = dict(os.environ, PYTHONPATH=str(_RUN.parents[2]), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(_RUN.parent / "tick_check.py"), f"--out={out}"],
                   check=True, env=env, capture_output=True, timeout=120)  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ticks = [r for r in rows if r["kind"] == "tick"]
    assert {r["slots"] for r in ticks} == {1, 2, 4, 8, 16, 32}
    for r in ticks:
        if r["slots"] > 1:  # below the measured tick even with every cache full
            assert r["fit_full_ms"] < r["tick_ms"]
    (line,) = [r for r in rows if r["kind"] == "line"]
    assert line["points"] == 12  # the 2- and 4-slot ticks are checked, not fitted
    assert line["max_abs_error"] < 0.05
    assert 0.5 < line["slope_ms"] < 0.8
    below = [r for r in rows if r["kind"] == "below_line"]
    assert sorted(r["slots"] for r in below) == [2, 4]
    for r in below:  # the line overstates them a little: all XLA there
        assert 0.0 < r["error"] < 0.1
        assert r["line_ms"] == pytest.approx(r["tick_ms"] * (1 + r["error"]))


def test_fit_tick_line_puts_every_multi_slot_point_on_one_line_and_one_slot_apart():
    # Capacity rows on 20 + 0.8 B a frame-step (B = 1 at 20.8), and scheduling ticks on
    # 30 + 0.7 B from 8 slots up with one all-XLA 1-slot tick of 36 ms (18 a frame-step).
    fit = sim.fit_capacity(_capacity_rows(a_ms=30.0, slope_ms=0.7), _COMPONENTS, config="xla_tts")
    engine_rows = [
        {"kind": "lockstep", "sessions": 1, "tick_ms": 36.0},
        {"kind": "tick", "frames_per_tick": 3, "slots": 4, "tick_ms": 99.0},  # f = 3: not a point
        {"kind": "tick", "frames_per_tick": 2, "slots": 4, "tick_ms": 50.0},  # below min_slots
        {"kind": "tick", "engine": "buckets", "slots": 8, "live": 8, "tick_ms": 2 * (30 + 5.6)},
        {"kind": "groups", "groups": 2, "group_slots": 16, "tick_ms": 2 * (30 + 11.2)},
        {"kind": "serve", "p50_ms": 99.0},  # no tick timed: not a point
    ]
    points = sim.measured_ticks(engine_rows)
    assert [p["slots"] for p in points] == [1, 4, 8, 16]
    line = sim.fit_tick_line(fit, points)  # the 4-slot point is off the fit (min_slots=8)
    assert line.tick_line
    assert not fit.tick_line  # the capacity fit is left as it was
    np.testing.assert_allclose(line.cost.a_ms, 30.0, rtol=1e-2)
    np.testing.assert_allclose(line.cost.b_ms, 0.7, rtol=1e-2)
    assert line.cost.c_ms == 0.0  # no context term: the fill does not move the tick
    # the 1-slot engine: the mean of the baseline's frame-step (30.7) and the lockstep tick's (18)
    assert line.cost.one_slot_ms == pytest.approx((30.7 + 18.0) / 2)
    assert line.cost.tick_ms(1) == pytest.approx(30.7 + 18.0)
    assert line.cost.tick_ms(8, 0.0) == pytest.approx(line.cost.tick_ms(8, 1.0))
    assert (line.tail, line.host_each) == (fit.tail, fit.host_each)
    assert line.cost.small_line is None  # one slot count below 8: the main line holds there


def test_fit_tick_line_gives_the_small_engines_their_own_line():
    # The same line from 8 slots up; all-XLA ticks at 2 and 4 slots on 25 + 0.5 B a frame-step.
    fit = sim.fit_capacity(_capacity_rows(a_ms=30.0, slope_ms=0.7), _COMPONENTS, config="xla_tts")
    engine_rows = [
        {"kind": "tick", "engine": "buckets", "slots": 8, "live": 8, "tick_ms": 2 * (30 + 5.6)},
        {"kind": "groups", "groups": 2, "group_slots": 16, "tick_ms": 2 * (30 + 11.2)},
        {"kind": "tick", "frames_per_tick": 2, "slots": 2, "tick_ms": 2 * (25 + 1.0)},
        {"kind": "tick", "frames_per_tick": 2, "slots": 4, "tick_ms": 2 * (25 + 2.0)},
    ]
    line = sim.fit_tick_line(fit, sim.measured_ticks(engine_rows))
    np.testing.assert_allclose(line.cost.small_line, (25.0, 0.5, 8), rtol=1e-6)
    assert line.cost.tick_ms(6) == pytest.approx(2 * (25 + 3.0))  # interpolated below 8
    np.testing.assert_allclose(line.cost.tick_ms(8), 2 * (30 + 5.6), rtol=1e-2)  # the line at 8
    np.testing.assert_allclose(line.cost.a_ms, 30.0, rtol=1e-2)  # the small ticks not fitted in


def test_run_tick_line_names_its_outputs_and_needs_the_current_fit(tmp_path):
    run = _RUN.parents[1] / "phase_stagger/run.py"
    env = dict(os.environ, PYTHONPATH=str(_RUN.parents[2]), JAX_PLATFORMS="cpu")
    out = tmp_path / "sim.jsonl"
    subprocess.run([sys.executable, str(run), "--parts=sim", "--tick_line", f"--sim_out={out}",
                    "--plot=", "--sim_sessions=8,16", "--sim_beats=50", "--seeds=1"],
                   check=True, env=env, capture_output=True, timeout=300)  # fmt: skip
    model = json.loads(out.read_text().splitlines()[0])
    assert (model["kind"], model["tick_line"], model["c_ms"]) == ("model", True, 0.0)
    bad = subprocess.run([sys.executable, str(run), "--parts=sim", "--tick_line",
                          "--capacity_config=xla_tts", f"--sim_out={out}", "--plot="],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0
    assert "--tick_line refits the current engine" in bad.stderr
