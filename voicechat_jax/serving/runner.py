"""One serving run from options: build the model, script the sessions, serve, stream the outputs.

This is the library behind ``voicechat-serve`` (and the tests of it): ``run(RunOptions(...))``.
With ``listen`` set it also serves live calls over the network (``serving.net.NetFront``) beside
the scripted sessions, until stopped. Each scripted session's ``output.wav`` and ``frames.jsonl``
are written beat by beat while the run goes (``writer.SessionFiles``; a live call's only with
``record_calls``), ``metrics.jsonl`` one line per tick and event; ``sessions.json`` (who failed,
was refused, or ended early, and why) is written when the run ends or is stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import AbstractMesh, Mesh

from voicechat_jax import config as config_lib
from voicechat_jax import mesh as mesh_lib
from voicechat_jax import step as step_lib
from voicechat_jax.model import voicechat
from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving import outdir
from voicechat_jax.serving import scheduler as scheduler_lib
from voicechat_jax.serving.memory import RolloverPolicy
from voicechat_jax.serving.report import format_table
from voicechat_jax.serving.server import Engine, Server, SessionPlan, pick_loop

DEFAULT_WAV = os.path.join(os.path.dirname(__file__), "..", "assets", "speech_16k.wav")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Everything a serving run is configured by (the CLI's flags).

    ``serve`` is the server configuration as the engine takes it (slots, beat, context cap and
    what happens at it, system prompt, deadline, sampler, kernels); the other fields say what
    to serve, for how long, and where the outputs go.
    """

    serve: config_lib.ServeConfig = dataclasses.field(default_factory=config_lib.ServeConfig)
    model: str = "tiny"
    sessions: int = 4
    seconds: float = 10.0
    input_wavs: tuple[str, ...] = ()
    output_dir: str = "runs/serve"
    loop: str = "auto"  # server.pick_loop: resident on one device, dispatch on a mesh or buckets
    clock: str = "realtime"
    devices: int = 1  # local devices the slots split over (``mesh.make_mesh``; dispatch loop only)
    model_parallel: int = 1  # devices per model group: the LLM tensor-parallel over them
    churn: bool = False
    seed: int = 0
    warmup_ticks: int = 3
    checkpoint: str | None = None
    gc_policy: str = "slack"
    listen: str | None = None  # HOST:PORT: serve live calls there too (``serving.net``)
    net: dict = dataclasses.field(default_factory=dict)  # more ``net.NetConfig`` fields
    scheduler: str = "lockstep"  # scheduler.Policy
    buckets: tuple[int, ...] = ()  # scheduler 'buckets': slot counts (default: default_buckets)
    shrink_after: int = 25  # scheduler 'buckets': beats of fitting a smaller bucket before a move
    rollovers_per_beat: int = 1  # reset/memory: roll-overs in one beat at most
    # Admission control (``scheduler.AdmissionControl``, experiments/admission_overload): at most
    # ``max_live`` sessions live at once (None: every slot); a session that finds them full waits
    # up to ``admission_queue_s`` for one to end (0: refused at once). Either set wraps the policy.
    max_live: int | None = None
    admission_queue_s: float = 0.0
    overwrite: bool = False  # write into an ``output_dir`` that holds a finished run
    manifest_sha256: str | None = None  # the checkpoint's integrity.json must have this sha256
    started: float | None = None  # time.monotonic() of the process's start (for the ready line)

    @property
    def admission_queue_beats(self) -> int:
        """``admission_queue_s`` in whole beats, rounded up (10 s at 160 ms: 63)."""
        beats = self.admission_queue_s * 1000.0 / self.serve.beat_ms
        return math.ceil(beats - 1e-9)  # a float just above a whole count is that count

    @property
    def admission(self) -> bool:
        """Whether the policy runs behind ``scheduler.AdmissionControl``."""
        return self.max_live is not None or self.admission_queue_s > 0

    @property
    def n_ticks(self) -> int:
        """Ticks to serve; ``seconds=math.inf`` (a server with ``listen``): until stopped."""
        if math.isinf(self.seconds):
            return 1 << 62
        return max(1, round(self.seconds * 1000.0 / self.serve.beat_ms))


@dataclasses.dataclass
class RunResult:
    summary: dict
    table: str
    outputs: dict  # session id -> {"wav": path, "frames": path, ...}
    failures: dict  # session id -> error message (refused, bad input, vanished)
    ended: dict  # session id -> why it ended before the run did (left, context cap, ...)
    compiles: int  # XLA compilations of the tick during the run (1 expected)
    failed: int = 0  # sessions that failed (input rejected, bad input, vanished); not refusals
    refused: int = 0  # sessions refused at capacity
    stopped: bool = False  # the run was stopped (drained) before its end
    url: str | None = None  # where live calls were served (``listen``)


