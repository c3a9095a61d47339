"""A load client: N concurrent live calls over real WebSockets, each on its own clock.

Each client (``run_client``) connects to ``/v1/realtime`` (the ``realtime`` subprotocol, the
API key when one is given), sends 80 ms frames of PCM16 paced by
its own monotonic clock (frame i at ``t0 + i * 80 ms``; a client that wakes up late skips to the
frame now due and counts the skipped ones: never a catch-up burst), and measures what a caller
would hear: the arrival of each 80 ms audio frame (the jitter of the intervals between them), and
the underruns of a playback buffer that starts after ``buffer_ms`` of audio (``playback``), plus
the server's own per-beat figures (``voicechat.beat``: beat latency, misses, input underruns).
``run_load`` starts N clients, then one more once the N are in, which a full server must refuse.

The results are ``ClientStats`` rows and a summary (``summarize``), as JSON and as a table
(``format_table``). The library is ``voicechat-load``'s (``cli/load.py``) and the tests'.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import json
import time
import urllib.request

import numpy as np
import websockets
from prometheus_client.parser import text_string_to_metric_families

from voicechat_jax.serving.net.auth import SUBPROTOCOL
from voicechat_jax.serving.net.protocol import FRAME_MS, ServerEvent

FRAME_S = FRAME_MS / 1000.0
# Every 80 ms frame of the stream: a response's audio, and (the extensions on) the audio between.
AUDIO_EVENTS = frozenset({str(ServerEvent.AUDIO_DELTA), str(ServerEvent.EXT_AUDIO_DELTA)})


@dataclasses.dataclass
class ClientStats:
    """One client's call, as measured on the client."""

    client: int
    admitted: bool = False
    refused: str | None = None  # the error code of a refusal
    close_code: int | None = None
    session_id: str | None = None
    connect_ms: float | None = None  # connect -> session.created (or the refusal)
    frames_sent: int = 0
    send_skipped: int = 0  # frame slots the client's own clock skipped (it woke up late)
    frames_received: int = 0
    samples_received: int = 0
    jitter_ms: dict | None = None  # |interval - 80 ms| between audio frames: p50, p99, max
    underruns: int = 0  # playback buffer empty while playing
    underrun_ms: float = 0.0  # time the playback was starved in all
    beats: int = 0  # voicechat.beat events
    beat_latency_ms: dict | None = None  # the server's beat latency seen by this call
    missed_beats: int = 0
    ticks_skipped: int = 0
    frame_gaps: int = 0  # beats whose first frame did not follow the previous beat's last
    input_underruns: int = 0  # beats whose input the server found incomplete
    errors: dict = dataclasses.field(default_factory=dict)  # error code -> count
    end_reason: str | None = None

    def to_json(self) -> dict:
        return {"type": "client", **dataclasses.asdict(self)}


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    a = np.asarray(values, np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
        "n": int(a.size),
    }


def playback(
    arrivals: list[float], samples: list[int], rate: int, prebuffer_s: float = 0.1
) -> tuple[int, float]:
    """(underruns, seconds starved) of a player fed ``samples[i]`` samples at ``arrivals[i]``
    seconds: it starts once ``prebuffer_s`` of audio is buffered, plays in real time, and on an
    empty buffer stops and buffers ``prebuffer_s`` again. The end of the stream is no underrun."""
    playing = False
    level = 0.0  # seconds buffered while not playing
    empty_at = 0.0  # while playing: when the buffer runs dry
    underruns, starved = 0, 0.0
    for t, n in zip(arrivals, samples, strict=True):
        chunk = n / rate
        if playing and t > empty_at:
            underruns += 1
            starved += t - empty_at
            playing, level = False, 0.0
        if playing:
            empty_at += chunk
            continue
        level += chunk
        if level >= prebuffer_s:
            playing, empty_at = True, t + level
    return underruns, starved


def realtime_url(url: str) -> str:
    """``http://host:port`` or ``ws://host:port[/v1/realtime]`` -> the calls' WebSocket URL."""
    if url.startswith("http"):
        url = "ws" + url[4:]
    if "/v1/realtime" not in url:
        url = url.rstrip("/") + "/v1/realtime"
    return url + ("&" if "?" in url else "?") + "voicechat=1"


