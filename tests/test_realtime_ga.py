"""The OpenAI Realtime API as today's clients speak it (issue 31): the official ``openai`` SDK's GA
and beta realtime clients against the in-process server, every event they receive strictly its
SDK type; access (API key, origins) and the ``realtime`` subprotocol; and, without a network, the
turns as responses and each conversation event's acknowledgement.

The server is ``tests/test_net.py``'s (the same tiny model and serving config, so its compiled
programs come from the run's compilation cache); the tiny model's text channel is words nearly
every frame, so that a call is in an agent turn from its first frame.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import aiohttp
import openai
import pytest
import websockets
from openai.types.beta.realtime import realtime_server_event as beta_events
from openai.types.realtime import realtime_server_event as ga_events
from pydantic import BaseModel, TypeAdapter

from tests import shared
from tests.test_net import NET, SPEECH_24K, _wait_until, engine, serving  # noqa: F401
from tests.test_net_protocol import _beat as protocol_beat
from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID
from voicechat_jax.serving.net import NetConfig, NetFront, auth
from voicechat_jax.serving.net import protocol as p
from voicechat_jax.serving.writer import StreamBeat, StreamEnd

GA = TypeAdapter(ga_events.RealtimeServerEvent)
BETA = TypeAdapter(beta_events.RealtimeServerEvent)
KEY = "test-key-31"
ALLOWED = "https://app.example"


def strict(adapter: TypeAdapter, event: dict | bytes | str) -> BaseModel:
    """The event as its SDK type, validated strictly (every required field, every literal)."""
    if isinstance(event, dict):
        return adapter.validate_python(event, strict=True)
    return adapter.validate_json(event, strict=True)


@pytest.fixture(scope="module")
def live(engine, tmp_path_factory):  # noqa: F811
    """The real-time server with two fronts: an open one and one behind a key and an origin."""
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text(KEY + "\n")
    with serving(engine, clock="realtime", keep_outputs=False) as s:
        keyed = NetFront(
            s.server,
            NetConfig(port=0, api_key_file=str(key_file), allowed_origins=(ALLOWED,), **NET),
        )
        keyed.start()
        s.begin()
        assert _wait_until(lambda: s.front.readiness()[0], 60)
        try:
            yield s, keyed
        finally:
            keyed.stop()


def _chunk(i: int) -> str:
    n = 1920  # 80 ms at 24 kHz
    return base64.b64encode(SPEECH_24K[(i * n) % (SPEECH_24K.size - n) :][:n].tobytes()).decode()


async def _paced(send, frames: int) -> None:
    t0 = time.monotonic()
    for i in range(frames):
        await asyncio.sleep(max(0.0, t0 + 0.08 * i - time.monotonic()))
        await send(_chunk(i))


class Received:
    """What an SDK connection received: raw messages and the SDK's parse of each."""

    def __init__(self, conn):
        self.conn = conn
        self.raw: list[dict] = []
        self.parsed: list = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        with_close = (websockets.ConnectionClosed, openai.OpenAIError)
        try:
            while True:
                data = await self.conn.recv_bytes()
                self.raw.append(json.loads(data))
                self.parsed.append(self.conn.parse_event(data))
        except with_close:
            pass

    def of(self, kind: str) -> list:
        return [e for e in self.parsed if getattr(e, "type", None) == kind]

    async def wait(self, kind: str, timeout: float = 5.0, where=lambda e: True) -> object:
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.of(kind) if where(e)]
            if found:
                return found[-1]
            assert time.monotonic() < deadline, f"no {kind}: {[r['type'] for r in self.raw][-20:]}"
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


# ---- the official SDK ---------------------------------------------------------------------------


