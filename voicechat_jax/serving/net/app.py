"""Live calls over the network: a WebSocket endpoint, health, readiness, metrics, the browser page.

``NetFront`` serves, beside a running ``Server`` (the beat clock, the slots, the tick), one aiohttp
application on its own thread and event loop:

- ``GET /v1/realtime`` (WebSocket): one call per connection, in the protocol of ``protocol``
  and ``docs/protocol.md`` (the OpenAI Realtime API, GA; beta to a client that asks), with the
  subprotocol ``realtime`` selected when offered. Access (``auth``): with an API key set, calls
  and ``/capacity`` need it (401 without; a browser's call is closed with 1008 and an ``error``
  that says why); with ``allowed_origins``, a browser's upgrade from another site gets 403.
  The connection asks ``Server.hub`` for a slot; refused (no slot free, not ready, draining) it
  gets an ``error`` event it can act on and a close code (1013: try again later; 1001: going
  away). Admitted, its audio goes to the hub as it arrives (cut into 80 ms frames, resampled to
  16 kHz); its output is drained from the session's bounded ``OutputStream`` and sent one 80 ms
  frame at a time, paced within each beat.
- ``GET /healthz``: the process answers. ``GET /readyz``: 200 once the tick is compiled and its
  warm-up beats are served, and while the server admits sessions, else 503 with the reason.
  ``GET /capacity``: JSON ``slots``, ``max_live`` (the admission threshold, ``slots`` without
  one), ``free`` (below it), ``live``, ``draining``, ``ready`` (what a router admits by).
  ``GET /metrics``: Prometheus text (``prometheus_client``): the server's report
  (``report.SummaryCollector``: beat latency summary and histogram, misses, skipped ticks,
  underruns, session events including refusals) and this front's gauges and counters (live
  sessions, free slots, connections, protocol errors, dropped output). ``GET /``: the browser
  page (``web/``).

Session lifetime. A call ends when the server ends it (context cap, shutdown drain, failed input:
the stream's end, after its last beat), when the client closes or vanishes (the read side ends; the
slot is released at the next beat), after ``idle_timeout_s`` without audio, or when the client
stops reading for ``send_timeout_s`` (stalled). The beat thread never waits for any of this: the
network side only pushes into the input queues and drains the bounded output streams.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging as std_logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

from absl import logging
from aiohttp import WSCloseCode, WSMsgType, web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving.fanout import SHUTDOWN
from voicechat_jax.serving.hub import CLIENT_ERROR, HubClosedError, Join
from voicechat_jax.serving.net import auth
from voicechat_jax.serving.net import protocol as p
from voicechat_jax.serving.report import SummaryCollector
from voicechat_jax.serving.scheduler import AdmissionControl
from voicechat_jax.serving.sessions import CapacityError
from voicechat_jax.serving.writer import OutputStream, StreamEnd

WEB_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "web")
REALTIME_PATH = "/v1/realtime"
_OUT_SAMPLES_PER_FRAME = 1764  # 22.05 kHz samples per 80 ms frame


@dataclasses.dataclass(frozen=True)
class NetConfig:
    """The network front's options (``voicechat-serve --listen`` and its flags)."""

    host: str = "127.0.0.1"
    port: int = 8765  # 0: any free port (``NetFront.url`` says which)
    idle_timeout_s: float = 10.0  # a call with no audio from its client for this long ends
    heartbeat_s: float = 5.0  # WebSocket ping interval; a client that misses a pong is gone
    max_message_bytes: int = 1 << 20  # larger messages close the connection (1009)
    output_beats: int = 16  # beats of output a session's stream holds before dropping the oldest
    # Unsent output a connection may hold: the kernel's send buffer (SO_SNDBUF), plus a half of it
    # in aiohttp's writer and a quarter in the event loop's transport (about 2 s of 24 kHz audio in
    # all): what a slow client can delay its own audio by, and how soon a stall is seen.
    send_buffer_bytes: int = 64 << 10
    send_timeout_s: float = 5.0  # a client that takes no output for this long has stalled
    max_protocol_errors: int = 64  # errors in one call before it is closed (1008)
    admit_timeout_s: float = 10.0  # the beat thread answers an admission within this
    retry_after_s: float = 1.0  # suggested in a capacity refusal
    record_calls: bool = False  # write each call's files when the server has an output_dir
    model: str = "voicechat"
    notice_interval_s: float = 2.0  # at most one overflow error per kind per this interval
    # Access (``auth``): calls and /capacity need the key in this file (else $VOICECHAT_API_KEY;
    # neither: no key); a browser's upgrade from a site not listed here is refused (none: any).
    api_key_file: str | None = None
    allowed_origins: tuple[str, ...] = ()
    # Slow or idle clients: a connection whose request (line and headers) is not in within
    # ``header_timeout_s`` of its opening, or of its last response, is closed; an unread request
    # body is drained for at most ``body_timeout_s`` before the connection is closed; at most
    # ``max_pending_connections`` connections may be open without being a WebSocket call (more
    # are closed at once).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 5.0
    max_pending_connections: int = 256

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_pending_connections < 1:
            raise ValueError("max_pending_connections must be >= 1")
        for name in (
            "idle_timeout_s",
            "heartbeat_s",
            "send_timeout_s",
            "admit_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.output_beats < 1 or self.max_message_bytes < 1024 or self.send_buffer_bytes < 4096:
            raise ValueError(
                "output_beats must be >= 1, max_message_bytes >= 1024, send_buffer_bytes >= 4096"
            )


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ValueError if malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in [0, 65535], got {value!r}")
    return host.strip("[]"), int(port)


def check_listen(value: str) -> tuple[str, int]:
    """``parse_listen``, then the address resolved and bound once (and let go), so that a bad
    host, an address not on this machine or a port in use is found before anything is built.
    Raises ValueError with one line saying which."""
    host, port = parse_listen(value)
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_ADDRCONFIG
        )
    except socket.gaierror as e:
        raise ValueError(f"--listen={value}: cannot resolve host {host!r} ({e.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            # As the server binds (asyncio's reuse_address): a port left in TIME_WAIT is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    why = f"port {port} is in use on {address[0]}"
                elif e.errno == errno.EADDRNOTAVAIL:
                    why = f"{address[0]} is not an address of this machine"
                elif e.errno == errno.EACCES:
                    why = f"no permission to listen on port {port}"
                else:
                    why = f"cannot listen on {address[0]}:{port} ({e.strerror})"
                raise ValueError(f"--listen={value}: {why}") from None
    return host, port


class _OneLineLog(std_logging.LoggerAdapter):
    """aiohttp's server log with a malformed request as one line (aiohttp logs each with its
    traceback); an exception in a handler (a bug here) keeps its traceback."""

    def exception(self, msg, *args, exc_info=True, **kw) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.logger.warning(msg + ": %s", *args, " ".join(str(exc_info).split()))
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kw)


