"""frames_per_tick's simulation with the tick split measured on the H200 (``--split=measured``):
the line in f through the committed ticks, and the serving rows it is checked against."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

_RUN = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "frames_per_tick" / "run.py"


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fpt") / "sim.jsonl"
    env = dict(os.environ, PYTHONPATH=str(_RUN.parents[2]), JAX_PLATFORMS="cpu")
    subprocess.run(
        [sys.executable, str(_RUN), "--parts=sim", "--tick_line", "--fpt=1,2,3,4", "--seeds=2",
         "--capacity_beats=200", f"--sim_out={out}", "--plot="],
        check=True, env=env, capture_output=True, timeout=300,
    )  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_split_is_a_line_in_f_through_the_measured_ticks(rows):
    (split,) = [r for r in rows if r["kind"] == "split"]
    assert split["slots"] == 32
    assert sorted(f for f, _ in split["points"]) == [2, 3, 4]  # f = 2 from the other experiments
    for f, t in split["points"]:
        line = split["per_beat_ms"] + split["per_frame_ms"] * f
        assert line == pytest.approx(t, rel=split["max_error"] + 1e-9)
    assert split["max_error"] < 0.02
    # the per-beat part's share of the f = 2 tick, as its definition says
    f2 = split["per_beat_ms"] + 2 * split["per_frame_ms"]
    assert split["share"] == pytest.approx(split["per_beat_ms"] / f2)
    assert 0.0 < split["share"] < 0.5


def test_the_measured_serves_are_checked_and_capacity_grows_with_the_beat(rows):
    checks = [r for r in rows if r["kind"] == "serve_validation"]
    assert sorted(r["frames_per_tick"] for r in checks) == [3, 4]
    for r in checks:  # the tick line with the measured split: within a few per cent
        assert abs(r["p50_error"]) < 0.05
        assert r["real_missed"] == 0
    caps = {r["frames_per_tick"]: r for r in rows if r["kind"] == "capacity"}
    assert sorted(caps) == [1, 2, 3, 4]
    assert all(r["per_beat_scales"] is None for r in caps.values())  # one model, not two bounds
    assert [caps[f]["capacity"] for f in (1, 2, 3, 4)] == sorted(
        caps[f]["capacity"] for f in (1, 2, 3, 4)
    )
    # a longer beat waits longer for its tick: input-to-output grows by about a beat a frame
    lat = np.array([caps[f]["input_to_output_p50_at_16_ms"] for f in (1, 2, 3, 4)])
    assert np.all(np.diff(lat) > 80.0)
