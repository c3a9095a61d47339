"""Network load: N live calls over real WebSockets against ``voicechat-serve --listen``.

Starts the server as its own process (``--slots`` = ``--clients``, on loopback), waits until
``/readyz`` says it is ready (the tick compiled), runs the load client (``serving.net.load``: N
calls paced on their own clocks, then call N+1, which must be refused), reads the server's
``/metrics``, drains the server with SIGTERM and takes its own summary from its ``metrics.jsonl``.
One JSON row per client, one summary row (with the server's figures), appended to ``--rows``, each
with its provenance (``experiments.harness``; the device is the first JAX device of this machine,
which the server runs on); a table at the end. See README.md beside this file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
import soxr
from absl import app, flags, logging

from experiments import harness
from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving.net import load

FLAGS = flags.FLAGS
flags.DEFINE_integer("clients", 8, "Concurrent calls (the server gets as many slots).")
flags.DEFINE_float("seconds", 30.0, "Length of each call.")
flags.DEFINE_string("checkpoint", None, "A converted checkpoint (default: the tiny random model).")
flags.DEFINE_string("model", "tiny", "Preset without --checkpoint.")
flags.DEFINE_list("server_flags", [], "More voicechat-serve flags, comma-separated.")
flags.DEFINE_string("label", None, "Names the run in the rows.")
flags.DEFINE_string("rows", None, "JSON-lines file the rows are appended to.")
flags.DEFINE_float("ready_timeout_s", 1800.0, "How long the server may take to compile.")
flags.DEFINE_string(
    "server_dir",
    None,
    "Keep the server's outputs (metrics.jsonl with every tick's host timeline, "
    "server.log) here instead of a temporary directory.",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def main(argv: list[str]) -> None:
    del argv
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    out = FLAGS.server_dir or tempfile.mkdtemp(prefix="network_load_")
    os.makedirs(out, exist_ok=True)
    cmd = [
        sys.executable, "-m", "voicechat_jax.cli.serve", f"--listen=127.0.0.1:{port}",
        f"--slots={FLAGS.clients}", f"--output_dir={out}", "--idle_timeout_s=30",
    ]  # fmt: skip
    cmd += [f"--checkpoint={FLAGS.checkpoint}"] if FLAGS.checkpoint else [f"--model={FLAGS.model}"]
    cmd += FLAGS.server_flags
    logging.info("server: %s", " ".join(cmd))
    with open(os.path.join(out, "server.log"), "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + FLAGS.ready_timeout_s
        while not _ready(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready; see {out}/server.log")
            time.sleep(0.5)
        assets = os.path.join(os.path.dirname(audio_lib.__file__), "..", "assets")
        wav = audio_lib.read_wav(os.path.join(assets, "speech_16k.wav"))
        pcm = np.rint(np.clip(soxr.resample(wav, 16000, 24000), -1, 1) * 32767).astype("<i2")
        t0 = time.time()
        rows = asyncio.run(load.run_load(url, pcm, clients=FLAGS.clients, seconds=FLAGS.seconds))
        scraped = load.scrape(url)
        summary = load.summarize(rows, FLAGS.clients, scraped)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    report = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row.get("type") == "summary":
                report = row
    summary.update(
        label=FLAGS.label or (FLAGS.checkpoint or FLAGS.model),
        seconds=FLAGS.seconds,
        started=t0,
        server_exit=server.returncode,
        server_ticks=report.get("ticks"),
        server_latency_ms=report.get("latency_ms"),
        server_missed_ticks=report.get("missed_ticks"),
        server_missed_by_cause=report.get("missed_by_cause"),
        server_skipped_by_cause=report.get("skipped_by_cause"),
        loadavg_1m=os.getloadavg()[0],
    )
    print(load.format_table(rows, summary))
    lat = report.get("latency_ms") or {}
    print(
        f"server: {report.get('ticks')} steady ticks, beat ms p50/p99/max "
        f"{lat.get('p50')}/{lat.get('p99')}/{lat.get('max')}, missed ticks "
        f"{report.get('missed_ticks')} (late {report.get('missed_by_cause')}, skipped "
        f"{report.get('skipped_by_cause')}), exit {server.returncode}"
    )
    if FLAGS.rows:
        log = harness.RowLog(FLAGS.rows)
        for r in rows:
            log.write({**r.to_json(), "label": summary["label"]})
        log.write(summary)


if __name__ == "__main__":
    app.run(main)
