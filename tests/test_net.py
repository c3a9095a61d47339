"""Live calls against the real server on loopback: the tiny random model, one compiled engine.

The class's server runs on the real-time clock (calls, faults, the load client, the browser page);
the test after it serves on the offline clock, where a scripted call's output can be compared bit
for bit; the last runs ``voicechat-serve --listen`` itself and drains it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import soxr
import websockets
from prometheus_client.parser import text_string_to_metric_families

from tests import shared
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.precision import Precision
from voicechat_jax.serving import read_wav
from voicechat_jax.serving.net import NetConfig, NetFront, load
from voicechat_jax.serving.scheduler import AdmissionControl, Lockstep
from voicechat_jax.serving.server import Server, SessionPlan

REPO = pathlib.Path(__file__).resolve().parent.parent
ASSET = REPO / "voicechat_jax" / "assets" / "speech_16k.wav"
CFG = tiny()
PREC = Precision.fp32()
SLOTS = 8
CAP = 96  # frames: a call reaches its context cap after 7.68 s
SERVE = ServeConfig(slots=SLOTS, frames_per_tick=2, context_frames=CAP, precision=PREC)
NET = {
    "idle_timeout_s": 1.5,
    "heartbeat_s": 1.0,
    "send_timeout_s": 1.0,
    "max_message_bytes": 64 << 10,
    "output_beats": 8,
}
SPEECH = read_wav(ASSET)
SPEECH_24K = np.rint(np.clip(soxr.resample(SPEECH, 16000, 24000), -1, 1) * 32767).astype("<i2")
AUDIO = tuple(load.AUDIO_EVENTS)  # every 80 ms frame: a response's audio, or the stream's between


@pytest.fixture(scope="module")
def engine():
    e = shared.engine(SERVE)  # one per process: test_realtime_ga.py serves the same
    e.compile_tick()
    return e


class Serving:
    """A ``Server`` with a ``NetFront``, its run on a thread (started by ``begin``)."""

    def __init__(self, engine, *, clock: str, plans=(), n_ticks: int = 1 << 40, **kw):
        engine.reset()
        self.server = Server(engine, clock=clock, loop="dispatch", seed=0, **kw)
        self.front = NetFront(self.server, NetConfig(port=0, **NET))
        self.url = self.front.start()
        self.ws_url = self.url.replace("http", "ws", 1) + "/v1/realtime?voicechat=1"
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(plans, n_ticks), daemon=True)

    def _run(self, plans, n_ticks) -> None:
        try:
            self.server.run(plans, n_ticks)
        except BaseException as e:
            self.error = e

    def begin(self) -> Serving:
        self._thread.start()
        return self

    def end(self) -> None:
        self.server.request_stop()
        self._thread.join(60)
        self.front.stop()
        assert self.error is None, self.error

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metrics(self) -> dict:
        _, text = self.get("/metrics")
        return {
            s.name + json.dumps(s.labels, sort_keys=True) * bool(s.labels): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples
        }


@contextlib.contextmanager
def serving(engine, **kw):
    s = Serving(engine, **kw)
    try:
        yield s
    finally:
        s.end()


class Caller:
    """One WebSocket call whose events are recorded with their arrival times."""

    def __init__(self, url: str, **connect):
        self.url = url
        self.connect = {"max_size": None, "compression": None, "proxy": None, **connect}
        self.events: list[tuple[float, dict]] = []
        self.first: dict | None = None
        self.closed = asyncio.Event()
        self.ws = None

    async def __aenter__(self) -> Caller:
        self.ws = await websockets.connect(self.url, **self.connect)
        self.first = json.loads(await self.ws.recv())
        self._task = asyncio.create_task(self._receive())
        return self

    async def __aexit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _receive(self) -> None:
        try:
            async for message in self.ws:
                self.events.append((time.monotonic(), json.loads(message)))
        except websockets.ConnectionClosed:
            pass
        finally:
            self.closed.set()

    @property
    def sid(self) -> str:
        return self.first["session"]["id"]

    def of(self, *kinds: str) -> list[dict]:
        return [e for _, e in self.events if e["type"] in kinds]

    def errors(self) -> list[str]:
        return [e["error"]["code"] for e in self.of("error")]

    async def send(self, event) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event))

    async def audio(self, frames: int, *, paced: bool = True, rate: int = 24000) -> None:
        n = rate * 80 // 1000
        pcm = SPEECH_24K if rate == 24000 else (SPEECH * 32767).astype("<i2")
        t0 = time.monotonic()
        for i in range(frames):
            if paced:
                await asyncio.sleep(max(0.0, t0 + 0.08 * i - time.monotonic()))
            chunk = pcm[(i * n) % (pcm.size - n) :][:n]
            await self.send(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
            )

    async def wait(self, kind: str, timeout: float = 5.0, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while len(self.of(kind)) < count:
            assert time.monotonic() < deadline, f"no {kind} in {timeout} s: {self.types()}"
            await asyncio.sleep(0.02)

    def types(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, e in self.events:
            out[e["type"]] = out.get(e["type"], 0) + 1
        return out

    def delta_times(self) -> np.ndarray:
        return np.array([t for t, e in self.events if e["type"] in AUDIO])


def _wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class TestLive:
    @pytest.fixture(scope="class")
    def live(self, engine):
        with serving(engine, clock="realtime", keep_outputs=False) as s:
            s.begin()
            assert _wait_until(lambda: s.front.readiness()[0], 30)
            yield s

    def test_http_endpoints(self, live):
        status, body = live.get("/healthz")
        assert (status, json.loads(body)["status"]) == (200, "ok")
        status, body = live.get("/readyz")
        assert status == 200
        assert json.loads(body) == {
            "ready": True,
            "reason": "ready",
            "free_slots": SLOTS,
            "live_sessions": 0,
        }
        status, body = live.get("/capacity")
        assert status == 200
        assert json.loads(body) == {
            "slots": SLOTS,
            "max_live": SLOTS,
            "free": SLOTS,
            "live": 0,
            "draining": False,
            "ready": True,
            "reason": "ready",
        }
        status, body = live.get("/")
        assert status == 200
        assert b"Start call" in body
        for path in ("/static/app.js", "/static/worklets.js"):
            assert live.get(path)[0] == 200
        assert live.get("/static/../../server.py")[0] == 404
        # Nothing live: the server runs no tick; the beats it lets pass are counted as idle.
        assert _wait_until(lambda: live.metrics()["voicechat_ticks_idle_total"] > 5)
        m = live.metrics()
        assert m["voicechat_free_slots"] == SLOTS
        assert m["voicechat_live_sessions"] == 0
        assert m["voicechat_ready"] == 1
        for name in (
            "voicechat_missed_ticks_total",
            "voicechat_ticks_skipped_total",
            "voicechat_input_underruns_total",
            "voicechat_sessions_refused_total",
            "voicechat_beat_latency_seconds_count",
        ):
            assert name in m
        buckets = {k: v for k, v in m.items() if k.startswith("voicechat_beat_latency_histogram")}
        inf = buckets['voicechat_beat_latency_histogram_seconds_bucket{"le": "+Inf"}']
        assert inf == m["voicechat_beat_latency_seconds_count"]

    def test_call_follows_the_realtime_events(self, live):
        async def call():
            async with Caller(live.ws_url) as c:
                assert c.first["type"] == "session.created"
                session = c.first["session"]
                assert session["voicechat"]["protocol_version"] == 2
                assert session["voicechat"]["input_sample_rate"] == 24000
                await c.wait("response.created")
                await c.audio(25)  # 2 s at 24 kHz
                at_24k = len(c.of(*AUDIO))
                await c.send(
                    {
                        "type": "session.update",
                        "session": {"voicechat": {"input_sample_rate": 16000}},
                        "audio": "ignored",
                    }
                )
                await c.send(
                    {
                        "type": "session.update",
                        "session": {"audio": {"output": {"format": {"rate": 16000}}}},
                    }
                )
                await c.wait("session.updated", count=2)
                await c.audio(15, rate=16000)
                await c.send({"type": "voicechat.session.close"})
                await asyncio.wait_for(c.closed.wait(), 5)
                return c, at_24k

        c, at_24k = asyncio.run(call())
        updated = c.of("session.updated")
        assert updated[0]["session"]["voicechat"]["input_sample_rate"] == 16000
        assert updated[1]["session"]["voicechat"]["output_sample_rate"] == 16000
        deltas = c.of(*AUDIO)
        sizes = np.array([len(base64.b64decode(d["delta"])) // 2 for d in deltas])
        assert at_24k >= 18
        assert set(sizes[:at_24k]) == {1920}  # exactly 80 ms at 24 kHz
        assert set(sizes[-8:]) == {1280}  # then exactly 80 ms at 16 kHz
        intervals = np.diff(c.delta_times()[: at_24k - 2]) * 1e3
        assert 70 <= np.median(intervals) <= 90  # one frame every 80 ms, paced within the beat
        beats = c.of("voicechat.beat")
        assert [b["frame"] for b in beats] == [2 * i for i in range(len(beats))]  # from frame 0
        assert all(b["latency_ms"] > 0 for b in beats)
        types = [e["type"] for _, e in c.events]
        # The hang-up cuts the agent's turn (the tiny model is always in one): its response
        # ends cancelled, then the session.
        assert types[-3:] == ["response.done", "rate_limits.updated", "voicechat.session.ended"]
        assert c.of("voicechat.session.ended")[0]["reason"] == "client_closed"
        assert c.of("response.done")[-1]["response"]["status"] == "cancelled"
        assert c.ws.close_code == 1000
        assert c.errors() == []
        # Every event names this session only; a new call is a new session, from a fresh slot.
        assert all(c.sid in e.get("event_id", c.sid) for _, e in c.events)

        async def again():
            async with Caller(live.ws_url) as d:
                await d.audio(6)
                await d.wait("voicechat.beat", count=2)
                return d

        d = asyncio.run(again())
        assert d.sid != c.sid
        assert d.of("voicechat.beat")[0]["frame"] == 0
        assert not any(c.sid in json.dumps(e) for _, e in d.events)

    def test_faults_leave_other_calls_on_their_beat(self, live):
        """Garbage, a flood, a vanished client, a reader that stalls, an input that stalls and a
        call that runs into its context cap, all at once: every other call keeps its beat."""
        server = live.server
        max_bytes = NET["max_message_bytes"]

        async def garbage():
            async with Caller(live.ws_url) as c:
                await c.send({"type": "no.such.event", "event_id": "e1"})
                await c.send("{not json")
                await c.send({"type": "input_audio_buffer.append", "audio": "YWJj"})  # odd bytes
                await c.send(b"\x00\x01")
                await c.send({"type": "conversation.item.delete", "item_id": "no-such-item"})
                await c.audio(8)
                await c.wait("error", count=5)
                alive = len(c.of(*AUDIO))
                await c.send(json.dumps({"type": "x", "pad": "A" * (max_bytes + 10)}))
                await asyncio.wait_for(c.closed.wait(), 5)
                return c, alive

        async def flood():
            async with Caller(live.ws_url) as c:
                await c.audio(40, paced=False)  # 3.2 s of audio at once
                await c.audio(12)
                await c.wait("error")
                return c

        async def vanish():
            c = Caller(live.ws_url)
            await c.__aenter__()
            await c.audio(6)
            c.ws.transport.abort()  # no close frame: the client is just gone
            t = time.monotonic()
            await asyncio.to_thread(_wait_until, lambda: c.sid in server.ended, 5)
            await c.__aexit__()
            return c, time.monotonic() - t

        async def stall_reading():
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            host, port = live.url.removeprefix("http://").split(":")
            sock.connect((host, int(port)))
            ws = await websockets.connect(
                live.ws_url, sock=sock, max_queue=1, compression=None, proxy=None
            )
            sid = json.loads(await ws.recv())["session"]["id"]
            t = time.monotonic()
            with contextlib.suppress(websockets.ConnectionClosed):
                for i in range(100):  # keeps talking, never reads
                    await asyncio.sleep(max(0.0, t + 0.08 * i - time.monotonic()))
                    chunk = SPEECH_24K[i * 1920 : (i + 1) * 1920].tobytes()
                    await ws.send(
                        json.dumps(
                            {
                                "type": "input_audio_buffer.append",
                                "audio": base64.b64encode(chunk).decode(),
                            }
                        )
                    )
                    if sid in server.ended:
                        break
            await asyncio.to_thread(_wait_until, lambda: sid in server.ended, 5)
            ws.transport.abort()
            return sid, time.monotonic() - t

        async def stall_input():
            async with Caller(live.ws_url) as c:
                await c.audio(4)
                await asyncio.wait_for(c.closed.wait(), 5)  # says nothing: the idle timeout
                return c

        async def to_the_cap():
            async with Caller(live.ws_url) as c:
                sending = asyncio.create_task(c.audio(200))
                await asyncio.wait_for(c.closed.wait(), 15)
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
                return c

        async def scenario():
            ref = asyncio.create_task(load.run_client(live.url, SPEECH_24K, client=0, seconds=6.0))
            await asyncio.sleep(0.3)
            faults = await asyncio.gather(
                garbage(), flood(), vanish(), stall_reading(), stall_input(), to_the_cap()
            )
            return await ref, faults

        ref, (g, f, v, r, i, cap) = asyncio.run(scenario())
        # The healthy call kept its beat: no gap in its frames, on pace, no error.
        assert ref.admitted
        assert ref.frame_gaps == 0
        assert ref.errors == {}
        assert ref.frames_received >= 0.8 * 6.0 / 0.08
        assert ref.jitter_ms["p50"] < 20
        assert ref.end_reason == "client_closed"
        # Garbage: each message answered with its error, the call went on, the oversized message
        # closed the connection (1009) and freed the slot.
        garbage_call, alive = g
        assert sorted(garbage_call.errors()[:5]) == sorted(
            [
                "unknown_event",
                "invalid_json",
                "invalid_audio",
                "binary_message_not_supported",
                "item_delete_invalid_item_id",
            ]
        )
        assert garbage_call.of("error")[0]["error"]["event_id"] == "e1"
        assert alive > 0
        assert garbage_call.ws.close_code == 1009
        assert _wait_until(lambda: garbage_call.sid in server.ended)
        # The flood: its oldest audio dropped with an error; its output no faster than real time
        # (one beat per tick however much input is queued: no burst).
        assert "input_audio_buffer_overflow" in f.errors()
        times = f.delta_times()
        assert len(times) >= 8
        assert len(times) <= (times[-1] - times[0]) / 0.08 + 3
        # The vanished client's slot was freed at once; the stalled reader's after its timeout.
        call, freed_s = v
        assert freed_s < 2.0
        assert server.ended[call.sid].startswith("client vanished")
        sid, stalled_s = r
        assert server.ended.get(sid, "").startswith("client stalled"), server.ended.get(sid)
        assert stalled_s < 10.0
        # The silent client ended at the idle timeout, with the event that says so.
        assert "idle_timeout" in i.errors(), (i.types(), server.ended.get(i.sid))
        assert i.of("voicechat.session.ended")[0]["reason"] == "idle_timeout"
        assert server.ended[i.sid].startswith("no audio for")
        # The call that ran into its cap ended with the Realtime API's code, after CAP frames.
        assert "session_expired" in cap.errors()
        ended = cap.of("voicechat.session.ended")[0]
        assert (ended["reason"], ended["frames"]) == ("context_cap", CAP)
        assert cap.ws.close_code == 1000
        assert _wait_until(lambda: len(server.slots) == 0)
        m = live.metrics()
        assert m['voicechat_net_errors_total{"code": "input_audio_buffer_overflow"}'] >= 1
        assert m["voicechat_input_dropped_samples_total"] > 0
        # the calls' beats ran, each in the latency histogram
        inf = m['voicechat_beat_latency_histogram_seconds_bucket{"le": "+Inf"}']
        assert inf == m["voicechat_beat_latency_seconds_count"] > 0
        assert "voicechat_input_skipped_samples_total" in m

    def test_load_client_fills_the_server_and_n_plus_one_is_refused(self, live, tmp_path):
        rows = tmp_path / "load.jsonl"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "voicechat_jax.cli.load",
                f"--url={live.url}",
                f"--clients={SLOTS}",
                "--seconds=2.5",
                f"--rows={rows}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(line) for line in rows.read_text().splitlines()]
        clients, summary = lines[:-1], lines[-1]
        assert len(clients) == SLOTS + 1
        assert all(c["admitted"] for c in clients[:SLOTS])
        assert all(c["frames_received"] >= 20 for c in clients[:SLOTS])
        assert all(c["frame_gaps"] == 0 for c in clients[:SLOTS])
        probe = clients[SLOTS]
        assert (probe["admitted"], probe["refused"], probe["close_code"]) == (
            False,
            "server_at_capacity",
            1013,
        )
        assert summary["admitted"] == SLOTS
        assert summary["probe_refused"] == "server_at_capacity"
        assert summary["server_sessions_refused"] >= 1
        assert "client N+1: server_at_capacity" in proc.stdout

    def test_browser_page_streams_a_call(self, live, tmp_path):
        shared.chromium()  # skips where it is not installed
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = shared.launch_chromium(pw, f"--use-file-for-fake-audio-capture={ASSET}")
            try:
                page = browser.new_page()
                page.goto(live.url + "/")
                page.click("#start")
                page.wait_for_function(
                    "window.voicechat.state === 'connected' && window.voicechat.deltas >= 30",
                    timeout=20000,
                )
                page.wait_for_timeout(500)  # the page renders every 250 ms
                stats = page.evaluate("window.voicechat.snapshot()")
                status = page.inner_text("#status")
                latency = page.inner_text("#lat-last")
                page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
                page.click("#stop")
                page.wait_for_function("window.voicechat.state === 'closed'", timeout=10000)
                ended = page.evaluate("window.voicechat.snapshot()")
            finally:
                browser.close()
        assert (tmp_path / "page.png").stat().st_size > 10_000
        assert status.startswith("connected: ")
        assert float(latency) > 0
        assert 70 <= stats["meanIntervalMs"] <= 95, stats
        assert stats["sent"] >= 25  # the microphone's 80 ms frames went out
        assert stats["beats"] >= 12
        assert stats["events"]["session.created"] == 1
        assert stats["events"]["session.updated"] == 1
        assert stats["audioSamples"] >= 25 * 1900
        assert stats["errors"] == []
        assert stats["agentText"]  # the text channel (ids: the tiny model has no tokenizer)
        assert ended["endReason"] == "client_closed"
        # The page's audio reached the model: its input underran only while it was starting up.
        sid = stats["sessionId"]
        per_session = live.server.metrics.summary()["per_session"][sid]
        assert per_session["underruns"] <= 0.3 * per_session["beats"], per_session


def test_max_live_refuses_the_second_caller_with_a_slot_still_empty(engine):
    """An admission threshold of 1 on 8 slots: ``/capacity`` counts free slots below it, and a
    second caller is refused at capacity (no queue) while 7 slots are empty."""
    policy = AdmissionControl(Lockstep(), max_live=1)
    with serving(engine, clock="realtime", keep_outputs=False, scheduler=policy) as s:
        s.begin()
        assert _wait_until(lambda: s.front.readiness()[0], 30)
        assert json.loads(s.get("/capacity")[1])["free"] == 1

        async def calls():
            async with Caller(s.ws_url) as a:
                assert a.first["type"] == "session.created"
                capacity = json.loads(s.get("/capacity")[1])
                async with Caller(s.ws_url) as b:
                    await asyncio.wait_for(b.closed.wait(), 5)
                return capacity, b

        capacity, b = asyncio.run(calls())
    assert capacity == {
        "slots": SLOTS,
        "max_live": 1,
        "free": 0,
        "live": 1,
        "draining": False,
        "ready": True,
        "reason": "ready",
    }
    assert b.first["type"] == "error"
    assert b.first["error"]["code"] == "server_at_capacity"
    assert "limit 1" in b.first["error"]["message"]
    assert b.ws.close_code == 1013
    assert s.server.slots.refused == 1


def test_a_queued_caller_is_admitted_when_the_live_one_leaves(engine):
    """An admission threshold of 1 with a 60-beat queue: a second caller hears nothing while it
    waits, and is admitted at the beat after the first one hangs up (no refusal)."""
    policy = AdmissionControl(Lockstep(), max_live=1, queue_beats=60)
    with serving(engine, clock="realtime", keep_outputs=False, scheduler=policy) as s:
        s.begin()
        assert _wait_until(lambda: s.front.readiness()[0], 30)

        async def calls():
            a = await Caller(s.ws_url).__aenter__()
            b = Caller(s.ws_url)
            entered = asyncio.create_task(b.__aenter__())
            await asyncio.sleep(0.5)  # a few beats: b waits in the queue, under a's idle timeout
            waiting = (entered.done(), policy.queued, a.first["type"])
            await a.__aexit__(None, None, None)
            await asyncio.wait_for(entered, 5)
            await b.__aexit__(None, None, None)
            return waiting, b.first

        waiting, first = asyncio.run(calls())
    assert waiting == (False, 1, "session.created")
    assert first["type"] == "session.created"
    assert policy.waited_beats >= 2
    assert s.server.slots.refused == 0


def test_a_call_cut_off_by_the_fronts_stop_still_hears_the_shutdown(engine):
    """The front stops while the server still serves a call (its grace runs out before the
    server's end reaches the call: a loaded host): the client still gets the shutdown's error
    and end, and a 1001 close, not a bare close."""
    with serving(engine, clock="realtime", keep_outputs=False) as s:
        s.begin()
        assert _wait_until(lambda: s.front.readiness()[0], 30)

        async def call():
            async with Caller(s.ws_url) as c:
                talking = asyncio.create_task(c.audio(100))
                await c.wait("response.output_audio.delta", timeout=10)
                await asyncio.to_thread(s.front.stop, 0.1)
                await asyncio.wait_for(c.closed.wait(), 5)
                talking.cancel()
                await asyncio.gather(talking, return_exceptions=True)
                return c

        c = asyncio.run(call())
        # The front released the slot as shut down, and the server, still running, freed it.
        assert _wait_until(lambda: len(s.server.slots) == 0, 5)
    assert s.server.ended[c.sid] == "the network front stopped"
    why = f"close {c.ws.close_code}, events {c.types()}"
    assert c.errors() == ["server_shutting_down"], why
    assert c.of("voicechat.session.ended")[0]["reason"] == "shutdown", why
    assert c.ws.close_code == 1001, why


def test_offline_output_unchanged_by_faulty_neighbours(engine):
    """On the offline clock a scripted call's output is exactly what it is alone, while network
    calls beside it send garbage, flood, and vanish."""
    n_ticks = 40  # 80 frames: under the context cap
    plan = [SessionPlan(id="ref", audio=SPEECH[: n_ticks * 2560], source="file")]

    with serving(engine, clock="offline", plans=plan, n_ticks=n_ticks, vanish_beats=None) as s:
        s.begin()
        s._thread.join(120)
    alone = s.server.logs["ref"].arrays()

    async def neighbours(url):
        async def garbage(c):
            for k in range(30):
                await c.send("{oops" if k % 2 else {"type": "what"})
                await c.audio(2, paced=False)

        async def flood(c):
            await c.audio(60, paced=False)

        async def vanish(c):
            await c.audio(3, paced=False)
            c.ws.transport.abort()

        async def call(act):
            # The run may end first: a call closed under it is not the test's failure.
            with contextlib.suppress(websockets.ConnectionClosed):
                async with Caller(url) as c:
                    await act(c)
                    return c.first["type"]
            return "session.created"

        return await asyncio.gather(call(garbage), call(flood), call(vanish))

    with serving(engine, clock="offline", plans=plan, n_ticks=n_ticks, vanish_beats=None) as s:
        # The network calls connect first and are admitted with the scripted one, at tick 0.
        results = {}
        t = threading.Thread(target=lambda: results.update(r=asyncio.run(neighbours(s.ws_url))))
        t.start()
        assert _wait_until(lambda: s.server.hub.waiting() == 3, 10)
        s.begin()
        s._thread.join(120)
        t.join(30)
        admitted = s.server.metrics.summary()["events"]["admitted"]
    together = s.server.logs["ref"].arrays()
    assert admitted == 4
    assert results["r"] == ["session.created"] * 3
    for key in ("text", "function", "codes", "wav", "transcript"):
        np.testing.assert_array_equal(together[key], alone[key], err_msg=key)
    assert alone["text"].shape == (2 * n_ticks,)


def test_serve_listen_drains_on_sigterm(tmp_path):
    """``voicechat-serve --listen``: live calls roll over at the cap; SIGTERM ends each with its
    events and the process exits 0 within the drain bound."""
    out = tmp_path / "out"
    log = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    # the default loop, as a user's server runs: live calls on the resident loop
    cmd = [
        sys.executable, "-m", "voicechat_jax.cli.serve", "--listen=127.0.0.1:0", "--slots=2",
        "--context_frames=24", "--at_cap=rollover", f"--output_dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=log[0], stderr=log[1], text=True, env=env)
    try:
        listen = out / "listen.json"
        assert _wait_until(lambda: listen.exists() or proc.poll() is not None, 300), "no listen"
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        url = json.loads(listen.read_text())["url"]

        def ready() -> bool:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        assert _wait_until(ready, 300)
        ws_url = url.replace("http", "ws", 1) + "/v1/realtime?voicechat=1"

        async def calls():
            async with Caller(ws_url) as a, Caller(ws_url) as b:
                talking = [asyncio.create_task(c.audio(150)) for c in (a, b)]
                await a.wait("voicechat.session.rolled_over", timeout=15)
                t = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(asyncio.gather(a.closed.wait(), b.closed.wait()), 10)
                for task in talking:
                    task.cancel()
                await asyncio.gather(*talking, return_exceptions=True)
                return a, b, time.monotonic() - t

        a, b, closed_s = asyncio.run(calls())
        rc = proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "the resident loop compiled and warmed" in stderr
    assert closed_s < 5.0
    for c in (a, b):
        why = f"{c.sid}: close {c.ws.close_code}, events {c.types()}\n{stderr[-3000:]}"
        assert "server_shutting_down" in c.errors(), why
        assert c.of("voicechat.session.ended")[0]["reason"] == "shutdown", why
        assert c.of("response.done")
        assert c.ws.close_code == 1001
    rolled = a.of("voicechat.session.rolled_over")[0]
    assert rolled["reason"] == "cap"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ended = {r["session"]: r["reason"] for r in rows if r.get("event") == "ended"}
    assert ended == {a.sid: "shutdown", b.sid: "shutdown"}
    assert rows[-1]["type"] == "summary"
    assert "served live calls at" in (tmp_path / "stdout.txt").read_text()
