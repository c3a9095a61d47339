r"""voicechat-serve: serve full-duplex voice sessions on the beat clock.

With no flags it runs the embedded default: the ``tiny`` model with random weights, the bundled
speech recording, 4 sessions for 10 s on the real-time clock. It prints the latency and miss table
and streams, per session, ``output.wav`` (22.05 kHz), ``frames.jsonl`` and, where a tokenizer is
available, ``transcript.txt``; plus ``metrics.jsonl`` and ``sessions.json`` for the run. They go
into ``--output_dir``, by default a new ``runs/serve/<YYYYmmdd-HHMMSS>/`` for each run
(``runs/serve/latest`` links to it); a directory another run is using is refused, and one that
holds a finished run unless ``--overwrite`` (``serving.outdir``).

  voicechat-serve --checkpoint=checkpoints/voicechat_11b --slots=32 --sessions=32 --seconds=80

With ``--listen=HOST:PORT`` it serves live calls over the network until stopped (docs/protocol.md:
a WebSocket at ``/v1/realtime`` in the OpenAI Realtime API's events, ``/healthz``, ``/readyz``,
``/metrics``, and a browser page at ``/``); scripted sessions run beside them only when
``--sessions`` is given, and the run ends after ``--seconds`` only when that is given.

  voicechat-serve --listen=0.0.0.0:8765 --slots=8

With ``--max_live`` and ``--admission_queue_s`` the scheduler runs behind an admission threshold
and a queue with a timeout (``scheduler.AdmissionControl``; experiments/admission_overload: 72
and a 10-30 s queue on one H200): a session that finds the server full waits, then is refused.

With ``--devices=N`` the slots split over the first N local devices (``voicechat_jax.mesh``: each
device steps its own ``slots / N``, no collective); the dispatch loop only. With
``--model_parallel=M`` as well, the devices form N / M groups of M: the slots split over the
groups, and within a group the LLM's weights and state split over its M devices (tensor
parallelism: one all-reduce per LLM layer; the rest of the model runs on each of the M). More
than one host: one server per host (or per GPU) behind a router, docs/fleet.md.

Flags are checked before anything is built (with the ``--listen`` address resolved and bound
once, the ``--system_prompt`` ids checked against the model's vocabulary); a bad one is refused
in one line. Compiles go to JAX's persistent cache (``--compilation_cache_dir``), so that a second
start is fast; the time to ready is logged. SIGTERM, SIGINT or SIGHUP drains the server (no new
session, the beat in flight finished, every live session ended with a ``shutdown`` event, its
files closed) and exits within ``--drain_timeout_s``; a second signal exits at once.

Exit status: 0 served (or drained) with no failed session; 1 could not run (a checkpoint that
cannot be restored, an output that cannot be written or that another run is using, a drain past
its timeout); 2 bad flags (an output directory holding a finished run, without ``--overwrite``);
3 served, but at least one scripted session failed (rejected input file, bad audio; sessions
refused at capacity do not count, nor live calls that their clients ended badly: those end as
``client error``); 128 + N on a second signal N.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import tempfile
import threading
import time

from absl import app, flags, logging

from voicechat_jax import config as config_lib
from voicechat_jax import precision as precision_lib
from voicechat_jax.cli import flag_parsing
from voicechat_jax.serving import outdir, runner

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SESSIONS_FAILED = 3
DEFAULT_RUNS = "runs/serve"  # each run without --output_dir gets a folder of its own here

FLAGS = flags.FlagValues()  # this app's own flags (cli.flag_parsing)
flags.DEFINE_string(
    "checkpoint", None, "A converted checkpoint directory (voicechat-convert).", flag_values=FLAGS
)
flags.DEFINE_string(
    "manifest_sha256",
    None,
    "With --checkpoint: the sha256 its integrity.json must have (printed by voicechat-convert), "
    "pinning every file it lists: integrity.json alone guards against damage, not tampering.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "model", "tiny", "Preset used without --checkpoint (random weights).", flag_values=FLAGS
)
flags.DEFINE_integer("slots", 4, "Slots the state is sized for (capacity).", flag_values=FLAGS)
flags.DEFINE_integer(
    "sessions", 4, "Scripted sessions to run (over --slots are refused).", flag_values=FLAGS
)
flags.DEFINE_float(
    "seconds",
    10.0,
    "Length of the run, finite (with --listen, leave it out to serve until stopped).",
    flag_values=FLAGS,
)
flags.DEFINE_integer("frames_per_tick", 2, "Model frames per beat (2 = 160 ms).", flag_values=FLAGS)
flags.DEFINE_integer(
    "context_frames", 1500, "Per-session context cap in frames (1500 = 120 s).", flag_values=FLAGS
)
flags.DEFINE_enum(
    "at_cap",
    "end",
    ["end", "reset", "memory", "rollover"],
    "What a session does at its context cap: end (with an event); reset or memory: roll over "
    "between a soft and a hard threshold (1125/1375 frames, scaled to a smaller cap), at a pause "
    "or at the hard one, to the system prompt alone (reset) or plus a capsule of the recent turns "
    "(memory); rollover: only at the cap, to the system prompt alone (the device's fallback).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "rollovers_per_beat",
    1,
    "reset/memory: sessions rolled over in one beat at most (each costs the beat a prefill of the "
    "capsule room; sessions due together are spread between the thresholds).",
    lower_bound=1,
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "system_prompt",
    [],
    "System prompt as LLM token ids, comma-separated (prefilled once).",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "deadline_ms",
    None,
    "Beat deadline in ms after the beat's start (default: the beat period).",
    flag_values=FLAGS,
)
flags.DEFINE_multi_string(
    "input_wav", None, "16 kHz mono WAV(s); sessions take them in turn.", flag_values=FLAGS
)
flags.DEFINE_string(
    "output_dir",
    None,
    f"Where per-session outputs and metrics go (default: a new {DEFAULT_RUNS}/<YYYYmmdd-HHMMSS>/ "
    f"for each run, {DEFAULT_RUNS}/latest linked to it). A directory another run is using is "
    "refused, and one that holds a finished run unless --overwrite.",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "overwrite",
    False,
    "Write into an --output_dir that holds a finished run (its files are replaced as the new "
    "run writes them).",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "JAX's persistent compilation cache, so that a second start skips the compiles (default: "
    "$JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/voicechat_jax/xla, under $XDG_CACHE_HOME "
    "if set; '' turns it off).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "loop",
    "auto",
    ["auto", "resident", "dispatch"],
    "How the tick is driven: resident (one on-device while loop for the run; its host callbacks "
    "only hand over each beat's input and output) or dispatch (one jitted call a beat). auto: "
    "resident on one device with one slot count (it held 51 faithful calls on an H100 at p99 "
    "111.2 ms against dispatch's 124.3, experiments/capacity), dispatch for --devices > 1 or "
    "--scheduler=buckets, which the resident loop does not serve.",
    flag_values=FLAGS,
)
flags.DEFINE_enum("clock", "realtime", ["realtime", "offline"], "Beat clock.", flag_values=FLAGS)
flags.DEFINE_integer(
    "devices",
    1,
    "Local devices to split the slots over (a data mesh: each device steps slots / devices of "
    "them; the dispatch loop only).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "model_parallel",
    1,
    "Devices per model group (with --devices): the LLM's weights and state split over each "
    "group's devices (tensor parallelism); the slots split over the --devices / "
    "--model_parallel groups.",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "speech_sampling",
    "faithful",
    ["faithful", "deterministic"],
    "Speech decoder sampler.",
    flag_values=FLAGS,
)
flags.DEFINE_bool("churn", False, "Sessions join and leave at random times.", flag_values=FLAGS)
flags.DEFINE_integer(
    "seed", 0, "Seed for random weights, churn and sampling keys.", flag_values=FLAGS
)
flags.DEFINE_enum(
    "precision",
    "reference",
    list(precision_lib.POLICIES),
    "Precision policy (dtypes, matmuls).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "warmup_ticks", 3, "Ticks reported as warm-up, apart from steady state.", flag_values=FLAGS
)
flags.DEFINE_enum(
    "ssm_kernel",
    "auto",
    [m.value for m in config_lib.SSMKernel],
    "Mamba-2 decode update (auto: the measured best for the device and slots, config.AUTO_KERNELS; "
    "pallas: the SSM update in place; fused: conv, SSM and norm in one).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "projection",
    "xla",
    [m.value for m in config_lib.ProjectionImpl],
    "LLM MLP and Mamba projections (pallas: the weight-streaming kernel).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "attention",
    "auto",
    [m.value for m in config_lib.AttentionImpl],
    "LLM decode attention (auto: the measured best for the device and slots).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "tts_attention",
    None,
    [m.value for m in config_lib.AttentionImpl],
    "Speech decoder attention (default: as --attention).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "codec_stream",
    False,
    "Experimental: each frame's codec step on a second GPU stream beside the next frame "
    "(ServeConfig.codec_stream; overlaps only with XLA_FLAGS="
    "--xla_gpu_experimental_stream_annotation=true).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "codec_in_attention",
    False,
    "Experimental: each frame's codec products inside the next frame's speech-decoder "
    "attention launches, one a layer (ServeConfig.codec_in_attention; fused where that attention "
    "is the 'pallas_mha' kernel).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "gc_policy",
    "slack",
    ["slack", "default"],
    "Garbage collection: only in a beat's slack after a frozen start-up heap (slack), or "
    "Python's automatic collector (default; for comparison).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "scheduler",
    "lockstep",
    ["lockstep", "buckets"],
    "Batching policy: lockstep (every slot every beat, one compiled tick) or buckets (ticks "
    "compiled for a few slot counts, live sessions compacted into the smallest that holds them: "
    "less device time at partial load; experiments/slot_buckets). Buckets need --loop=dispatch.",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "buckets",
    [],
    "Slot counts of --scheduler=buckets, ending at --slots (default: powers of two "
    "from slots/8, and slots).",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "shrink_after",
    25,
    "--scheduler=buckets: beats the live count must fit a smaller bucket "
    "before sessions are moved into it.",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "max_live",
    None,
    "Admission threshold: sessions live at once at most (default: every slot); one that finds "
    "them full waits up to --admission_queue_s, then is refused (experiments/admission_overload).",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "admission_queue_s",
    0.0,
    "Seconds a session that finds the server full (--max_live or every slot) waits for a slot, "
    "first come first served, before it is refused (0: refused at once).",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "drain_timeout_s",
    10.0,
    "After SIGTERM/SIGINT, exit 1 if draining takes longer than this.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "listen",
    None,
    "HOST:PORT: serve live calls over the network (WebSocket, HTTP) until stopped.",
    flag_values=FLAGS,
)
flags.DEFINE_float(
    "idle_timeout_s", 10.0, "With --listen: a call with no audio this long ends.", flag_values=FLAGS
)
flags.DEFINE_bool(
    "record_calls",
    False,
    "With --listen: write each call's files to --output_dir.",
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "api_key_file",
    None,
    "With --listen: calls and /capacity need the key in this file (Authorization: Bearer KEY); "
    "default $VOICECHAT_API_KEY, else no key.",
    flag_values=FLAGS,
)
flags.DEFINE_list(
    "allowed_origins",
    [],
    "With --listen: the browser origins (scheme://host[:port]) besides the server's own that may "
    "open calls; others are refused. Empty: any.",
    flag_values=FLAGS,
)

flags.register_validator("slots", lambda v: v >= 1, "must be >= 1", flag_values=FLAGS)
flags.register_validator("devices", lambda v: v >= 1, "must be >= 1", flag_values=FLAGS)
flags.register_validator("model_parallel", lambda v: v >= 1, "must be >= 1", flag_values=FLAGS)
flags.register_validator("sessions", lambda v: v >= 1, "must be >= 1", flag_values=FLAGS)
flags.register_validator(
    "seconds",
    lambda v: 0 < v < math.inf,
    "must be > 0 and finite (with --listen, leave it out to serve until stopped)",
    flag_values=FLAGS,
)
flags.register_validator(
    "frames_per_tick",
    lambda v: 1 <= v <= config_lib.ENCODER_CALL_FRAMES,
    f"must be in [1, {config_lib.ENCODER_CALL_FRAMES}] (the encoder's cache ring)",
    flag_values=FLAGS,
)
flags.register_validator("warmup_ticks", lambda v: v >= 0, "must be >= 0", flag_values=FLAGS)
flags.register_validator("drain_timeout_s", lambda v: v > 0, "must be > 0", flag_values=FLAGS)
flags.register_validator("idle_timeout_s", lambda v: v > 0, "must be > 0", flag_values=FLAGS)
flags.register_validator("admission_queue_s", lambda v: v >= 0, "must be >= 0", flag_values=FLAGS)


@flags.validator("api_key_file", "must be a readable file that holds the key", flag_values=FLAGS)
def _check_api_key_file(path: str | None) -> bool:
    try:
        return path is None or bool(open(path, encoding="utf-8").read().strip())
    except (OSError, UnicodeDecodeError):
        return False


@flags.validator("listen", "expected HOST:PORT with a port in [0, 65535]", flag_values=FLAGS)
def _check_listen(value: str | None) -> bool:
    host, sep, port = (value or "h:0").rpartition(":")
    return bool(sep and host and port.isdigit() and 0 <= int(port) <= 65535)


flags.register_validator(
    "model",
    lambda v: v in config_lib.PRESETS,
    f"must be a preset: {sorted(config_lib.PRESETS)}",
    flag_values=FLAGS,
)


@flags.multi_flags_validator(["context_frames", "frames_per_tick"], flag_values=FLAGS)
def _check_context(values: dict) -> bool:
    cap, fpt = values["context_frames"], values["frames_per_tick"]
    if fpt >= 1 and cap < fpt:
        raise flags.ValidationError("the context cap is below one beat (frames_per_tick)")
    return True


@flags.multi_flags_validator(["deadline_ms", "frames_per_tick"], flag_values=FLAGS)
def _check_deadline(values: dict) -> bool:
    deadline, fpt = values["deadline_ms"], values["frames_per_tick"]
    beat_ms = 80.0 * fpt
    if deadline is not None and not 0 < deadline <= beat_ms:
        raise flags.ValidationError(f"the deadline must be in (0, {beat_ms:g}] ms (the beat)")
    return True


@flags.multi_flags_validator(["devices", "slots", "loop", "model_parallel"], flag_values=FLAGS)
def _check_devices(values: dict) -> bool:
    n, slots, loop, m = values["devices"], values["slots"], values["loop"], values["model_parallel"]
    if n > 1 and loop == "resident":
        raise flags.ValidationError(
            "--devices > 1 needs --loop=dispatch (the resident loop serves one device)"
        )
    if n >= 1 and m >= 1 and n % m:
        raise flags.ValidationError(f"--model_parallel={m} does not divide --devices={n}")
    if m == 1 and n >= 1 and slots % n:
        raise flags.ValidationError(f"--slots={slots} does not split evenly over --devices={n}")
    if m > 1 and n >= m and slots % (n // m):
        raise flags.ValidationError(
            f"--slots={slots} does not split evenly over the {n // m} groups of "
            f"--model_parallel={m} devices"
        )
    return True


@flags.multi_flags_validator(
    ["scheduler", "buckets", "slots", "loop", "shrink_after", "devices"], flag_values=FLAGS
)
def _check_buckets(values: dict) -> bool:
    if values["scheduler"] != "buckets":
        if values["buckets"]:
            raise flags.ValidationError("--buckets needs --scheduler=buckets")
        return True
    if values["loop"] == "resident":
        raise flags.ValidationError("--scheduler=buckets needs --loop=dispatch")
    if values["devices"] != 1:
        raise flags.ValidationError("--scheduler=buckets serves one device (--devices=1)")
    if values["shrink_after"] < 1:
        raise flags.ValidationError("--shrink_after must be >= 1")
    b = values["buckets"]
    if b and not all(x.strip().isdigit() and int(x) >= 1 for x in b):
        raise flags.ValidationError("--buckets must be slot counts >= 1, comma-separated")
    if b and max(int(x) for x in b) != values["slots"]:
        raise flags.ValidationError(f"--buckets must end at --slots={values['slots']}")
    return True


@flags.multi_flags_validator(["max_live", "slots"], flag_values=FLAGS)
def _check_max_live(values: dict) -> bool:
    limit, slots = values["max_live"], values["slots"]
    if limit is not None and slots >= 1 and not 1 <= limit <= slots:
        raise flags.ValidationError(f"--max_live={limit} must be in [1, --slots={slots}]")
    return True


@flags.multi_flags_validator(["manifest_sha256", "checkpoint"], flag_values=FLAGS)
def _check_manifest(values: dict) -> bool:
    digest = values["manifest_sha256"]
    if digest is None:
        return True
    if not values["checkpoint"]:
        raise flags.ValidationError("--manifest_sha256 goes with --checkpoint")
    if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
        raise flags.ValidationError("--manifest_sha256 must be 64 hex digits (a sha256)")
    return True


@flags.validator(
    "system_prompt", "token ids must be non-negative integers, comma-separated", flag_values=FLAGS
)
def _check_prompt(ids: list[str]) -> bool:
    return all(x.strip().isdigit() for x in ids)


@flags.validator("output_dir", flag_values=FLAGS)
def _check_output_dir(path: str | None) -> bool:
    """The directory (or, by default, the folder of runs) exists or can be made, and a file can
    be written in it."""
    path = DEFAULT_RUNS if path is None else path
    if os.path.exists(path) and not os.path.isdir(path):
        raise flags.ValidationError("exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise flags.ValidationError(f"cannot be written: {e.strerror or e}") from None
    return True


def _fail(message: str, code: int, *, now: bool = False) -> None:
    """One line on stderr, then exit: a user's error, not a bug, gets no traceback.

    ``now``: from a thread other than the main one, or past a drain's deadline (``os._exit``).
    """
    sys.stderr.write(f"voicechat-serve: {message}\n")
    sys.stderr.flush()
    if now:
        os._exit(code)
    sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flag_parsing.parse(FLAGS, argv, __doc__)
    except flags.Error as e:
        _fail(str(e).replace("\n", " "), EXIT_USAGE)
        raise  # not reached


class _Signals:
    """SIGTERM / SIGINT / SIGHUP: the first drains the server, a second exits at once.

    SIGHUP (the terminal closed, the SSH session dropped) drains like SIGTERM, unless the
    process was started ignoring it (``nohup``): then it is left ignored.

    The work is done by a watcher thread woken through ``signal.set_wakeup_fd``, not in the Python
    handler: during the resident loop the main thread sits in one long XLA call, and a Python
    handler would not run before it returns.

    ``close`` puts back the handlers and the wakeup fd it found (``main`` called in a process
    that goes on, such as a test's) and stops the watcher.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, stop: threading.Event, drain_timeout_s: float):
        self.stop = stop
        self.drain_timeout_s = drain_timeout_s
        self.first_at: float | None = None  # time.monotonic() of the first signal
        self._timer: threading.Timer | None = None
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._saved_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._saved = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
        for sig in self.SIGNALS:
            if sig == signal.SIGHUP and self._saved[sig] == signal.SIG_IGN:
                continue  # nohup: the user asked for the server to outlive the terminal
            signal.signal(sig, self._handler)
        threading.Thread(target=self._watch, args=(read_fd,), name="signals", daemon=True).start()

    def close(self) -> None:
        """The handlers and wakeup fd as they were; the watcher thread ends."""
        signal.set_wakeup_fd(self._saved_wakeup)
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        os.close(self._write_fd)  # the watcher reads end-of-file and returns

    @staticmethod
    def _handler(signum, frame) -> None:
        del signum, frame  # the watcher thread acts; this only replaces the default action

    def _watch(self, read_fd: int) -> None:
        received = 0
        while True:
            data = os.read(read_fd, 64)
            if not data:  # closed
                os.close(read_fd)
                return
            for signum in data:
                if signum not in self.SIGNALS:
                    continue
                received += 1
                name = signal.Signals(signum).name
                if received > 1:
                    sys.stderr.write(f"voicechat-serve: second {name}: exiting now\n")
                    sys.stderr.flush()
                    os._exit(128 + signum)
                logging.warning(
                    "%s: draining (stops admitting, ends every session; a second signal exits "
                    "at once)",
                    name,
                )
                self.first_at = time.monotonic()
                self.stop.set()
                self._timer = threading.Timer(self.drain_timeout_s, self._timeout)
                self._timer.daemon = True
                self._timer.start()

    def drained(self) -> float | None:
        """The server has drained (files closed): no deadline any more; seconds since the signal."""
        if self._timer is not None:
            self._timer.cancel()
        return None if self.first_at is None else time.monotonic() - self.first_at

    def _timeout(self) -> None:
        message = f"draining took longer than {self.drain_timeout_s:g} s; exiting"
        _fail(message, EXIT_ERROR, now=True)


def options_from_flags() -> runner.RunOptions:
    """The run's options from the parsed flags (one ``ServeConfig`` for the serving fields)."""
    serve = config_lib.ServeConfig(
        slots=FLAGS.slots,
        frames_per_tick=FLAGS.frames_per_tick,
        context_frames=FLAGS.context_frames,
        at_cap=FLAGS.at_cap,
        speech_sampling=FLAGS.speech_sampling,
        system_prompt=tuple(int(x) for x in FLAGS.system_prompt),
        attention=FLAGS.attention,
        tts_attention=FLAGS.tts_attention,
        ssm_kernel=FLAGS.ssm_kernel,
        projection=FLAGS.projection,
        codec_stream=FLAGS.codec_stream,
        codec_in_attention=FLAGS.codec_in_attention,
        deadline_ms=FLAGS.deadline_ms,
        precision=FLAGS.precision,
    )
    listen = FLAGS.listen
    # A listening server runs until stopped, with no scripted session, unless told otherwise.
    sessions = FLAGS.sessions if not listen or FLAGS["sessions"].present else 0
    seconds = FLAGS.seconds if not listen or FLAGS["seconds"].present else math.inf
    return runner.RunOptions(
        serve=serve,
        checkpoint=FLAGS.checkpoint,
        model=FLAGS.model,
        sessions=sessions,
        seconds=seconds,
        input_wavs=tuple(FLAGS.input_wav or ()),
        output_dir=DEFAULT_RUNS if FLAGS.output_dir is None else FLAGS.output_dir,
        loop=FLAGS.loop,
        clock=FLAGS.clock,
        devices=FLAGS.devices,
        model_parallel=FLAGS.model_parallel,
        churn=FLAGS.churn,
        seed=FLAGS.seed,
        warmup_ticks=FLAGS.warmup_ticks,
        gc_policy=FLAGS.gc_policy,
        listen=listen,
        net={
            "idle_timeout_s": FLAGS.idle_timeout_s,
            "record_calls": FLAGS.record_calls,
            "api_key_file": FLAGS.api_key_file,
            "allowed_origins": tuple(FLAGS.allowed_origins),
        },
        scheduler=FLAGS.scheduler,
        buckets=tuple(int(x) for x in FLAGS.buckets),
        shrink_after=FLAGS.shrink_after,
        rollovers_per_beat=FLAGS.rollovers_per_beat,
        max_live=FLAGS.max_live,
        admission_queue_s=FLAGS.admission_queue_s,
        overwrite=FLAGS.overwrite,
        manifest_sha256=FLAGS.manifest_sha256,
        started=time.monotonic() - _process_age_s(),
    )


def _process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 elsewhere: from now)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def compilation_cache_dir() -> str | None:
    """Where JAX's persistent compilation cache goes: ``--compilation_cache_dir`` if given ('':
    none), else ``$JAX_COMPILATION_CACHE_DIR`` if set, else the user's cache directory."""
    if FLAGS.compilation_cache_dir is not None:
        return FLAGS.compilation_cache_dir or None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "voicechat_jax", "xla")


