"""experiments/device_queue.sh: commands queued in one call run in order after it returns, each
with its exit status logged, and a later ``wait`` copies the log and the rows back to $OUT."""

from __future__ import annotations

import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "device_queue.sh"


def _run(*args, env):
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_queue_outlives_the_call_and_wait_copies_rows(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, DEVICE_QUEUE_DIR=str(tmp_path / "queue"), OUT=str(out))
    started = _run(
        "start",
        'sleep 1; echo "{\\"n\\": 1}" > $QUEUE_ROWS/rows.jsonl',
        "exit 3",
        'echo "$JAX_COMPILATION_CACHE_DIR" >> $QUEUE_ROWS/rows.jsonl',
        env=env,
    )
    assert started.returncode == 0, started.stderr
    assert "queue started" in started.stdout
    waited = _run("wait", "30", env=env)
    assert waited.returncode == 0, waited.stderr
    assert "queue done" in waited.stdout
    log = (out / "queue.log").read_text()
    assert log.index("start 1:") < log.index("end 1: rc=0") < log.index("start 2:")
    assert "end 2: rc=3" in log  # a failing command is logged, and the queue goes on
    assert "end 3: rc=0" in log
    rows = (out / "rows.jsonl").read_text().splitlines()
    assert rows[0] == '{"n": 1}'
    assert rows[1].endswith(".jax_cache")  # the compilation cache is set for every command


def test_a_start_after_the_queue_finished_runs_only_the_new_command(tmp_path):
    """The 2026-12-05 defect: a second `start` after the runner had finished ran the whole queue
    again from its first command (and the device time went to repeats)."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, DEVICE_QUEUE_DIR=str(tmp_path / "queue"), OUT=str(out))
    assert _run("start", "echo one >> $QUEUE_ROWS/ran", env=env).returncode == 0
    assert "queue done" in _run("wait", "30", env=env).stdout
    again = _run("start", "echo two >> $QUEUE_ROWS/ran", env=env)
    assert "queue started" in again.stdout
    assert "queue done" in _run("wait", "30", env=env).stdout
    assert (out / "ran").read_text().split() == ["one", "two"]
    assert "start 2: echo two" in (out / "queue.log").read_text()


def test_unknown_verb_is_refused(tmp_path):
    env = dict(os.environ, DEVICE_QUEUE_DIR=str(tmp_path / "queue"))
    r = _run("frobnicate", env=env)
    assert r.returncode == 2
    assert "usage" in r.stderr
