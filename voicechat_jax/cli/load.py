r"""voicechat-load: N concurrent live calls against a ``voicechat-serve --listen`` server.

Each client paces 80 ms frames of the input (the bundled speech recording by default, resampled
to ``--rate``) on its own clock, with no catch-up burst, and measures the arrival jitter of the
audio it gets back, the underruns of a ``--buffer_ms`` playback buffer, and the server's beat
latency and misses as reported to it; once all N are in, client N+1 connects and should be
refused. It prints one line per client and a summary, and writes JSON rows to ``--rows``. A
server with an API key takes it from ``$VOICECHAT_API_KEY``.

  voicechat-serve --listen=127.0.0.1:8765 --slots=8 &
  voicechat-load --url=http://127.0.0.1:8765 --clients=8 --seconds=30 --rows=load.jsonl

Exit status: 0 every client was admitted and served; 1 some client was not (or the run failed);
2 bad flags.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.error
import urllib.request

from absl import app, flags, logging

from voicechat_jax.cli import flag_parsing

FLAGS = flags.FlagValues()  # this app's own flags (cli.flag_parsing)
flags.DEFINE_string(
    "url", "http://127.0.0.1:8765", "The server's base URL (or its ws:// URL).", flag_values=FLAGS
)
flags.DEFINE_integer("clients", 8, "Concurrent calls.", flag_values=FLAGS)
flags.DEFINE_float("seconds", 20.0, "Length of each call.", flag_values=FLAGS)
flags.DEFINE_string(
    "input_wav", None, "16 kHz mono WAV to send (default: the bundled speech).", flag_values=FLAGS
)
flags.DEFINE_enum(
    "rate", "24000", ["16000", "24000"], "PCM16 sample rate in and out.", flag_values=FLAGS
)
flags.DEFINE_float(
    "buffer_ms", 100.0, "The simulated playback buffer (jitter buffer).", flag_values=FLAGS
)
flags.DEFINE_bool(
    "probe_refusal",
    True,
    "Once all are in, connect one more (expect a refusal).",
    flag_values=FLAGS,
)
flags.DEFINE_float("stagger_ms", 0.0, "Delay between the clients' starts.", flag_values=FLAGS)
flags.DEFINE_string(
    "rows", None, "Write one JSON row per client and a summary row here.", flag_values=FLAGS
)

flags.register_validator("clients", lambda v: v >= 1, "must be >= 1", flag_values=FLAGS)
flags.register_validator("seconds", lambda v: v > 0, "must be > 0", flag_values=FLAGS)
flags.register_validator("buffer_ms", lambda v: v > 0, "must be > 0", flag_values=FLAGS)
flags.DEFINE_float(
    "connect_timeout_s",
    5.0,
    "A server that does not answer /healthz this soon is not there.",
    flag_values=FLAGS,
)


def _fail(message: str, code: int = 1) -> None:
    sys.stderr.write(f"voicechat-load: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def _reachable(url: str, timeout_s: float) -> None:
    """Exits in one line unless the server answers ``/healthz`` within ``timeout_s``."""
    base = url.replace("ws", "http", 1).split("/v1/realtime")[0].split("?")[0].rstrip("/")
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=timeout_s):
            return
    except urllib.error.HTTPError as e:
        _fail(f"{base} answered /healthz with HTTP {e.code}: not a voicechat-serve --listen")
    except (OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        _fail(f"cannot reach a server at {base} ({why}); is voicechat-serve --listen running?")


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flag_parsing.parse(FLAGS, argv, __doc__)
    except flags.Error as e:
        _fail(str(e).replace("\n", " "), 2)
        raise  # not reached


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    import numpy as np
    import soxr
    import websockets

    import voicechat_jax
    from voicechat_jax.serving import audio as audio_lib
    from voicechat_jax.serving.net import load

    _reachable(FLAGS.url, FLAGS.connect_timeout_s)
    rate = int(FLAGS.rate)
    bundled = os.path.join(os.path.dirname(voicechat_jax.__file__), "assets", "speech_16k.wav")
    wav = audio_lib.read_wav(FLAGS.input_wav or bundled, expected_rate=16000)
    if rate != 16000:
        wav = soxr.resample(wav, 16000, rate)
    pcm = np.rint(np.clip(wav, -1.0, 1.0) * 32767.0).astype("<i2")
    logging.info("%d clients x %g s against %s", FLAGS.clients, FLAGS.seconds, FLAGS.url)
    try:
        rows = asyncio.run(
            load.run_load(
                FLAGS.url,
                pcm,
                clients=FLAGS.clients,
                seconds=FLAGS.seconds,
                rate=rate,
                buffer_ms=FLAGS.buffer_ms,
                probe_refusal=FLAGS.probe_refusal,
                stagger_s=FLAGS.stagger_ms / 1000.0,
                api_key=os.environ.get("VOICECHAT_API_KEY") or None,  # the server's, if it has one
            )
        )
    except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as e:
        # the server went away mid-run, or is not what it seemed
        _fail(f"the calls to {FLAGS.url} failed: {type(e).__name__}: {e}")
    try:
        server = load.scrape(FLAGS.url)
    except OSError as e:
        logging.warning("could not read the server's /metrics: %s", e)
        server = None
    summary = load.summarize(rows, FLAGS.clients, server)
    print(load.format_table(rows, summary))  # the CLI's report; the library never prints
    if FLAGS.rows:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.rows)), exist_ok=True)
        with open(FLAGS.rows, "w") as f:
            for r in rows:
                f.write(json.dumps(r.to_json()) + "\n")
            f.write(json.dumps(summary) + "\n")
    served = all(r.admitted and r.frames_received > 0 for r in rows if r.client < FLAGS.clients)
    sys.exit(0 if served else 1)


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
