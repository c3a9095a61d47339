"""A profiler trace of back-to-back ticks, reduced to device time per model component. See
README.md.

Per slot count in ``--slots``: the engine as ``experiments/capacity`` builds it (random weights,
the policy's precision, kernels ``auto``, every attention cache held full with ``--hold_full``),
the staged dispatch tick compiled alone (its admission program too; not the roll-over ones), two
warm ticks (the first admits every slot), ``--probe_ticks`` timed back to back without the
profiler, then a ``jax.profiler`` trace of ``--ticks`` ticks, each inside a ``tick <k>``
annotation and blocked on, and of one admission. The trace and the compiled HLO are written to
``--out_dir`` (default ``$OUT``, else ``runs/tick_profile/<time>``) and reduced
(``reduce.py``) to rows, written as JSON lines to ``rows.jsonl`` there as soon as each is known; a
table is printed last and written to ``table.md``.

``--reduce_only=DIR`` reduces the traces and HLO a run left in DIR again (no JAX device work).
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
import traceback

from absl import app, flags, logging

from experiments import harness
from experiments.tick_profile import reduce as reduce_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "voicechat_11b", "Preset: voicechat_11b | tiny.")
flags.DEFINE_list("slots", ["72", "112"], "Slot counts, one engine each, in this order.")
flags.DEFINE_integer("context_frames", 1500, "Context cap in frames (caches sized for it).")
flags.DEFINE_string("policy", "reference", "Precision policy (voicechat_jax.precision).")
flags.DEFINE_string("ssm_kernel", "auto", "LLM Mamba step update (ServeConfig.ssm_kernel).")
flags.DEFINE_string("attention", "auto", "LLM decode attention (ServeConfig.attention).")
flags.DEFINE_string("tts_attention", None, "Speech decoder's attention (default: as LLM's).")
flags.DEFINE_string("projection", "xla", "LLM projections (ServeConfig.projection).")
flags.DEFINE_bool("hold_full", True, "Every live slot's attention caches held full.")
flags.DEFINE_bool("codec_stream", False, "Each frame's codec step on a second GPU stream.")
flags.DEFINE_bool(
    "codec_in_attention", False, "Each frame's codec products in the next frame's attention."
)
flags.DEFINE_bool(
    "codec_frame_behind",
    False,
    "With codec_in_attention, the codec a frame behind: every frame's products in attention.",
)
flags.DEFINE_integer("ticks", 3, "Ticks in the trace.", lower_bound=1)
flags.DEFINE_integer("probe_ticks", 5, "Ticks timed back to back without the profiler.")
flags.DEFINE_string("out_dir", None, "Rows, table, traces and HLO (default $OUT, else runs/).")
flags.DEFINE_string("commit", None, "The engine commit for the rows (default: git rev-parse).")
flags.DEFINE_string("reduce_only", None, "Reduce the traces and HLO a run left in this folder.")

REPO = pathlib.Path(__file__).resolve().parents[2]
COPY_TBPS, DATASHEET_TBPS = 3.7, 4.8  # measured device copy; H200 datasheet
FP32_TFLOPS = 67.0  # H200 fp32 without tensor cores (datasheet)
ENV_KEYS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_COMPILATION_CACHE_DIR")


def commit() -> str:
    return FLAGS.commit or harness.commit()


SOURCES = "sources.json.gz"  # the repository files the HLO's frames name, as they were


def keep_sources(out_dir: pathlib.Path, hlo_texts: list[str]) -> None:
    """Adds to ``out_dir/sources.json.gz`` every repository file the HLO's stack frames name, as
    the checkout holds it now: the reduction of this run reads them, not a later tree."""
    path = out_dir / SOURCES
    files: dict[str, str] = {}
    if path.exists():
        with gzip.open(path, "rt") as f:
            files = json.load(f)
    for text in hlo_texts:
        hlo = reduce_lib.parse_hlo(text)
        for rel in {reduce_lib.repository_path(f.file) for f in hlo.locations.values()}:
            if rel is not None and rel not in files and (REPO / rel).exists():
                files[rel] = (REPO / rel).read_text()
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(files, f)


class Rows:
    """JSON lines appended to a file as they arrive, each with the run's provenance."""

    def __init__(self, path: pathlib.Path, provenance: dict):
        self.path, self.provenance, self.rows = path, provenance, []
        self._lock = threading.Lock()  # the reduction of one count runs beside the next

    def write(self, row: dict) -> dict:
        row = {**row, **self.provenance}
        logging.info("row %s", json.dumps(row, default=str)[:400])
        with self._lock, open(self.path, "a") as f:
            self.rows.append(row)
            f.write(json.dumps(row, default=float) + "\n")
        return row


