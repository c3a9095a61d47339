"""What every experiment's rows share: where they were measured, and a row log that keeps them.

``provenance()`` is the part every row carries: the commit of the checkout, the device, the jax
version, the command line that ran and the UTC time. ``RowLog`` appends each row to a JSON-lines
file as it is measured (a device call cut short keeps what it measured), with the provenance.
Rows that no device measured (a simulation fitted to measured rows) say so: ``device`` is
``SIMULATION``.
``experiments.rows`` reads the committed rows, holds older ones to the same keys and prints the
READMEs' tables from them.

The setup every engine experiment shares is here too: the engine flags as ``voicechat-serve``
names them (``define_engine_flags``) and the ``ServeConfig`` they make (``serve_config``), the
test signal (``speech``), random weights (``random_params``), back-to-back tick timing
(``tick_ms``), a call's median time (``time_call``) and the device's memory
(``device_memory``). JAX is imported where used, so the rows tools load without it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SIMULATION = "simulation"  # the device of a simulated row


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


COMMIT_ENV = "EXPERIMENTS_COMMIT"


def commit() -> str:
    """The short commit of this checkout, with ``+dirty`` when it has uncommitted changes; or
    ``$EXPERIMENTS_COMMIT`` when set. A lent device's copy of the working tree keeps the git
    metadata of an older commit (2026-12-05: ``b87ce12+dirty`` for a tree at ``752356b``), so a
    device call sets it to the commit it sends: ``EXPERIMENTS_COMMIT=<git rev-parse --short HEAD
    here>``."""
    given = os.environ.get(COMMIT_ENV)
    if given:
        return given
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def provenance(device: str | None = None) -> dict:
    """The commit, the device, the jax version, the command and the time of a measurement;
    ``device`` (e.g. ``SIMULATION``) in place of the first JAX device's kind."""
    import jax

    return {
        "commit": commit(),
        "device": device or jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "command": shlex.join([pathlib.Path(sys.executable).name, *sys.argv]),
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def latency_fields(summary: dict) -> dict:
    """The serving summary's beat latency, misses and host stages (``MetricsRecorder.summary``),
    under the keys the capacity rows use."""
    lat, stages = summary["latency_ms"], summary["host_stages_ms"]
    return {
        "steady_ticks": summary["ticks"],
        "p50_ms": lat["p50"],
        "p99_ms": lat["p99"],
        "p99.9_ms": lat.get("p99.9"),
        "max_ms": lat["max"],
        "missed_ticks": summary["missed_ticks"],
        "ticks_skipped": summary["ticks_skipped"],
        "missed_by_cause": summary["missed_by_cause"],
        "skipped_by_cause": summary["skipped_by_cause"],
        "stage_p99_ms": {k: v["p99"] for k, v in stages.items()},
        "stage_max_ms": {k: v["max"] for k, v in stages.items()},
    }


def _plain(value):
    """A value JSON has no form for: a numpy (or jax) scalar or array as numbers, else its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


class RowLog:
    """JSON-lines rows appended to ``path`` as they are measured, each with the provenance (taken
    at the first row; ``device`` as ``provenance``'s). No ``path``: the rows are only kept."""

    def __init__(self, path: str | pathlib.Path | None, device: str | None = None):
        self.path = pathlib.Path(path) if path else None
        self.device = device
        self.rows: list[dict] = []
        self._provenance: dict | None = None

    def write(self, row: dict) -> dict:
        if self._provenance is None:
            self._provenance = provenance(self.device)
        row = {**row, **self._provenance}
        self.rows.append(row)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=_plain) + "\n")
        return row


# ---- the setup every engine experiment shares ------------------------------------------------

KERNEL_FLAGS = ("ssm_kernel", "attention", "tts_attention", "projection")


def define_engine_flags(*, precision: bool = True) -> None:
    """``--ssm_kernel``, ``--attention``, ``--tts_attention``, ``--projection`` (``ServeConfig``'s
    kernel choices, validated), and ``--precision`` (a policy name) unless the script chooses
    policies itself."""
    from absl import flags

    from voicechat_jax import config as config_lib

    if precision:
        flags.DEFINE_string("precision", "reference", "Precision policy (precision.POLICIES).")
    attention = [m.value for m in config_lib.AttentionImpl]
    flags.DEFINE_enum(
        "ssm_kernel", "auto", [m.value for m in config_lib.SSMKernel], "LLM Mamba-2 step update."
    )
    flags.DEFINE_enum("attention", "auto", attention, "LLM decode attention.")
    flags.DEFINE_enum(
        "tts_attention", None, attention, "Speech decoder's attention (default: as --attention)."
    )
    flags.DEFINE_enum(
        "projection", "xla", [m.value for m in config_lib.ProjectionImpl], "LLM projections."
    )