def test_openai_sdk_ga_client_gets_its_own_types(live):
    """``AsyncOpenAI(base_url=...).realtime.connect``: every event is its GA class (and strictly
    valid), 5 s in gives at least 3.5 s of response.output_audio.delta, and response.cancel,
    conversation.item.truncate and response.create get their answers, no error."""
    s, _ = live

    async def call():
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="voicechat") as conn:
            got = Received(conn)
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": "Be brief.",
                    "audio": {
                        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"}
                    },
                }
            )
            await got.wait("session.updated")
            await _paced(lambda a: conn.input_audio_buffer.append(audio=a), 63)  # 5.04 s
            await asyncio.sleep(0.3)
            active = got.of("response.created")[-1].response.id
            await conn.response.cancel()
            done = await got.wait("response.done", where=lambda e: e.response.id == active)
            item = next(i.id for i in done.response.output if i.type == "message")
            await conn.conversation.item.truncate(item_id=item, content_index=0, audio_end_ms=1000)
            await got.wait("conversation.item.truncated")
            await conn.response.create(response={"metadata": {"asked": "yes"}})
            # Between turns it opens the asked response; if the model began a turn of its own
            # in the moment since the cancel, OpenAI's answer is the active-response error.
            deadline = time.monotonic() + 5.0
            while not (
                [e for e in got.of("response.created") if e.response.metadata == {"asked": "yes"}]
                or got.of("error")
            ):
                assert time.monotonic() < deadline, [r["type"] for r in got.raw][-20:]
                await asyncio.sleep(0.02)
            await got.stop()
            return got, done, item

    got, done, item = asyncio.run(call())
    errors = [r for r in got.raw if r["type"] == "error"]
    raced = [e for e in errors if e["error"]["code"] == "conversation_already_has_active_response"]
    if raced:  # the model's own next turn was open when response.create came: that one's error
        (created,) = [r for r in got.raw if r["type"] == "response.created"][-1:]
        assert created["response"]["id"] != done.response.id
        assert created["response"]["id"] in raced[0]["error"]["message"]
        keep = [i for i, r in enumerate(got.raw) if r is not raced[0]]
        got.raw, got.parsed = [got.raw[i] for i in keep], [got.parsed[i] for i in keep]
    types = [r["type"] for r in got.raw]
    assert "error" not in types, [r for r in got.raw if r["type"] == "error"]
    for raw, parsed in zip(got.raw, got.parsed, strict=True):
        assert type(parsed).__module__.startswith("openai.types.realtime."), raw["type"]
        assert type(strict(GA, raw)) is type(parsed)
    audio = got.of("response.output_audio.delta")
    seconds = sum(len(base64.b64decode(e.delta)) for e in audio) / 2 / 24000
    assert seconds >= 3.5, (seconds, types[:30])
    assert not [t for t in types if t.startswith(("response.audio", "voicechat."))]
    # The session as applied, and what was not.
    updated = got.of("session.updated")[0]
    assert updated.session.audio.output.voice == "Aria"  # the model's one voice
    assert updated.session.audio.input.turn_detection.type == "semantic_vad"
    not_applied = got.raw[types.index("session.updated")]["voicechat"]["not_applied"]
    assert {e["param"] for e in not_applied} == {
        "session.instructions",
        "session.audio.output.voice",
    }
    # The cancelled turn: its response ended cancelled, its message incomplete, no more audio.
    assert (done.response.status, done.response.status_details.reason) == (
        "cancelled",
        "client_cancelled",
    )
    assert {i.status for i in done.response.output} == {"incomplete"}
    cancelled_at = max(
        i
        for i, r in enumerate(got.raw)
        if r["type"] == "response.done" and r["response"]["id"] == done.response.id
    )
    after = [r for r in got.raw[cancelled_at:] if r.get("response_id") == done.response.id]
    assert after == []
    truncated = got.of("conversation.item.truncated")[0]
    sent_ms = 80 * sum(e.item_id == item for e in audio)
    assert (truncated.item_id, truncated.audio_end_ms) == (item, min(1000, sent_ms))
    if not raced:
        created = got.of("response.created")[-1]
        assert created.response.metadata == {"asked": "yes"}
    assert "rate_limits.updated" in types[cancelled_at:]