# ------------------------------------------------------------------------------ device side


def profile_slots(n: int, params, cfg, template, out_dir: pathlib.Path, rows: Rows):
    """Builds, compiles, warms, times and traces the engine at ``n`` slots; returns the template
    and the measure row (the trace and HLO written beside the rows)."""
    import jax
    import numpy as np

    from voicechat_jax import config as config_lib
    from voicechat_jax import precision as precision_lib
    from voicechat_jax import state as state_lib
    from voicechat_jax import step as step_lib
    from voicechat_jax.engine import Engine, byte_floor_ms

    serve = config_lib.ServeConfig(
        slots=n,
        frames_per_tick=2,
        context_frames=FLAGS.context_frames,
        precision=precision_lib.policy(FLAGS.policy),
        ssm_kernel=FLAGS.ssm_kernel,
        attention=FLAGS.attention,
        tts_attention=FLAGS.tts_attention,
        projection=FLAGS.projection,
        codec_stream=FLAGS.codec_stream,
        codec_in_attention=FLAGS.codec_in_attention,
        codec_frame_behind=FLAGS.codec_frame_behind,
        hold_full=FLAGS.hold_full,
    )
    engine = Engine(params, cfg, serve, template=template)
    template, state, memory = engine.template, engine.state, engine.memory
    kernels, template_s = engine.kernels.row(), engine.template_s
    engine.state = None  # the state is this function's now: the programs below donate it
    del engine
    programs = step_lib.make_staged(cfg, serve)
    samples = serve.frames_per_tick * cfg.encoder.mel.samples_per_frame
    empty = state_lib.empty_beat(n, samples, serve.capsule_tokens)
    t = time.perf_counter()
    tick = programs.tick.lower(params, state, template, empty, state_lib.masks_of(empty)).compile()
    tick_s = time.perf_counter() - t
    t = time.perf_counter()
    admit = programs.admit.lower(state, template, np.int32(0)).compile()
    admit_s = time.perf_counter() - t
    logging.info("%d slots: tick compiled in %.1f s, admission in %.1f s", n, tick_s, admit_s)

    first = state_lib.empty_beat(n, samples, serve.capsule_tokens)
    first.admit[:] = True  # every slot already holds the template: admission is the flag
    first.key[:] = np.arange(first.key.size, dtype=np.uint32).reshape(first.key.shape)
    beat = state_lib.empty_beat(n, samples, serve.capsule_tokens)
    beat.audio[:] = np.stack([harness.speech(samples, i) for i in range(n)])
    t = time.perf_counter()
    # Every slot live with room in every beat (the caches are held full): the beats' masks.
    masks = state_lib.masks_of(beat)
    for b, m in ((first, masks.replace(admit=first.admit)), (beat, masks)):  # warm: first runs
        state, out = tick(params, state, template, b, m)
        jax.block_until_ready((state, out))
    warm_s = time.perf_counter() - t
    probe = []
    for _ in range(FLAGS.probe_ticks):
        t = time.perf_counter()
        state, out = tick(params, state, template, beat, masks)
        jax.block_until_ready((state, out))
        probe.append((time.perf_counter() - t) * 1e3)
    digest = out_digest(out)

    trace_root = pathlib.Path(tempfile.mkdtemp(prefix=f"tick_profile_{n}_"))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python frames would only fill the trace
    t = time.perf_counter()
    jax.profiler.start_trace(str(trace_root), create_perfetto_trace=True, profiler_options=options)
    try:
        for k in range(FLAGS.ticks):
            with jax.profiler.TraceAnnotation(f"tick {k}"):
                state, out = tick(params, state, template, beat, masks)
                jax.block_until_ready((state, out))
        with jax.profiler.TraceAnnotation("admission"):
            state = admit(state, template, np.int32(0))
            jax.block_until_ready(state)
    finally:
        jax.profiler.stop_trace()
    trace_s = time.perf_counter() - t
    found = sorted(trace_root.glob("plugins/profile/*/perfetto_trace.json.gz"))
    trace_file = out_dir / f"trace_{n}.json.gz"
    if found:
        shutil.copyfile(found[-1], trace_file)
    hlo_file = out_dir / f"hlo_{n}.txt.gz"
    with gzip.open(hlo_file, "wt", compresslevel=6) as f:
        f.write(tick.as_text())
        f.write("\n")
        f.write(admit.as_text())
    keep_sources(out_dir, [tick.as_text(), admit.as_text()])
    shutil.rmtree(trace_root, ignore_errors=True)

    cost = tick.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else (cost or {})
    stats = jax.devices()[0].memory_stats() or {}
    measure = rows.write(
        {
            "kind": "measure",
            "slots": n,
            "kernels": kernels,
            "template_s": round(template_s, 2),
            "tick_compile_s": round(tick_s, 2),
            "admit_compile_s": round(admit_s, 2),
            "warm_s": round(warm_s, 2),
            "trace_s": round(trace_s, 2),
            "probe_ms": [round(x, 3) for x in probe],
            "probe_ms_p50": reduce_lib.median(probe) if probe else None,
            "out_digest": digest,
            "floor_ms": byte_floor_ms(params, template, n, tbps=COPY_TBPS),
            "floor_ms_datasheet": byte_floor_ms(params, template, n, tbps=DATASHEET_TBPS),
            "state_gib": round(memory.state_bytes / 2**30, 2),
            "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
            "limit_gib": round(stats.get("bytes_limit", 0) / 2**30, 2),
            "xla_flops": float(cost.get("flops", 0.0)),
            "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "trace_file": trace_file.name if found else None,
            "hlo_file": hlo_file.name,
            "ticks_traced": FLAGS.ticks,
        }
    )
    del state, out
    return template, measure