async def run_client(
    url: str,
    audio: np.ndarray,
    *,
    client: int,
    seconds: float,
    rate: int = 24000,
    buffer_ms: float = 100.0,
    admitted: asyncio.Event | None = None,
    api_key: str | None = None,
) -> ClientStats:
    """One call for ``seconds``: ``audio`` (int16 [n] at ``rate``, looped) in 80 ms frames."""
    stats = ClientStats(client=client)
    frame = rate * FRAME_MS // 1000
    arrivals: list[float] = []
    sizes: list[int] = []
    latency: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    next_frame: list[int | None] = [None]
    t_connect = time.monotonic()
    async with websockets.connect(
        realtime_url(url),
        max_size=None,
        open_timeout=30,
        compression=None,
        proxy=None,
        subprotocols=[SUBPROTOCOL],
        additional_headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
    ) as ws:
        first = json.loads(await ws.recv())
        stats.connect_ms = 1e3 * (time.monotonic() - t_connect)
        if first["type"] == "error":
            stats.refused = first["error"]["code"]
            try:
                await asyncio.wait_for(ws.wait_closed(), 5.0)
            finally:
                stats.close_code = ws.close_code
            return stats
        stats.admitted = True
        stats.session_id = first["session"]["id"]
        await ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "voicechat": {
                            "events": True,
                            "input_sample_rate": rate,
                            "output_sample_rate": rate,
                        }
                    },
                }
            )
        )
        if admitted is not None:
            admitted.set()

        async def send() -> None:
            t0 = time.monotonic()
            i = 0
            n_frames = round(seconds / FRAME_S)
            while i < n_frames:
                due = t0 + i * FRAME_S
                now = time.monotonic()
                if now < due:
                    await asyncio.sleep(due - now)
                else:
                    late = int((now - due) // FRAME_S)  # whole slots already past: skipped
                    if late:
                        stats.send_skipped += late
                        i += late
                        continue
                j = (i * frame) % max(1, audio.shape[0] - frame)
                pcm = audio[j : j + frame].tobytes()
                payload = base64.b64encode(pcm).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": payload}))
                stats.frames_sent += 1
                i += 1
            await ws.send(json.dumps({"type": "voicechat.session.close"}))

        async def receive() -> None:
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind in AUDIO_EVENTS:
                    arrivals.append(time.monotonic())
                    sizes.append(len(base64.b64decode(event["delta"])) // 2)
                elif kind == "voicechat.beat":
                    stats.beats += 1
                    latency.append(event["latency_ms"])
                    stats.missed_beats += bool(event["missed"])
                    stats.ticks_skipped += event["ticks_skipped"]
                    stats.input_underruns += bool(event["input_underrun"])
                    if next_frame[0] is not None and event["frame"] != next_frame[0]:
                        stats.frame_gaps += 1
                    next_frame[0] = event["frame"] + event["frames"]
                elif kind == "error":
                    errors[event["error"]["code"]] += 1
                elif kind == "voicechat.session.ended":
                    stats.end_reason = event["reason"]

        sender = asyncio.create_task(send())
        receiver = asyncio.create_task(receive())
        try:
            await sender
            await asyncio.wait_for(receiver, timeout=10.0)
        except websockets.ConnectionClosed:
            pass
        finally:
            for task in (sender, receiver):
                task.cancel()
            await asyncio.gather(sender, receiver, return_exceptions=True)
            stats.close_code = ws.close_code
    stats.frames_received = len(arrivals)
    stats.samples_received = sum(sizes)
    intervals = np.diff(np.asarray(arrivals)) * 1e3
    stats.jitter_ms = _stats(list(np.abs(intervals - FRAME_MS)))
    stats.underruns, starved = playback(arrivals, sizes, rate, buffer_ms / 1000.0)
    stats.underrun_ms = 1e3 * starved
    stats.beat_latency_ms = _stats(latency)
    stats.errors = dict(errors)
    return stats


async def run_load(
    url: str,
    audio: np.ndarray,
    *,
    clients: int,
    seconds: float,
    rate: int = 24000,
    buffer_ms: float = 100.0,
    probe_refusal: bool = True,
    stagger_s: float = 0.0,
    api_key: str | None = None,
) -> list[ClientStats]:
    """``clients`` concurrent calls (started ``stagger_s`` apart) and, once they are all in, one
    more (index ``clients``), which a server with ``clients`` slots refuses."""
    admitted = [asyncio.Event() for _ in range(clients)]

    async def one(i: int) -> ClientStats:
        await asyncio.sleep(i * stagger_s)
        return await run_client(
            url,
            audio,
            client=i,
            seconds=seconds,
            rate=rate,
            buffer_ms=buffer_ms,
            admitted=admitted[i],
            api_key=api_key,
        )

    tasks = [asyncio.create_task(one(i)) for i in range(clients)]
    extra = None
    if probe_refusal:
        waits = [asyncio.create_task(e.wait()) for e in admitted]
        await asyncio.wait(waits, timeout=60.0)
        for w in waits:
            w.cancel()
        extra = asyncio.create_task(
            run_client(
                url,
                audio,
                client=clients,
                seconds=1.0,
                rate=rate,
                buffer_ms=buffer_ms,
                api_key=api_key,
            )
        )
    rows = list(await asyncio.gather(*tasks))
    if extra is not None:
        rows.append(await extra)
    return rows


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The server's ``/metrics`` as {sample name with labels: value}."""
    base = url.replace("ws", "http", 1).split("/v1/realtime")[0].split("?")[0].rstrip("/")
    with urllib.request.urlopen(base + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def summarize(rows: list[ClientStats], clients: int, server: dict | None = None) -> dict:
    """The run in one row: the N calls pooled, the N+1 probe, and the server's counters."""
    calls = [r for r in rows if r.client < clients]
    probe = next((r for r in rows if r.client == clients), None)

    def pooled(key: str, stat: str) -> float | None:
        values = [getattr(r, key)[stat] for r in calls if getattr(r, key)]
        if not values:
            return None
        return max(values) if stat in ("max", "p99") else float(np.median(values))

    out = {
        "type": "summary",
        "clients": clients,
        "admitted": sum(r.admitted for r in calls),
        "frames_sent": sum(r.frames_sent for r in calls),
        "send_skipped": sum(r.send_skipped for r in calls),
        "frames_received": sum(r.frames_received for r in calls),
        "jitter_ms_p50": pooled("jitter_ms", "p50"),
        "jitter_ms_p99": pooled("jitter_ms", "p99"),
        "jitter_ms_max": pooled("jitter_ms", "max"),
        "beat_latency_ms_p50": pooled("beat_latency_ms", "p50"),
        "beat_latency_ms_p99": pooled("beat_latency_ms", "p99"),
        "beat_latency_ms_max": pooled("beat_latency_ms", "max"),
        "missed_beats": sum(r.missed_beats for r in calls),
        "ticks_skipped": max((r.ticks_skipped for r in calls), default=0),
        "frame_gaps": sum(r.frame_gaps for r in calls),
        "playback_underruns": sum(r.underruns for r in calls),
        "input_underruns": sum(r.input_underruns for r in calls),
        "errors": dict(sum((collections.Counter(r.errors) for r in calls), collections.Counter())),
        "probe_refused": None if probe is None else probe.refused,
        "probe_close_code": None if probe is None else probe.close_code,
        "probe_ms": None if probe is None else probe.connect_ms,
    }
    if server:
        for key in (
            "voicechat_missed_ticks_total",
            "voicechat_ticks_skipped_total",
            "voicechat_missed_session_beats_total",
            "voicechat_input_underruns_total",
            "voicechat_sessions_refused_total",
        ):
            out["server_" + key.removeprefix("voicechat_").removesuffix("_total")] = server.get(key)
        for q in ("0.5", "0.99"):
            value = server.get(f'voicechat_beat_latency_seconds{{quantile="{q}"}}')
            out[f"server_beat_latency_ms_q{q}"] = None if value is None else 1e3 * value
    return out


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[ClientStats], summary: dict) -> str:
    """One line per client, then the summary."""
    head = (
        f"{'client':>6} {'admitted':>8} {'sent':>6} {'recv':>6} {'jitter p50/p99/max ms':>22} "
        f"{'beat p50/p99/max ms':>20} {'missed':>6} {'underruns':>9} {'in-underruns':>12}  end"
    )
    lines = [head]
    for r in rows:
        j, b = r.jitter_ms or {}, r.beat_latency_ms or {}
        jit = "/".join(_fmt(j.get(k)) for k in ("p50", "p99", "max"))
        lat = "/".join(_fmt(b.get(k)) for k in ("p50", "p99", "max"))
        admitted = "yes" if r.admitted else f"no ({r.refused}, {r.close_code})"
        lines.append(
            f"{r.client:>6} {admitted:>8} {r.frames_sent:>6} {r.frames_received:>6} {jit:>22} "
            f"{lat:>20} {r.missed_beats:>6} {r.underruns:>9} {r.input_underruns:>12}  "
            f"{r.end_reason or '-'}"
        )
    s = summary
    lines.append("")
    lines.append(
        f"{s['admitted']}/{s['clients']} admitted; client N+1: "
        f"{s['probe_refused'] or 'not refused'} (close {s['probe_close_code']}); "
        f"jitter ms p50/p99/max {_fmt(s['jitter_ms_p50'])}/{_fmt(s['jitter_ms_p99'])}/"
        f"{_fmt(s['jitter_ms_max'])}; beat ms p50/p99/max {_fmt(s['beat_latency_ms_p50'])}/"
        f"{_fmt(s['beat_latency_ms_p99'])}/{_fmt(s['beat_latency_ms_max'])}; missed beats "
        f"{s['missed_beats']}; playback underruns {s['playback_underruns']}; input underruns "
        f"{s['input_underruns']}"
    )
    return "\n".join(lines)
