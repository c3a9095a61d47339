"""Which H200 rows an experiment's simulated part is fitted to: its flags, the fit, its labels.

Shared by the scheduling experiments of issue 15 (``batching_policy``, ``slot_buckets``,
``frames_per_tick``, ``phase_stagger``, ``admission_overload``, ``idle_speech``). ``--fit=capacity``
(the default) fits ``sim.fit_capacity`` to the ``experiments/capacity`` rows of one engine
configuration, ``--capacity_config``: ``auto`` (the default, the engine's GPU default kernels) or
``xla_tts`` (the engine of ``d846496`` and ``5386a4f``, XLA's speech-decoder attention: the
previous fit, kept as history); ``--fit=beat_profile`` fits ``sim.fit_h200`` to the older
engine's (``9dce6ca``) beat-profile rows, which reproduces the experiments' history. Component
rows (the context share) come from the beat-profile file in both.
"""

from __future__ import annotations

import pathlib

from absl import flags

from experiments.policy_sim import engine_runs as er
from experiments.policy_sim import sim

FLAGS = flags.FLAGS
CAPACITY_ROWS = er.H200_PROFILE.parents[2] / "capacity/results/h200_reference.jsonl"
# the scheduling experiments' H200 engine rows, and the 2- and 4-slot ticks (all XLA under
# ``auto``) that frames_per_tick's script timed
TICK_ROWS = [
    *(er.H200_PROFILE.parents[2] / f"{e}/results/h200_voicechat_11b.jsonl"
      for e in ("batching_policy", "slot_buckets", "phase_stagger")),
    er.H200_PROFILE.parents[2] / "batching_policy/results/h200_small_ticks.jsonl",
]  # fmt: skip


def define_fit_flags(figure: str) -> None:
    """``--fit``, ``--capacity_config``, ``--tick_line``, ``--tick_rows``, ``--capacity_rows``,
    ``--profile_rows``, ``--sim_out`` and ``--plot``.

    ``figure``: the experiment's figure name beside its ``run.py`` by default:
    ``FIGURE_current.png`` (the current fit), ``FIGURE_xla_tts.png`` (the capacity fit of the
    engine with XLA's speech-decoder attention) or ``FIGURE.png`` (the oldest, beat_profile).
    """
    flags.DEFINE_enum(
        "fit", "capacity", ["capacity", "beat_profile"],
        "Rows the simulator is fitted to: 'capacity' (--capacity_rows, the current engine: "
        "sim.fit_capacity) or 'beat_profile' (--profile_rows, the older engine 9dce6ca: "
        "sim.fit_h200).",
    )  # fmt: skip
    define_config_flag()
    flags.DEFINE_bool(
        "tick_line", False,
        "With --fit=capacity: refit the step cost to one line through the scheduling experiments' "
        "measured multi-slot ticks (--tick_rows) and the capacity probes, the 1-slot engine apart "
        "(sim.fit_tick_line); outputs named *_line.",
    )  # fmt: skip
    flags.DEFINE_list(
        "tick_rows", [str(p) for p in TICK_ROWS],
        "The scheduling experiments' H200 engine rows, for --tick_line.",
    )  # fmt: skip
    flags.DEFINE_string(
        "capacity_rows", str(CAPACITY_ROWS),
        "Current engine's H200 rows (baseline, probe, hold_full serve) for --fit=capacity.",
    )  # fmt: skip
    flags.DEFINE_string(
        "profile_rows", str(er.H200_PROFILE),
        "Older engine's H200 rows: tick and serve rows for --fit=beat_profile; component rows "
        "(the context share) for both fits.",
    )  # fmt: skip
    flags.DEFINE_string(
        "sim_out", None,
        "Simulated rows (rewritten); default results/sim_h200_current.jsonl for --fit=capacity "
        "(results/sim_h200_xla_tts.jsonl with --capacity_config=xla_tts), results/sim_h200.jsonl "
        "for --fit=beat_profile.",
    )  # fmt: skip
    flags.DEFINE_string(
        "plot", None,
        f"PNG ('' for none); default {figure}_current.png for --fit=capacity "
        f"({figure}_xla_tts.png with --capacity_config=xla_tts), {figure}.png for "
        "--fit=beat_profile.",
    )  # fmt: skip


def define_config_flag() -> None:
    """``--capacity_config``: which engine configuration's capacity rows ``--fit=capacity`` uses."""
    flags.DEFINE_enum(
        "capacity_config", "auto", list(sim.CAPACITY_CONFIGS),
        "Engine configuration whose capacity rows --fit=capacity fits (sim.CAPACITY_CONFIGS): "
        "'auto' (the GPU default kernels, the current engine) or 'xla_tts' (XLA's "
        "speech-decoder attention: the previous fit, kept as history).",
    )  # fmt: skip