# ------------------------------------------------------------------------------- reduction


def reduce_measure(measure: dict, out_dir: pathlib.Path, rows: Rows) -> dict | None:
    """Reduces one slot count's trace and HLO to component rows; returns a summary for the
    table (None without a trace)."""
    n = measure["slots"]
    if not measure.get("trace_file"):
        rows.write({"kind": "error", "slots": n, "error": "no trace file was written"})
        return None
    trace = reduce_lib.load_trace(str(out_dir / measure["trace_file"]))
    with gzip.open(out_dir / measure["hlo_file"], "rt") as f:
        text = f.read()
    parts = text.split("\nHloModule ")
    hlos = [reduce_lib.parse_hlo(p if i == 0 else "HloModule " + p) for i, p in enumerate(parts)]
    events, kind, lines, alignment = reduce_lib.device_events(trace, hlos)
    snapshot = out_dir / SOURCES
    files = None
    if snapshot.exists():
        with gzip.open(snapshot, "rt") as f:
            files = json.load(f)
    sources = reduce_lib.Sources(str(REPO), files)
    ticks = reduce_lib.windows(trace, "tick ")
    admission = reduce_lib.windows(trace, "admission")

    def of(module: str) -> list:  # the events of one program (all, where they name none)
        return [e for e in events if e.hlo_module in (None, module)]

    tick_red = reduce_lib.reduce_window(of(hlos[0].module), hlos, sources, ticks)
    adm_red = reduce_lib.reduce_window(of(hlos[-1].module), hlos, sources, admission, top=5)
    spans = tick_red["spans"]

    def med(key: str) -> float:
        return reduce_lib.median([s[key] for s in spans]) / 1e3

    probe = measure.get("probe_ms_p50")
    busy_ms = med("busy_us")
    tick_row = rows.write(
        {
            "kind": "tick",
            "slots": n,
            "trace_kind": kind,
            "trace_lines": lines,
            "graph_kernels": sum(e.graph is not None for e in events),
            "kernels_traced": len(events),
            "alignment": alignment,
            "ticks": len(spans),
            "wall_ms_profiled": med("wall_us"),
            "kernel_span_ms": med("kernel_span_us"),
            "busy_ms": busy_ms,
            "kernel_sum_ms": med("kernel_sum_us"),
            "idle_in_span_ms": med("idle_us"),
            "launches": reduce_lib.median([s["launches"] for s in spans]),
            "per_tick": spans,
            "probe_ms_p50": probe,
            "floor_ms": measure.get("floor_ms"),
            "idle_vs_probe_ms": (probe - busy_ms) if probe else None,
            "unmatched_us": tick_red["unmatched"],
        }
    )
    comps = reduce_lib.ordered(tick_red["components"])
    for c in comps:
        rows.write(component_row(n, c, busy_ms, probe, "tick"))
    for c in reduce_lib.ordered(adm_red["components"]):
        rows.write(component_row(n, c, None, None, "admission"))
    for k in tick_red["kernels"]:
        rows.write({"kind": "kernel", "slots": n, **k})
    for op in tick_red["ops"]:
        rows.write({"kind": "op", "slots": n, **op})
    return {
        "slots": n,
        "tick": tick_row,
        "components": comps,
        "admission": adm_red,
        "ops": tick_red["ops"],
    }


