"""What a probe of bad input, signals and hostile clients broke (issue 32): one test per defect.

Network cases go through real sockets and a real WebSocket client against one tiny server on
127.0.0.1 (``runner.run`` with ``--listen``, the real-time clock, host-made random weights so that
only the tick compiles); the rest call the CLI's functions in-process, with absl flags parsed
here, or the library. Subprocesses only where the process itself is what is tested (a signal
while the converter starts, the load client's exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import websockets

from voicechat_jax import checkpoint as ckpt
from voicechat_jax import convert as conv
from voicechat_jax.cli import serve as serve_cli
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import MemoryPlanError
from voicechat_jax.model import voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving import outdir, runner
from voicechat_jax.serving.net import protocol as p

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = serve_cli.FLAGS
CFG = tiny()
PREC = Precision.fp32()
HEADER_TIMEOUT_S = 1.0
MAX_PENDING = 6
MAX_PROTOCOL_ERRORS = 4


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _one_line(text: str, program: str = "voicechat-serve") -> str:
    """The one error line of a CLI: the last line, the only one naming the program, no
    traceback."""
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith(f"{program}:")]
    assert len(lines) == 1, text[-3000:]
    assert text.rstrip("\n").splitlines()[-1] == lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# the CLI in-process: absl flags parsed here, signal handlers put back


class _NotBuiltError(Exception):
    """Raised by a stand-in ``runner.build``: the run got as far as building the model."""


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """``cli(*args)``: voicechat-serve's flags parsed (unparsed again after the test), in a
    fresh working directory (the default ``runs/serve`` lands there); the model is never built
    (``runner.build`` raises ``_NotBuiltError``); signal handlers are restored."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    monkeypatch.chdir(tmp_path)

    def build(*a, **k):
        raise _NotBuiltError

    monkeypatch.setattr(runner, "build", build)

    def parse(*args: str) -> None:
        FLAGS.unparse_flags()
        serve_cli._parse_flags(["voicechat-serve", *args])

    yield parse
    FLAGS.unparse_flags()
    signal.set_wakeup_fd(-1)
    for s, handler in saved.items():
        signal.signal(s, handler)


def _main_exits(capsys) -> tuple[int, str]:
    """Runs ``voicechat-serve``'s main on the parsed flags; (exit status, its one error line)."""
    with pytest.raises(SystemExit) as e:
        serve_cli.main(["voicechat-serve"])
    return e.value.code, _one_line(capsys.readouterr().err)


# 1. one output directory, two runs


def test_output_dir_is_locked_and_a_finished_run_is_not_overwritten(cli, capsys, tmp_path):
    d = tmp_path / "run"
    with outdir.OutputLock(d):  # a run in progress there
        cli(f"--output_dir={d}", "--clock=offline")
        code, line = _main_exits(capsys)
        assert code == 1
        assert line.startswith(f"voicechat-serve: {d} is in use by another run (pid {os.getpid()}")
    (d / "sessions.json").write_text("{}")  # a finished one
    cli(f"--output_dir={d}", "--clock=offline")
    code, line = _main_exits(capsys)
    assert code == 2
    assert "holds a finished run (sessions.json): pass --overwrite" in line
    assert (d / "sessions.json").read_text() == "{}"
    cli(f"--output_dir={d}", "--clock=offline", "--overwrite")
    with pytest.raises(_NotBuiltError):  # past the lock: the run would build and write over it
        serve_cli.main(["voicechat-serve"])
    # Without --output_dir every run gets a folder of its own, ``latest`` the newest.
    first, second = outdir.new_run_dir(tmp_path / "runs"), outdir.new_run_dir(tmp_path / "runs")
    assert first != second
    assert os.listdir(first) == os.listdir(second) == []
    assert os.path.realpath(tmp_path / "runs" / "latest") == os.path.realpath(second)


# 2. SIGHUP