def default_wav() -> str:
    path = os.path.normpath(DEFAULT_WAV)
    if not os.path.exists(path):
        raise FileNotFoundError(f"the bundled recording is missing: {path}")
    return path


def _usable_samples(options: RunOptions, cfg) -> int:
    """Input samples a scripted session can use: the run's frames, and at most its context cap
    when a session ends there (``at_cap=end``); what lies past them in a file is not read."""
    spf = cfg.encoder.mel.samples_per_frame
    frames = options.n_ticks * options.serve.frames_per_tick
    if options.serve.at_cap == "end":
        frames = min(frames, options.serve.context_frames)
    return min(frames * spf, audio_lib.MAX_WAV_SAMPLES)


def _load_inputs(
    paths: tuple[str, ...], n: int, max_samples: int = audio_lib.MAX_WAV_SAMPLES
) -> list[tuple[str, np.ndarray | Exception]]:
    """Each session's (source, audio or the error reading it); sessions take files in turn,
    each read up to ``max_samples``."""
    if n == 0:
        return []
    paths = paths or (default_wav(),)
    loaded: dict[str, np.ndarray | Exception] = {}
    for p in paths:
        try:
            loaded[p] = audio_lib.read_wav(p, expected_rate=16000, max_samples=max_samples)
        except audio_lib.AudioInputError as e:
            logging.error("input %s rejected: %s", p, e)
            loaded[p] = e
    return [(paths[i % len(paths)], loaded[paths[i % len(paths)]]) for i in range(n)]


def plans_for(
    options: RunOptions, n_ticks: int, inputs: list[tuple[str, np.ndarray | Exception]]
) -> tuple[list[SessionPlan], dict]:
    """Scripted sessions: all join at tick 0, or (churn) join and leave at random ticks."""
    rng = np.random.default_rng(options.seed)
    plans, failures = [], {}
    for i, (src, audio) in enumerate(inputs):
        sid = f"s{i:03d}"
        if isinstance(audio, Exception):
            failures[sid] = str(audio)
            continue
        join, leave = 0, None
        if options.churn:
            join = int(rng.integers(0, max(1, n_ticks - 1)))
            span = int(rng.integers(1, max(2, n_ticks - join)))
            leave = join + span if join + span < n_ticks else None
        plans.append(SessionPlan(id=sid, audio=audio, join=join, leave=leave, source=src))
    return plans, failures


def make_mesh(options: RunOptions) -> Mesh | None:
    """The mesh over the first ``options.devices`` local devices; None for one device.

    A 1-D ``data`` mesh, or with ``model_parallel > 1`` the ``(data, model)`` mesh whose
    ``model`` groups split the LLM (``mesh.make_mesh``). Raises ValueError for a resident loop on
    a mesh, slots that do not split evenly over ``data``, a ``model_parallel`` that does not
    divide the devices, or more devices than this process has.
    """
    m = options.model_parallel
    if options.devices == 1:
        if m != 1:
            raise ValueError(f"model_parallel={m} needs as many devices at least (devices=1)")
        return None
    pick_loop(options.loop, mesh=True, buckets=False)  # the server's rule, before anything is built
    mesh = mesh_lib.make_mesh(options.devices, model_parallel=m if m > 1 else None)
    mesh_lib.check_slots(options.serve.slots, mesh)
    return mesh


def model_config(options: RunOptions) -> config_lib.ModelConfig | None:
    """The run's model config without building anything: the preset's, or the checkpoint's own
    ``model_config.json`` (None when that cannot be read: the restore reports it)."""
    if not options.checkpoint:
        return config_lib.PRESETS[options.model]()
    from voicechat_jax import checkpoint as ckpt

    try:
        return ckpt.config_from_json(ckpt.read_json(options.checkpoint, ckpt.MODEL_CONFIG))
    except (ckpt.CheckpointError, TypeError, ValueError):
        return None


def check_model(options: RunOptions) -> None:
    """Raises ValueError (one line) when ``options.serve`` does not fit the model (a system
    prompt id past its vocabulary: ``ServeConfig.check_model``), before anything is built."""
    cfg = model_config(options)
    if cfg is not None:
        options.serve.check_model(cfg)