def reduce_into(measure: dict, out_dir: pathlib.Path, rows: Rows, summaries: list) -> None:
    """``reduce_measure``, its summary appended to ``summaries``; a failure is a row (the trace
    and HLO stay, for ``--reduce_only``)."""
    t = time.perf_counter()
    try:
        summaries.append(reduce_measure(measure, out_dir, rows))
    except Exception as e:
        logging.error("%d slots, reduction: %s", measure["slots"], traceback.format_exc())
        rows.write({"kind": "error", "slots": measure["slots"], "error": "reduce: " + str(e)[:500]})
    logging.info("%d slots reduced in %.1f s", measure["slots"], time.perf_counter() - t)


def out_digest(out) -> dict:
    """What the last timed tick produced, in a form two runs compare: a hash of its integer
    leaves (tokens and codes) and the sum of its float leaves (audio), so that a compiler flag
    that must not change the numbers is seen not to."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    total = 0.0
    for leaf in jax.tree.leaves(out):
        a = np.asarray(leaf)
        if np.issubdtype(a.dtype, np.floating):
            total += float(np.sum(a, dtype=np.float64))
        else:
            h.update(a.tobytes())
    return {"ints_sha256": h.hexdigest()[:16], "floats_sum": total}


def component_row(n: int, c, busy_ms, probe_ms, window: str) -> dict:
    ms = c.us / 1e3
    return {
        "kind": "component" if window == "tick" else "admission_component",
        "slots": n,
        "component": c.name,
        "ms": ms,
        "launches": c.launches,
        "executions": c.executions,
        "memcpy_ms": c.memcpy_us / 1e3,
        "idle_before_ms": c.idle_before_us / 1e3,
        "gb": c.bytes / 1e9,
        "gflop": c.flops / 1e9,
        "tb_s": c.bytes / (c.us * 1e6) if c.us else None,
        "tflop_s": c.flops / (c.us * 1e6) if c.us else None,
        "share_of_busy": ms / busy_ms if busy_ms else None,
        "share_of_probe": ms / probe_ms if probe_ms else None,
    }


def table(summaries: list[dict]) -> str:
    """A markdown table: per component ms / tick, launches, GB, TB/s, TFLOP/s at each count."""
    summaries = [s for s in summaries if s]
    if not summaries:
        return "(no trace reduced)\n"
    names = []
    for s in summaries:
        names += [c.name for c in s["components"] if c.name not in names]
    names = [c for c in reduce_lib.COMPONENTS if c in names] + [
        c for c in names if c not in reduce_lib.COMPONENTS
    ]
    head = "| component |" + "".join(
        f" B={s['slots']} ms | memcpy ms | launches | GB | TB/s | TFLOP/s |" for s in summaries
    )
    out = [head, "|---|" + "---:|" * 6 * len(summaries)]

    def cells(c) -> str:
        if c is None:
            return " | | | | | |"
        ms = c.us / 1e3
        tbs = f"{c.bytes / (c.us * 1e6):.2f}" if c.us else ""
        tfs = f"{c.flops / (c.us * 1e6):.1f}" if c.us and c.flops else ""
        mem = f"{c.memcpy_us / 1e3:.2f}" if c.memcpy_us else ""
        return f" {ms:.2f} | {mem} | {c.launches} | {c.bytes / 1e9:.3g} | {tbs} | {tfs} |"

    for name in names:
        row = f"| {name} |"
        for s in summaries:
            row += cells(next((c for c in s["components"] if c.name == name), None))
        out.append(row)

    def line(label: str, key: str, fmt: str = "{:.2f}") -> str:
        row = f"| **{label}** |"
        for s in summaries:
            v = s["tick"].get(key)
            row += f" {fmt.format(v) if v is not None else '-'} | | | | | |"
        return row

    out += [
        line("kernels, sum", "kernel_sum_ms"),
        line("device idle inside the tick (profiled)", "idle_in_span_ms"),
        line("first to last kernel (profiled)", "kernel_span_ms"),
        line("tick wall, profiled", "wall_ms_profiled"),
        line("tick wall, no profiler (p50)", "probe_ms_p50"),
        line("byte floor (3.7 TB/s)", "floor_ms"),
        line("launches per tick", "launches", "{:.0f}"),
    ]
    return (
        "\n".join(out)
        + "\n"
        + "".join(map(idle_line, summaries))
        + "".join(map(ops_table, summaries))
    )


def idle_line(summary: dict, shown: int = 6) -> str:
    """Where the device waited: the tick's idle time by the component whose kernel came next."""
    comps = sorted(summary["components"], key=lambda c: -c.idle_before_us)[:shown]
    parts = [f"{c.name} {c.idle_before_us / 1e3:.2f}" for c in comps if c.idle_before_us >= 10]
    return (
        f"\n{summary['slots']} slots, the device idle before each component's kernels (ms, the "
        f"largest): {', '.join(parts) or 'none'}\n"
    )


