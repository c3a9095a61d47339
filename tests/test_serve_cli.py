"""``voicechat-serve`` as a user runs it: the README's command with no flags, and with flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import wave

import pytest


def _check_outputs(out_dir: str, sessions: int, ticks: int) -> None:
    """Each session's files agree with each other and with the tick records.

    On the real-time clock a tick the host fell a whole beat behind on is skipped (counted as a
    miss, no output), so a session has 2 frames per tick that ran.
    """
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    tick_rows = [r for r in records if r.get("type") == "tick"]
    assert len(tick_rows) == ticks
    ran = sum(not r["skipped"] for r in tick_rows)
    assert ran >= ticks // 2
    for i in range(sessions):
        d = os.path.join(out_dir, f"s{i:03d}")
        with open(os.path.join(d, "frames.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        assert [r["frame"] for r in rows] == list(range(2 * ran))
        assert all({"text", "function", "codes"} <= set(r) for r in rows)
        with wave.open(os.path.join(d, "output.wav")) as w:
            assert w.getframerate() == 22050
            assert w.getnchannels() == 1
            assert w.getnframes() == len(rows) * 1764


def test_readme_command_runs_the_embedded_default(tmp_path):
    """Exactly the README's run command: 4 sessions of the bundled recording, 10 s, real time."""
    exe = shutil.which("voicechat-serve")
    cmd = [exe] if exe else [sys.executable, "-m", "voicechat_jax.serve"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "beat latency ms p50/p99/p99.9/max" in proc.stdout
    _check_outputs(str(tmp_path / "runs" / "serve"), sessions=4, ticks=62)


@pytest.mark.parametrize(("loop", "ssm_kernel"), [("dispatch", "pallas"), ("resident", "xla")])
def test_flags(tmp_path, loop, ssm_kernel):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "voicechat_jax.serve",
        f"--loop={loop}",
        f"--ssm_kernel={ssm_kernel}",
        "--clock=offline",
        "--speech_sampling=deterministic",
        "--slots=2",
        "--sessions=3",
        "--seconds=0.8",
        f"--output_dir={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_outputs(str(out), sessions=2, ticks=5)
    with open(out / "sessions.json") as f:
        failures = json.load(f)["failures"]
    assert "server full" in failures["s002"]
