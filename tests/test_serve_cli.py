"""``voicechat-serve`` as a user runs it: the README's command, flags, signals, bad flags.

The README's command and the signal tests run the real entry point, a subprocess of this
checkout's code (``PYTHONPATH`` points at it, whatever ``voicechat-serve`` on the ``PATH`` was
installed from). Every other run calls the app in this process (``serve_main``: the flags parsed
by the app's own parser, then ``cli.serve.main``), so that the runs share this process's compiled
programs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import wave

import pytest

from voicechat_jax.cli import serve as serve_cli

REPO = pathlib.Path(__file__).resolve().parent.parent
ASSET = REPO / "voicechat_jax" / "assets" / "speech_16k.wav"
SAMPLES_PER_FRAME = 1764  # 22.05 kHz output samples per 80 ms frame


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _cmd(*flags: str, console_script: bool = False) -> list[str]:
    exe = shutil.which("voicechat-serve") if console_script else None
    return [exe, *flags] if exe else [sys.executable, "-m", "voicechat_jax.cli.serve", *flags]


def _run(*flags: str, cwd=None, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(*flags, **kw), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env()
    )


@dataclasses.dataclass
class Ran:
    """What an in-process run of the app left: its exit status, stdout, stderr and log."""

    returncode: int
    stdout: str
    stderr: str
    log: str


@pytest.fixture
def serve_main(capsys, caplog):
    """``serve_main(*flags)``: ``voicechat-serve FLAGS`` in this process; a bad flag or a run
    that cannot start exits with its status as ``SystemExit`` does."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="absl")

    def call(*flags: str) -> Ran:
        capsys.readouterr()
        caplog.clear()
        try:
            code = serve_cli.main(serve_cli._parse_flags(["voicechat-serve", *flags]))
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return Ran(code, out.out, out.err, caplog.text)

    return call


def _table(stdout: str) -> dict[str, str]:
    """The summary table's rows (name -> value)."""
    rows = [re.split(r" {2,}", line, maxsplit=1) for line in stdout.splitlines()]
    return {row[0]: row[1] for row in rows if len(row) == 2}


def _event_ticks(rows: list[dict], event: str) -> dict[str, int]:
    """Session -> tick of each ``event`` row of a run's metrics."""
    return {r["session"]: r["tick"] for r in rows if r.get("event") == event}


