"""The idle-speech experiment's simulated tick with the speech decoder's measured H200 cost
(experiments/idle_speech/run.py, ``--speech_cost=measured``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

_RUN = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "idle_speech" / "run.py"
_ROWS = _RUN.parent / "results" / "h200_voicechat_11b.jsonl"

# run.py defines its absl flags at import: loaded once, under a name of its own
_spec = importlib.util.spec_from_file_location("idle_speech_run", _RUN)
idle = sys.modules["idle_speech_run"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(idle)


def _speech_row(B: int, k: int, *, frame, codec_beat, copy) -> dict:
    """A ``speech`` row whose calls lie exactly on the given lines (b = k, a power of two)."""
    b = idle.bucket(k, B)
    return {
        "kind": "speech", "slots": B, "speaking": k, "bucket": b, "commit": "test",
        "tts_full_ms": frame[0] + frame[1] * B, "tts_masked_ms": frame[0] + frame[1] * B,
        "tts_small_ms": frame[0] + frame[1] * b,
        "tts_compacted_ms": frame[0] + frame[1] * b + copy[0] + copy[1] * k,
        "codec_full_ms": codec_beat[0] + codec_beat[1] * B,
        "codec_small_ms": codec_beat[0] + codec_beat[1] * b,
        "codec_compacted_ms": codec_beat[0] + codec_beat[1] * b,
    }  # fmt: skip


def test_fit_line():
    assert idle.fit_line([(8, 2.0), (16, 4.0)]) == pytest.approx((0.0, 0.25))
    # a repeated x is averaged first: (32, 10) and (32, 12) weigh as one point at 11
    assert idle.fit_line([(16, 5.0), (32, 10.0), (32, 12.0)]) == pytest.approx((-1.0, 0.375))
    assert idle.fit_line([(8, 4.0), (8, 6.0)]) == pytest.approx((0.0, 0.625))  # through 0


def test_measured_speech_recovers_exact_lines():
    lines = {"frame": (4.0, 0.3), "codec_beat": (1.6, 0.3), "copy": (-3.0, 2.0)}
    rows = [_speech_row(32, 8, **lines), _speech_row(32, 16, **lines)]
    m = idle.measured_speech(rows)
    assert m.frame == pytest.approx(lines["frame"])
    assert m.codec == pytest.approx((0.8, 0.15))  # per frame-step: half a beat's call
    assert m.copy == pytest.approx(lines["copy"])
    assert m.copy_ms(16) == pytest.approx(29.0)
    assert m.copy_ms(1) == 0.0  # the line is negative below k = 1: no copy, not a saving


def test_measured_lines_through_the_h200_rows():
    rows = [json.loads(line) for line in _ROWS.read_text().splitlines() if line.strip()]
    sp = [r for r in rows if r["kind"] == "speech"]
    assert sp
    m = idle.measured_speech(rows)
    for r in sp:
        b, B, k = r["bucket"], r["slots"], r["speaking"]
        # the frame step and the codec: least squares through small (b) and full (B) points
        assert m.frame[0] + m.frame[1] * b == pytest.approx(r["tts_small_ms"], rel=0.05)
        assert m.frame[0] + m.frame[1] * B == pytest.approx(r["tts_full_ms"], rel=0.05)
        assert 2 * (m.codec[0] + m.codec[1] * b) == pytest.approx(r["codec_small_ms"], rel=0.05)
        assert 2 * (m.codec[0] + m.codec[1] * B) == pytest.approx(r["codec_full_ms"], rel=0.05)
        # the copy: through compacted - small at each k (two k measured: exactly)
        assert m.copy_ms(k) == pytest.approx(r["tts_compacted_ms"] - r["tts_small_ms"], rel=0.05)
    # the compaction's copy costs more than the full step it replaces
    assert all(r["tts_compacted_ms"] > r["tts_full_ms"] for r in sp)


def test_speech_checks_errors():
    lines = {"frame": (4.0, 0.3), "codec_beat": (1.6, 0.3), "copy": (-2.0, 2.0)}
    rows = [_speech_row(32, 8, **lines), _speech_row(32, 16, **lines)]
    m = idle.measured_speech(rows)
    checks = idle.speech_checks(rows, m.frame, m.codec, m.copy_ms, "measured")
    assert len(checks) == 16  # eight calls a row
    assert all(abs(c["error"]) < 1e-9 for c in checks)
    by = {(c["call"], c["speaking"]): c for c in checks}
    assert by[("tts_compacted", 16)]["rows"] == 16
    assert by[("tts_masked", 8)]["rows"] == 32
    assert by[("tts_copy", 8)]["measured_ms"] == pytest.approx(14.0)
    # a model twice as costly is off by +100 % on every call
    double = idle.speech_checks(
        rows, (8.0, 0.6), (0.8, 0.15), lambda k: 2 * m.copy_ms(k), "twice"
    )  # fmt: skip
    assert by[("tts_full", 8)]["model_ms"] * 2 == pytest.approx(double[0]["model_ms"])
    assert double[0]["error"] == pytest.approx(1.0)


def test_variant_tick():
    def speech_ms(n):
        return 2 * (4.0 + 0.3 * n) + 2 * (0.8 + 0.15 * n)

    def copy_ms(k):
        return 2 * max(0.0, -2.0 + 2.0 * k)

    full = 90.0
    tick = {h: idle.variant_tick_ms(full, 32, 0.3, h, speech_ms, copy_ms)
            for h in ("masked", "compacted_index", "compacted_copy")}  # fmt: skip
    assert tick["masked"] == full
    k = math.ceil(0.3 * 32)  # 10 speakers; the copied variant runs a bucket of 16
    assert tick["compacted_index"] == pytest.approx(full - speech_ms(32) + speech_ms(k))
    assert tick["compacted_copy"] == pytest.approx(
        full - speech_ms(32) + speech_ms(16) + copy_ms(k)
    )
    # everyone speaking: indexed is masked; copied is masked plus the copy of every slot (b = B)
    assert idle.variant_tick_ms(full, 32, 1.0, "compacted_index", speech_ms, copy_ms) == full
    assert idle.variant_tick_ms(
        full, 32, 1.0, "compacted_copy", speech_ms, copy_ms
    ) == pytest.approx(full + copy_ms(32))
    # scale multiplies the speech part only
    scaled = idle.variant_tick_ms(full, 32, 0.3, "compacted_index", speech_ms, copy_ms, scale=0.5)
    assert full - scaled == pytest.approx(0.5 * (full - tick["compacted_index"]))


def test_measured_name():
    assert idle.measured_name("/a/results/sim_h200_current.jsonl") == (
        "/a/results/sim_h200_current_measured.jsonl"
    )
    assert idle.measured_name("/a/idle_speech_line.png") == "/a/idle_speech_line_measured.png"


def test_run_measured(tmp_path):
    out = tmp_path / "sim.jsonl"
    env = {**os.environ, "PYTHONPATH": str(_RUN.parents[2])}
    subprocess.run([sys.executable, str(_RUN), "--parts=sim", "--speech_cost=measured",
                    "--sim_speaking=0.5,1.0", "--seeds=1", "--capacity_beats=30",
                    f"--sim_out={out}", "--plot="],
                   check=True, env=env, capture_output=True, timeout=120)  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    (model,) = [r for r in rows if r["kind"] == "model"]
    assert model["speech_cost"] == "measured"
    assert model["speech_rows_commits"] == ["b7b4b9a"]
    m = idle.measured_speech([json.loads(x) for x in _ROWS.read_text().splitlines() if x.strip()])
    assert model["speech_frame_ms"] == pytest.approx(list(m.frame))
    assert model["copy_ms"] == pytest.approx(list(m.copy))
    checks = [r for r in rows if r["kind"] == "speech_check"]
    assert {r["model"] for r in checks} == {"components", "measured"}
    cap = {(r["speaking"], r["variant"]): r for r in rows if r["kind"] == "capacity"}
    assert cap[(1.0, "compacted_index")]["capacity"] == cap[(1.0, "masked")]["capacity"]
    assert cap[(0.5, "compacted_index")]["capacity"] > cap[(0.5, "masked")]["capacity"]
    assert cap[(0.5, "compacted_copy")]["capacity"] < cap[(0.5, "masked")]["capacity"]
    at32 = {h: cap[(1.0, h)]["tick_ms_at_32"] for h in ("masked", "compacted_copy")}
    assert at32["compacted_copy"] - at32["masked"] == pytest.approx(2 * m.copy_ms(32))