def test_openai_sdk_beta_client_with_the_beta_header(live):
    """``client.beta.realtime.connect`` (``OpenAI-Beta: realtime=v1``): beta names and shapes."""
    s, _ = live

    async def call():
        # The beta client connects by wss:// unless told the WebSocket base URL.
        client = openai.AsyncOpenAI(
            base_url=s.url + "/v1",
            websocket_base_url=s.url.replace("http", "ws", 1) + "/v1",
            api_key="unused",
            max_retries=0,
        )
        async with client.beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
            got = Received(conn)
            await conn.session.update(session={"input_audio_format": "pcm16", "voice": "alloy"})
            await _paced(lambda a: conn.input_audio_buffer.append(audio=a), 15)
            await got.wait("response.audio.delta")
            await got.stop()
            return got

    got = asyncio.run(call())
    types = [r["type"] for r in got.raw]
    assert "error" not in types
    for raw, parsed in zip(got.raw, got.parsed, strict=True):
        assert type(parsed).__module__.startswith("openai.types.beta.realtime."), raw["type"]
        assert type(strict(BETA, raw)) is type(parsed)
    assert not [t for t in types if t.startswith("response.output_audio")]
    created = got.of("session.created")[0]
    assert (created.session.input_audio_format, created.session.voice) == ("pcm16", "Aria")
    assert got.raw[0]["session"]["voicechat"]["realtime_api"] == "beta"
    updated = got.raw[types.index("session.updated")]
    assert [e["param"] for e in updated["voicechat"]["not_applied"]] == ["session.voice"]


# ---- access and the subprotocol -----------------------------------------------------------------


def _http_status(url: str, headers: dict | None = None) -> tuple[int, dict]:
    async def get():
        async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as r:
            return r.status, await r.json()

    return asyncio.run(get())