def ops_table(summary: dict, min_ms: float = 0.1) -> str:
    """Each component's largest operations at one slot count (the reducer's ``ops``; the rows
    keep every one, the table those of at least ``min_ms`` a tick)."""
    rows = [
        f"\n{summary['slots']} slots, by operation (each component's largest, >= {min_ms} ms):\n",
        "| component | operation | ms | launches | GB | TB/s | TFLOP/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for op in summary.get("ops", []):
        us = op["us_per_span"]
        if us < min_ms * 1e3:
            continue
        tbs = f"{op['bytes_per_span'] / (us * 1e6):.2f}"
        tfs = f"{op['flops_per_span'] / (us * 1e6):.1f}" if op["flops_per_span"] else ""
        rows.append(
            f"| {op['component']} | `{op['op'][-60:]}` | {us / 1e3:.2f} | "
            f"{op['launches_per_span']:.0f} | {op['bytes_per_span'] / 1e9:.3g} | {tbs} | {tfs} |"
        )
    return "\n".join(rows) + "\n"


def main(argv):
    del argv
    out_dir = FLAGS.reduce_only or FLAGS.out_dir or os.environ.get("OUT")
    if not out_dir:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        out_dir = str(REPO / "runs" / "tick_profile" / stamp)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    provenance = {"commit": commit(), "command": " ".join(sys.argv), "model": FLAGS.model}
    summaries = []
    if FLAGS.reduce_only:
        rows = Rows(out_dir / "reduced.jsonl", provenance)
        with open(out_dir / "rows.jsonl") as f:
            measures = [r for r in map(json.loads, f) if r["kind"] == "measure"]
        for m in measures:  # the run's provenance; this reduction's commit beside it
            keep = ("commit", "command", "device", "jax", "measured_at")  # the row format's five
            keep += ("context_frames", "policy", "env")  # and the run's configuration
            rows.provenance = {k: m.get(k) for k in keep} | {
                "reduced_at": provenance["commit"],
                "reduce_command": provenance["command"],
            }
            reduce_into(m, out_dir, rows, summaries)
    else:
        import jax

        from voicechat_jax import config as config_lib
        from voicechat_jax import precision as precision_lib
        from voicechat_jax.model import voicechat

        provenance |= {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "measured_at": harness.provenance()["measured_at"],
            "context_frames": FLAGS.context_frames,
            "policy": FLAGS.policy,
            "hold_full": FLAGS.hold_full,
            # a cache folder inside the checkout is named relative to it (no machine's path)
            "env": {
                k: os.environ[k].replace(os.getcwd() + os.sep, "")
                for k in ENV_KEYS
                if k in os.environ
            },
        }
        rows = Rows(out_dir / "rows.jsonl", provenance)
        cfg = config_lib.PRESETS[FLAGS.model]()
        t = time.perf_counter()
        params = voicechat.init_compiled(
            jax.random.key(0), cfg, precision_lib.policy(FLAGS.policy), serving=True
        )
        jax.block_until_ready(params)
        logging.info("random %s params in %.1f s", FLAGS.model, time.perf_counter() - t)
        template, threads = None, []
        for n in (int(x) for x in FLAGS.slots):
            try:
                template, measure = profile_slots(n, params, cfg, template, out_dir, rows)
            except Exception as e:  # a count that does not fit (memory) is a result
                logging.error("%d slots: %s", n, traceback.format_exc())
                rows.write({"kind": "error", "slots": n, "error": str(e)[:500]})
                continue
            # Reduced beside the next count's compile (pure Python; the compile is XLA's).
            t = threading.Thread(target=reduce_into, args=(measure, out_dir, rows, summaries))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        summaries.sort(key=lambda s: s["slots"] if s else 0)
    text = table(summaries)
    (out_dir / ("table_reduced.md" if FLAGS.reduce_only else "table.md")).write_text(text)
    print(f"{provenance['model']} at commit {rows.provenance['commit']}; rows in {out_dir}")
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