def _rows(path: pathlib.Path) -> list[dict]:
    """JSON lines, skipping a last line still being written."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _session_frames(d: pathlib.Path) -> tuple[int, int]:
    """(frames in frames.jsonl, frames in output.wav); every line parses, frames are contiguous."""
    rows = [json.loads(line) for line in (d / "frames.jsonl").read_text().splitlines()]
    assert [r["frame"] for r in rows] == list(range(len(rows)))
    assert all({"text", "function", "codes", "transcript"} <= set(r) for r in rows)
    with wave.open(str(d / "output.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (22050, 1, 2)
        n = w.getnframes()
        assert len(w.readframes(n)) == 2 * n  # the header's count is really there
    assert n % SAMPLES_PER_FRAME == 0
    return len(rows), n // SAMPLES_PER_FRAME


def _check_outputs(out_dir: str, sessions: int, ticks: int) -> None:
    """Each session's files agree with each other and with the tick records.

    On the real-time clock a tick the host fell a whole beat behind on is skipped (counted as a
    miss, no output), so a session has 2 frames per tick that ran.
    """
    records = _rows(pathlib.Path(out_dir) / "metrics.jsonl")
    tick_rows = [r for r in records if r.get("type") == "tick"]
    assert len(tick_rows) == ticks
    ran = sum(not r["skipped"] for r in tick_rows)
    assert ran >= ticks // 2
    assert records[-1]["type"] == "summary"
    for i in range(sessions):
        assert _session_frames(pathlib.Path(out_dir) / f"s{i:03d}") == (2 * ran, 2 * ran)


def test_readme_command_runs_the_embedded_default(tmp_path):
    """Exactly the README's run command: 4 sessions of the bundled recording, 10 s, real time."""
    proc = _run(cwd=tmp_path, console_script=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "beat latency ms p50/p99/p99.9/max" in proc.stdout
    assert "late, by cause" in proc.stdout
    _check_outputs(str(tmp_path / "runs" / "serve" / "latest"), sessions=4, ticks=62)


@pytest.mark.parametrize(("loop", "ssm_kernel"), [("dispatch", "pallas"), ("resident", "xla")])
def test_flags(serve_main, tmp_path, loop, ssm_kernel):
    out = tmp_path / "out"
    proc = serve_main(
        f"--loop={loop}",
        f"--ssm_kernel={ssm_kernel}",
        "--clock=offline",
        "--speech_sampling=deterministic",
        "--slots=2",
        "--sessions=3",
        "--seconds=0.8",
        f"--output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # a refusal at capacity is not a failure
    _check_outputs(str(out), sessions=2, ticks=5)
    with open(out / "sessions.json") as f:
        failures = json.load(f)["failures"]
    assert "server full" in failures["s002"]
    assert "sessions refused" in proc.stdout


def test_context_cap_and_failed_sessions_are_reported(serve_main, tmp_path):
    """A session that reaches the cap is logged and counted; a rejected input fails its session,
    shows in the summary and makes the exit status 3."""
    bad = tmp_path / "bad.wav"
    bad.write_text("this is a text file, not audio at all")
    out = tmp_path / "out"
    proc = serve_main(
        "--context_frames=4",
        "--seconds=1.6",
        "--clock=offline",
        "--loop=dispatch",
        "--slots=2",
        "--sessions=2",
        f"--input_wav={ASSET}",
        f"--input_wav={bad}",
        f"--output_dir={out}",
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "session s000 ended at the context cap (4 frames)" in proc.log
    assert "1 session(s) failed" in proc.stderr
    table = _table(proc.stdout)
    assert table["sessions ended: context cap"] == "1"
    assert table["sessions failed"] == "1"
    assert _session_frames(out / "s000") == (4, 4)
    sessions = json.loads((out / "sessions.json").read_text())
    assert sessions["ended"] == {"s000": "context cap"}
    assert "not a RIFF/WAVE file" in sessions["failures"]["s001"]


def _serve_until(tmp_path, ticks: int, *flags: str):
    """Starts a 60 s real-time run (2 sessions on 4 slots); returns (process, output dir, ticks
    run) once ``ticks`` ran."""
    out = tmp_path / "out"
    log = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    # The README command's 4 slots: its programs are in the suite's compilation cache by now.
    cmd = _cmd("--seconds=60", "--sessions=2", "--slots=4", f"--output_dir={out}", *flags)
    proc = subprocess.Popen(cmd, stdout=log[0], stderr=log[1], text=True, env=_env())
    deadline = time.monotonic() + 500
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        metrics = out / "metrics.jsonl"
        if metrics.exists():
            rows = _rows(metrics)
            ran = sum(1 for r in rows if r["type"] == "tick" and not r["skipped"])
            if ran >= ticks:
                return proc, out, ran
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start serving in time")


@pytest.mark.parametrize(
    ("sig", "loop"), [(signal.SIGTERM, "dispatch"), (signal.SIGINT, "resident")]
)
def test_signal_drains_and_exits_0(tmp_path, sig, loop):
    """SIGTERM / SIGINT mid-run: every session ends with a shutdown event and its files hold at
    least every beat served before the signal, whole; exit 0 within the drain bound."""
    proc, out, ran_before = _serve_until(tmp_path, 8, f"--loop={loop}")
    t = time.monotonic()
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    drain_s = time.monotonic() - t
    stderr = (tmp_path / "stderr.txt").read_text()
    assert rc == 0, stderr[-3000:]
    assert drain_s < 10.0  # --drain_timeout_s, the README's bound
    assert "Traceback" not in stderr
    rows = _rows(out / "metrics.jsonl")
    assert rows[-1]["type"] == "summary"
    ran = sum(1 for r in rows if r["type"] == "tick" and not r["skipped"])
    assert ran_before <= ran < ran_before + 20
    ended = sorted(
        (r["session"], r["reason"]) for r in rows if r["type"] == "event" and r["event"] == "ended"
    )
    assert ended == [("s000", "shutdown"), ("s001", "shutdown")]
    for sid in ("s000", "s001"):
        assert _session_frames(out / sid) == (2 * ran, 2 * ran)
    sessions = json.loads((out / "sessions.json").read_text())
    assert sessions["ended"] == {"s000": "shutdown", "s001": "shutdown"}
    assert sessions["stopped"] is True
    stdout = (tmp_path / "stdout.txt").read_text()
    assert "stopped by signal" in stdout
    drained = float(re.search(r"drained in ([0-9.]+) s", stdout).group(1))
    assert drained < drain_s


def test_second_signal_exits_at_once(tmp_path):
    """A second signal does not wait for the drain; the files are still valid."""
    proc, out, ran_before = _serve_until(tmp_path, 8, "--loop=dispatch")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=30)
    assert rc in (128 + signal.SIGINT, 128 + signal.SIGTERM)
    assert "exiting now" in (tmp_path / "stderr.txt").read_text()
    for sid in ("s000", "s001"):
        lines, wav_frames = _session_frames(out / sid)
        assert lines >= 2 * ran_before
        assert wav_frames in (lines, lines - 2)  # the beat being written may be in one file only


BAD_FLAGS = [
    ("--slots=0", "--slots=0: must be >= 1"),
    ("--frames_per_tick=0", "--frames_per_tick=0: must be in [1, 8] (the encoder's cache ring)"),
    ("--frames_per_tick=9", "--frames_per_tick=9: must be in [1, 8]"),
    ("--context_frames=1", "context cap is below one beat"),
    ("--seconds=0", "--seconds=0.0: must be > 0"),
    ("--seconds=-3", "--seconds=-3.0: must be > 0"),
    ("--sessions=0", "--sessions=0: must be >= 1"),
    ("--deadline_ms=500", "the deadline must be in (0, 160] ms"),
    ("--system_prompt=12,x", "token ids must be non-negative integers"),
    ("--at_cap=wrap", "--at_cap=wrap: value should be one of <end|reset|memory|rollover>"),
    ("--model=nope", "--model=nope: must be a preset"),
    ("--no_such_flag=1", "Unknown command line flag 'no_such_flag'"),
    ("--output_dir=FILE", "exists and is not a directory"),
    ("--output_dir=FILE/sub", "cannot be written: Not a directory"),
    ("--devices=0", "--devices=0: must be >= 1"),
    ("--devices=2 --loop=resident", "--devices > 1 needs --loop=dispatch"),
    ("--devices=3 --slots=4", "--slots=4 does not split evenly over --devices=3"),
    ("--buckets=2,4", "--buckets needs --scheduler=buckets"),
    ("--scheduler=fifo", "--scheduler=fifo: value should be one of <lockstep|buckets>"),
    ("--max_live=0", "--max_live=0 must be in [1, --slots=4]"),
    ("--max_live=3 --slots=2", "--max_live=3 must be in [1, --slots=2]"),
    ("--admission_queue_s=-1", "--admission_queue_s=-1.0: must be >= 0"),
    ("--codec_in_attention --precision=tf32_codec", "codec_in_attention runs the codec's products"),
    ("--codec_in_attention --codec_stream", "two places for one codec"),
]


@pytest.mark.parametrize(("flag", "message"), BAD_FLAGS, ids=[f for f, _ in BAD_FLAGS])
def test_bad_flag_fails_fast_with_one_line(serve_main, tmp_path, flag, message):
    afile = tmp_path / "FILE"
    afile.write_text("a file, not a directory")
    flag = flag.replace("FILE", str(afile))
    out = tmp_path / "out"
    args = (
        flag.split() if flag.startswith("--output_dir") else [f"--output_dir={out}", *flag.split()]
    )
    t = time.monotonic()
    proc = serve_main(*args)
    elapsed = time.monotonic() - t
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("voicechat-serve: ")
    assert message in lines[0]
    assert not (out / "metrics.jsonl").exists()  # nothing was built or run
    assert elapsed < 5  # refused before anything is built


@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_checkpoint_error_is_one_line(serve_main, tmp_path, kind):
    ckpt = tmp_path / "ckpt"
    if kind == "empty":
        ckpt.mkdir()
    proc = serve_main(f"--checkpoint={ckpt}", f"--output_dir={tmp_path / 'out'}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    mine = [line for line in proc.stderr.splitlines() if line.startswith("voicechat-serve:")]
    assert len(mine) == 1
    assert str(ckpt) in mine[0]


def test_help_lists_the_servers_flags(serve_main):
    proc = serve_main("--help")
    assert proc.returncode == 0
    for flag in ("--slots", "--context_frames", "--at_cap", "--system_prompt", "--deadline_ms"):
        assert flag in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--scheduler=buckets", "--loop=resident"), "--scheduler=buckets needs --loop=dispatch"),
        (("--scheduler=buckets", "--slots=4", "--buckets=1,2"), "--buckets must end at --slots=4"),
        (("--scheduler=buckets", "--buckets=2,x"), "--buckets must be slot counts >= 1"),
    ],
)
def test_bad_scheduler_flags_fail_fast(serve_main, tmp_path, flags, message):
    proc = serve_main(*flags, f"--output_dir={tmp_path / 'out'}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("voicechat-serve: ")
    assert message in lines[0]


def test_scheduler_buckets_serves_churn_with_moves(serve_main, tmp_path):
    """``--scheduler=buckets``: three slot buckets compiled before the clock; sessions join and
    leave at random and each still gets 2 frames per live tick, in order, in both files."""
    from voicechat_jax.config import ServeConfig
    from voicechat_jax.serving import runner

    out = tmp_path / "out"
    proc = serve_main(
        "--scheduler=buckets",
        "--shrink_after=1",
        "--slots=4",
        "--sessions=6",
        "--churn",
        "--seed=3",
        "--clock=offline",
        "--seconds=2.4",
        f"--output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bucket engine: 3 ticks (1,2,4 slots), 2 pads, 6 resizes compiled" in proc.log
    opts = runner.RunOptions(serve=ServeConfig(slots=4), sessions=6, churn=True, seed=3,
                             seconds=2.4)  # fmt: skip
    plans, _ = runner.plans_for(opts, opts.n_ticks, [("x", None)] * 6)
    failures = json.loads((out / "sessions.json").read_text())["failures"]
    served = 0
    for p in plans:
        if p.id in failures:
            assert "server full" in failures[p.id]
            continue
        frames = 2 * ((p.leave or opts.n_ticks) - p.join)
        assert _session_frames(out / p.id) == (frames, frames)
        served += 1
    assert served >= 4


def _admission_run(serve_main, tmp_path, loop: str, *flags: str) -> tuple[pathlib.Path, dict]:
    """Three scripted sessions on 2 slots behind ``--max_live=1`` (offline clock, ``loop``), with
    ``flags``; asserts the run exits 0 and returns (output dir, summary table)."""
    out = tmp_path / "out"
    proc = serve_main(f"--loop={loop}", "--clock=offline", "--slots=2", "--max_live=1",
                      "--sessions=3", *flags, f"--output_dir={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, _table(proc.stdout)


@pytest.mark.parametrize("loop", ["dispatch", "resident"])
def test_max_live_refuses_past_the_threshold_at_once(serve_main, tmp_path, loop):
    """``--max_live=1`` on 2 slots, no queue: the sessions past the first are refused at tick 0
    (a slot stays empty), and the run still exits 0 (a refusal is not a failure); on either
    loop. The 4-frame cap is the queue test's below: one compiled configuration for both."""
    out, table = _admission_run(serve_main, tmp_path, loop, "--context_frames=4", "--seconds=0.8")
    assert table["sessions refused"] == "2"
    assert table["sessions queued (beats waited)"] == "0 (0)"
    failures = json.loads((out / "sessions.json").read_text())["failures"]
    assert sorted(failures) == ["s001", "s002"]
    for sid in ("s001", "s002"):
        assert f"(limit 1); session {sid} refused" in failures[sid]
        assert "waiting" not in failures[sid]
    rows = _rows(out / "metrics.jsonl")
    assert _event_ticks(rows, "refused") == {"s001": 0, "s002": 0}
    assert rows[-1]["admission"] == {
        "max_live": 1, "queue_beats": 0, "queued": 0, "waited_beats": 0
    }  # fmt: skip
    assert _session_frames(out / "s000") == (4, 4)  # ended at its cap
    assert not (out / "s001").exists()


@pytest.mark.parametrize("loop", ["dispatch", "resident"])
def test_admission_queue_admits_when_a_session_ends_then_times_out(serve_main, tmp_path, loop):
    """``--max_live=1 --admission_queue_s=0.5`` (4 beats, rounded up): s000 reaches its 4-frame
    context cap in 2 beats, is seen at it after the third and released at tick 3; s001, first in
    the queue, takes its place then; s002, behind it, is refused when its 4 beats are up."""
    out, table = _admission_run(
        serve_main, tmp_path, loop, "--admission_queue_s=0.5", "--context_frames=4", "--seconds=1.6"
    )
    assert table["sessions refused"] == "1"
    assert table["sessions queued (beats waited)"] == "2 (7)"  # s001 3 beats, s002 4
    sessions = json.loads((out / "sessions.json").read_text())
    assert sessions["ended"] == {"s000": "context cap", "s001": "context cap"}
    assert list(sessions["failures"]) == ["s002"]
    assert "session s002 refused after waiting 4 beats" in sessions["failures"]["s002"]
    rows = _rows(out / "metrics.jsonl")
    assert _event_ticks(rows, "admitted") == {"s000": 0, "s001": 3}
    assert _event_ticks(rows, "refused") == {"s002": 4}
    assert rows[-1]["admission"] == {
        "max_live": 1, "queue_beats": 4, "queued": 2, "waited_beats": 7
    }  # fmt: skip
    for sid in ("s000", "s001"):
        assert _session_frames(out / sid) == (4, 4)