def test_api_key_and_origins(live):
    """With a key: /capacity and calls refused without it (401; a browser: 1008 and an error
    saying why), admitted with it (header, SDK, or a browser's subprotocol); with an origin list:
    another site's browser refused (403), the listed one and the server's own page admitted."""
    _, keyed = live
    ws_url = keyed.url.replace("http", "ws", 1) + "/v1/realtime"
    host = keyed.url.removeprefix("http://")

    status, body = _http_status(keyed.url + "/capacity")
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    assert _http_status(keyed.url + "/capacity", {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert _http_status(keyed.url + "/healthz")[0] == 200  # health stays open to probes

    async def first(headers=None, protocols=None, origin=None):
        """(first event, close code or None while open, selected subprotocol)."""
        async with websockets.connect(
            ws_url,
            additional_headers=headers,
            subprotocols=protocols,
            origin=origin,
            proxy=None,
            open_timeout=10,
        ) as ws:
            event = json.loads(await ws.recv())
            if event["type"] == "error":
                await asyncio.wait_for(ws.wait_closed(), 5)
            return event, ws.close_code, ws.subprotocol

    async def refused_status(**kw) -> int:
        with pytest.raises(websockets.InvalidStatus) as e:
            await first(**kw)
        return e.value.response.status_code

    async def sdk():
        client = openai.AsyncOpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
        async with client.realtime.connect(model="voicechat") as conn:
            return (await conn.recv()).type

    async def scenario():
        return {
            "no key": await refused_status(),
            "wrong key": await refused_status(headers={"Authorization": "Bearer nope"}),
            "key": await first(headers={"Authorization": f"Bearer {KEY}"}),
            "sdk": await sdk(),
            "browser": await first(
                protocols=["realtime", auth.KEY_SUBPROTOCOL + KEY], origin=f"http://{host}"
            ),
            "browser, wrong key": await first(
                protocols=["realtime", auth.KEY_SUBPROTOCOL + "nope"], origin=f"http://{host}"
            ),
            "listed site": await first(
                protocols=["realtime", auth.KEY_SUBPROTOCOL + KEY], origin=ALLOWED
            ),
            "other site": await refused_status(
                protocols=["realtime", auth.KEY_SUBPROTOCOL + KEY], origin="https://evil.example"
            ),
        }

    r = asyncio.run(scenario())
    assert (r["no key"], r["wrong key"], r["other site"]) == (401, 401, 403)
    assert r["key"][0]["type"] == "session.created"
    assert r["sdk"] == "session.created"
    assert (r["browser"][0]["type"], r["browser"][2]) == ("session.created", "realtime")
    wrong, close, _ = r["browser, wrong key"]
    assert (wrong["error"]["code"], close) == ("invalid_api_key", 1008)
    strict(GA, wrong)
    assert r["listed site"][0]["type"] == "session.created"
    assert keyed.refusals["invalid_api_key"] == 4  # /capacity once, the calls three times


def test_subprotocol_is_selected(live):
    """aiohttp with ``protocols=("realtime",)``: selected; offering the browser SDK's beta
    subprotocol too gets the beta session."""
    s, _ = live

    async def connect(protocols):
        url = s.url + "/v1/realtime"
        async with aiohttp.ClientSession() as http, http.ws_connect(url, protocols=protocols) as ws:
            return ws.protocol, await ws.receive_json(timeout=10)

    async def both():
        return await connect(("realtime",)), await connect(("realtime", auth.BETA_SUBPROTOCOL))

    (ga_protocol, ga), (beta_protocol, beta) = asyncio.run(both())
    assert (ga_protocol, beta_protocol) == ("realtime", "realtime")
    assert ga["type"] == beta["type"] == "session.created"
    assert ga["session"]["type"] == "realtime"
    assert beta["session"]["input_audio_format"] == "pcm16"
    strict(GA, ga)
    strict(BETA, beta)


def test_browser_page_keyed_calls_one_after_another(live, tmp_path):
    """The page as a person uses it, against the keyed front: the key typed in (sent as a
    subprotocol), a call, hang-up, a second call without a reload; the transcript follows the
    newest words; the console stays clean (no favicon 404, no error)."""
    shared.chromium()  # skips where it is not installed
    from playwright.sync_api import sync_playwright

    _, keyed = live
    console: list[str] = []
    with sync_playwright() as pw:
        browser = shared.launch_chromium(pw)
        try:
            page = browser.new_page()
            page.on("console", lambda m: m.type == "error" and console.append(m.text))
            page.on("pageerror", lambda e: console.append(str(e)))
            page.goto(keyed.url + "/")
            page.fill("#key", KEY)
            calls = []
            for _ in range(2):
                page.click("#start")
                page.wait_for_function(
                    "window.voicechat.state === 'connected' && window.voicechat.deltas >= 40",
                    timeout=20000,
                )
                # More text than the panel holds (the tiny model's ids fill it slowly).
                page.evaluate("window.voicechat.agentText += 'words\\n'.repeat(60)")
                page.wait_for_timeout(300)  # the page renders every 250 ms
                scroll = page.evaluate(
                    "(() => { const b = document.getElementById('agent');"
                    " return [b.scrollTop + b.clientHeight, b.scrollHeight, b.clientHeight]; })()"
                )
                page.click("#stop")
                page.wait_for_function("window.voicechat.state === 'closed'", timeout=10000)
                calls.append((page.evaluate("window.voicechat.snapshot()"), scroll))
            start_label = page.inner_text("#start")
        finally:
            browser.close()
    assert console == []
    (first, _), (second, (seen, height, shown)) = calls
    assert (first["calls"], second["calls"]) == (1, 2)
    assert first["sessionId"] != second["sessionId"]
    for stats, _ in calls:
        assert stats["endReason"] == "client_closed"
        assert stats["errors"] == []
        assert stats["events"]["session.created"] == 1  # the second call's counts are its own
    assert height > 2 * shown  # the text overflows the panel
    assert seen >= height - 24  # which is scrolled to the newest words
    assert start_label == "Start another call"


def test_public_bind_without_a_key_warns(live, monkeypatch, caplog):
    s, _ = live
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)
    front = NetFront(s.server, NetConfig(host="0.0.0.0", port=0, **NET))
    with caplog.at_level(logging.WARNING):
        front.start()
        front.stop()
    warnings = [r.getMessage() for r in caplog.records if "no API key" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "0.0.0.0" in warnings[0]


def test_auth_rules(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text(" k1 \n")
    monkeypatch.setenv(auth.API_KEY_ENV, "from-env")
    assert auth.read_api_key(str(key_file)) == "k1"
    assert auth.read_api_key(None) == "from-env"
    monkeypatch.delenv(auth.API_KEY_ENV)
    assert auth.read_api_key(None) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        auth.read_api_key(str(tmp_path / "empty"))
    assert auth.authorized({}, None)
    assert auth.authorized({"Authorization": "Bearer k1"}, "k1")
    assert auth.authorized({"Authorization": "bearer k1"}, "k1")
    assert not auth.authorized({"Authorization": "Bearer k2"}, "k1")
    assert not auth.authorized({"Authorization": "Basic k1"}, "k1")
    assert auth.authorized({"Sec-WebSocket-Protocol": "realtime, openai-insecure-api-key.k1"}, "k1")
    assert not auth.authorized({"Sec-WebSocket-Protocol": "realtime"}, "k1")
    assert auth.origin_allowed({"Origin": "https://x.example"}, "h:1", ())
    assert auth.origin_allowed({}, "h:1", ("https://a.example",))
    assert auth.origin_allowed({"Origin": "http://h:1"}, "h:1", ("https://a.example",))
    assert auth.origin_allowed({"Origin": "https://a.example"}, "h:1", ("https://a.example/",))
    assert not auth.origin_allowed({"Origin": "https://x.example"}, "h:1", ("https://a.example",))
    assert auth.wants_beta({"OpenAI-Beta": "realtime=v1"}, {})
    assert auth.wants_beta({}, {"beta": ""})
    assert not auth.wants_beta({}, {"beta": "0"})
    assert auth.wants_beta({"Sec-WebSocket-Protocol": "realtime, openai-beta.realtime-v1"}, {})
    assert not auth.wants_beta({"OpenAI-Beta": "assistants=v2"}, {})
    assert [auth.is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::")] == [
        True,
        True,
        True,
        False,
        False,
    ]


# ---- turns as responses, and the conversation events (no network) -------------------------------


def _beat(tick: int, text, function=None, transcript=None) -> StreamBeat:
    """Beat ``tick`` of two frames (``test_net_protocol``'s beats)."""
    return protocol_beat(tick, 2 * tick, text, function, transcript)


class Call:
    """``CallEvents`` driven beat by beat, with the client's events in between."""

    def __init__(self, *, beta: bool = False, extensions: bool = False):
        self.ev = p.CallEvents(
            "s",
            text_decode=lambda ids: " ".join(f"w{i}" for i in ids),
            asr_decode=lambda ids: "a" * len(ids),
            beta=beta,
            context_frames=96,
        )
        self.cfg = p.SessionConfig(extensions=extensions)
        self.tick = 0
        self.out: list[dict] = [self.ev.session_created(self.cfg, {})]

    def beats(self, *texts, **kw) -> list[dict]:
        new = []
        for text in texts:
            for frame in self.ev.beat(_beat(self.tick, text, **kw), [b"\0\0" * 4] * 2, self.cfg):
                new += frame
            self.tick += 1
        self.out += new
        return new

    def send(self, kind: str, **fields) -> list[dict]:
        new = self.ev.control({"type": kind, **fields}, self.cfg)
        self.out += new
        return new

    def types(self, events=None) -> list[str]:
        return [e["type"] for e in (self.out if events is None else events)]


WORDS = [100, 101]
QUIET = [PAD_ID, PAD_ID]


def test_each_turn_is_one_response_with_its_item_and_part():
    c = Call()
    c.beats([BOS_ID, 100], [101, EOS_ID], QUIET, QUIET, [102, 103], [EOS_ID, PAD_ID], QUIET, QUIET)
    created = [e for e in c.out if e["type"] == "response.created"]
    done = [e for e in c.out if e["type"] == "response.done"]
    assert len(created) == len(done) == 2
    for start, end in zip(created, done, strict=True):
        rid = start["response"]["id"]
        assert (end["response"]["id"], end["response"]["status"]) == (rid, "completed")
        inside = c.out[c.out.index(start) : c.out.index(end) + 1]
        assert c.types(inside)[1:4] == [
            "response.output_item.added",
            "conversation.item.added",
            "response.content_part.added",
        ]
        assert c.types(inside)[-7:] == [
            "response.output_audio.delta",
            "response.output_audio.done",
            "response.output_audio_transcript.done",
            "response.content_part.done",
            "response.output_item.done",
            "conversation.item.done",
            "response.done",
        ]
        assert {e["response_id"] for e in inside if "response_id" in e} == {rid}
    # Audio only inside a response: from its BOS to two frames past its EOS (the speech lags).
    audio = [e for e in c.out if e["type"] == "response.output_audio.delta"]
    assert len(audio) == 6 + 5
    assert done[0]["response"]["output"][0]["content"][0]["transcript"] == "w100 w101"
    limits = next(e for e in c.out if e["type"] == "rate_limits.updated")["rate_limits"][0]
    assert (limits["name"], limits["limit"]) == ("tokens", 96)
    assert limits["remaining"] == 96 - 6  # the response ended at frame 5
    for event in c.out:
        strict(GA, event)


def test_response_create_between_turns_and_mid_turn():
    c = Call()
    [created] = c.send("response.create", response={"instructions": "hi", "metadata": {"k": "v"}})
    assert created["response"]["metadata"] == {"k": "v"}
    assert [x["param"] for x in created["voicechat"]["not_applied"]] == ["response.instructions"]
    new = c.beats(QUIET, [BOS_ID, 100])  # the model's next turn is its output
    assert "response.created" not in c.types(new)
    added = next(e for e in new if e["type"] == "response.output_item.added")
    assert added["response_id"] == created["response"]["id"]
    with pytest.raises(p.ProtocolError) as e:
        c.send("response.create")
    assert e.value.code == "conversation_already_has_active_response"
    # Between turns, a request the model does not answer within the wait ends with nothing.
    c.beats([EOS_ID, PAD_ID], QUIET, QUIET)
    [waiting] = c.send("response.create")
    new = c.beats(*[QUIET] * (p.Limits().request_wait_frames // 2))
    done = next(e for e in new if e["type"] == "response.done")
    assert done["response"]["id"] == waiting["response"]["id"]
    assert (done["response"]["status"], done["response"]["output"]) == ("incomplete", [])
    for event in c.out:
        strict(GA, event)


def test_response_cancel_ends_the_turns_audio():
    c = Call(extensions=True)
    c.beats([BOS_ID, 100], WORDS)
    [item] = [e["item"]["id"] for e in c.out if e["type"] == "response.output_item.added"]
    answer = c.send("response.cancel")
    assert c.types(answer)[-2:] == ["response.done", "rate_limits.updated"]
    done = answer[-2]["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "client_cancelled")
    assert done["output"][0]["status"] == "incomplete"
    # The rest of the turn is not sent, not even as the stream's audio; the next turn is new.
    rest = c.beats(WORDS, WORDS)
    assert [t for t in c.types(rest) if "audio" in t or t.startswith("response.")] == []
    new = c.beats([BOS_ID, 102])
    assert "response.created" in c.types(new)
    with pytest.raises(p.ProtocolError) as e:
        c.send("response.cancel", response_id="resp_other")
    assert e.value.code == "response_cancel_not_active"
    # output_audio_buffer.clear: the same cut, acknowledged.
    cleared = c.send("output_audio_buffer.clear")
    assert c.types(cleared)[-3:] == [
        "response.done",
        "rate_limits.updated",
        "output_audio_buffer.cleared",
    ]
    # Truncate: at most the audio sent (4 frames of the first turn).
    [truncated] = c.send(
        "conversation.item.truncate", item_id=item, content_index=0, audio_end_ms=9000
    )
    assert truncated["audio_end_ms"] == 4 * p.FRAME_MS
    for event in c.out:
        if not event["type"].startswith("voicechat."):
            strict(GA, event)


def test_conversation_events_are_acknowledged():
    c = Call()
    c.beats(QUIET, transcript=[(1,), (2,)])
    c.beats(*[QUIET] * 4)  # the caller's turn ends: committed as a user item
    user = next(e for e in c.out if e["type"] == "input_audio_buffer.committed")["item_id"]
    [committed] = c.send("input_audio_buffer.commit")
    assert committed["voicechat"]["note"].startswith("nothing to commit")
    assert committed["previous_item_id"] == user
    [cleared] = c.send("input_audio_buffer.clear")
    assert cleared["type"] == "input_audio_buffer.cleared"
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    added, item_done = c.send("conversation.item.create", item=item)
    assert (added["type"], item_done["type"]) == (
        "conversation.item.added",
        "conversation.item.done",
    )
    assert added["voicechat"]["not_applied"][0]["param"] == "item"
    new_id = added["item"]["id"]
    [retrieved] = c.send("conversation.item.retrieve", item_id=new_id)
    assert retrieved["item"]["content"] == item["content"]
    assert (
        c.send("conversation.item.delete", item_id=new_id)[0]["type"] == "conversation.item.deleted"
    )
    for kind, code in [
        ("conversation.item.delete", "item_delete_invalid_item_id"),
        ("conversation.item.retrieve", "item_retrieve_invalid_item_id"),
        ("conversation.item.truncate", "item_truncate_invalid_item_id"),
    ]:
        with pytest.raises(p.ProtocolError) as e:
            c.send(kind, item_id=new_id, audio_end_ms=0)
        assert e.value.code == code
    with pytest.raises(p.ProtocolError) as e:
        c.send("conversation.item.truncate", item_id=user, audio_end_ms=0)  # not the model's
    assert e.value.code == "item_truncate_invalid_item_id"
    with pytest.raises(p.ProtocolError) as e:
        c.send("conversation.item.create", item={"type": "bogus"})
    assert e.value.code == "invalid_value"
    for event in c.out:
        strict(GA, event)


def test_beta_names_and_shapes():
    c = Call(beta=True)
    c.beats([BOS_ID, 100], [101, EOS_ID], QUIET, QUIET, transcript=[(1,), ()])
    c.beats(*[QUIET] * 3)
    c.send("conversation.item.create", item={"type": "message", "role": "user", "content": []})
    types = set(c.types())
    assert {
        "response.audio.delta",
        "response.audio_transcript.done",
        "conversation.item.created",
    } <= types
    assert not {t for t in types if "output_audio" in t or t == "conversation.item.done"}
    message = next(e for e in c.out if e["type"] == "response.output_item.done")["item"]
    assert message["content"][0]["type"] == "audio"
    for event in c.out:
        strict(BETA, event)


def test_session_update_lists_what_it_cannot_honour():
    cfg = p.SessionConfig()
    same, skipped = cfg.apply(
        {
            "type": "realtime",
            "output_modalities": ["audio"],
            "audio": {
                "input": {"turn_detection": dict(p.TURN_DETECTION), "transcription": None},
                "output": {"voice": "Aria", "format": {"type": "audio/pcm", "rate": 16000}},
            },
            "tool_choice": "auto",
            "tools": [],
        }
    )
    assert same.output_rate == 16000
    assert [x["param"] for x in skipped] == ["session.audio.input.transcription"]
    _, skipped = cfg.apply(
        {
            "modalities": ["text"],
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 200},
            "temperature": 0.7,
            "tools": [{"type": "function", "name": "f"}],
            "frobnicate": 1,
        }
    )
    assert [x["param"] for x in skipped] == [
        "session.modalities",
        "session.turn_detection",
        "session.temperature",
        "session.tools",
        "session.frobnicate",
    ]
    with pytest.raises(p.ProtocolError, match="only audio/pcm"):
        cfg.apply({"audio": {"input": {"format": {"type": "audio/pcmu"}}}})


def test_end_cuts_the_active_response():
    c = Call()
    c.beats([BOS_ID, 100])
    events, close = c.ev.end(StreamEnd("shutdown", "drain"), 2, c.cfg)
    done = next(e for e in events if e["type"] == "response.done")["response"]
    assert (done["status"], close) == ("incomplete", 1001)
    assert c.types(events).index("response.done") < c.types(events).index("error")
    for event in events:
        strict(GA, event)
