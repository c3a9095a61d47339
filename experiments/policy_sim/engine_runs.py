"""Real-engine measurements shared by the scheduling experiments (issue 15).

Each experiment's ``run.py`` (absl) calls ``harness.define_engine_flags`` (precision policy and
kernels, as ``voicechat-serve`` names them), builds the model once with ``build`` and its serve
configurations with ``harness.serve_config``, then measures with:

- ``serve``: a serving run of scripted sessions on the beat clock under a scheduler, one row;
- ``experiments.harness``'s ``tick_ms`` (back-to-back ticks, some slots live), ``time_call`` and
  ``speech`` (the test signal).

Engine rows carry the model and the engine flags (``engine_setup``) and, written by ``RowLog``,
the provenance every row carries (``experiments.harness``: commit, device, jax version, command,
time); simulated rows carry it with the device ``simulation``. On the CPU with the tiny model the
engine rows are smoke rows (shapes and mechanics, not capacity).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Sequence

from absl import flags, logging

from experiments import harness
from voicechat_jax import config as config_lib
from voicechat_jax import precision as precision_lib
from voicechat_jax.engine import Engine
from voicechat_jax.serving.server import Server, SessionPlan

_REPO = pathlib.Path(__file__).resolve().parents[2]


def engine_setup(model: str) -> dict:
    """Model preset and engine flags, for every engine row (``RowLog`` adds the provenance)."""
    return {"model": model, **harness.engine_flags()}


def build(model: str):
    """(cfg, params) of a preset with random weights in the flags' precision policy (jitted)."""
    cfg = config_lib.PRESETS[model]()
    return cfg, harness.random_params(cfg, precision_lib.policy(flags.FLAGS.precision), model)


def serve(
    engine: Engine,
    plans: Sequence[SessionPlan],
    n_ticks: int,
    *,
    scheduler=None,
    clock: str = "realtime",
    warmup_ticks: int = 5,
    **server_kw,
) -> tuple[dict, Server]:
    """Serves ``plans`` for ``n_ticks`` beats (dispatch loop); the metrics row and the server."""
    engine.reset()
    server = Server(
        engine,
        clock=clock,
        loop="dispatch",  # the loop every committed row of these experiments was measured on
        warmup_ticks=warmup_ticks,
        scheduler=scheduler,
        keep_outputs=False,
        **server_kw,
    )
    server.run(plans, n_ticks)
    s = server.metrics.summary()
    lat = s["latency_ms"]
    row = {
        "scheduler": server.scheduler.name,
        "slots": engine.serve.slots,
        "frames_per_tick": engine.serve.frames_per_tick,
        "context_frames": engine.serve.context_frames,
        "clock": clock,
        "steady_ticks": s["ticks"],
        "p50_ms": lat["p50"],
        "p99_ms": lat["p99"],
        "max_ms": lat["max"],
        "missed_ticks": s["missed_ticks"],
        "session_beats": s["session_beats"],
        "missed_session_beats": s["missed_session_beats"],
        "underruns": s["underruns"],
        "events": s["events"],
        "compile_s": s["compile_s"],
    }
    return row, server


def plans_all_joined(n: int, n_ticks: int, samples_per_beat: int) -> list[SessionPlan]:
    """``n`` sessions live from tick 0 to the end, each with its own audio."""
    return [
        SessionPlan(id=f"s{i:03d}", audio=harness.speech(n_ticks * samples_per_beat, i))
        for i in range(n)
    ]


class RowLog(list):
    """Rows, each appended to ``path`` with its provenance as it arrives (``harness.RowLog``), so
    a run cut short (a device call's time limit) keeps every row it measured; ``device``: as
    ``harness.RowLog``'s (``harness.SIMULATION`` for simulated rows)."""

    def __init__(self, path: str | None, device: str | None = None):
        super().__init__()
        self.log = harness.RowLog(path, device)

    def append(self, row: dict) -> None:
        row = self.log.write(row)
        logging.info("%s", row)
        super().append(row)

    def extend(self, rows) -> None:
        for r in rows:
            self.append(r)

    def __iadd__(self, rows):
        self.extend(rows)
        return self


def read_rows(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_parts(
    parts: Sequence[str],
    *,
    out: str | None,
    sim_out: str,
    plot_path: str | None,
    engine_part: Callable[[list[dict]], None],
    sim_part: Callable[[], list[dict]],
    plot: Callable[[list[dict], list[dict], str], None],
    print_tables: Callable[[list[dict], list[dict]], None],
) -> None:
    """The scheduling experiments' ``main``: the real-engine part (rows appended to ``out`` as they
    are measured), the simulator part (``sim_out`` rewritten, device ``simulation``), the plot
    from this run's rows or else the files', and the tables of this run's rows."""
    engine_rows = RowLog(out)  # written to ``out`` row by row
    sim_rows: list[dict] = []
    if "engine" in parts:
        engine_part(engine_rows)
    if "sim" in parts:
        rows = sim_part()
        if os.path.exists(sim_out):
            os.remove(sim_out)
        sim_rows = RowLog(sim_out, harness.SIMULATION)
        sim_rows += rows
    if plot_path:
        sr = sim_rows or (read_rows(sim_out) if os.path.exists(sim_out) else [])
        en = engine_rows or (read_rows(out) if out and os.path.exists(out) else [])
        plot(sr, en, plot_path)
    print_tables(sim_rows, engine_rows)


H200_PROFILE = _REPO / "experiments/beat_profile/results/h200_voicechat_11b.jsonl"