def check_model_parallel(options: RunOptions) -> None:
    """Raises ValueError (one line) when the LLM cannot split over ``options.model_parallel``
    devices (``mesh.local_config``), before anything is built: the config is the preset's, or
    the checkpoint's own ``model_config.json`` (one that cannot be read is left to the restore
    to report)."""
    if options.model_parallel == 1:
        return
    cfg = model_config(options)
    if cfg is None:
        return
    groups = max(options.devices // options.model_parallel, 1)
    axes = (groups, options.model_parallel)
    mesh_lib.local_config(cfg, options.serve, AbstractMesh(axes, (mesh_lib.DATA, mesh_lib.MODEL)))


def build(options: RunOptions, mesh: Mesh | None = None):
    """The model config, params, serve config and tokenizer of a run (params in the precision
    policy of ``options.serve.precision`` and the serving layout, ``voicechat.serving_layout``;
    on ``mesh``, replicated over its devices).

    A converted checkpoint that cannot be restored raises ``checkpoint.CheckpointError``.
    """
    precision = options.serve.precision
    if options.checkpoint:
        from voicechat_jax import checkpoint as ckpt  # converted checkpoints (voicechat-convert)

        sharding = None if mesh is None else mesh_lib.replicated(mesh)
        cfg, params, tokenizer = ckpt.restore(
            options.checkpoint,
            precision,
            sharding=sharding,
            manifest_sha256=options.manifest_sha256,
        )
        # As the engine serves them (``voicechat.serving_layout``); the stacked copy goes here,
        # before any session state is allocated.
        params = voicechat.serving_layout(params, precision)
    else:
        if options.model not in config_lib.PRESETS:
            known = sorted(config_lib.PRESETS)
            raise ValueError(f"unknown model preset {options.model!r}: {known}")
        cfg = config_lib.PRESETS[options.model]()
        params = voicechat.init_compiled(jax.random.key(options.seed), cfg, precision, serving=True)
        tokenizer = None
    return cfg, params, options.serve, tokenizer


def build_engine(
    options: RunOptions, params, cfg, serve, mesh: Mesh | None = None
) -> tuple[Engine, scheduler_lib.Scheduler]:
    """The engine and the scheduler of ``options.scheduler``: ``lockstep`` on an ``Engine``
    (over ``mesh`` if given); ``buckets`` on an ``Engine`` with those slot buckets (one device;
    its ticks compiled before the clock starts). With ``options.max_live`` or
    ``options.admission_queue_s`` set, the policy sits behind a ``scheduler.AdmissionControl``;
    otherwise it is the plain one."""
    if scheduler_lib.Policy(options.scheduler) == scheduler_lib.Policy.BUCKETS:
        if mesh is not None:
            raise ValueError("slot buckets serve one device (--devices=1)")
        buckets = options.buckets or scheduler_lib.default_buckets(serve.slots)
        engine = Engine(params, cfg, serve, buckets=buckets)
        policy = scheduler_lib.make("buckets", buckets=buckets, shrink_after=options.shrink_after)
    else:
        engine, policy = Engine(params, cfg, serve, mesh=mesh), scheduler_lib.Lockstep()
    if options.admission:
        policy = scheduler_lib.AdmissionControl(
            policy, max_live=options.max_live, queue_beats=options.admission_queue_beats
        )
    return engine, policy


def run(options: RunOptions, *, stop: threading.Event | None = None) -> RunResult:
    """Serves the scripted sessions of ``options``, streaming their outputs.

    ``stop``: once set (a signal handler, another thread), the server drains: no new admission,
    the beat in flight is finished, every live session ends with a ``shutdown`` event and its
    files are closed; then this returns as a finished run does.

    The output directory is locked for the run (``outdir.OutputLock``): another run there, or a
    finished one without ``options.overwrite``, raises ``outdir.OutputDirError`` before anything
    is built.
    """
    with outdir.OutputLock(options.output_dir, overwrite=options.overwrite):
        return _run(options, stop)


def _run(options: RunOptions, stop: threading.Event | None) -> RunResult:
    t_build = time.monotonic()
    t0 = t_build if options.started is None else options.started
    mesh = make_mesh(options)
    cfg, params, serve, tokenizer = build(options, mesh)
    t_built = time.monotonic()
    n_ticks = options.n_ticks
    inputs = _load_inputs(options.input_wavs, options.sessions, _usable_samples(options, cfg))
    plans, failures = plans_for(options, n_ticks, inputs)
    compiles = step_lib.CompileCounter("tick")
    with compiles:
        engine, scheduler = build_engine(options, params, cfg, serve, mesh)
        del params  # the engine holds them as placed (split over a model axis: the whole copy goes)
        # Line-buffered: each tick's line reaches the file as it is recorded (by the writer thread).
        with open(os.path.join(options.output_dir, "metrics.jsonl"), "w", buffering=1) as sink:
            server = Server(
                engine,
                clock=options.clock,
                loop=options.loop,
                seed=options.seed,
                warmup_ticks=options.warmup_ticks,
                metrics_sink=sink,
                max_backlog_beats=None if options.clock == "offline" else 4,
                gc_policy=options.gc_policy,
                vanish_beats=_vanish_beats(options),
                output_dir=options.output_dir,
                keep_outputs=False,
                tokenizer=tokenizer,
                stop_event=stop,
                scheduler=scheduler,
                rollover=RolloverPolicy.for_cap(
                    serve.at_cap,
                    serve.context_frames,
                    serve.frames_per_tick,
                    capsule_tokens=serve.capsule_tokens,
                    max_per_beat=options.rollovers_per_beat,
                ),
                on_ready=lambda: logging.info(
                    "ready to serve %.1f s after the start (the model built in %.1f s, the %s "
                    "loop compiled and warmed in %.1f s)",
                    time.monotonic() - t0,
                    t_built - t_build,
                    server.loop,
                    time.monotonic() - t_built,
                ),
            )
            for sid, message in failures.items():
                server.metrics.record_event("failed", session=sid, tick=None, message=message)
            front = _start_front(options, server, tokenizer) if options.listen else None
            try:
                server.run(plans, n_ticks)
            finally:
                if front is not None:
                    front.stop()
                summary = server.metrics.close(_admission_report(scheduler))
                failures.update(server.failures)
                with open(os.path.join(options.output_dir, "sessions.json"), "w") as f:
                    json.dump(
                        {
                            "failures": failures,
                            "ended": dict(server.ended),
                            # Every session that ended before the run did, by how it ended
                            # ("client error": a network client ended its call badly).
                            "ended_by_reason": dict(summary["ended"]),
                            "stopped": server.stopping,
                        },
                        f,
                        indent=1,
                        default=str,
                    )
    return RunResult(
        summary=summary,
        table=format_table(summary),
        outputs=dict(server.outputs),
        failures=failures,
        ended=dict(server.ended),
        compiles=compiles.count,
        failed=summary["failed_sessions"],
        refused=server.slots.refused,
        stopped=server.stopping,
        url=None if front is None else front.url,
    )


def _admission_report(scheduler: scheduler_lib.Scheduler) -> dict:
    """The admission queue's counts for the run's summary: ``{"admission": {...}}`` (threshold,
    queue in beats, sessions that waited, beats waited in all); {} without admission control."""
    if not isinstance(scheduler, scheduler_lib.AdmissionControl):
        return {}
    report = {
        "max_live": scheduler.max_live,
        "queue_beats": scheduler.queue_beats,
        "queued": scheduler.queued,
        "waited_beats": scheduler.waited_beats,
    }
    return {"admission": report}


def net_options(options: RunOptions) -> dict:
    """The ``net.NetConfig`` fields of ``options`` (its ``net``): with an admission queue, the
    front waits for an admission's answer longer than the queue (queue + 10 s at least), so that
    a queued caller is admitted or refused by the server, never cut off by the front's timeout."""
    fields = dict(options.net)
    if options.admission_queue_beats:
        queue_s = options.admission_queue_beats * options.serve.beat_ms / 1000.0
        fields["admit_timeout_s"] = max(fields.get("admit_timeout_s", 10.0), queue_s + 10.0)
    return fields


def _vanish_beats(options: RunOptions) -> int:
    """Beats without audio after which a session counts as vanished: 4 s; with live calls, 2 s
    past their idle timeout, so that the front ends an idle call first, with its own reason."""
    beat_s = options.serve.beat_ms / 1000.0
    if not options.listen:
        return 25
    idle_s = options.net.get("idle_timeout_s", 10.0)
    return math.ceil((idle_s + 2.0) / beat_s)


def _start_front(options: RunOptions, server: Server, tokenizer):
    """Starts serving live calls beside ``server``; writes ``listen.json`` (the bound URL)."""
    from voicechat_jax.serving import net  # aiohttp: imported only by a server that listens

    host, port = net.parse_listen(options.listen)
    config = net.NetConfig(host=host, port=port, **net_options(options))
    front = net.NetFront(server, config, text_decode=tokenizer)
    url = front.start()
    with open(os.path.join(options.output_dir, "listen.json"), "w") as f:
        json.dump({"url": url, "realtime": url.replace("http", "ws", 1) + net.REALTIME_PATH}, f)
    return front