class _Guarded(asyncio.Protocol):
    """aiohttp's request handler for one connection, behind the front's connection limits.

    Refused at once when ``max_pending_connections`` connections are already open without
    being a call; otherwise every event goes to aiohttp's handler (``inner``), and the front
    hears when the connection closes (``_ConnectionGuard.closed``).
    """

    def __init__(self, inner: asyncio.Protocol, guard: _ConnectionGuard):
        self.inner, self.guard = inner, guard
        self.transport: asyncio.Transport | None = None
        self.admitted = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.admitted = self.guard.opened(transport)
        if not self.admitted:
            transport.abort()
            return
        self.inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        if self.admitted:
            self.guard.closed(self.transport)
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _ConnectionGuard:
    """Which connections are open and what became of them (the front's event loop only)."""

    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self.pending: set = set()  # transports open, not (yet) a WebSocket call
        self.requested: set = set()  # transports that sent at least one whole request
        self.opened_total = 0
        self.refused = 0  # closed at once: too many pending
        self.without_request = 0  # closed before a whole request (resets, bare handshakes, slow)

    def opened(self, transport) -> bool:
        if len(self.pending) >= self.max_pending:
            self.refused += 1
            return False
        self.opened_total += 1
        self.pending.add(transport)
        return True

    def request(self, transport) -> None:
        self.requested.add(transport)

    def upgraded(self, transport) -> None:
        self.pending.discard(transport)

    def closed(self, transport) -> None:
        self.pending.discard(transport)
        if transport in self.requested:
            self.requested.discard(transport)
        else:
            self.without_request += 1