def _tick_line() -> bool:
    """``--tick_line`` where the experiment defines it (``policy_sim/run.py`` does not)."""
    return "tick_line" in FLAGS and FLAGS.tick_line


def fit_key() -> str:
    """``--fit``, with the capacity configuration where it is not the current one."""
    if FLAGS.fit == "capacity" and FLAGS.capacity_config != "auto":
        return f"capacity_{FLAGS.capacity_config}"
    if FLAGS.fit == "capacity" and _tick_line():
        return "capacity_line"
    return FLAGS.fit


def fit_models(profile: list[dict] | None = None) -> sim.H200Fit:
    """The simulator's step-cost and tail models fitted to the rows ``--fit`` names.

    ``profile``: the ``--profile_rows`` rows, if already read.
    """
    if _tick_line() and (FLAGS.fit, FLAGS.capacity_config) != ("capacity", "auto"):
        raise ValueError("--tick_line refits the current engine: it needs --fit=capacity and "
                         "--capacity_config=auto")  # fmt: skip
    if profile is None:
        profile = er.read_rows(FLAGS.profile_rows)
    if FLAGS.fit == "beat_profile":
        return sim.fit_h200(profile)
    fit = capacity_fit(FLAGS.capacity_config, profile)
    if _tick_line():
        fit = sim.fit_tick_line(fit, tick_points())
    return fit


def capacity_fit(config: str, profile: list[dict]) -> sim.H200Fit:
    """``sim.fit_capacity`` on the ``--capacity_rows`` of engine configuration ``config``, the
    context share from ``profile``'s component rows (the ``--profile_rows``)."""
    components = [r for r in profile if r["kind"] == "component"]
    return sim.fit_capacity(er.read_rows(FLAGS.capacity_rows), components, config=config)


def tick_points() -> list[dict]:
    """The back-to-back ticks measured in the ``--tick_rows`` files (``sim.measured_ticks``)."""
    return [p for path in FLAGS.tick_rows for p in sim.measured_ticks(er.read_rows(path))]


def model_row(fit: sim.H200Fit) -> dict:
    """The fit the simulated rows come from: its rows, step cost, host overhead and stalls."""
    config = {"config": fit.config} if fit.config else {}
    config |= {"tick_line": True} if fit.tick_line else {}
    cost = {k: v for k, v in vars(fit.cost).items() if v is not None}
    return {"kind": "model", "source": fit.source, **config, **cost,
            "context_share": fit.share, "host_ms": fit.tail.host_ms,
            "stall_prob": fit.tail.stall_prob}  # fmt: skip


def sim_files(here: pathlib.Path, figure: str) -> tuple[str, str]:
    """``(sim_out, plot)``: the flags where given, else ``--fit``'s defaults in ``here``."""
    out, png = {
        "capacity": ("results/sim_h200_current.jsonl", f"{figure}_current.png"),
        "capacity_xla_tts": ("results/sim_h200_xla_tts.jsonl", f"{figure}_xla_tts.png"),
        "capacity_line": ("results/sim_h200_line.jsonl", f"{figure}_line.png"),
        "beat_profile": ("results/sim_h200.jsonl", f"{figure}.png"),
    }[fit_key()]
    return (
        FLAGS.sim_out if FLAGS.sim_out is not None else str(here / out),
        FLAGS.plot if FLAGS.plot is not None else str(here / png),
    )


def fit_label(sim_rows: list[dict]) -> str:
    """Which rows the simulated rows were fitted to (rows without a ``model`` source: the older
    engine's, as before the capacity fit existed; a capacity model row without a ``config``: the
    ``xla_tts`` engine's, as before the configurations were named)."""
    model = next((r for r in sim_rows if r["kind"] == "model"), {})
    if model.get("source") != "capacity":
        return "beat_profile rows"
    line = ", tick line" if model.get("tick_line") else ""
    return f"capacity rows, {model.get('config', 'xla_tts')} kernels{line}"


def print_validation(sim_rows: list[dict]) -> None:
    """One line per ``validation`` row: the real and simulated p50 and the error."""
    for v in (r for r in sim_rows if r["kind"] == "validation"):
        print(f"  validation {v['sessions']:>4} sessions: real p50 {v['real_p50_ms']:.1f} sim "
              f"{v['sim_p50_ms']:.1f} ms ({100 * v['p50_error']:+.1f} %)")  # fmt: skip
