"""Host side of the serving engine: beat clock, audio I/O, slots and input queues, metrics.

Everything timed runs on a fake time source, so the tests are exact and take no wall time.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import math
import pathlib
import re
import struct
import threading
import wave

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from voicechat_jax import state as state_lib
from voicechat_jax.model import voicechat
from voicechat_jax.serving import (
    FRAME_LEN,
    AudioInputError,
    BeatClock,
    BeatPool,
    CapacityError,
    Cause,
    EndedRecords,
    GcMonitor,
    GcPause,
    GcPolicy,
    HostTimeline,
    InputQueues,
    MetricsRecorder,
    SessionFiles,
    SessionOutput,
    SlotTable,
    decode_pcm16,
    format_table,
    frames,
    prometheus_text,
    read_wav,
    validate_frame,
    write_wav,
)
from voicechat_jax.serving import writer as writer_lib
from voicechat_jax.serving.writer import HostBeat, WavStream, frame_lines, to_pcm16

P = 0.16  # seconds per tick: 2 frames of 80 ms
BEAT = 2 * FRAME_LEN  # input samples per tick
ASSETS = pathlib.Path(__file__).resolve().parent.parent / "voicechat_jax" / "assets"


class FakeTime:
    """A monotonic time source whose sleep advances it exactly."""

    def __init__(self, t: float = 1000.0):
        self.t = t
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def _clock(mode: str = "realtime", **kw) -> tuple[BeatClock, FakeTime]:
    ft = FakeTime()
    return BeatClock(P, mode, now=ft.now, sleep=ft.sleep, **kw), ft


# ---------------------------------------------------------------------------------------------
# Clock


def test_clock_realtime_sleeps_until_start_and_reports_lateness():
    clock, ft = _clock()
    t0 = clock.begin()
    first = clock.wait_for_tick(0)
    assert first.start == t0
    assert first.late_s == 0.0
    assert ft.sleeps == []
    ft.t += 0.05  # tick 0 took 50 ms: the host is early for tick 1 and sleeps the rest
    second = clock.wait_for_tick(1)
    assert ft.sleeps == [pytest.approx(P - 0.05)]
    assert second.began == pytest.approx(t0 + P)
    assert second.late_s == pytest.approx(0.0)
    assert second.deadline == pytest.approx(t0 + 2 * P)
    ft.t = t0 + 2 * P + 0.03  # 30 ms late for tick 2: no sleep, lateness reported
    third = clock.wait_for_tick(2)
    assert len(ft.sleeps) == 1
    assert third.start == pytest.approx(t0 + 2 * P)
    assert third.late_s == pytest.approx(0.03)
    assert third.skipped == 0
    assert clock.late_ticks == 1


def test_clock_never_bursts_after_a_stall():
    clock, ft = _clock()
    t0 = clock.begin()
    work = [0.05, 0.05, 0.5, 0.05, 0.05, 0.05, 0.3, 0.05]  # two stalls: 500 ms and 300 ms
    ran, timings, last = [], [], None
    for w in work:
        k = clock.next_tick(last)
        timing = clock.wait_for_tick(k)
        ran.append(k)
        timings.append(timing)
        ft.t += w
        last = k
    # Tick 2 ends at t0 + 2P + 0.5 = inside tick 5's slot: ticks 3 and 4 are skipped, not run.
    # Tick 8 (begun at t0 + 8P) ends at t0 + 8P + 0.3, inside tick 9's slot: tick 9 runs late.
    assert ran == [0, 1, 2, 5, 6, 7, 8, 9]
    assert [t.skipped for t in timings] == [0, 0, 0, 2, 0, 0, 0, 0]
    assert clock.skipped_total == 2
    # Every tick began inside its own slot: never two ticks for one period of wall time.
    for t in timings:
        assert t0 + t.tick * P <= t.began < t0 + (t.tick + 1) * P
    assert timings[3].late_s == pytest.approx(0.5 - 3 * P)  # began in tick 5's slot
    assert timings[7].late_s == pytest.approx(0.3 - P)
    begins = [t.began for t in timings]
    assert len(set(ran)) == len(ran)
    assert begins == sorted(begins)


def test_clock_late_by_more_than_a_period_still_runs_one_tick():
    clock, ft = _clock()
    t0 = clock.begin()
    ft.t = t0 + 3.5 * P
    timing = clock.wait_for_tick(1)  # the host insists on tick 1: it is told how late it is
    assert timing.late_s == pytest.approx(2.5 * P)
    assert clock.due_tick() == 3
    assert clock.next_tick(1) == 3


def test_clock_offline_runs_back_to_back():
    clock, ft = _clock("offline")
    t0 = ft.t
    a = clock.wait_for_tick(0)
    ft.t += 0.4  # slower than real time: offline never counts that as late
    b = clock.wait_for_tick(1)
    assert (a.start, b.start) == (t0, t0 + 0.4)
    assert a.late_s == b.late_s == 0.0
    assert ft.sleeps == []
    assert clock.deadline(1) == pytest.approx(t0 + 0.4 + P)
    assert clock.tick_start(0) == t0
    assert clock.next_tick(1) == 2
    assert clock.next_tick(None) == 0
    with pytest.raises(KeyError):
        clock.tick_start(7)


def test_clock_tighter_deadline_and_bad_arguments():
    clock, _ = _clock(deadline_s=0.1)
    t0 = clock.begin(t0=5.0)
    assert t0 == 5.0
    assert clock.deadline(3) == pytest.approx(5.0 + 3 * P + 0.1)
    with pytest.raises(ValueError, match="deadline_s"):
        BeatClock(P, deadline_s=0.2)
    with pytest.raises(ValueError, match="mode"):
        BeatClock(P, "fast")
    with pytest.raises(RuntimeError, match="begin"):
        BeatClock(P).wait_for_tick(0)


def test_clock_due_tick_exact_boundaries():
    clock, ft = _clock()
    t0 = clock.begin()
    for k in range(200):
        ft.t = t0 + k * P  # exactly at a start: that tick is due, whatever float rounding does
        assert clock.due_tick() == k


def test_clock_real_time_source():
    clock = BeatClock(0.01)
    clock.begin()
    timings = [clock.wait_for_tick(k) for k in range(3)]
    for t in timings:
        assert t.began >= t.start
        assert t.late_s >= 0.0
    assert timings[2].start - timings[0].start == pytest.approx(0.02)


# ---------------------------------------------------------------------------------------------
# Audio


def _riff(tag: int, channels: int, rate: int, bits: int, payload: bytes, data_size=None) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    size = len(payload) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", size) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_write_then_read_pcm16_round_trip(tmp_path):
    x = np.random.default_rng(0).uniform(-0.9, 0.9, 3000).astype(np.float32)
    write_wav(tmp_path / "a.wav", x, rate=16000)
    y = read_wav(tmp_path / "a.wav")
    assert y.dtype == np.float32
    assert y.shape == (3000,)
    np.testing.assert_array_equal(y, np.round(x * 32767) / np.float32(32768))
    assert np.abs(y - x).max() < 2 / 32768


def test_write_wav_clips_and_rejects_nan(tmp_path):
    write_wav(tmp_path / "c.wav", np.array([2.0, -2.0, 0.5], np.float32))
    y = read_wav(tmp_path / "c.wav", expected_rate=22050)
    np.testing.assert_array_equal(y * 32768, [32767, -32767, round(0.5 * 32767)])
    with pytest.raises(ValueError, match="NaN"):
        write_wav(tmp_path / "n.wav", np.array([0.0, np.nan], np.float32))


@pytest.mark.parametrize(
    ("tag", "bits", "encode"),
    [
        (1, 8, lambda v: (np.round(v * 128) + 128).astype(np.uint8).tobytes()),
        (
            1,
            24,
            lambda v: b"".join(round(s * 2**23).to_bytes(3, "little", signed=True) for s in v),
        ),
        (1, 32, lambda v: np.round(v * 2**31).astype("<i4").tobytes()),
        (3, 32, lambda v: v.astype("<f4").tobytes()),
        (3, 64, lambda v: v.astype("<f8").tobytes()),
    ],
)
def test_read_wav_formats(tmp_path, tag, bits, encode):
    v = np.array([0.0, 0.5, -0.5, 0.25, -0.75], np.float64)
    (tmp_path / "f.wav").write_bytes(_riff(tag, 1, 16000, bits, encode(v)))
    np.testing.assert_allclose(read_wav(tmp_path / "f.wav"), v, atol=1e-6)


def test_read_wav_extensible_float(tmp_path):
    v = np.array([0.1, -0.2, 0.3], np.float32)
    guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    ext = struct.pack("<HHIIHH", 0xFFFE, 1, 16000, 64000, 4, 32)
    ext += struct.pack("<HHI", 22, 32, 4) + struct.pack("<H", 3) + guid_tail
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(ext)) + ext
    body += b"data" + struct.pack("<I", 12) + v.tobytes()
    (tmp_path / "x.wav").write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    np.testing.assert_array_equal(read_wav(tmp_path / "x.wav"), v)


def _pcm16(n: int = 640) -> bytes:
    return (np.arange(n, dtype=np.int16) % 200 - 100).astype("<i2").tobytes()


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("rate.wav", _riff(1, 1, 44100, 16, _pcm16()), r"44100 Hz; expected 16000 Hz"),
        ("stereo.wav", _riff(1, 2, 16000, 16, _pcm16()), r"2 channels; expected mono"),
        ("both.wav", _riff(1, 2, 8000, 16, _pcm16()), r"2 channels.*8000 Hz; expected 16000"),
        (
            "nan.wav",
            _riff(3, 1, 16000, 32, np.array([0.0, np.nan, 0.1, np.inf], "<f4").tobytes()),
            r"2 NaN/Inf sample\(s\), the first at index 1",
        ),
        (
            "clip.wav",
            _riff(3, 1, 16000, 32, np.array([0.0, 1.5, -0.2], "<f4").tobytes()),
            r"outside \[-1, 1\] \(clipped\), the first at index 1",
        ),
        ("empty.wav", b"", r"empty file"),
        ("nodata.wav", _riff(1, 1, 16000, 16, b""), r"no audio samples"),
        ("trunc.wav", _riff(1, 1, 16000, 16, _pcm16())[:-100], r"truncated: data chunk declares"),
        (
            "half.wav",
            _riff(1, 1, 16000, 16, _pcm16() + b"\x01"),
            r"truncated: data ends mid-sample",
        ),
        ("header.wav", _riff(1, 1, 16000, 16, _pcm16())[:30], r"truncated"),
        ("text.wav", b"hello, this is not audio at all", r"not a RIFF/WAVE file"),
        ("alaw.wav", _riff(6, 1, 16000, 8, b"\x00" * 10), r"unsupported sample format"),
    ],
)
def test_read_wav_errors(tmp_path, name, content, pattern):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(AudioInputError, match=pattern) as info:
        read_wav(path)
    assert info.value.source == str(path)
    assert str(path) in str(info.value)


def test_read_wav_missing_file(tmp_path):
    with pytest.raises(AudioInputError, match="cannot read"):
        read_wav(tmp_path / "absent.wav")


def test_validate_frame():
    ok = np.full(FRAME_LEN, 0.25, np.float32)
    assert validate_frame(ok, FRAME_LEN) is ok
    as_int = validate_frame(np.full(FRAME_LEN, -16384, np.int16), FRAME_LEN)
    assert as_int.dtype == np.float32
    assert np.all(as_int == -0.5)
    bad = [
        (np.zeros(FRAME_LEN - 1, np.float32), "1279 samples; expected one frame of 1280"),
        (np.zeros(FRAME_LEN, np.float64), "dtype float64"),
        (np.zeros((2, FRAME_LEN // 2), np.float32), r"shape \(2, 640\)"),
        ([0.0] * FRAME_LEN, "expected a NumPy array"),
        (np.where(np.arange(FRAME_LEN) == 7, np.nan, 0).astype(np.float32), "first at index 7"),
        (np.full(FRAME_LEN, 1.01, np.float32), "clipped"),
    ]
    for samples, pattern in bad:
        with pytest.raises(AudioInputError, match=pattern):
            validate_frame(samples, FRAME_LEN, source="client 9")


def test_decode_pcm16_and_frames():
    np.testing.assert_array_equal(decode_pcm16(b"\x00\x40\x00\xc0"), [0.5, -0.5])
    with pytest.raises(AudioInputError, match="odd length 3"):
        decode_pcm16(b"\x00\x40\x00")
    x = np.arange(1, 6, dtype=np.float32)
    f = frames(x, 2)
    np.testing.assert_array_equal(f, [[1, 2], [3, 4], [5, 0]])
    assert frames(np.zeros(0, np.float32), 4).shape == (0, 4)
    assert frames(np.ones(8, np.float32), 4).shape == (2, 4)


def test_default_speech_asset():
    x = read_wav(ASSETS / "speech_16k.wav")
    assert 3.0 <= x.shape[0] / 16000 <= 5.0
    assert (ASSETS / "speech_16k.wav").stat().st_size < 200_000
    assert 0.1 < np.abs(x).max() <= 1.0  # speech, not silence


# ---------------------------------------------------------------------------------------------
# Slots


def test_capacity_error_on_n_plus_one():
    table = SlotTable(3)
    assert [table.admit(s, tick=0) for s in "abc"] == [0, 1, 2]
    with pytest.raises(CapacityError) as info:
        table.admit("d", tick=4)
    assert str(info.value) == "server full: 3 of 3 slots in use; session d refused"
    assert (table.admitted, table.refused, len(table)) == (3, 1, 3)
    events = table.drain_events()
    assert [e["event"] for e in events] == ["admitted"] * 3 + ["refused"]
    assert events[-1]["tick"] == 4
    assert "server full" in events[-1]["message"]
    assert table.drain_events() == []


def test_release_frees_only_its_slot_and_slot_is_reused():
    table = SlotTable(4)
    for s in "abcd":
        table.admit(s)
    record = table.release("b", tick=9)
    assert record.slot == 1
    assert record.released_tick == 9
    np.testing.assert_array_equal(table.active_mask(), [True, False, True, True])
    assert table.slot_sessions() == ["a", None, "c", "d"]
    assert table.admit("e", tick=10) == 1  # the lowest free slot
    assert [table.slot_of(s) for s in "acde"] == [0, 2, 3, 1]
    assert table.session("e").admitted_tick == 10
    assert table.active_mask().all()
    with pytest.raises(ValueError, match="already admitted"):
        table.admit("a")
    with pytest.raises(KeyError):
        table.release("b")
    assert (table.admitted, table.released) == (5, 1)


# ---------------------------------------------------------------------------------------------
# Input queues


def _beat(value: float) -> np.ndarray:
    return np.full(BEAT, value, np.float32)


def _setup(ids: str = "ab", n_slots: int = 3, **kw) -> tuple[SlotTable, InputQueues]:
    table = SlotTable(n_slots)
    queues = InputQueues(n_slots, BEAT, **kw)
    for s in ids:
        table.admit(s)
        queues.open(table.session(s))
    return table, queues


def test_late_audio_becomes_silence_plus_underrun():
    table, queues = _setup()
    queues.push("a", _beat(0.1))
    audio, underrun = queues.take_beat(table.slot_sessions())
    assert audio.shape == (3, BEAT)
    assert audio.dtype == np.float32
    np.testing.assert_array_equal(audio[0], _beat(0.1))
    np.testing.assert_array_equal(audio[1:], 0.0)  # b's audio is late; slot 2 is free
    np.testing.assert_array_equal(underrun, [False, True, False])
    assert (table.session("a").underruns, table.session("b").underruns) == (0, 1)
    queues.push("b", _beat(0.2))  # arrives after the tick: played next beat, not dropped
    audio, underrun = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(audio[1], _beat(0.2))
    np.testing.assert_array_equal(underrun, [True, False, False])
    assert queues.underruns == 2


def test_partial_beat_is_used_zero_padded_and_counted():
    table, queues = _setup("a")
    queues.push("a", np.full(FRAME_LEN, 0.3, np.float32))  # one frame of a two-frame beat
    audio, underrun = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(audio[0, :FRAME_LEN], np.float32(0.3))
    np.testing.assert_array_equal(audio[0, FRAME_LEN:], 0.0)
    assert underrun[0]
    assert table.session("a").underruns == 1
    assert queues.backlog("a") == 0


def test_no_catch_up_burst():
    table, queues = _setup("a")
    queues.push("a", np.concatenate([_beat(0.1), _beat(0.2)]))  # two beats at once
    assert queues.backlog("a") == 2 * BEAT
    first, u1 = queues.take_beat(table.slot_sessions())
    second, u2 = queues.take_beat(table.slot_sessions())
    third, u3 = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(first[0], _beat(0.1))
    np.testing.assert_array_equal(second[0], _beat(0.2))
    np.testing.assert_array_equal(third[0], 0.0)
    assert (u1[0], u2[0], u3[0]) == (False, False, True)


def test_backlog_bound_drops_oldest():
    table, queues = _setup("a", max_backlog_beats=2)
    for v in range(5):
        queues.push("a", _beat(v / 10))
    assert queues.backlog("a") == 2 * BEAT
    assert table.session("a").dropped_samples == 3 * BEAT == queues.dropped_samples
    audio, _ = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(audio[0], _beat(0.3))  # beats 0, 1, 2 went first
    queues.push("a", _beat(0.5))
    queues.discard_beats(1)  # the server skipped a tick: that beat of input goes too
    audio, _ = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(audio[0], _beat(0.5))
    # counted apart: the client's pace did not cause it
    assert table.session("a").dropped_samples == 3 * BEAT == queues.dropped_samples
    assert table.session("a").skipped_samples == BEAT == queues.skipped_samples


def test_bad_input_fails_only_that_session():
    table, queues = _setup("abc", n_slots=4)
    for s, v in zip("abc", (0.1, 0.2, 0.3), strict=True):
        queues.push(s, _beat(v))
    with pytest.raises(AudioInputError, match="session b: 1 NaN/Inf"):
        queues.push("b", np.where(np.arange(BEAT) == 3, np.nan, 0.0).astype(np.float32))
    with pytest.raises(AudioInputError, match="failed earlier"):
        queues.push("b", _beat(0.0))
    assert "NaN" in table.session("b").failure
    assert list(queues.failed()) == ["b"]
    assert (queues.backlog("a"), queues.backlog("b"), queues.backlog("c")) == (BEAT, 0, BEAT)
    audio, underrun = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(audio[0], _beat(0.1))
    np.testing.assert_array_equal(audio[1], 0.0)
    np.testing.assert_array_equal(audio[2], _beat(0.3))
    assert not underrun.any()  # a failed session is fed silence but not counted as underrun
    assert table.session("a").failure is None
    assert table.session("c").failure is None
    # Wrong frame size and wrong dtype fail their sessions the same way.
    with pytest.raises(AudioInputError, match="positive multiple"):
        queues.push("a", np.zeros(1000, np.float32))
    with pytest.raises(AudioInputError, match="dtype float64"):
        queues.push("c", np.zeros(BEAT, np.float64))
    assert set(queues.failed()) == {"a", "b", "c"}
    # A vanished client is failed by the network layer; an unknown session is a KeyError.
    table.admit("d")
    queues.open(table.session("d"))
    queues.fail("d", "client disconnected")
    assert table.session("d").failure == "client disconnected"
    with pytest.raises(KeyError):
        queues.push("zz", _beat(0.0))


def test_int16_input_and_buffer_ownership():
    table, queues = _setup("a")
    buf = np.full(BEAT, 8192, np.int16)
    queues.push("a", buf)
    buf[:] = 0  # the client reuses its buffer: what was queued must not change
    audio, _ = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(audio[0], 0.25)
    f32 = _beat(0.4)
    queues.push("a", f32)
    f32[:] = 0
    audio, _ = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(audio[0], np.float32(0.4))


def test_concurrent_pushes_from_threads():
    ids = [f"s{i}" for i in range(6)]
    table, queues = SlotTable(6), InputQueues(6, BEAT, max_backlog_beats=None)
    for s in ids:
        table.admit(s)
        queues.open(table.session(s))

    def client(sid: str, value: float) -> None:
        for _ in range(50):
            queues.push(sid, np.full(FRAME_LEN, value, np.float32))

    threads = [threading.Thread(target=client, args=(s, i / 10)) for i, s in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [queues.backlog(s) for s in ids] == [50 * FRAME_LEN] * 6
    audio, underrun = queues.take_beat(table.slot_sessions())
    np.testing.assert_array_equal(
        audio, np.repeat(np.arange(6)[:, None] / 10, BEAT, 1).astype(np.float32)
    )
    assert not underrun.any()


def test_take_beat_checks_slot_count_and_session_output():
    _, queues = _setup("a")
    with pytest.raises(ValueError, match="expected 3 slot entries"):
        queues.take_beat(["a"])
    out = SessionOutput()
    for i in range(40):  # past the initial capacity: the buffers grow and keep every frame
        out.append(
            text=np.array([2 * i, 2 * i + 1], np.int32),
            function=np.array([7, 8], np.int32),
            codes=np.full((2, 4), i, np.int32),
            wav=np.full(3528, i / 40, np.float32),
            transcript=np.full((2, 3), i, np.int32),
            n_transcript=np.array([i % 4, 0], np.int32),
        )
    assert out.frames == 80
    a = out.arrays()
    np.testing.assert_array_equal(a["text"], np.arange(80))
    np.testing.assert_array_equal(a["codes"][:, 0], np.repeat(np.arange(40), 2))
    assert a["wav"].shape == (40 * 3528,)
    np.testing.assert_array_equal(a["wav"][3528 * 39 :], np.float32(39 / 40))
    assert out.transcript(2 * 3) == [3, 3, 3]
    assert out.transcript(2 * 4) == []
    assert SessionOutput().arrays()["text"].shape == (0,)


def test_growing_buffer_keeps_its_chunks_and_every_row(monkeypatch):
    """Appends of odd sizes across many chunks read back whole; the chunks already written are
    never reallocated (an append copies only its own rows), and stop doubling at the limit."""
    monkeypatch.setattr(writer_lib, "_CHUNK_BYTES", 8 * 4 * 3)  # 8 rows of [3] int32
    g = writer_lib._Growing((3,), np.int32, capacity=2)
    first = g._chunks[0]
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 100, (int(n), 3), dtype=np.int32) for n in rng.integers(0, 11, 30)]
    for p in parts:
        g.extend(p)
    want = np.concatenate(parts)
    np.testing.assert_array_equal(g.view(), want)
    assert g._chunks[0] is first
    assert len(g._chunks) > 3
    assert [c.shape[0] for c in g._chunks[:4]] == [2, 4, 8, 8]
    np.testing.assert_array_equal(g.row(len(want) - 1), want[-1])
    with pytest.raises(IndexError):
        g.row(len(want))


# ---------------------------------------------------------------------------------------------
# Metrics


def _synthetic_run(sink=None):
    """3 warm-up ticks (compile: 2 s) then 400 steady ticks with random latency and sessions."""
    rng = np.random.default_rng(1)
    rec = MetricsRecorder(warmup_ticks=3, sink=sink)
    rec.record_compile("tick", 41.5)
    ids = [f"s{i}" for i in range(8)]
    expected = {"lat": [], "missed_ticks": 0, "beats": 0, "missed_beats": 0, "underruns": 0}
    per_missed = dict.fromkeys(ids, 0)
    per_beats = dict.fromkeys(ids, 0)
    t0 = 50.0
    for k in range(403):
        start = t0 + k * P
        live = [s for s in ids if rng.random() < 0.7]
        under = [s for s in live if rng.random() < 0.05]
        if k < 3:
            rec.record(k, start, start + 2.0, start + P, live, under)
            continue
        # Tick 100 is skipped: missed by everyone live, no latency.
        readable = None if k == 100 else start + float(rng.uniform(0.05, 0.17))
        rec.record(k, start, readable, start + P, live, under)
        missed = readable is None or readable > start + P
        if readable is not None:
            expected["lat"].append(readable - start)
        expected["missed_ticks"] += missed
        expected["beats"] += len(live)
        expected["missed_beats"] += len(live) * missed
        expected["underruns"] += len(under)
        for s in live:
            per_beats[s] += 1
            per_missed[s] += missed
    rec.record_event("admitted", session="s0", slot=0, tick=0)
    rec.record_event("refused", session="s9", tick=0, message="server full")
    return rec, expected, per_beats, per_missed


def test_summary_statistics_against_numpy():
    rec, exp, per_beats, per_missed = _synthetic_run()
    s = rec.summary()
    lat_ms = np.array(exp["lat"]) * 1e3
    assert s["ticks"] == 400
    assert s["ticks_skipped"] == 1
    for name, q in (("p50", 50), ("p99", 99), ("p99.9", 99.9)):
        assert s["latency_ms"][name] == pytest.approx(np.percentile(lat_ms, q), rel=1e-12)
    assert s["latency_ms"]["max"] == pytest.approx(lat_ms.max(), rel=1e-12)
    assert s["latency_ms"]["mean"] == pytest.approx(lat_ms.mean(), rel=1e-12)
    assert s["missed_ticks"] == exp["missed_ticks"] > 1
    assert s["session_beats"] == exp["beats"]
    assert s["missed_session_beats"] == exp["missed_beats"] > s["missed_ticks"]
    assert s["underruns"] == exp["underruns"] > 0
    assert s["miss_rate_ticks"] == pytest.approx(exp["missed_ticks"] / 400)
    assert s["miss_rate_session_beats"] == pytest.approx(exp["missed_beats"] / exp["beats"])
    assert s["miss_rate_bound_95"] is None  # misses seen: no rule-of-three bound
    assert {k: v["beats"] for k, v in s["per_session"].items()} == per_beats
    assert {k: v["missed"] for k, v in s["per_session"].items()} == per_missed
    assert s["max_missed_per_session"] == max(per_missed.values())
    assert s["events"] == {"admitted": 1, "refused": 1}
    assert s["compile_s"] == {"tick": 41.5}


def test_warmup_excluded_from_steady_state():
    sink = io.StringIO()
    rec, *_ = _synthetic_run(sink)
    s = rec.summary()
    rows = [json.loads(line) for line in sink.getvalue().splitlines()]
    warm_rows = [r for r in rows if r["type"] == "tick" and r["phase"] == "warmup"]
    assert [r["tick"] for r in warm_rows] == [0, 1, 2]
    assert s["warmup"]["missed_session_beats"] == sum(r["live_sessions"] for r in warm_rows)
    assert s["latency_ms"]["max"] < 200.0  # the 2 s compile ticks are not in steady stats
    assert s["warmup"]["ticks"] == 3
    assert s["warmup"]["latency_ms"]["max"] == pytest.approx(2000.0)
    assert s["warmup"]["missed_ticks"] == 3
    ticks = list(rec.recent)  # the last 256 records: all 403 ticks minus the oldest 147
    assert len(ticks) == 256
    assert ticks[-1].tick == 402
    assert all(r.phase == "steady" for r in ticks)


def test_rule_of_three_bound_when_no_miss():
    rec = MetricsRecorder(warmup_ticks=2)
    for k in range(502):
        rec.record(k, k * P, k * P + (1.0 if k < 2 else 0.1), (k + 1) * P, ["a", "b"])
    s = rec.summary()
    assert s["ticks"] == 500
    assert s["missed_ticks"] == 0
    assert s["warmup"]["missed_ticks"] == 2
    assert s["miss_rate_bound_95"] == pytest.approx(3 / 500)
    assert s["session_beats"] == 1000
    assert "0.600 % of ticks" in format_table(s)


def test_tick_record_late_tick_misses_every_live_session():
    rec = MetricsRecorder(warmup_ticks=0)
    on_time = rec.record(0, 0.0, 0.15, 0.16, ["a", "b", "c"], ["b"])
    late = rec.record(1, 0.16, 0.33, 0.32, ["a", "b", "c"])
    assert not on_time.missed
    assert late.missed
    assert late.latency == pytest.approx(0.17)
    s = rec.summary()
    assert (s["missed_ticks"], s["missed_session_beats"], s["underruns"]) == (1, 3, 1)
    assert s["per_session"]["b"] == {"beats": 2, "missed": 1, "underruns": 1}


def test_jsonl_table_and_prometheus():
    sink = io.StringIO()
    rec, exp, *_ = _synthetic_run(sink)
    summary = rec.close()
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    types = [line["type"] for line in lines]
    assert types.count("tick") == 403
    assert types.count("event") == 2
    assert types[0] == "compile"
    assert types[-1] == "summary"
    ticks = [line for line in lines if line["type"] == "tick"]
    assert [t["tick"] for t in ticks] == list(range(403))
    assert ticks[100]["skipped"] is True
    assert ticks[100]["latency"] is None
    assert lines[-1]["missed_session_beats"] == exp["missed_beats"]

    table = format_table(summary)
    assert f"{summary['missed_session_beats']} (" in table
    assert "compile tick s" in table

    text = prometheus_text(summary)
    sample = re.compile(r'^voicechat_[a-z_]+(\{[a-z]+="[^"]*"(,[a-z]+="[^"]*")*\})? -?[0-9.e+-]+$')
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) voicechat_[a-z_]+ ", line)
            continue
        assert sample.match(line), line
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    assert values["voicechat_missed_session_beats_total"] == exp["missed_beats"]
    assert values["voicechat_beat_latency_seconds_count"] == 399
    assert values['voicechat_beat_latency_seconds{quantile="0.99"}'] == pytest.approx(
        summary["latency_ms"]["p99"] / 1e3, rel=1e-8
    )
    assert values['voicechat_session_events_total{event="refused"}'] == 1
    assert math.isclose(values["voicechat_beat_latency_seconds_sum"], sum(exp["lat"]), rel_tol=1e-8)
    # The text parses as Prometheus exposition, with the miss causes as labelled samples.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    causes = {
        (x.labels["cause"], x.labels["kind"]): x.value
        for x in families["voicechat_missed_ticks_by_cause"].samples
    }
    assert causes[("unknown", "skipped")] == 1  # recorded without a timeline
    assert sum(causes.values()) == summary["missed_ticks"]


# ---------------------------------------------------------------------------------------------
# Host timeline and attribution


def _timeline(start, *, prepare=0.001, dispatch=0.001, device=0.02, pickup=0.001, wake=0.0, **kw):
    woke = start + wake
    prepared = woke + prepare
    dispatched = None if dispatch is None else prepared + dispatch
    ready = (prepared if dispatched is None else dispatched) + device
    return HostTimeline(
        woke=woke,
        prepared=prepared,
        dispatched=dispatched,
        ready=ready,
        readable=ready + pickup,
        reader_began=kw.get("reader_began", prepared if dispatch is None else dispatched),
        collect_s=0.002,
    )


def _record(rec, k, timeline, live=("a", "b")):
    start = k * P
    return rec.record(k, start, timeline.readable, start + P, list(live), timeline=timeline)


def test_late_tick_attributed_to_device_or_host():
    rec = MetricsRecorder(warmup_ticks=0, period_s=P)
    on_time = _record(rec, 0, _timeline(0.0))
    assert (on_time.missed, on_time.cause) == (False, None)
    assert on_time.stages["device"] == pytest.approx(0.02)
    assert on_time.stages["collect"] == pytest.approx(0.002)
    # The device alone took longer than the beat: a device miss, whatever the host did.
    slow_device = _record(rec, 1, _timeline(P, device=0.2))
    assert (slow_device.missed, slow_device.cause, slow_device.host_stage) == (True, "device", None)
    # The device was in time; preparing the input took too long: the host lost the beat.
    slow_prepare = _record(rec, 2, _timeline(2 * P, prepare=0.15, device=0.02))
    assert (slow_prepare.cause, slow_prepare.host_stage) == ("host", "prepare")
    # A collection inside the device interval held the GIL when the output was ready: host.
    t = _timeline(3 * P, device=0.2)
    rec.record_gc([GcPause(3 * P + 0.01, 3 * P + 0.17, 2, 0, policy=False)])
    gc_tick = _record(rec, 3, t)
    assert (gc_tick.cause, gc_tick.host_stage) == ("host", "gc")
    assert gc_tick.stages["gc"] == pytest.approx(0.16)
    assert (gc_tick.gc_pauses, gc_tick.gc_generation) == (1, 2)
    # The output was there before the reader looked (its wait returned at once): the reader's
    # lateness is the host's.
    start = 4 * P
    late_reader = _timeline(start, device=0.19)
    late_reader = dataclasses.replace(late_reader, reader_began=late_reader.ready - 1e-5)
    reader_tick = _record(rec, 4, late_reader)
    assert (reader_tick.cause, reader_tick.host_stage) == ("host", "reader")
    s = rec.summary()
    assert s["missed_by_cause"] == {"host": 3, "device": 1, "unknown": 0}
    assert s["host_stages_ms"]["prepare"]["max"] == pytest.approx(150.0)
    assert s["gc"]["automatic"] == [0, 0, 1]
    assert "host 3 / device 1" in format_table(s)


@pytest.mark.parametrize(
    ("late", "cause", "stage"),
    [
        # A roll-over program launched before the tick: the device stage grows by its work while
        # the host's dispatch takes what it always takes; the device alone is still in time.
        ({"dispatch": 0.02, "device": 0.15}, "device", None),
        ({"prepare": 0.04}, "host", "prepare"),
        ({"dispatch": 0.06}, "host", "dispatch"),
        ({"pickup": 0.04}, "host", "pickup"),
        ({"wake": 0.04}, "host", "wake"),
        ({"reader": 0.04}, "host", "reader"),
        ({"gc": 0.04}, "host", "gc"),
    ],
)
def test_late_tick_charged_to_the_stage_that_made_it_late(late, cause, stage):
    """After steady beats of 20 ms dispatch and 125 ms device work (a 148 ms beat), one beat is
    made late by one stage: it is charged to that stage, device or host."""
    rec = MetricsRecorder(warmup_ticks=0, period_s=P)
    usual = {"dispatch": 0.02, "device": 0.125}
    for k in range(20):
        assert not _record(rec, k, _timeline(k * P, **usual)).missed
    k = 20
    start = k * P
    parts = {**usual, **{s: v for s, v in late.items() if s not in ("reader", "gc")}}
    t = _timeline(start, **parts)
    if "reader" in late:  # the output was there; the reader came late for it
        t = dataclasses.replace(
            t,
            reader_began=t.ready + late["reader"] - 1e-5,
            ready=t.ready + late["reader"],
            readable=t.readable + late["reader"],
        )
    if "gc" in late:  # a collection held the GIL inside the device interval
        t = dataclasses.replace(t, ready=t.ready + late["gc"], readable=t.readable + late["gc"])
        rec.record_gc([GcPause(t.dispatched + 0.01, t.dispatched + 0.01 + late["gc"], 2, 0, False)])
    tick = _record(rec, k, t)
    assert tick.missed
    assert tick.stages["device"] < P or cause == "host"  # the device alone would have held
    assert (tick.cause, tick.host_stage) == (cause, stage)
    assert rec.summary()["missed_by_cause"][cause] == 1


def test_skipped_tick_attributed_to_its_cause():
    # Resident loop: the beat thread waits for each beat's device work.
    rec = MetricsRecorder(warmup_ticks=0, period_s=P, beat_waits_for_device=True)
    _record(rec, 0, _timeline(0.0, dispatch=None, device=0.45))  # the device stalls 450 ms
    assert rec.record(1, P, None, 2 * P, ["a"]).cause == "device"  # even a perfect host skips 1
    # Tick 2 starts late because of the device: that lateness is the device's, not the host's.
    late = _record(rec, 2, _timeline(2 * P, dispatch=None, wake=0.13, device=0.04))
    assert late.missed
    assert late.cause == "device"  # 130 ms forced by the last beat + 40 ms of its own > 160 ms
    # A host that stalls after an in-time device beat skips the next tick on its own.
    _record(rec, 3, _timeline(3 * P, dispatch=None, device=0.02))
    assert rec.record(4, 4 * P, None, 5 * P, ["a"]).cause == "host"
    # Dispatch loop: the beat thread never waits for the device, so a skip is the host's,
    # unless the server skipped because the device was still behind.
    rec = MetricsRecorder(warmup_ticks=0, period_s=P, beat_waits_for_device=False)
    _record(rec, 0, _timeline(0.0, device=0.45))
    assert rec.record(1, P, None, 2 * P, ["a"]).cause == "host"
    assert rec.record(2, 2 * P, None, 3 * P, ["a"], cause=Cause.DEVICE).cause == "device"
    s = rec.summary()
    assert s["skipped_by_cause"] == {"host": 1, "device": 1, "unknown": 0}
    assert s["ticks_skipped"] == 2
    # Without any timeline there is nothing to attribute by.
    assert MetricsRecorder(0).record(0, 0.0, None, P).cause == "unknown"


def test_recorder_memory_is_bounded():
    rec = MetricsRecorder(warmup_ticks=2, window=100, recent=10, max_sessions=5)
    for k in range(3000):
        sid = f"s{k // 10}"  # a new session every 10 ticks: 300 in all
        if k % 10 == 0:
            rec.record_event("admitted", session=sid, tick=k)
        missed = k % 97 == 0
        rec.record(k, k * P, k * P + (0.2 if missed else 0.01), (k + 1) * P, [sid])
        rec.record_gc([GcPause(k * P, k * P + 1e-4, 0, 0, policy=True)])
        if k % 10 == 9:
            rec.record_event("released", session=sid, tick=k)
    kept = rec.retained()
    assert kept == {
        "recent": 10,
        "window": 100,
        "sessions": 5,
        "pauses": kept["pauses"],
        "warmup": 2,
    }
    assert kept["pauses"] <= 2
    s = rec.summary()
    assert s["ticks"] == 2998  # running counters cover the whole run
    assert s["window_ticks"] == 100
    assert s["missed_ticks"] == sum(1 for k in range(2, 3000) if k % 97 == 0)
    assert s["sessions_with_misses"] == s["missed_ticks"]  # each miss in a different session
    assert len(s["per_session"]) == 5
    assert s["gc"]["policy"][0] == 3000


# ---------------------------------------------------------------------------------------------
# GC policy


def test_gc_policy_slack_freezes_and_collects_only_when_it_fits():
    assert gc.isenabled()
    monitor = GcMonitor()
    policy = GcPolicy("slack", monitor=monitor)
    with monitor:
        policy.start()
        try:
            assert not gc.isenabled()
            assert gc.get_freeze_count() > 0
            monitor.drain()
            for _ in range(3 * gc.get_threshold()[0]):
                a = []
                a.append(a)  # cyclic garbage: only a collection frees it
            del a
            assert policy.due() is not None
            assert policy.in_slack(0.0) == 0.0  # no slack: nothing runs, the collection waits
            assert policy.deferred == 1
            assert monitor.drain() == []
            assert policy.in_slack(1.0) > 0.0
            pauses = monitor.drain()
            assert len(pauses) == 1
            assert pauses[0].policy
            assert pauses[0].collected > 0
            assert sum(policy.collections) == 1
        finally:
            policy.stop()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    # "default" leaves Python's collector alone.
    default = GcPolicy("default")
    with default:
        assert gc.isenabled()
        assert gc.get_freeze_count() == 0
        assert default.in_slack(1.0) == 0.0
    with pytest.raises(ValueError, match="often"):
        GcPolicy("often")


def test_gc_monitor_records_automatic_collections():
    monitor = GcMonitor(maxlen=4)
    with monitor:
        for _ in range(6):
            gc.collect(0)
    pauses = monitor.drain()
    assert len(pauses) == 4  # bounded: the two oldest were dropped
    assert monitor.dropped == 2
    assert all(not p.policy and p.generation == 0 and p.end >= p.start for p in pauses)
    gc.collect(0)
    assert monitor.drain() == []  # uninstalled


def test_ended_records_keep_the_newest():
    records = EndedRecords(limit=3)
    for i in range(10):
        records[f"s{i}"] = i
    assert list(records) == ["s7", "s8", "s9"]
    assert records.dropped == 7
    assert dict(records) == {"s7": 7, "s8": 8, "s9": 9}
    with pytest.raises(ValueError, match="limit"):
        EndedRecords(0)


# ---------------------------------------------------------------------------------------------
# Streamed outputs


def test_wav_stream_is_valid_after_every_append(tmp_path):
    path = tmp_path / "out.wav"
    stream = WavStream(path, 22050)
    assert read_wav_or_empty(path) == 0  # a valid header counting no samples
    rng = np.random.default_rng(3)
    chunks = [rng.uniform(-0.5, 0.5, 3528).astype(np.float32) for _ in range(5)]
    for i, chunk in enumerate(chunks):
        stream.append(to_pcm16(chunk))
        # Read while the stream is still open, as after a crash: every beat so far is there.
        got = read_wav(path, expected_rate=22050)
        np.testing.assert_array_equal(
            got, np.concatenate([to_pcm16(c) for c in chunks[: i + 1]]) / np.float32(32768)
        )
    # A crash between the data and the header patch: the header counts fewer samples than the
    # file holds; the file still reads, as the beats it counts.
    data = path.read_bytes() + to_pcm16(chunks[0]).tobytes()
    (tmp_path / "crashed.wav").write_bytes(data)
    assert read_wav(tmp_path / "crashed.wav", expected_rate=22050).shape == (5 * 3528,)
    stream.close()
    stream.close()  # idempotent
    with wave.open(str(path)) as w:
        assert (w.getnframes(), w.getframerate(), w.getsampwidth()) == (5 * 3528, 22050, 2)


def test_wav_stream_left_open_closes_writer_before_file(tmp_path, monkeypatch):
    """A stream dropped unclosed, in a reference cycle, is closed by its finaliser: no error
    from ``Wave_write.__del__`` on a closed file, and the file counts every sample."""
    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    stream = WavStream(tmp_path / "left.wav", 24000)
    stream.append(np.zeros(480, np.int16))
    stream.cycle = stream
    del stream
    gc.collect()
    assert unraisable == []
    assert read_wav_or_empty(tmp_path / "left.wav") == 480


def read_wav_or_empty(path) -> int:
    with wave.open(str(path)) as w:
        return w.getnframes()


def test_to_pcm16_clips_and_zeroes_nan():
    x = np.array([[0.5, 2.0, -2.0], [np.nan, np.inf, -np.inf]], np.float32)
    out = np.zeros((2, 3), "<i2")
    assert to_pcm16(x, out=out) is out
    np.testing.assert_array_equal(out, [[16384, 32767, -32767], [0, 32767, -32767]])


def test_session_files_stream_frames_jsonl(tmp_path):
    def tokenizer(ids: np.ndarray) -> str:
        return " ".join(map(str, ids.tolist()))

    files = SessionFiles(tmp_path / "s0", sample_rate=22050, tokenizer=tokenizer)
    for beat in range(3):
        text = np.array([2 * beat, 2 * beat + 1], np.int32)
        transcript = np.zeros((2, 4), np.int32)
        transcript[0, :2] = [7, 8]
        lines = frame_lines(
            2 * beat,
            text,
            text + 100,
            np.full((2, 3), beat, np.int32),
            transcript,
            np.array([2, 0], np.int32),
        )
        files.append(lines, np.zeros(3528, "<i2"), text)
        rows = [json.loads(line) for line in (tmp_path / "s0" / "frames.jsonl").open()]
        assert [r["frame"] for r in rows] == list(range(2 * beat + 2))  # on disk beat by beat
    raw = (tmp_path / "s0" / "frames.jsonl").read_text().splitlines()
    assert raw == [json.dumps(r) for r in rows]  # the layout json.dumps writes
    assert rows[2] == {
        "frame": 2,
        "text": 2,
        "function": 102,
        "codes": [1, 1, 1],
        "transcript": [7, 8],
    }
    assert rows[3]["transcript"] == []
    paths = files.close()
    assert (tmp_path / "s0" / "transcript.txt").read_text() == "0 1 2 3 4 5\n"
    assert set(paths) == {"wav", "frames", "transcript"}


def _host_output(value, slots=2, frames=2):
    """A ``BeatOutput`` of NumPy leaves, every leaf of it filled from ``value``."""
    rng = np.random.default_rng(value)
    return state_lib.BeatOutput(
        frames=voicechat.FrameOutputs(
            text=np.full((slots, frames), value, np.int32),
            function=rng.integers(-5, 5, (slots, frames), dtype=np.int32),
            codes=rng.integers(0, 1024, (slots, frames, 3), dtype=np.int32),
            wav=np.full((slots, frames * 1764), value, np.float32),
            transcript=rng.integers(0, 9, (slots, frames, 4), dtype=np.int32),
            n_transcript=rng.integers(0, 4, (slots, frames), dtype=np.int32),
        ),
        ran=rng.random(slots) < 0.5,
        active=np.ones(slots, bool),
        at_cap=rng.random(slots) < 0.5,
        reseeded=np.zeros(slots, bool),
        frame=np.full(slots, value, np.int32),
    )


def test_a_packed_beat_reads_back_bit_for_bit():
    out = _host_output(7, slots=3)
    out = out.replace(
        frames=out.frames.replace(wav=np.array([[-0.0, np.nan, np.inf] * 1176] * 3, np.float32))
    )
    packed = np.asarray(state_lib.pack_output(out))  # what the dispatch loop copies back
    assert packed.dtype == np.uint32
    assert packed.shape == (sum(np.size(v) for v in out.named().values()),)
    direct, from_packed = HostBeat.like(out), HostBeat.like(out)
    direct.fill(out)
    from_packed.fill_packed(packed)
    for f in dataclasses.fields(HostBeat):
        a, b = getattr(direct, f.name), getattr(from_packed, f.name)
        assert a.dtype == b.dtype, f.name
        assert a.tobytes() == b.tobytes(), f.name
    with pytest.raises(ValueError, match="packed beat of"):
        from_packed.fill_packed(packed[:-1])


def test_beat_pool_reuses_and_bounds_buffers():
    out = _host_output

    pool = BeatPool(capacity=2)
    first = pool.take(out(1))
    source = out(2)
    second = pool.take(source)
    source.frames.wav[:] = 0  # the pickup owns a copy: the device's buffer may be reused
    assert second.wav[0, 0] == 2
    assert first.text[0, 0] == 1
    for beat in (first, second):
        pool.give(beat)
    assert pool.take(out(3)) in (first, second)  # reused, refilled
    taken = [pool.take(out(4)) for _ in range(5)]  # the writer is behind: more are made
    assert pool.allocated == 6
    for beat in taken:
        pool.give(beat)
    assert pool._free.qsize() == 2  # back to the bound once it caught up