class NetFront:
    """The aiohttp application beside a ``Server``; see the module docstring.

    Args:
      server: the server whose hub, slots and metrics this front serves (it need not be running
        yet: admissions wait for its first beat, ``/readyz`` says when it is ready).
      config: addresses, timeouts and bounds.
      text_decode: LLM ids -> text for the agent's words and tool calls (None: ids only).
      asr_decode: RNNT ids -> text for the caller's words (None: ids only).

    ``start`` binds and serves on a thread of its own; ``stop`` waits (bounded) for the calls to
    end and closes everything. Counters are touched only on the front's event loop.
    """

    def __init__(
        self,
        server,
        config: NetConfig | None = None,
        *,
        text_decode: Callable[[Sequence[int]], str] | None = None,
        asr_decode: Callable[[Sequence[int]], str] | None = None,
    ):
        self.server = server
        self.config = config or NetConfig()
        self.text_decode = text_decode
        self.asr_decode = asr_decode
        self.url: str | None = None
        self.connections = 0  # WebSocket connections accepted
        self.refusals: collections.Counter[str] = collections.Counter()  # by error code
        self.errors: collections.Counter[str] = collections.Counter()  # protocol errors by code
        self.ended: collections.Counter[str] = collections.Counter()  # calls by end reason
        self.output_dropped = 0  # output beats dropped because a client fell behind
        self.unstarted = 0  # calls whose client left before session.created (not refusals)
        self.guard = _ConnectionGuard(self.config.max_pending_connections)
        self._listener: asyncio.AbstractServer | None = None
        self._calls: set[asyncio.Task] = set()
        self.closing = False  # ``stop`` began: the calls left get the grace, then their end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._api_key = auth.read_api_key(self.config.api_key_file)
        self.registry = CollectorRegistry()
        self.registry.register(SummaryCollector(server.metrics))
        self.registry.register(_FrontCollector(self))

    # ---- lifecycle (any thread) --------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> str:
        """Binds and starts serving on a new thread; returns the base URL (``http://host:port``)."""
        self._thread = threading.Thread(target=self._main, name="voicechat-net", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError("the network front did not start")
        if self._start_error is not None:
            raise self._start_error
        return self.url

    def stop(self, grace_s: float = 2.0) -> None:
        """Waits up to ``grace_s`` for the calls to end (the server ends them when it drains),
        then closes every connection and the listener, and joins the thread."""
        if self._loop is None or self._thread is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), self._loop)
        try:
            future.result(timeout=grace_s + 10.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            logging.warning("the network front did not shut down cleanly: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        self._loop = self._thread = None  # stopped: a second stop does nothing

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:
            self._start_error = e
            self._started.set()
            logging.error("the network front failed to start: %s", e)
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        app = web.Application(
            client_max_size=self.config.max_message_bytes, middlewares=[self._seen_request]
        )
        app.router.add_get("/", self._index)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/capacity", self._capacity)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get(REALTIME_PATH, self._realtime)
        app.router.add_static("/static/", WEB_DIR, show_index=False)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            # aiohttp's idle timer runs from a connection's opening and from each response:
            # a request that is not whole by then (headers that never end) is closed with it.
            keepalive_timeout=self.config.header_timeout_s,
            lingering_time=self.config.body_timeout_s,
            logger=_OneLineLog(std_logging.getLogger("aiohttp.server"), {}),
        )
        await self._runner.setup()
        handler = self._runner.server
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: _Guarded(handler(), self.guard),
            self.config.host,
            self.config.port,
            reuse_address=True,
        )
        sockets = self._listener.sockets
        port = sockets[0].getsockname()[1] if sockets else self.config.port
        host = self.config.host
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        logging.info("network front listening on %s (calls at %s)", self.url, REALTIME_PATH)
        if self._api_key is None and not auth.is_loopback(host):
            logging.warning(
                "listening on %s with no API key: anyone who reaches it may call "
                "(--api_key_file or $%s)",
                host,
                auth.API_KEY_ENV,
            )

    async def _shutdown(self, grace_s: float) -> None:
        self.closing = True  # a call cut off below still sends the shutdown end
        if self._listener is not None:
            self._listener.close()  # no new connection; the open ones end below
        calls = list(self._calls)
        if calls:
            _, pending = await asyncio.wait(calls, timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- state -------------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): compiled, warmed up, admitting, not draining."""
        if self.server.stopping:
            return False, "draining"
        if self.server.hub.closed:
            return False, "stopped"
        if self.server.engine.compile_s is None:  # set once the tick (or loop) is compiled
            return False, "compiling"
        if not self.server.warmed_up:  # the first beats' one-time costs not paid yet
            return False, "warming up"
        return True, "ready"

    def max_live(self) -> int:
        """Sessions the server admits at once: its slots, or fewer under an admission threshold
        (``scheduler.AdmissionControl.max_live``)."""
        n = self.server.slots.n_slots
        policy = self.server.scheduler
        if isinstance(policy, AdmissionControl) and policy.max_live is not None:
            return min(policy.max_live, n)
        return n

    def free_slots(self) -> int:
        """Sessions that would be admitted now (what ``/readyz`` and ``/capacity`` report and a
        router admits by): below the admission threshold, not merely empty slots."""
        return max(0, self.max_live() - len(self.server.slots))

    # ---- HTTP --------------------------------------------------------------------------------

    @web.middleware
    async def _seen_request(self, request: web.Request, handler) -> web.StreamResponse:
        if request.transport is not None:
            self.guard.request(request.transport)
        return await handler(request)

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(os.path.join(WEB_DIR, "index.html"))

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, why = self.readiness()
        body = {
            "ready": ready,
            "reason": why,
            "free_slots": self.free_slots(),
            "live_sessions": len(self.server.slots),
        }
        return web.json_response(body, status=200 if ready else 503)

    async def _capacity(self, request: web.Request) -> web.Response:
        """What a router admits by: slots, the admission threshold, free slots (below it), live
        sessions, draining, ready (always 200, so that a draining server's numbers can still be
        read); 401 without the API key when one is set."""
        if not auth.authorized(request.headers, self._api_key):
            return self._refused(p.ErrorCode.INVALID_API_KEY, _NO_KEY, 401)
        ready, why = self.readiness()
        body = {
            "slots": self.server.slots.n_slots,
            "max_live": self.max_live(),
            "free": self.free_slots(),
            "live": len(self.server.slots),
            "draining": bool(self.server.stopping),
            "ready": ready,
            "reason": why,
        }
        return web.json_response(body)

    async def _metrics(self, request: web.Request) -> web.Response:
        # The report's percentiles take a few ms under the recorder's lock: off the event loop.
        text = await asyncio.get_running_loop().run_in_executor(
            None, generate_latest, self.registry
        )
        return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4"})

    # ---- calls -------------------------------------------------------------------------------

    async def _realtime(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        if not auth.origin_allowed(request.headers, request.host, cfg.allowed_origins):
            origin = request.headers.get("Origin")
            return self._refused(
                p.ErrorCode.ORIGIN_NOT_ALLOWED, f"origin {origin} is not allowed", 403
            )
        keyed = auth.authorized(request.headers, self._api_key)
        if not keyed and "Origin" not in request.headers:  # not a browser: it reads the status
            return self._refused(p.ErrorCode.INVALID_API_KEY, _NO_KEY, 401)
        ws = web.WebSocketResponse(
            protocols=(auth.SUBPROTOCOL,),
            heartbeat=cfg.heartbeat_s,
            max_msg_size=cfg.max_message_bytes,
            compress=False,
            writer_limit=cfg.send_buffer_bytes // 2,
        )
        try:
            await ws.prepare(request)
        except (ConnectionError, RuntimeError):
            self.unstarted += 1  # reset during the handshake
            raise ConnectionResetError("the client left during the handshake") from None
        transport = request.transport
        if transport is not None:
            self.guard.upgraded(transport)
            transport.set_write_buffer_limits(high=cfg.send_buffer_bytes // 4)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.send_buffer_bytes)
        if not keyed:  # a browser sees no status: the reason comes as an event and the close
            self.refusals[str(p.ErrorCode.INVALID_API_KEY)] += 1
            event = {**p.error_event(p.ErrorCode.INVALID_API_KEY, _NO_KEY), "event_id": "refused"}
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(json.dumps(event))
                await ws.close(code=p.CloseCode.POLICY_VIOLATION, message=b"invalid API key")
            return ws
        self.connections += 1
        task = asyncio.current_task()
        self._calls.add(task)
        try:
            await _Call(self, ws, request).run()
        finally:
            self._calls.discard(task)
        return ws

    def count_error(self, code: p.ErrorCode) -> None:
        self.errors[str(code)] += 1

    def _refused(self, code: p.ErrorCode, message: str, status: int) -> web.Response:
        """An HTTP refusal (counted) with the Realtime API's error body."""
        self.refusals[str(code)] += 1
        body = p.error_event(code, message)["error"]
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.json_response({"error": body}, status=status, headers=headers)