def engine_flags() -> dict:
    """The engine flags' values (``define_engine_flags``), for the rows."""
    from absl import flags

    f = flags.FLAGS
    return {n: getattr(f, n) for n in ("precision", *KERNEL_FLAGS) if n in f}


def serve_config(*, precision=None, **kw):
    """A ``ServeConfig`` with the engine flags' kernels, ``precision`` (default: the
    ``--precision`` policy) and ``kw``."""
    from absl import flags

    from voicechat_jax import config as config_lib
    from voicechat_jax import precision as precision_lib

    f = flags.FLAGS
    precision = precision_lib.policy(f.precision) if precision is None else precision
    kernels = {n: getattr(f, n) for n in KERNEL_FLAGS}
    return config_lib.ServeConfig(precision=precision, **kernels, **kw)


def speech(n: int, seed: int):
    """``n`` samples of a speech-like test signal (a modulated tone plus noise), 16 kHz, float32;
    each ``seed`` its own pitch and noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    x = np.sin(2 * np.pi * (180 + 40 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 1.7 * t))
    return (0.3 * x + 0.03 * rng.standard_normal(n)).astype(np.float32)


def random_params(cfg, precision, name: str = "model"):
    """Random weights of ``cfg`` in ``precision``, initialised by one jitted program (op by op the
    11B init took ~45 s on an H200), on the device, in the layout the engine serves
    (``voicechat.serving_layout``: an engine built from them holds no second copy)."""
    import time

    import jax
    from absl import logging

    from voicechat_jax.model import voicechat

    t = time.perf_counter()
    params = voicechat.init_compiled(jax.random.key(0), cfg, precision, serving=True)
    jax.block_until_ready(params)
    logging.info("random %s params in %.1f s", name, time.perf_counter() - t)
    return params


def tick_ms(engine, ticks: int, *, live: int | None = None, warmup: int = 2):
    """Wall ms of ``ticks`` dispatch ticks run back to back, each blocked on (device time plus
    launch; no host work of a server).

    The first ``live`` slots (default all) are admitted on an untimed first tick and run every
    tick; the others are free (a fixed-shape tick costs the same either way); with slot buckets
    the state is first placed in the smallest bucket that holds them. ``warmup`` more ticks run
    untimed.
    """
    import time

    import jax
    import numpy as np

    from voicechat_jax.serving.scheduler import BeatPlan

    engine.reset()
    n = engine.serve.slots if live is None else live
    if len(engine.buckets) > 1:
        bucket = next(b for b in engine.buckets if b >= n)
        engine.place(BeatPlan(run=np.ones(engine.serve.slots, bool), bucket=bucket))
    beat = engine.empty_beat()
    beat.admit[:n] = True
    jax.block_until_ready(engine.tick(beat))
    beat = engine.empty_beat()
    times = []
    for _ in range(warmup + ticks):
        t = time.perf_counter()
        jax.block_until_ready(engine.tick(beat))
        times.append((time.perf_counter() - t) * 1e3)
    return np.asarray(times[warmup:])


def time_call(fn, calls: int = 10, warmup: int = 2) -> float:
    """Median wall ms of ``fn()``, its result blocked on."""
    import time

    import jax
    import numpy as np

    times = []
    for _ in range(warmup + calls):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times[warmup:]))


def device_memory() -> dict:
    """GiB in use, at peak and the limit on the first device, where it reports them (GPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {
        k: round(stats[k] / 2**30, 2)
        for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
        if k in stats
    }


@contextlib.contextmanager
def traced_as_gpu():
    """``jax.default_backend()`` answers 'gpu' inside: what is traced picks the kernels, product
    presets and weight layout a GPU gets (``model.attention``, ``precision.lax_precision``,
    ``voicechat.serving_layout``), on a machine without one."""
    import jax

    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def abstract_tick_args(cfg, serve) -> tuple:
    """The dispatch tick's arguments as shapes, allocating nothing: (params, state, template,
    beat, masks) for ``serve`` (its kernels chosen), the template traced as the engine builds it
    (its matmul scope, cap and prompt), the weights in the layout a GPU engine serves
    (``voicechat.serving_layout`` under ``traced_as_gpu``)."""
    import jax

    from voicechat_jax import engine as engine_lib
    from voicechat_jax import state as state_lib
    from voicechat_jax.model import voicechat

    params = voicechat.abstract(cfg, serve.precision)
    template = jax.eval_shape(engine_lib.template_fn(cfg, serve), params)
    with traced_as_gpu():
        params = jax.eval_shape(lambda p: voicechat.serving_layout(p, serve.precision), params)
    state = jax.eval_shape(lambda t: state_lib.from_template(t, serve.slots), template)
    samples = serve.frames_per_tick * cfg.encoder.mel.samples_per_frame
    beat = state_lib.empty_beat(serve.slots, samples, serve.capsule_tokens)
    return params, state, template, beat, state_lib.masks_of(beat)
