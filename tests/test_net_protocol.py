"""The live-call protocol and the host side it rests on, without a network or a model: session
config, client events, audio conversion, beats -> events, output streams, the session hub, and
the load client's playback model."""

from __future__ import annotations

import base64
import concurrent.futures
import json

import numpy as np
import pytest

from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID
from voicechat_jax.serving.hub import HubClosedError, Join, ScriptedSessions, SessionHub
from voicechat_jax.serving.net import load
from voicechat_jax.serving.net import protocol as p
from voicechat_jax.serving.sessions import CapacityError, InputQueues, SlotTable
from voicechat_jax.serving.writer import BeatStamp, OutputStream, StreamBeat, StreamEnd

W = 1764  # 22.05 kHz samples per 80 ms frame


# ---- session config and client events --------------------------------------------------------


def test_session_update_formats_and_rates():
    cfg = p.SessionConfig()
    assert (cfg.input_rate, cfg.output_rate, cfg.extensions) == (24000, 24000, False)
    new = cfg.update(
        {
            "input_audio_format": "pcm16",
            "instructions": "ignored",
            "voicechat": {"events": True, "input_sample_rate": 16000},
        }
    )
    assert (new.input_rate, new.output_rate, new.extensions) == (16000, 24000, True)
    ga = cfg.update({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}})
    assert ga.output_rate == 16000
    bad = [
        ({"input_audio_format": "g711_ulaw"}, "only 'pcm16'"),
        ({"voicechat": {"input_sample_rate": 44100}}, "input sample rate 44100"),
        ({"voicechat": {"output_sample_rate": "24000"}}, "output sample rate '24000'"),
        ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "only audio/pcm"),
        ({"voicechat": []}, "must be an object"),
        ([], "must be an object"),
    ]
    for session, message in bad:
        with pytest.raises(p.ProtocolError, match=message) as e:
            cfg.update(session)
        assert e.value.code == p.ErrorCode.INVALID_SESSION_CONFIG


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("{not json", p.ErrorCode.INVALID_JSON),
        (b"\xff\xfe", p.ErrorCode.INVALID_JSON),
        ("[1, 2]", p.ErrorCode.INVALID_EVENT),
        ('{"event_id": "e1"}', p.ErrorCode.INVALID_EVENT),
        ('{"type": 3}', p.ErrorCode.INVALID_EVENT),
    ],
)
def test_malformed_client_events(text, code):
    with pytest.raises(p.ProtocolError) as e:
        p.parse_client_event(text)
    assert e.value.code == code
    event = p.error_event(e.value.code, e.value.message, event_id=e.value.event_id)
    assert event["type"] == "error"
    assert event["error"]["code"] == str(code)


def test_decode_audio():
    pcm = np.arange(-5, 5, dtype="<i2").tobytes()
    good = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    assert p.decode_audio(good) == pcm
    for audio, message in [
        (None, "base64 string"),
        ("***", "not valid base64"),
        (base64.b64encode(b"abc").decode(), "odd number"),
    ]:
        with pytest.raises(p.ProtocolError, match=message) as e:
            p.decode_audio({"type": "input_audio_buffer.append", "audio": audio, "event_id": "x"})
        assert e.value.code == p.ErrorCode.INVALID_AUDIO
        assert e.value.event_id == "x"


# ---- audio ------------------------------------------------------------------------------------


def _tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return np.rint(0.5 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.shape[0])))
    return float(np.argmax(spectrum) * rate / x.shape[0])