_NO_KEY = (
    "no valid API key: send Authorization: Bearer KEY (from a browser, the subprotocol "
    f"{auth.KEY_SUBPROTOCOL}KEY)"
)


class _Call:
    """One WebSocket connection: admission, then a reader, a sender and an idle watchdog."""

    def __init__(self, front: NetFront, ws: web.WebSocketResponse, request: web.Request):
        self.front = front
        self.ws = ws
        self.hub = front.server.hub
        self.cfg = front.config
        self.loop = asyncio.get_running_loop()
        engine = front.server.engine
        self.session = p.SessionConfig(
            extensions=request.query.get("voicechat") in ("1", "true"),
            voice=engine.cfg.tts.speaker_name,
            model=self.cfg.model,
        )
        self.sid = self.hub.new_id()
        self.peer = request.remote or "?"
        self.transport = request.transport
        self.events = p.CallEvents(
            self.sid,
            text_decode=front.text_decode,
            asr_decode=front.asr_decode,
            beta=auth.wants_beta(request.headers, request.query),
            context_frames=engine.serve.context_frames,
        )
        # The reader's acknowledgements and the sender's frames each build and send their events
        # under it, so that no event of a frame the client has just cancelled follows the cancel.
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.stream = OutputStream(self.cfg.output_beats, notify=self._wake_sender)
        self.input = p.InputAudio(self.session.input_rate)
        self.output = p.OutputAudio(self.session.output_rate)
        self.record = None  # the server's ``Session`` record once admitted
        self.last_audio = self.loop.time()
        self.released = False  # we asked the hub to end it
        self.ended = False  # the server ended it (the stream's end was sent)
        self.errors = 0
        self.frames = 0  # frames sent
        self._dropped_seen = 0
        self._input_dropped_seen = 0
        self._notices: dict[str, float] = {}

    async def send(self, event: dict) -> None:
        await asyncio.wait_for(self.ws.send_str(json.dumps(event)), self.cfg.send_timeout_s)

    async def refuse(self, code: p.ErrorCode, message: str, close: int, **extra) -> None:
        self.front.refusals[str(code)] += 1
        event = p.error_event(code, message, error_type=p.ErrorType.SERVER, extra=extra or None)
        with contextlib.suppress(ConnectionError, TimeoutError, RuntimeError):
            await self.send(self.events.stamp(event))
            await self.ws.close(code=close, message=message[:120].encode())

    # ---- the call ----------------------------------------------------------------------------

    async def run(self) -> None:
        front, server = self.front, self.front.server
        ready, why = front.readiness()
        if not ready:
            if why == "compiling":
                await self.refuse(
                    p.ErrorCode.SERVER_NOT_READY,
                    "the server is starting (compiling the tick); try again shortly",
                    p.CloseCode.TRY_AGAIN_LATER,
                    retry_after_s=self.cfg.retry_after_s,
                )
            else:
                await self.refuse(
                    p.ErrorCode.SERVER_SHUTTING_DOWN,
                    f"the server is not admitting sessions ({why})",
                    p.CloseCode.GOING_AWAY,
                )
            return
        join = Join(
            self.sid, source=f"ws:{self.peer}", stream=self.stream, record=self.cfg.record_calls
        )
        future = asyncio.wrap_future(self.hub.admit(join))
        try:
            slot = await asyncio.wait_for(future, self.cfg.admit_timeout_s)
        except CapacityError as e:
            n = server.slots.n_slots
            await self.refuse(
                p.ErrorCode.SERVER_AT_CAPACITY,
                str(e),
                p.CloseCode.TRY_AGAIN_LATER,
                retry_after_s=self.cfg.retry_after_s,
                slots=n,
            )
            return
        except HubClosedError as e:
            await self.refuse(p.ErrorCode.SERVER_SHUTTING_DOWN, str(e), p.CloseCode.GOING_AWAY)
            return
        except (TimeoutError, asyncio.CancelledError):
            self.front.unstarted += 1
            self.hub.release(self.sid, "left", "admission abandoned")
            if not self.ws.closed:
                await self.refuse(
                    p.ErrorCode.SERVER_SHUTTING_DOWN,
                    "no answer to the admission in time",
                    p.CloseCode.TRY_AGAIN_LATER,
                )
            raise
        try:
            self.record = server.slots.session(self.sid)
        except KeyError:  # released already (a drain began at this very beat)
            self.record = None
        info = {
            "slot": slot,
            "beat_ms": server.engine.serve.beat_ms,
            "context_frames": server.engine.serve.context_frames,
            "at_cap": str(server.engine.serve.at_cap),
            "idle_timeout_s": self.cfg.idle_timeout_s,
        }
        self.info = info
        logging.info("call %s from %s admitted into slot %d", self.sid, self.peer, slot)
        try:
            await self.send(self.events.session_created(self.session, info))
        except (TimeoutError, ConnectionError, RuntimeError):
            self.front.unstarted += 1
            self.hub.release(self.sid, "left", "the client left before the session began")
            return
        tasks = {
            asyncio.create_task(self.read(), name=f"{self.sid}-read"),
            asyncio.create_task(self.send_output(), name=f"{self.sid}-send"),
            asyncio.create_task(self.watch_idle(), name=f"{self.sid}-idle"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            reader = next(t for t in tasks if t.get_name().endswith("-read"))
            sender = next(t for t in tasks if t.get_name().endswith("-send"))
            # The client is gone or closed: the slot frees at the next beat; nothing more to
            # send, except the end when the connection is still open (a graceful close).
            if reader in done and not sender.done() and not self.ws.closed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(sender), self.cfg.send_timeout_s)
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            crashed = [r for r in results if isinstance(r, Exception)]  # a bug here
            for e in crashed:
                logging.error("call %s: %s: %s", self.sid, type(e).__name__, e, exc_info=e)
            if self.front.closing and not self.ended and not self.released and not self.ws.closed:
                # The front's grace ran out before the server's end reached this call: the end
                # the server gives every session it stops, so that the client still hears why
                # the call ends, and the slot freed as shut down.
                detail = "the network front stopped"
                self.release(SHUTDOWN, detail)
                with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
                    await self.finish(StreamEnd(SHUTDOWN, detail))
            if not self.ended and not self.released:
                self.release("left", "the connection closed")
            if not self.ws.closed:
                # 1000 only for a call that ended normally.
                code = p.CloseCode.INTERNAL_ERROR if crashed else p.CloseCode.NORMAL
                with contextlib.suppress(Exception):
                    await self.ws.close(code=code)
            logging.info("call %s ended (%d frames sent)", self.sid, self.frames)

    def _wake_sender(self) -> None:
        """The stream's notify (writer thread): a beat or the end is queued for the sender."""
        with contextlib.suppress(RuntimeError):  # the front's loop is closed: no one to wake
            self.loop.call_soon_threadsafe(self.wake.set)

    def release(self, why: str, detail: str) -> None:
        if not self.released and not self.ended:
            self.released = True
            self.front.ended[why] += 1
            self.hub.release(self.sid, why, detail)

    # ---- reading -----------------------------------------------------------------------------

    async def read(self) -> None:
        ws = self.ws
        while True:
            msg = await ws.receive()
            if msg.type == WSMsgType.TEXT:
                if not await self.handle(msg.data):
                    return
            elif msg.type == WSMsgType.BINARY:
                await self.protocol_error(
                    p.ProtocolError(
                        p.ErrorCode.BINARY_NOT_SUPPORTED,
                        "binary messages are not part of the protocol; send JSON text events",
                    )
                )
            elif msg.type == WSMsgType.ERROR:
                code = ws.close_code
                why = "message too big" if code == WSCloseCode.MESSAGE_TOO_BIG else str(msg.data)
                self.front.count_error(p.ErrorCode.INVALID_EVENT)
                self.release(CLIENT_ERROR, f"connection error: {why}")
                return
            else:  # CLOSE / CLOSING / CLOSED: the client closed or vanished
                if self.ended:
                    return
                code = ws.close_code
                if code in (None, WSCloseCode.ABNORMAL_CLOSURE):
                    self.release(CLIENT_ERROR, "client vanished: the connection dropped, no close")
                else:
                    self.release("left", f"the client closed the connection (code {code})")
                return
            if self.errors > self.cfg.max_protocol_errors:
                self.release(CLIENT_ERROR, f"too many protocol errors ({self.errors})")
                with contextlib.suppress(Exception):
                    await ws.close(code=p.CloseCode.POLICY_VIOLATION, message=b"protocol errors")
                return

    async def handle(self, text: str) -> bool:
        """One client event; False when the call is over from the client's side."""
        try:
            event = p.parse_client_event(text)
            kind = event["type"]
            if kind == p.ClientEvent.INPUT_AUDIO_APPEND:
                self.append(p.decode_audio(event))
                await self.notice_input_overflow()
            elif kind == p.ClientEvent.SESSION_UPDATE:
                new, not_applied = self.session.apply(event.get("session"))
                if new.input_rate != self.session.input_rate:
                    self.input = p.InputAudio(new.input_rate)
                if new.output_rate != self.session.output_rate:
                    self.output = p.OutputAudio(new.output_rate)
                self.session = new
                await self.send(self.events.session_updated(new, self.info, not_applied))
            elif kind == p.ClientEvent.SESSION_CLOSE:
                self.release("left", "closed by the client")
                return True  # the sender sends the end and closes
            elif kind in p.CONTROL:
                if kind == p.ClientEvent.INPUT_AUDIO_CLEAR:
                    self.input.clear()
                async with self.lock:
                    for answer in self.events.control(event, self.session):
                        await self.send(answer)
            else:
                raise p.ProtocolError(
                    p.ErrorCode.UNKNOWN_EVENT,
                    f"unknown event type {kind!r}",
                    event_id=event.get("event_id"),
                )
        except p.ProtocolError as e:
            await self.protocol_error(e)
        except (audio_lib.AudioInputError, KeyError):
            return False  # the session failed or ended: the stream's end follows
        except (TypeError, ValueError, AttributeError, LookupError, RecursionError) as e:
            # An event the parser should have refused (a bug here): refused all the same, and
            # the call goes on.
            logging.warning("call %s: event not understood (%s: %s)", self.sid, type(e).__name__, e)
            await self.protocol_error(
                p.ProtocolError(p.ErrorCode.INVALID_EVENT, "the event could not be understood")
            )
        return True

    def append(self, pcm: bytes) -> None:
        self.last_audio = self.loop.time()
        frames = self.input.feed(pcm)
        if frames.size and not self.released:
            self.hub.push(self.sid, frames)

    async def protocol_error(self, e: p.ProtocolError) -> None:
        self.errors += 1
        self.front.count_error(e.code)
        await self.send(
            self.events.stamp(p.error_event(e.code, e.message, event_id=e.event_id, param=e.param))
        )

    def _due(self, kind: str) -> bool:
        now = self.loop.time()
        if now - self._notices.get(kind, -1e9) < self.cfg.notice_interval_s:
            return False
        self._notices[kind] = now
        return True

    async def notice_input_overflow(self) -> None:
        """Audio faster than real time beyond the bounded queue: the oldest was dropped."""
        if self.record is None:
            return
        dropped = self.record.dropped_samples
        if dropped > self._input_dropped_seen and self._due("input"):
            ms = 1000.0 * (dropped - self._input_dropped_seen) / audio_lib.INPUT_RATE
            self._input_dropped_seen = dropped
            self.front.count_error(p.ErrorCode.INPUT_OVERFLOW)
            await self.send(
                self.events.stamp(
                    p.error_event(
                        p.ErrorCode.INPUT_OVERFLOW,
                        f"audio arrives faster than real time: {ms:.0f} ms of the oldest input "
                        "dropped (the server queues at most a few beats; send 80 ms every 80 ms)",
                        extra={"dropped_ms": round(ms, 1)},
                    )
                )
            )

    async def watch_idle(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.cfg.idle_timeout_s / 4))
            idle = self.loop.time() - self.last_audio
            if idle > self.cfg.idle_timeout_s and not self.released:
                # The server ends it at the next beat; the sender sends the end and closes.
                self.release("idle timeout", f"no audio for {idle:.1f} s")

    # ---- sending -----------------------------------------------------------------------------

    async def send_output(self) -> None:
        """Drains the session's stream: each beat's frames, 80 ms apart; then its end."""
        period = p.FRAME_MS / 1000.0
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                beats, end = self.stream.drain()
                for i, beat in enumerate(beats):
                    dropped = self.stream.dropped - self._dropped_seen
                    self._dropped_seen = self.stream.dropped
                    if dropped:
                        self.front.output_dropped += dropped
                        await self.notice_output_dropped(dropped)
                    base = self.loop.time()
                    last = i == len(beats) - 1
                    for t in range(beat.text.shape[0]):
                        if t and last:  # pace the newest beat's frames; catch up on older ones
                            await asyncio.sleep(max(0.0, base + t * period - self.loop.time()))
                        wav = beat.wav[
                            t * _OUT_SAMPLES_PER_FRAME : (t + 1) * _OUT_SAMPLES_PER_FRAME
                        ]
                        async with self.lock:
                            pcm = self.output.convert(wav)
                            for event in self.events.frame(
                                beat, t, pcm, self.session, dropped=dropped
                            ):
                                await self.send(event)
                        self.frames += 1
                if end is not None:
                    await self.finish(end)
                    return
        except TimeoutError:
            self.release(
                CLIENT_ERROR, f"client stalled: took no output for {self.cfg.send_timeout_s:g} s"
            )
            if self.transport is not None:
                self.transport.abort()  # a close frame would queue behind what it did not read
        except (ConnectionError, RuntimeError):
            return  # the connection is gone; the reader releases the slot

    async def notice_output_dropped(self, dropped: int) -> None:
        if self._due("output"):
            self.front.count_error(p.ErrorCode.OUTPUT_OVERFLOW)
            await self.send(
                self.events.stamp(
                    p.error_event(
                        p.ErrorCode.OUTPUT_OVERFLOW,
                        f"{dropped} beat(s) of output dropped: the client reads slower than real "
                        "time",
                        extra={"dropped_beats": dropped},
                    )
                )
            )

    async def finish(self, end) -> None:
        """The server ended the session: the end events, then the close."""
        self.ended = True
        if not self.released:
            self.front.ended[end.reason] += 1
        events, close = self.events.end(end, self.frames, self.session)
        for event in events:
            await self.send(event)
        await self.ws.close(code=close, message=end.reason.encode()[:120])


