"""A fleet on loopback: three ``voicechat-serve --listen`` processes behind HAProxy.

The router's configuration is ``serving.fleet.haproxy_config``'s. One module-scoped fleet (the
first server fills a persistent compilation cache, the other two start from it) serves one
scenario in three acts: calls spread over every server (least connections, at most ``--slots``
each); SIGTERM to one server ends its calls with their ``shutdown`` events, its ``/readyz`` goes
unready and HAProxy sends new calls only to the others; SIGKILL to another closes its calls'
connections (no close frame: 1006) while the third server's calls keep receiving audio at pace.
Three servers, not two, so that a server with calls is left after the drain and the kill.

Skipped, with the reason, where ``haproxy`` is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.test_net import Caller
from voicechat_jax.serving import fleet

REPO = pathlib.Path(__file__).resolve().parent.parent
HAPROXY = shutil.which("haproxy")
SLOTS = 4  # per server
NAMES = ("v0", "v1", "v2")  # v0 is drained, v1 killed, v2 survives
ROUTER = {"check_interval_s": 0.25, "fall": 1, "rise": 1, "queue_timeout_s": 2.0}

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (.ci/run)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int | None, bytes]:
    """(status, body); (None, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None, b""


def _unready(url: str, timeout: float) -> tuple[int | None, bytes]:
    """The first answer of ``url`` that is not 200 (the signal reaches the server's handler
    a moment after it is sent), or the last answer after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = _get(url)
        if status != 200 or time.monotonic() > deadline:
            return status, body
        time.sleep(0.02)


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class Fleet:
    def __init__(self, root: pathlib.Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.haproxy: subprocess.Popen | None = None
        self.router_url = ""
        self.stats_url = ""

    def start_servers(self) -> None:
        """The first server alone, filling a persistent compilation cache; then the others at
        once, from it (a cold start is ~100 s of the tiny model's compiles here, a warm one ~10)."""
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "JAX_PLATFORMS": "cpu",
            # The suite's cache (tests/conftest.py) where there is one: the params' programs are
            # the other tests' too.
            "JAX_COMPILATION_CACHE_DIR": os.environ.get(
                "JAX_COMPILATION_CACHE_DIR", str(self.root / "jax_cache")
            ),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
        self._start(NAMES[:1], env)
        self._start(NAMES[1:], env)

    def _start(self, names, env) -> None:
        for name in names:
            out = self.root / name
            cmd = [
                sys.executable, "-m", "voicechat_jax.cli.serve", "--listen=127.0.0.1:0",
                f"--slots={SLOTS}", f"--output_dir={out}", "--drain_timeout_s=30",
                "--loop=dispatch",  # its programs in the suite's cache from other tests
            ]  # fmt: skip
            with (self.root / f"{name}.log").open("w") as log:
                self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        for name in names:
            proc, listen = self.procs[name], self.root / name / "listen.json"
            assert _wait_until(lambda p=proc, f=listen: f.exists() or p.poll() is not None, 600), (
                name
            )
            assert proc.poll() is None, self.log(name)
            url = self.urls[name] = json.loads(listen.read_text())["url"]
            assert _wait_until(lambda u=url: _get(u + "/readyz")[0] == 200, 600), self.log(name)

    def start_router(self) -> None:
        port, stats = _free_port(), _free_port()
        backends = [
            fleet.Backend(name, "127.0.0.1", int(url.rsplit(":", 1)[1]), SLOTS)
            for name, url in self.urls.items()
        ]
        router = fleet.RouterConfig(bind=f"127.0.0.1:{port}", stats=f"127.0.0.1:{stats}", **ROUTER)
        cfg = self.root / "haproxy.cfg"
        cfg.write_text(fleet.haproxy_config(backends, router))
        with (self.root / "haproxy.log").open("w") as log:
            self.haproxy = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=log
            )
        self.router_url = f"http://127.0.0.1:{port}"
        self.stats_url = f"http://127.0.0.1:{stats}/;csv"
        assert _wait_until(lambda: self.status() == dict.fromkeys(NAMES, "UP"), 30), (
            self.status(),
            (self.root / "haproxy.log").read_text(),
        )

    def status(self) -> dict[str, str]:
        """Each server's state as HAProxy sees it ("UP", "DOWN", ...)."""
        code, body = _get(self.stats_url)
        if code != 200:
            return {}
        rows = csv.DictReader(io.StringIO(body.decode().lstrip("# ")))
        return {r["svname"]: r["status"] for r in rows if r["svname"] in NAMES}

    def capacity(self, name: str) -> dict | None:
        code, body = _get(self.urls[name] + "/capacity")
        return json.loads(body) if code == 200 else None

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()[-3000:]

    def close(self) -> None:
        for proc in [self.haproxy, *self.procs.values()]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        f.start_servers()
        f.start_router()
        yield f
    finally:
        f.close()


def test_config_is_valid_haproxy(tmp_path):
    """The generated text is a configuration HAProxy accepts, one server line per backend."""
    backends = [fleet.Backend(f"gpu{i}", "10.0.0.7", 8765 + i, 8) for i in range(4)]
    text = fleet.haproxy_config(backends, fleet.RouterConfig(stats="127.0.0.1:8404"))
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    proc = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    servers = [line.split() for line in text.splitlines() if line.strip().startswith("server ")]
    assert [s[1:3] for s in servers] == [[f"gpu{i}", f"10.0.0.7:{8765 + i}"] for i in range(4)]
    assert all(s[3:7] == ["maxconn", "8", "weight", "8"] for s in servers)
    with pytest.raises(ValueError, match="unique"):
        fleet.haproxy_config(backends[:1] * 2)


def test_fleet_spreads_drains_and_survives_a_kill(running):
    f = running
    ws_url = f.router_url.replace("http", "ws", 1) + "/v1/realtime?voicechat=1"

    async def call(stack: contextlib.AsyncExitStack) -> tuple[Caller, str]:
        c = await stack.enter_async_context(Caller(ws_url))
        assert c.first["type"] == "session.created", c.first
        talking = asyncio.create_task(c.audio(500))
        stack.callback(talking.cancel)
        return c, c.ws.response.headers["X-Voicechat-Server"]

    async def scenario() -> dict:
        async with contextlib.AsyncExitStack() as stack:
            # 1. Six calls, one after another: least connections puts two on each server.
            calls = [await call(stack) for _ in range(6)]
            placed = {n: [c for c, where in calls if where == n] for n in NAMES}
            spread = {n: len(cs) for n, cs in placed.items()}
            live = await asyncio.to_thread(
                _wait_until, lambda: all(f.capacity(n)["live"] == spread[n] for n in NAMES), 10
            )
            # 2. SIGTERM to v0: its calls end with their events; it is unready, then DOWN.
            f.procs["v0"].send_signal(signal.SIGTERM)
            readyz = await asyncio.to_thread(_unready, f.urls["v0"] + "/readyz", 10)
            ended = placed["v0"]
            await asyncio.wait_for(asyncio.gather(*(c.closed.wait() for c in ended)), 15)
            down = await asyncio.to_thread(
                _wait_until, lambda: f.status().get("v0", "").startswith("DOWN"), 10
            )
            after_drain = [await call(stack) for _ in range(2)]
            # 3. SIGKILL to v1: its calls' connections close; v2's calls keep their pace.
            killed = [c for c, where in [*calls, *after_drain] if where == "v1"]
            survivors = [c for c, where in [*calls, *after_drain] if where == "v2"]
            t_kill = time.monotonic()
            f.procs["v1"].send_signal(signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*(c.closed.wait() for c in killed)), 10)
            closed_s = time.monotonic() - t_kill
            await asyncio.sleep(3.5)
            return {
                "survivors_open": [not c.closed.is_set() for c in survivors],
                "spread": spread,
                "live": live,
                "readyz": readyz,
                "ended": ended,
                "down": down,
                "after_drain": [where for _, where in after_drain],
                "v0_rc": f.procs["v0"].wait(30),
                "killed": killed,
                "closed_s": closed_s,
                "survivors": survivors,
                "t_kill": t_kill,
            }

    r = asyncio.run(scenario())
    assert r["spread"] == dict.fromkeys(NAMES, 2)
    assert r["live"]  # each server's /capacity counted the calls HAProxy sent it
    # The draining server said so (or had already drained and exited) and ended its calls.
    status, body = r["readyz"]
    assert status is None or (status == 503 and json.loads(body)["reason"] == "draining")
    for c in r["ended"]:
        assert "server_shutting_down" in c.errors()
        assert c.of("voicechat.session.ended")[0]["reason"] == "shutdown"
        assert c.ws.close_code == 1001
    assert r["down"], f.status()
    assert r["v0_rc"] == 0, f.log("v0")
    assert set(r["after_drain"]) <= {"v1", "v2"}
    # The killed server's calls: the connection closed with no close frame and no end event.
    assert r["killed"]
    assert r["closed_s"] < 5.0
    for c in r["killed"]:
        assert c.ws.close_code == 1006
        assert not c.of("voicechat.session.ended")
    # The survivors kept receiving audio, one frame every 80 ms, after the kill.
    assert len(r["survivors"]) >= 2
    assert all(r["survivors_open"])
    for c in r["survivors"]:
        times = c.delta_times()
        times = times[(times > r["t_kill"] + 0.5) & (times < r["t_kill"] + 3.5)]
        assert len(times) >= 0.8 * 3.0 / 0.08, len(times)
        assert 70 <= np.median(np.diff(times)) * 1e3 <= 90