def _preflight(options: runner.RunOptions) -> None:
    """What can be refused before anything is built, each in one line with exit 2: an address
    that cannot be listened on, system prompt ids past the model's vocabulary."""
    if options.listen:
        from voicechat_jax.serving.net import check_listen  # aiohttp: only when listening

        try:
            check_listen(options.listen)
        except ValueError as e:
            _fail(str(e), EXIT_USAGE)
    try:
        runner.check_model(options)
    except ValueError as e:
        _fail(f"--system_prompt: {e}", EXIT_USAGE)


def main(argv: list[str]) -> int:
    """The app on parsed flags; returns the exit status (``run`` exits with it). A bad flag or a
    run that cannot start exits here (``SystemExit``) with its one line on stderr."""
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]} (flags are --name=value)", EXIT_USAGE)
    from voicechat_jax.checkpoint import CheckpointError  # orbax: imported once flags are good
    from voicechat_jax.engine import MemoryPlanError

    try:
        options = options_from_flags()
    except ValueError as e:  # a combination ServeConfig refuses
        _fail(str(e), EXIT_USAGE)
    _preflight(options)
    import jax  # the device count is known once the backend starts

    cache = compilation_cache_dir()
    if cache is not None:
        # Compiles are most of a start-up: a second start loads them instead. JAX keys each
        # entry by program, compile options, jaxlib version and device.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    logging.info("compilation cache: %s", cache or "off")

    if options.devices > jax.local_device_count():
        _fail(
            f"--devices={options.devices}: this process has {jax.local_device_count()} "
            f"{jax.default_backend()} device(s)",
            EXIT_USAGE,
        )
    try:
        runner.check_model_parallel(options)  # the LLM must split over the model groups
    except ValueError as e:
        _fail(f"--model_parallel={options.model_parallel}: {e}", EXIT_USAGE)
    if FLAGS.output_dir is None:
        try:
            options = dataclasses.replace(options, output_dir=outdir.new_run_dir(DEFAULT_RUNS))
        except (OSError, outdir.OutputDirError) as e:
            _fail(f"--output_dir: {e}", EXIT_ERROR)
    logging.info("serving with %s", options)
    stop = threading.Event()
    signals = _Signals(stop, FLAGS.drain_timeout_s)
    try:
        result = runner.run(options, stop=stop)
    except CheckpointError as e:
        _fail(f"checkpoint {FLAGS.checkpoint}: {e}", EXIT_ERROR)
    except MemoryPlanError as e:  # refused before anything was allocated
        _fail(f"--slots={options.serve.slots}: {e}", EXIT_USAGE)
    except jax.errors.JaxRuntimeError as e:
        if not str(e).startswith("RESOURCE_EXHAUSTED"):
            raise  # a bug: its traceback
        # Past the plan: a compile (the autotuner's buffers) or a beat found the device full.
        first = str(e).splitlines()[0]  # XLA's own line; the rest is its source trace
        _fail(
            f"--slots={options.serve.slots}: the device ran out of memory ({first}); "
            "serve fewer slots",
            EXIT_ERROR,
        )
    except outdir.OutputDirFinishedError as e:
        _fail(str(e), EXIT_USAGE)
    except outdir.OutputDirError as e:
        _fail(str(e), EXIT_ERROR)
    except OSError as e:
        _fail(f"error: {e}", EXIT_ERROR)
    finally:
        drain_s = signals.drained()
        signals.close()
    print(result.table)  # the CLI's report; the library itself never prints
    if result.url:
        print(f"served live calls at {result.url}")
    print(f"outputs: {os.path.abspath(options.output_dir)}")
    if result.stopped:
        drained = "" if drain_s is None else f"; drained in {drain_s:.2f} s"
        print(f"stopped by signal: every live session ended with a shutdown event{drained}")
    code = EXIT_OK
    if result.failed:
        sys.stderr.write(f"voicechat-serve: {result.failed} session(s) failed (sessions.json)\n")
        code = EXIT_SESSIONS_FAILED
    return code


def _main_and_exit(argv: list[str]) -> None:
    code = main(argv)
    # Every file is closed: exit now, without waiting for the runtime's threads to wind down.
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> None:
    """Console-script entry point."""
    app.run(_main_and_exit, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