class _FrontCollector:
    """Prometheus families of the network front (read on the scrape's thread)."""

    def __init__(self, front: NetFront):
        self.front = front

    def describe(self):
        return []

    def collect(self):
        f = self.front
        ready, _ = f.readiness()
        yield GaugeMetricFamily("voicechat_ready", "1 when the server admits sessions.", int(ready))
        yield GaugeMetricFamily(
            "voicechat_live_sessions", "Sessions in a slot now.", len(f.server.slots)
        )
        yield GaugeMetricFamily(
            "voicechat_free_slots",
            "Slots free now (below the admission threshold).",
            f.free_slots(),
        )
        yield GaugeMetricFamily(
            "voicechat_slots", "Slots the state is sized for.", f.server.slots.n_slots
        )
        yield CounterMetricFamily(
            "voicechat_sessions_refused", "Sessions refused at capacity.", f.server.slots.refused
        )
        yield CounterMetricFamily(
            "voicechat_net_connections", "WebSocket connections accepted.", f.connections
        )
        yield CounterMetricFamily(
            "voicechat_net_tcp_connections", "TCP connections accepted.", f.guard.opened_total
        )
        yield CounterMetricFamily(
            "voicechat_net_connections_without_request",
            "TCP connections that closed before a whole request (resets, bare handshakes, "
            "headers past the timeout).",
            f.guard.without_request,
        )
        yield CounterMetricFamily(
            "voicechat_net_connections_over_limit",
            "TCP connections closed at once: too many open without being a call.",
            f.guard.refused,
        )
        yield CounterMetricFamily(
            "voicechat_net_calls_unstarted",
            "WebSocket calls whose client left before session.created (refusals apart).",
            f.unstarted,
        )
        refusals = CounterMetricFamily(
            "voicechat_net_refusals", "Connections refused, by error code.", labels=["code"]
        )
        for code, n in sorted(f.refusals.items()):
            refusals.add_metric([code], n)
        yield refusals
        errors = CounterMetricFamily(
            "voicechat_net_errors", "Errors sent to clients, by code.", labels=["code"]
        )
        for code, n in sorted(f.errors.items()):
            errors.add_metric([code], n)
        yield errors
        ended = CounterMetricFamily(
            "voicechat_net_calls_ended", "Calls ended, by reason.", labels=["reason"]
        )
        for reason, n in sorted(f.ended.items()):
            ended.add_metric([reason], n)
        yield ended
        yield CounterMetricFamily(
            "voicechat_net_output_dropped_beats",
            "Output beats dropped because a client read slower than real time.",
            f.output_dropped,
        )
        yield CounterMetricFamily(
            "voicechat_input_dropped_samples",
            "Input samples dropped by the backlog bound (audio faster than real time).",
            f.server.queues.dropped_samples,
        )
        yield CounterMetricFamily(
            "voicechat_input_skipped_samples",
            "Input samples of ticks the server skipped (its own lateness, not the client's pace).",
            f.server.queues.skipped_samples,
        )