def test_input_audio_resamples_into_whole_frames():
    tone = _tone(24000, 2.0)
    audio = p.InputAudio(24000)
    # Odd-sized chunks, as a browser sends them: every output is whole 1280-sample frames.
    chunks = np.array_split(tone, 37)
    out = [audio.feed(c.tobytes()) for c in chunks]
    assert all(o.size % 1280 == 0 for o in out)
    x = np.concatenate(out)
    assert 2.0 * 16000 - 2 * 1280 <= x.size <= 2.0 * 16000
    assert x.dtype == np.float32
    assert abs(_peak_hz(x[2000:], 16000) - 440.0) < 5.0
    assert np.abs(x).max() <= 1.0
    # At 16 kHz nothing is resampled: the samples are the PCM16 values, exactly.
    same = p.InputAudio(16000)
    pcm = _tone(16000, 0.2)
    y = np.concatenate([same.feed(pcm[:1000].tobytes()), same.feed(pcm[1000:].tobytes())])
    np.testing.assert_array_equal(y, pcm[: y.size].astype(np.float32) / 32768.0)
    assert y.size == (pcm.size // 1280) * 1280


@pytest.mark.parametrize("rate", [24000, 16000, 22050])
def test_output_audio_exact_frames_rate_and_clipping(rate):
    wav = 1.5 * np.sin(2 * np.pi * 300 * np.arange(200 * W) / 22050).astype(np.float32)
    wav[5] = np.nan
    out = p.OutputAudio(rate)
    frames = [np.frombuffer(out.convert(wav[i * W : (i + 1) * W]), "<i2") for i in range(200)]
    assert {f.size for f in frames} == {rate * 80 // 1000}  # every frame exactly 80 ms
    assert out.shortfalls == 0  # and never padded with silence past the start
    pcm = np.concatenate(frames)
    assert (pcm.max(), pcm.min()) == (32767, -32767)  # clipped to full scale, never wrapped
    assert abs(_peak_hz(pcm[pcm.size // 4 :].astype(np.float64), rate) - 300.0) < 2.0


# ---- beats -> events --------------------------------------------------------------------------


def _beat(tick, frame, text, function=None, transcript=None, *, latency=0.05, underrun=False,
          rollover=None) -> StreamBeat:  # fmt: skip
    T = len(text)
    return StreamBeat(
        stamp=BeatStamp(tick, tick * 0.16, tick * 0.16 + 0.16, tick * 0.16 + latency),
        frame=frame,
        wav=np.zeros((T * W,), np.float32),
        text=np.asarray(text, np.int32),
        function=np.asarray(function or [PAD_ID] * T, np.int32),
        transcript=tuple(tuple(t) for t in (transcript or [()] * T)),
        underrun=underrun,
        rollover=rollover,
    )


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def _run(events: p.CallEvents, beats, cfg=None) -> list[dict]:
    cfg = cfg or p.SessionConfig(extensions=True)
    out = []
    for beat in beats:
        T = beat.text.shape[0]
        for frame in events.beat(beat, [b"\0\0" * 4] * T, cfg):
            out += frame
    return out


def test_agent_turn_from_the_text_channel():
    ev = p.CallEvents("s1", text_decode=_words)
    beats = [
        _beat(0, 0, [PAD_ID, BOS_ID]),
        _beat(1, 2, [100, PAD_ID]),
        _beat(2, 4, [101, EOS_ID]),
        _beat(3, 6, [PAD_ID, PAD_ID]),
        _beat(4, 8, [PAD_ID, PAD_ID]),
    ]
    out = _run(ev, beats)
    types = [e["type"] for e in out]
    # One delta per 80 ms frame: the turn's response from its BOS to 2 frames past its EOS.
    assert types.count("response.output_audio.delta") == 7
    assert types.count("voicechat.output_audio.delta") == 3
    assert types.count("voicechat.beat") == 5
    added = [e for e in out if e["type"] == "response.output_item.added"]
    assert len(added) == 1
    item = added[0]["item"]["id"]
    deltas = [e for e in out if e["type"] == "response.output_audio_transcript.delta"]
    assert [d["delta"] for d in deltas] == ["w100", " w101"]
    assert [d["voicechat"]["ids"] for d in deltas] == [[100], [101]]
    done = next(e for e in out if e["type"] == "response.output_audio_transcript.done")
    assert (done["item_id"], done["transcript"]) == (item, "w100 w101")
    assert types.index("response.output_item.done") > done_at(types, "transcript.done")
    assert types.index("response.done") > types.index("response.output_item.done")
    # The turn's audio names the turn's item; before and after it, the stream's (extension).
    audio = [e for e in out if e["type"] == "response.output_audio.delta"]
    assert {a["item_id"] for a in audio} == {item}
    assert types[-1] == "voicechat.output_audio.delta"
    ids = [e["event_id"] for e in out]
    assert len(set(ids)) == len(ids)


def done_at(types: list[str], suffix: str) -> int:
    return next(i for i, t in enumerate(types) if t.endswith(suffix))


def test_no_extension_fields_unless_asked():
    ev = p.CallEvents("s2")
    out = _run(ev, [_beat(0, 0, [BOS_ID, 100])], p.SessionConfig())
    assert not [e for e in out if e["type"].startswith("voicechat.")]
    assert all("voicechat" not in e for e in out)
    delta = next(e for e in out if e["type"] == "response.output_audio_transcript.delta")
    assert delta["delta"] == ""  # no tokenizer on the server: text empty, ids only with extensions


def test_caller_turns_from_the_transcript():
    ev = p.CallEvents("s3", asr_decode=lambda ids: "".join(chr(97 + i % 26) for i in ids))
    gap = p.Limits().user_gap_frames
    beats = [_beat(0, 0, [PAD_ID, PAD_ID], transcript=[(0, 1), (2,)])]
    beats += [_beat(1 + k, 2 + 2 * k, [PAD_ID, PAD_ID]) for k in range(gap // 2 + 1)]
    out = _run(ev, beats)
    started = [e for e in out if e["type"] == "input_audio_buffer.speech_started"]
    stopped = [e for e in out if e["type"] == "input_audio_buffer.speech_stopped"]
    assert len(started) == len(stopped) == 1
    assert started[0]["audio_start_ms"] == 0
    assert stopped[0]["audio_end_ms"] == 2 * p.FRAME_MS  # after the last frame with words
    deltas = [e["delta"] for e in out if e["type"].endswith("input_audio_transcription.delta")]
    assert deltas == ["ab", "c"]
    done = next(e for e in out if e["type"].endswith("input_audio_transcription.completed"))
    assert done["transcript"] == "abc"
    assert done["item_id"] == started[0]["item_id"]


def test_function_call_channel():
    call = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    pieces = {1000 + i: ch for i, ch in enumerate(call)}
    ev = p.CallEvents("s4", text_decode=lambda ids: "".join(pieces.get(i, "?") for i in ids))
    function = [p.SOTC_ID, *pieces, p.EOTC_ID, PAD_ID]
    n = len(function) + (len(function) % 2)
    function += [PAD_ID] * (n - len(function))
    beats = [
        _beat(k, 2 * k, [PAD_ID, PAD_ID], function=function[2 * k : 2 * k + 2])
        for k in range(n // 2)
    ]
    out = _run(ev, beats)
    added = [e for e in out if e["type"] == "response.output_item.added"]
    assert added[0]["item"]["type"] == "function_call"
    deltas = "".join(e["delta"] for e in out if e["type"].endswith("arguments.delta"))
    assert deltas == call
    done = next(e for e in out if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "get_weather"
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    assert done["call_id"] == added[0]["item"]["call_id"]
    assert p.parse_tool_call("not a call") == ("", "not a call")


def test_beat_event_fields_and_rollover():
    ev = p.CallEvents("s5")
    beats = [
        _beat(3, 0, [PAD_ID, PAD_ID], latency=0.2, underrun=True),
        _beat(6, 2, [PAD_ID, PAD_ID], rollover={"reason": "cap", "capsule_len": 0}),
    ]
    out = _run(ev, beats)
    b0, b1 = [e for e in out if e["type"] == "voicechat.beat"]
    assert (b0["tick"], b0["missed"], b0["input_underrun"], b0["ticks_skipped"]) == (
        3,
        True,
        True,
        0,
    )
    assert b0["latency_ms"] == pytest.approx(200.0)
    assert (b1["missed"], b1["ticks_skipped"], b1["frame"]) == (False, 2, 2)
    rolled = [e for e in out if e["type"] == "voicechat.session.rolled_over"]
    assert [e["reason"] for e in rolled] == ["cap"]


@pytest.mark.parametrize(
    ("reason", "close", "code", "status"),
    [
        ("context cap", 1000, "session_expired", "incomplete"),
        ("shutdown", 1001, "server_shutting_down", "incomplete"),
        ("idle timeout", 1000, "idle_timeout", "incomplete"),
        ("left", 1000, None, "cancelled"),
        ("failed", 1011, "session_failed", "failed"),
    ],
)
def test_end_events(reason, close, code, status):
    ev = p.CallEvents("s6", text_decode=_words)
    _run(ev, [_beat(0, 0, [BOS_ID, 100])])  # an agent turn is open at the end
    events, got = ev.end(StreamEnd(reason, "why"), 2, p.SessionConfig(extensions=True))
    assert got == close
    types = [e["type"] for e in events]
    assert types[0] == "response.output_audio.done"  # the open turn's response is closed first
    assert types[-1] == "voicechat.session.ended"
    assert next(e for e in events if e["type"] == "response.done")["response"]["status"] == status
    errors = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert errors == ([] if code is None else [code])
    ended = next(e for e in events if e["type"] == "voicechat.session.ended")
    assert ended["detail"] == "why"


# ---- output streams and the hub ---------------------------------------------------------------


def test_output_stream_is_bounded_and_ends_after_its_beats():
    woke = []
    stream = OutputStream(3, notify=lambda: woke.append(1))
    for k in range(5):
        stream.put(_beat(k, 2 * k, [PAD_ID, PAD_ID]))
    assert (len(stream), stream.dropped, len(woke)) == (3, 2, 5)
    stream.close("left", "bye")
    stream.put(_beat(9, 18, [PAD_ID, PAD_ID]))  # after the end: ignored
    beats, end = stream.drain()
    assert [b.stamp.tick for b in beats] == [2, 3, 4]
    assert end == StreamEnd("left", "bye")
    assert stream.drain() == ([], end)


def _hub(slots: int = 2):
    queues = InputQueues(slots, 2560)
    return SessionHub(queues), SlotTable(slots), queues


def test_hub_admits_answers_and_releases():
    hub, table, _ = _hub(1)
    a = hub.admit(Join("a"))
    b = hub.admit(Join("b"))
    with pytest.raises(ValueError, match="already"):
        hub.admit(Join("a"))
    joins = hub.joins(0)
    assert [j.id for j in joins] == ["a", "b"]
    # The beat thread's part, as Server.prepare does it.
    hub.admitted(joins[0], table.admit("a"), 0)
    with pytest.raises(CapacityError) as refused:
        table.admit("b")
    hub.refused(joins[1], refused.value, 0)
    assert a.result(0) == 0
    with pytest.raises(CapacityError):
        b.result(0)
    assert hub.live() == 1
    hub.release("a", "left", "bye")
    assert [(x.id, x.why) for x in hub.leaves(1)] == [("a", "left")]
    hub.ended("a", "left", "bye", 1)
    hub.release("a")  # no longer live: nothing queued
    assert (hub.leaves(2), hub.live()) == ([], 0)


def test_hub_withdrawn_and_closed_admissions():
    hub, _, _ = _hub()
    waiting = hub.admit(Join("w"))
    hub.release("w")  # before the beat took it: withdrawn
    assert waiting.cancelled()
    assert hub.joins(0) == []
    taken = hub.admit(Join("t"))
    cancelled = hub.admit(Join("c"))
    cancelled.cancel()  # the consumer gave up before the beat
    assert [j.id for j in hub.joins(1)] == ["t"]
    assert not taken.cancel()  # running: only the beat thread answers it now
    hub.release("t")  # taken, not yet answered: released at the next beat
    assert [x.id for x in hub.leaves(2)] == ["t"]
    late = hub.admit(Join("late"))
    hub.close("draining")
    with pytest.raises(HubClosedError, match="draining"):
        late.result(0)
    with pytest.raises(HubClosedError):
        hub.admit(Join("after")).result(0)
    assert isinstance(hub.admit(Join("x")), concurrent.futures.Future)
    assert hub.new_id() != hub.new_id()


def test_scripted_sessions_source():
    plans = ScriptedSessions(
        [
            _plan("a", 0, None, audio=np.ones(6000, np.float32) * 0.1),
            _plan("b", 1, 3, audio=np.ones(100, np.float32) * 0.2),
        ],
        samples_per_beat=2560,
    )
    table = SlotTable(2)
    queues = InputQueues(2, 2560, max_backlog_beats=None)
    for k in range(4):
        for leave in plans.leaves(k):
            table.release(leave.id)
            queues.close(leave.id)
            plans.ended(leave.id, leave.why, leave.detail, k)
        for join in plans.joins(k):
            plans.admitted(join, table.admit(join.id), k)
            queues.open(table.session(join.id))
        plans.feed(k, queues)
        plans.feed(k, queues)  # fed ahead of the beat, then in it: pushed once
        audio, _ = queues.take_beat(table.slot_sessions())
        assert not any(queues.backlog(s) for s in table.slot_sessions() if s is not None)
        if k == 1:
            np.testing.assert_allclose(audio[0], 0.1)  # a's second beat
            np.testing.assert_allclose(audio[1, :100], 0.2)  # b's clip, then silence
            assert not audio[1, 100:].any()
    assert plans.retained() == {
        "plans_pending": 0,
        "leaves_pending": 0,
        "live": 1,
        "late_buffer": 1,
        "fed": 1,
    }


def _plan(sid, join, leave, *, audio):
    from voicechat_jax.serving.hub import SessionPlan

    return SessionPlan(id=sid, audio=audio, join=join, leave=leave)


# ---- the load client's playback model ---------------------------------------------------------


def test_playback_model_counts_underruns():
    rate = 24000
    n = 1920  # 80 ms
    on_time = [0.08 * i for i in range(50)]
    assert load.playback(on_time, [n] * 50, rate, 0.1) == (0, 0.0)
    # A 300 ms hole after frame 20: the buffer (two frames once the 100 ms prebuffer is met)
    # runs dry once, for the hole's 380 ms less the 160 ms it held.
    gap = [t + (0.3 if i > 20 else 0.0) for i, t in enumerate(on_time)]
    underruns, starved = load.playback(gap, [n] * 50, rate, 0.1)
    assert underruns == 1
    assert starved == pytest.approx(0.38 - 0.16, abs=1e-9)
    # 10 ms of jitter: frames paced 80 ms apart keep a margin; two at a time every 160 ms do not.
    shake = [0.01 * (i % 3 == 1) for i in range(50)]
    paced = [0.08 * i + d for i, d in enumerate(shake)]
    bursts = [0.16 * (i // 2) + shake[i // 2 * 2] for i in range(50)]
    assert load.playback(paced, [n] * 50, rate, 0.1)[0] == 0
    assert load.playback(bursts, [n] * 50, rate, 0.1)[0] > 0
    assert load.realtime_url("http://h:1") == "ws://h:1/v1/realtime?voicechat=1"