def test_sighup_drains_like_sigterm(monkeypatch):
    got: list[int] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, lambda s, f: got.append(s))  # before the fix: caught here
    stop = threading.Event()
    try:
        signals = serve_cli._Signals(stop, drain_timeout_s=30.0)
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.wait(5.0), f"SIGHUP did not start a drain (caught elsewhere: {got})"
        assert signals.drained() is not None
        # Started under nohup (SIGHUP ignored): left ignored.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        serve_cli._Signals(threading.Event(), drain_timeout_s=30.0)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.set_wakeup_fd(-1)
        for s, handler in saved.items():
            signal.signal(s, handler)


# 5, 6, 11, 12 (--seconds=inf): flags refused before anything is built


def test_listen_address_is_checked_before_the_build(cli, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = {
        "nohost.invalid:8765": "cannot resolve host 'nohost.invalid'",
        "192.0.2.1:8765": "192.0.2.1 is not an address of this machine",
        f"127.0.0.1:{port}": f"port {port} is in use on 127.0.0.1",
    }
    try:
        for listen, says in cases.items():
            cli(f"--listen={listen}")
            code, line = _main_exits(capsys)
            assert code == 2
            assert line.startswith(f"voicechat-serve: --listen={listen}: {says}"), line
    finally:
        taken.close()


def test_system_prompt_ids_past_the_vocabulary_are_refused(cli, capsys):
    V = CFG.llm.vocab_size
    cli(f"--system_prompt=1,{V}", "--clock=offline")
    code, line = _main_exits(capsys)
    assert code == 2
    assert line == f"voicechat-serve: --system_prompt: system prompt id(s) {V} outside the " + (
        f"vocabulary [0, {V})"
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):  # the library's own guard
        ServeConfig(system_prompt=(V + 5,)).check_model(CFG)
    ServeConfig(system_prompt=(0, V - 1)).check_model(CFG)


def test_help_exits_0_and_lists_every_flag(cli, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["voicechat-serve", "--help"])
    with pytest.raises(SystemExit) as e:
        serve_cli._parse_flags(sys.argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    own = FLAGS.get_flags_for_module(serve_cli)
    assert len(own) >= 39
    for flag in own:
        listed = f"--{flag.name}:" in out or f"--[no]{flag.name}:" in out
        assert listed, f"--{flag.name} is not in --help"
        end = "".join(flag.help.split())[-24:]  # absl wraps the text (at hyphens too)
        assert end in "".join(out.split()), f"--{flag.name}'s help is not in --help"


def test_seconds_inf_is_refused(cli, capsys):
    for value in ("inf", "nan"):
        with pytest.raises(SystemExit) as e:
            cli(f"--seconds={value}")
        assert e.value.code == 2
        assert "must be > 0 and finite" in _one_line(capsys.readouterr().err)


def test_compilation_cache_by_default(cli, monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cli()
    assert serve_cli.compilation_cache_dir() == str(tmp_path / "voicechat_jax" / "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert serve_cli.compilation_cache_dir() == str(tmp_path / "env")
    cli(f"--compilation_cache_dir={tmp_path / 'flag'}")
    assert serve_cli.compilation_cache_dir() == str(tmp_path / "flag")
    cli("--compilation_cache_dir=")
    assert serve_cli.compilation_cache_dir() is None


# 7. input files that are not files


def _wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    pcm = (samples * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, 2 * rate, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(pcm))
    return b"RIFF" + struct.pack("<I", len(body) + len(pcm)) + body + pcm


def test_input_wav_must_be_a_regular_file_read_within_a_bound(tmp_path):
    fifo = tmp_path / "fifo.wav"
    os.mkfifo(fifo)
    outcome: list = []

    def read() -> None:
        try:
            audio_lib.read_wav(fifo)
        except audio_lib.AudioInputError as e:
            outcome.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5.0)
    if t.is_alive():  # before the fix: blocked opening the FIFO; let it go
        with open(fifo, "wb"):
            pass
        t.join(5.0)
        pytest.fail("reading a FIFO hung")
    assert "not a regular file (a FIFO)" in str(outcome[0])
    for path, kind in (("/dev/zero", "a character device"), (str(tmp_path), "a directory")):
        with pytest.raises(audio_lib.AudioInputError, match=rf"not a regular file \({kind}\)"):
            audio_lib.read_wav(path)
    long = tmp_path / "long.wav"
    long.write_bytes(_wav(np.full(16000 * 10, 0.25, np.float32)))
    assert audio_lib.read_wav(long, max_samples=16000).shape == (16000,)
    assert audio_lib.read_wav(long).shape == (160000,)
    # A run reads no more of a file than its sessions can use: its beats, at most the cap.
    options = runner.RunOptions(seconds=1.0, serve=ServeConfig(context_frames=1500))
    assert runner._usable_samples(options, CFG) == options.n_ticks * 2 * audio_lib.FRAME_LEN
    options = runner.RunOptions(seconds=60.0, serve=ServeConfig(context_frames=100))
    assert runner._usable_samples(options, CFG) == 100 * audio_lib.FRAME_LEN


# 8, 9. the converter


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def test_convert_stops_on_sigint_while_starting(tmp_path):
    """Ctrl-C while the converter still loads JAX: before the fix it was lost (SIGINT inherited
    ignored, as in a script's background job, or the KeyboardInterrupt swallowed by JAX's GC
    callback) and the conversion went on."""
    (tmp_path / "release").mkdir()
    dst = tmp_path / "out" / "ck"
    cmd = [sys.executable, "-m", "voicechat_jax.cli.convert", f"--src={tmp_path / 'release'}"]
    default = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited, as by `convert &`
    try:
        proc = subprocess.Popen(
            [*cmd, f"--dst={dst}"], cwd=REPO, env=_env(), stderr=subprocess.PIPE, text=True
        )
    finally:
        signal.signal(signal.SIGINT, default)
    try:
        deadline = time.monotonic() + 60
        while "jaxlib" not in _maps(proc.pid):  # JAX is being imported: flags not yet read
            assert proc.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, stderr[-2000:]
    assert _one_line(stderr, "voicechat-convert") == (
        "voicechat-convert: interrupted by SIGINT; nothing was written"
    )
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_dst_inside_src(tmp_path):
    src = tmp_path / "release"
    src.mkdir()
    for dst in (src / "ck", src / "a" / "b"):
        with pytest.raises(conv.ConversionError, match="is inside the release directory"):
            conv.convert(src, dst)
    assert os.listdir(src) == []


# 12. checkpoint integrity: what a damaged file is called, a pinned listing


@pytest.fixture
def listed(tmp_path):
    """A directory with two files and their ``integrity.json``."""
    d = tmp_path / "ck"
    (d / "params").mkdir(parents=True)
    (d / "params" / "shard.bin").write_bytes(bytes(range(256)) * 16)
    (d / "model_config.json").write_text("{}")
    ckpt.write_integrity(str(d))
    return d


def test_an_altered_file_is_not_called_truncated(listed):
    shard = listed / "params" / "shard.bin"
    shard.write_bytes(b"something else")  # replaced, not cut short
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.verify_files(str(listed), ckpt.Verify.SIZES)
    assert str(e.value) == f"{shard}: size differs: 14 bytes, the conversion wrote 4,096"
    shard.write_bytes(bytes(4096))  # same size, other bytes
    with pytest.raises(ckpt.CheckpointError, match="altered or corrupt: sha256"):
        ckpt.verify_files(str(listed), ckpt.Verify.FULL)


def test_a_pinned_integrity_listing_catches_tampering(listed, cli, capsys):
    pin = ckpt.integrity_digest(listed)
    assert pin == hashlib.sha256((listed / ckpt.INTEGRITY).read_bytes()).hexdigest()
    ckpt.verify_files(str(listed), ckpt.Verify.FULL, manifest_sha256=pin)
    # Whoever alters a file can list it again: the listing checks out against itself ...
    (listed / "params" / "shard.bin").write_bytes(b"tampered")
    ckpt.write_integrity(str(listed))
    ckpt.verify_files(str(listed), ckpt.Verify.FULL)
    # ... but not against the pin kept apart.
    with pytest.raises(ckpt.CheckpointError, match=r"integrity\.json: sha256 .* is not the pinned"):
        ckpt.verify_files(str(listed), ckpt.Verify.FULL, manifest_sha256=pin)
    # On the command lines: voicechat-convert --check, voicechat-serve --checkpoint.
    cmd = ["-m", "voicechat_jax.cli.convert", f"--check={listed}", f"--manifest_sha256={pin}"]
    out = subprocess.run(
        [sys.executable, *cmd], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert "is not the pinned" in _one_line(out.stderr, "voicechat-convert")
    with pytest.raises(SystemExit) as e:
        cli(f"--manifest_sha256={pin}")
    assert e.value.code == 2
    assert "--manifest_sha256 goes with --checkpoint" in _one_line(capsys.readouterr().err)
    cli(f"--checkpoint={listed}", f"--manifest_sha256={pin}")
    assert serve_cli.options_from_flags().manifest_sha256 == pin  # on to ckpt.restore


# 12. voicechat-load against nothing


def test_load_client_fails_fast_when_no_server_is_there():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cmd = [sys.executable, "-m", "voicechat_jax.cli.load", f"--url=http://127.0.0.1:{port}"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=30)
    assert time.monotonic() - t0 < 15
    assert out.returncode == 1
    line = _one_line(out.stderr, "voicechat-load")
    assert line.startswith(f"voicechat-load: cannot reach a server at http://127.0.0.1:{port} (")


# ---------------------------------------------------------------------------------------------
# the network: one tiny server on loopback


def _host_params(precision: Precision):
    """Random weights made on the host (``voicechat.init`` would compile for tens of seconds)."""
    rng = np.random.default_rng(0)

    def leaf(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.asarray(0.05 * rng.standard_normal(a.shape, np.float32), a.dtype)
        return jnp.zeros(a.shape, a.dtype)

    return jax.tree.map(leaf, voicechat.abstract(CFG, precision))


class Served:
    """``runner.run`` serving live calls on a thread; ``stop`` drains it and returns the result."""

    def __init__(self, output_dir):
        self.output_dir = output_dir
        self.stop_event = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self.options = runner.RunOptions(
            serve=ServeConfig(slots=2, context_frames=1500, precision=PREC),
            sessions=0,
            seconds=math.inf,
            output_dir=str(output_dir),
            clock="realtime",
            loop="dispatch",
            warmup_ticks=1,
            listen="127.0.0.1:0",
            net={
                "idle_timeout_s": 5.0,
                "heartbeat_s": 1.0,
                "max_protocol_errors": MAX_PROTOCOL_ERRORS,
                "header_timeout_s": HEADER_TIMEOUT_S,
                "body_timeout_s": HEADER_TIMEOUT_S,
                "max_pending_connections": MAX_PENDING,
            },
        )
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result = runner.run(self.options, stop=self.stop_event)
        except BaseException as e:
            self.error = e

    def start(self) -> Served:
        self._thread.start()
        listen = self.output_dir / "listen.json"
        deadline = time.monotonic() + 120
        while not listen.exists():
            assert self.error is None, self.error
            assert time.monotonic() < deadline
            time.sleep(0.05)
        self.url = json.loads(listen.read_text())["url"]
        self.host, self.port = "127.0.0.1", int(self.url.rsplit(":", 1)[1])
        while self.get("/readyz")[0] != 200:
            assert self.error is None, self.error
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return self

    def stop(self):
        if self._thread.is_alive():
            self.stop_event.set()
            self._thread.join(60)
        assert self.error is None, self.error
        return self.result

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return 0, b""

    def metrics(self) -> dict[str, float]:
        from voicechat_jax.serving.net import load

        return load.scrape(self.url)

    def call(self, coro_fn):
        """Runs ``coro_fn(ws)`` on a new WebSocket call (aiohttp's client) after its
        ``session.created``; returns what it returns."""

        async def go():
            async with (
                aiohttp.ClientSession() as http,
                http.ws_connect(self.url + "/v1/realtime", heartbeat=None) as ws,
            ):
                first = await ws.receive_json(timeout=10)
                assert first["type"] == "session.created", first
                await ws.receive_json(timeout=10)  # response.created
                return await coro_fn(ws)

        return asyncio.run(go())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        params = _host_params(PREC)
        mp.setattr(runner, "build", lambda options, mesh=None: (CFG, params, options.serve, None))
        s = Served(tmp_path_factory.mktemp("served")).start()
        try:
            yield s
        finally:
            s.stop_event.set()
            s._thread.join(60)


async def _next_of(ws, kind: str, timeout: float = 5.0) -> dict:
    """The next event of ``kind`` (audio and other events skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = await ws.receive(timeout=max(0.01, deadline - time.monotonic()))
        assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data, ws.close_code)
        event = json.loads(msg.data)
        if event["type"] == kind:
            return event


# 4. malformed session.update


MALFORMED = {
    "audio.input a list": json.dumps(
        {"type": "session.update", "session": {"audio": {"input": [24000]}}}
    ),
    "nested 5000 deep": '{"type": "session.update", "session": ' + "[" * 5000 + "]" * 5000 + "}",
    "an integer too large": '{"type": "session.update", "session": {"voicechat": '
    + '{"input_sample_rate": '
    + "9" * 5000
    + "}}}",
}


def test_malformed_session_update_is_an_error_and_the_call_goes_on(served):
    async def probe(ws):
        codes = []
        for text in MALFORMED.values():
            await ws.send_str(text)
            codes.append((await _next_of(ws, "error"))["error"]["code"])
        end = time.monotonic() + 1.5 * HEADER_TIMEOUT_S  # a call outlives the HTTP timeouts
        while time.monotonic() < end:  # reading (which answers the server's pings)
            msg = await ws.receive(timeout=5)
            assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, ws.close_code)
        await ws.send_json(
            {"type": "session.update", "session": {"voicechat": {"output_sample_rate": 16000}}}
        )
        updated = await _next_of(ws, "session.updated")
        return codes, updated, ws.closed

    codes, updated, closed = served.call(probe)
    assert codes == [
        p.ErrorCode.INVALID_SESSION_CONFIG,
        p.ErrorCode.INVALID_JSON,
        p.ErrorCode.INVALID_JSON,
    ]
    assert updated["session"]["voicechat"]["output_sample_rate"] == 16000
    assert not closed


# 3. slow clients, and 12: connections that leave early, malformed requests


def _raw(served) -> socket.socket:
    return socket.create_connection((served.host, served.port), timeout=10)


def _closed_after(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closes ``sock`` (None: still open after ``limit_s``)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_slow_clients_are_cut_off(served):
    with _raw(served) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers that never end
        took = _closed_after(slow, 5 * HEADER_TIMEOUT_S)
    assert took is not None, "still open"
    assert took < 3 * HEADER_TIMEOUT_S, took
    with _raw(served) as slow:  # a body that never arrives
        slow.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nab")
        took = _closed_after(slow, 5 * HEADER_TIMEOUT_S)
    assert took is not None, "still open"
    assert took < 3 * HEADER_TIMEOUT_S, took
    before = served.metrics()
    time.sleep(0.3)  # the scrape's connection closed
    idle = [_raw(served) for _ in range(MAX_PENDING)]  # as many as may wait
    try:
        with _raw(served) as one_more:
            took = _closed_after(one_more, HEADER_TIMEOUT_S / 2)
        assert took is not None, "a connection over the limit was kept"
    finally:
        for sock in idle:
            sock.close()
    after = served.metrics()
    assert after["voicechat_net_connections_over_limit_total"] >= (
        before["voicechat_net_connections_over_limit_total"] + 1
    )
    deadline = time.monotonic() + 5
    while served.get("/healthz")[0] != 200:  # the limit frees as they go
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert served.get("/")[0] == 200  # the page, sent through the guarded connection


def test_connections_that_leave_early_are_counted(served):
    key = "voicechat_net_connections_without_request_total"
    time.sleep(0.3)  # the last test's connections are all closed
    before = served.metrics()[key]
    with _raw(served):  # a bare handshake
        pass
    reset = _raw(served)  # a reset mid-request
    reset.sendall(b"GET /v1/realtime HTTP/1.1\r\n")
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset.close()
    deadline = time.monotonic() + 5
    while served.metrics()[key] < before + 2:
        assert time.monotonic() < deadline, served.metrics()[key]
        time.sleep(0.05)
    assert "voicechat_net_calls_unstarted_total" in served.metrics()


def test_a_malformed_request_is_one_log_line(served, caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    with _raw(served) as bad:
        bad.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        assert bad.recv(4096).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    deadline = time.monotonic() + 5
    while not [r for r in caplog.records if r.name == "aiohttp.server"]:
        assert time.monotonic() < deadline, "nothing logged"
        time.sleep(0.02)
    (record,) = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert record.exc_info is None, record.getMessage()
    assert "\n" not in record.getMessage()
    assert record.getMessage().startswith("Error handling request from 127.0.0.1: ")


# 10 (last: it stops the server). Calls a client ended badly are not the server's failures.


def test_client_errors_are_not_server_failures(served):
    async def too_many_errors(ws):
        for _ in range(MAX_PROTOCOL_ERRORS + 1):
            await ws.send_str("not json")
        while (await ws.receive(timeout=10)).type == aiohttp.WSMsgType.TEXT:
            pass
        return ws.close_code

    assert served.call(too_many_errors) == p.CloseCode.POLICY_VIOLATION

    async def vanish():
        async with websockets.connect(served.url.replace("http", "ws") + "/v1/realtime") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            ws.transport.abort()  # gone: no close frame

    asyncio.run(vanish())
    deadline = time.monotonic() + 10
    key = 'voicechat_sessions_ended_total{reason="client error"}'  # the server's own count
    while served.metrics().get(key, 0) < 2:
        assert time.monotonic() < deadline, served.metrics()
        time.sleep(0.05)
    metrics = served.metrics()
    assert metrics['voicechat_net_calls_ended_total{reason="client error"}'] == 2
    assert metrics["voicechat_sessions_failed_total"] == 0
    result = served.stop()  # the drain SIGTERM would start
    assert (result.stopped, result.failed) == (True, 0)  # voicechat-serve exits 0
    sessions = json.loads((served.output_dir / "sessions.json").read_text())
    assert sessions["failures"] == {}
    assert sessions["ended_by_reason"]["client error"] == 2
    with contextlib.suppress(KeyError):
        assert sessions["ended_by_reason"]["failed"] == 0


# A server that does not fit its device (an H100's autotuner, 2026-12-06)


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (
            lambda: MemoryPlanError("the state does not fit: 64 slots x 934.3 MiB ... at most 51"),
            2,
            "voicechat-serve: --slots=64: the state does not fit: 64 slots x 934.3 MiB",
        ),
        (
            lambda: jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.11GiB\nmore"
            ),
            1,
            "voicechat-serve: --slots=64: the device ran out of memory (RESOURCE_EXHAUSTED: "
            "Out of memory while trying to allocate 1.11GiB); serve fewer slots",
        ),
    ],
)
def test_slots_that_do_not_fit_are_one_line_errors(cli, capsys, monkeypatch, error, code, message):
    """The memory plan's refusal (exit 2) and a device that runs out of memory past it, such as
    the GPU autotuner's buffers while the tick compiles (exit 1): one line each, no traceback."""

    def build(*a, **k):
        raise error()

    monkeypatch.setattr(runner, "build", build)
    cli("--slots=64", "--sessions=1", "--clock=offline")
    got, line = _main_exits(capsys)
    assert got == code
    assert line.startswith(message)


def test_other_runtime_errors_keep_their_traceback(cli, monkeypatch):
    def build(*a, **k):
        raise jax.errors.JaxRuntimeError("INTERNAL: a bug")

    monkeypatch.setattr(runner, "build", build)
    cli("--slots=2", "--sessions=1", "--clock=offline")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        serve_cli.main(["voicechat-serve"])
