"""Idle speech-decoder work (frames where the agent is silent) in a fixed-shape batch: masked
against compacted.

Engine part (``--parts=engine``; tiny on the CPU for smoke rows, ``--model=voicechat_11b`` on the
H200): the speech decoder's frame step (``ear_tts.tts_step``: backbone, MoG rounds, RVQ) and the
codec's beat step (``codec.decode_step``) timed, jitted with their state donated, at B slots of
which k speak:

- ``full``: every row runs (the tick today);
- ``masked``: the step's run mask set to the k speakers (the same fixed shape);
- ``compacted``: the k speakers' rows gathered into a bucket of b >= k rows, stepped, scattered
  back (the state copied out and in);
- ``small``: a b-row state stepped alone (what an indexed kernel that reads the speakers' rows
  where they lie, with no copy, could cost: the lower bound of compaction).

Simulated part (``--parts=sim``; host only): the H200 tick with the speech decoder's components
(``experiments/beat_profile`` rows at B = 16, 32) at b rows instead of B, with and without the
copy (bytes at the measured copy bandwidth); capacity at zero misses with the simulator fitted to
the H200 rows, for speaking fractions. ``--fit`` picks the whole-tick fit: ``capacity`` (default:
the current engine's ``experiments/capacity`` rows, ``sim.fit_capacity``; with
``--capacity_config=xla_tts`` the previous engine's, the README's history) or ``beat_profile``
(the older engine's, ``sim.fit_h200``: the README's older history); the speech decoder's part
comes from the beat_profile component rows under each (``--speech_cost``: as measured, or scaled
to the fitted tick), or from this experiment's own H200 engine rows (``--speech_cost=measured``:
lines fitted to ``--speech_rows``, the copy from their compacted minus small step). Skipping a
silent frame changes what the model computes (its speech-decoder context skips those frames): this
measures cost, not quality.
``--parts=`` (neither part) draws only the figure, from the rows already written (``--sim_out``,
``--out``), through ``experiments.plot``. See README.md beside this file.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import harness

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
from experiments import plot as draw  # noqa: E402
from experiments.policy_sim import engine_runs as er  # noqa: E402
from experiments.policy_sim import fits, sim  # noqa: E402
from voicechat_jax.engine import build_template  # noqa: E402
from voicechat_jax.model import codec, ear_tts  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Preset: tiny | voicechat_11b.")
flags.DEFINE_list("parts", ["engine", "sim"], "engine (real runs) and/or sim (H200 simulator).")
flags.DEFINE_list("slots", ["4", "8"], "Slot counts B.")
flags.DEFINE_list("speaking", ["0.25", "0.5", "0.75"], "Share of the slots whose agent speaks.")
flags.DEFINE_integer("calls", 10, "Timed calls per point (median).")
flags.DEFINE_integer("context_frames", 64, "Context cap in frames (1500 on the H200).")
flags.DEFINE_string("out", str(_HERE / "results/cpu_tiny.jsonl"), "Engine rows (appended).")
flags.DEFINE_list("sim_speaking", ["0.3", "0.5", "0.7", "1.0"], "Simulated speaking shares.")
flags.DEFINE_integer("seeds", 5, "Simulator seeds per capacity probe.")
flags.DEFINE_integer("capacity_beats", 500, "Beats per simulated capacity probe.")
flags.DEFINE_enum(
    "speech_cost", "components", ["components", "scaled", "measured"],
    "The speech decoder's ms in the simulated tick: 'components' (the beat_profile component rows' "
    "ms as measured), 'scaled' (those ms times, at each B, the whole-tick fit over the sum of "
    "all components: the speech decoder's share of the component rows kept, as frames_per_tick "
    "scales them) or 'measured' (lines fitted to this experiment's H200 rows, --speech_rows: the "
    "speech decoder's frame step and the codec through their small and full points, the "
    "compaction's copy through compacted minus small; outputs named *_measured).",
)  # fmt: skip
flags.DEFINE_string(
    "speech_rows", str(_HERE / "results/h200_voicechat_11b.jsonl"),
    "This experiment's H200 engine rows (kind speech), for --speech_cost=measured.",
)  # fmt: skip
harness.define_engine_flags()
fits.define_fit_flags("idle_speech")


# The speech decoder's components in the beat_profile rows: per frame, and the codec per beat.
SPEECH_FRAME = ("TTS backbone", "TTS text side", "MoG round", "RVQ encoding")
SPEECH_BEAT = ("codec decode",)


def bucket(k: int, B: int) -> int:
    """The smallest power of two >= k, at most B."""
    return min(B, 1 << max(0, math.ceil(math.log2(max(k, 1)))))


def _slots(tree, n: int):
    """``n`` copies of a batch-1 state (the template's speech decoder or codec part)."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n, *x.shape[1:])).copy(), tree)


def _gather(tree, idx):
    return jax.tree_util.tree_map(lambda x: jnp.take(x, idx, axis=0, mode="clip"), tree)


def _scatter(tree, idx, sub):
    """``sub``'s rows written at ``idx`` (rows whose index is out of range are dropped)."""
    return jax.tree_util.tree_map(lambda x, s: x.at[idx].set(s, mode="drop"), tree, sub)


def engine_part(rows: list[dict]) -> None:
    base = er.engine_setup(FLAGS.model)
    cfg, params = er.build(FLAGS.model)
    serve = harness.serve_config(slots=1, context_frames=FLAGS.context_frames)
    template = build_template(params, cfg, serve)
    Q = cfg.tts.n_quantizers
    step = functools.partial(ear_tts.tts_step, cfg=cfg, deterministic=False)
    beat_codes = functools.partial(codec.decode_step, cfg=cfg.codec)

    def tts_full(p, s, text, keys):
        return step(p.tts, s, text, keys)[:2]

    def tts_masked(p, s, text, keys, run):
        return step(p.tts, s, text, keys, run)[:2]

    def tts_compacted(p, s, text, keys, idx):
        sub, codes = step(p.tts, _gather(s, idx), text[idx % text.shape[0]],
                          keys[idx % keys.shape[0]])[:2]  # fmt: skip
        return _scatter(s, idx, sub), codes

    def codec_full(p, s, codes):
        return beat_codes(p.codec, s, codes)

    def codec_compacted(p, s, codes, idx):
        sub, wav = beat_codes(p.codec, _gather(s, idx), codes[idx % codes.shape[0]])
        return _scatter(s, idx, sub), wav

    jit = functools.partial(jax.jit, donate_argnums=(1,))
    fns = {n: jit(f) for n, f in (("tts_full", tts_full), ("tts_masked", tts_masked),
                                  ("tts_compacted", tts_compacted), ("codec_full", codec_full),
                                  ("codec_compacted", codec_compacted))}  # fmt: skip
    rng = np.random.default_rng(0)

    def timed(name, state, *args):
        box = [state]

        def call():
            box[0], out = fns[name](params, box[0], *args)
            return out

        return harness.time_call(call, calls=FLAGS.calls)

    for B in (int(x) for x in FLAGS.slots):
        full = template.replace(tts=_slots(template.tts, B), codec=_slots(template.codec, B))
        text = jnp.asarray(rng.integers(0, cfg.llm.vocab_size, B), jnp.int32)
        keys = jnp.asarray(rng.integers(0, 2**31, (B, 2)), jnp.uint32)
        codes = jnp.asarray(rng.integers(0, cfg.tts.codebook_size, (B, 2, Q)), jnp.int32)
        copy = functools.partial(jax.tree_util.tree_map, lambda x: x.copy())
        t_full = timed("tts_full", copy(full.tts), text, keys)
        c_full = timed("codec_full", copy(full.codec), codes)
        for share in (float(x) for x in FLAGS.speaking):
            k = max(1, round(share * B))
            b = bucket(k, B)
            run = jnp.arange(B) < k
            idx = jnp.where(jnp.arange(b) < k, jnp.arange(b), B).astype(jnp.int32)  # pad: dropped
            small = template.replace(tts=_slots(template.tts, b), codec=_slots(template.codec, b))
            row = {
                **base, "kind": "speech", "slots": B, "speaking": k, "bucket": b,
                "tts_full_ms": t_full,
                "tts_masked_ms": timed("tts_masked", copy(full.tts), text, keys, run),
                "tts_compacted_ms": timed("tts_compacted", copy(full.tts), text, keys, idx),
                "tts_small_ms": timed("tts_full", small.tts, text[:b], keys[:b]),
                "codec_full_ms": c_full,
                "codec_compacted_ms": timed("codec_compacted", copy(full.codec), codes, idx),
                "codec_small_ms": timed("codec_full", small.codec, codes[:b]),
            }  # fmt: skip
            rows.append(row)
            del small
        del full


# ---- simulated -----------------------------------------------------------------------------


def lines(components: list[dict], names: tuple[str, ...]) -> tuple[float, float]:
    """Sum of the named components' ms per frame-step as a line in B (through B = 16, 32)."""
    by = {(r["component"], r["slots"]): r for r in components}
    a = b = 0.0
    for (name, slots), r in by.items():
        if slots == 16 and name.startswith(names) and (name, 32) in by:
            slope = (by[(name, 32)]["ms"] - r["ms"]) / 16
            a += r["ms"] - 16 * slope
            b += slope
    return a, b


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``a + b*x`` through ``(x, y)`` points.

    The ys of a repeated x are averaged first, so that each x weighs the same (two points: the
    line through them). A single x: the line through the origin and its mean.
    """
    by: dict[float, list[float]] = {}
    for x, y in points:
        by.setdefault(float(x), []).append(float(y))
    xs = sorted(by)
    ys = [float(np.mean(by[x])) for x in xs]
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


@dataclasses.dataclass(frozen=True)
class MeasuredSpeech:
    """The speech decoder's ms fitted to this experiment's engine rows (``measured_speech``)."""

    frame: tuple[float, float]  # ``tts_step``, ms per frame-step at n rows: a + b*n
    codec: tuple[float, float]  # ``codec.decode_step``, ms per frame-step (half a beat's call)
    copy: tuple[float, float]  # gather and scatter of k speakers' state, ms per frame-step: a + b*k

    def copy_ms(self, k: int) -> float:
        """The copy of ``k`` speakers per frame-step (the line, at least 0)."""
        return max(0.0, self.copy[0] + self.copy[1] * k)


def measured_speech(rows: Sequence[dict]) -> MeasuredSpeech:
    """Lines through the ``speech`` rows' points: the frame step and the codec through the small
    step at b rows and the full step at B; the copy through ``tts_compacted - tts_small`` at k
    speakers (the codec's compacted step is measured no slower than its small one: no copy)."""
    sp = [r for r in rows if r["kind"] == "speech"]
    if not sp:
        raise ValueError("no speech rows")
    frame = fit_line([(r["bucket"], r["tts_small_ms"]) for r in sp]
                     + [(r["slots"], r["tts_full_ms"]) for r in sp])  # fmt: skip
    ca, cb = fit_line([(r["bucket"], r["codec_small_ms"]) for r in sp]
                      + [(r["slots"], r["codec_full_ms"]) for r in sp])  # fmt: skip
    copy = fit_line([(r["speaking"], r["tts_compacted_ms"] - r["tts_small_ms"]) for r in sp])
    return MeasuredSpeech(frame=frame, codec=(ca / 2, cb / 2), copy=copy)


def speech_checks(
    rows: Sequence[dict],
    frame: tuple[float, float],
    codec: tuple[float, float],
    copy_ms: Callable[[int], float],
    model: str,
) -> list[dict]:
    """Each measured call of the ``speech`` rows against a model of it (``kind=speech_check``).

    ``frame``: the frame step at n rows; ``codec``: the codec per frame-step (twice per call, a
    beat); ``copy_ms(k)``: the compaction's copy of k speakers per frame-step. Masking is modelled
    as the full step, the codec's compaction as its small step (no copy); ``tts_copy`` is
    ``tts_compacted - tts_small``. ``rows``: the n each call is modelled at; error = model /
    measured - 1.
    """
    out = []
    for r in (r for r in rows if r["kind"] == "speech"):
        B, k, b = r["slots"], r["speaking"], r["bucket"]
        n = {"tts_full": B, "tts_masked": B, "tts_compacted": b, "tts_small": b, "tts_copy": k,
             "codec_full": B, "codec_compacted": b, "codec_small": b}  # fmt: skip
        model_ms = {c: frame[0] + frame[1] * n[c] for c in n if c.startswith("tts")}
        model_ms["tts_compacted"] += copy_ms(k)
        model_ms["tts_copy"] = copy_ms(k)
        model_ms |= {c: 2 * (codec[0] + codec[1] * n[c]) for c in n if c.startswith("codec")}
        measured = {c: r[f"{c}_ms"] for c in n if c != "tts_copy"}
        measured["tts_copy"] = r["tts_compacted_ms"] - r["tts_small_ms"]
        out += [{"kind": "speech_check", "model": model, "call": c, "slots": B, "speaking": k,
                 "bucket": b, "rows": n[c], "measured_ms": measured[c], "model_ms": model_ms[c],
                 "error": model_ms[c] / measured[c] - 1} for c in n]  # fmt: skip
    return out


def variant_tick_ms(
    full_ms: float,
    B: int,
    share: float,
    how: str,
    speech_ms: Callable[[float], float],
    copy_ms: Callable[[int], float],
    scale: float = 1.0,
) -> float:
    """A tick of ``B`` slots with a ``share`` of them speaking, run ``how``.

    ``masked``: the fitted tick ``full_ms``. ``compacted_index``: its speech part ``speech_ms(B)``
    (ms per tick, times ``scale``) at ``k = ceil(share * B)`` rows instead. ``compacted_copy``: at
    the power-of-two bucket ``b >= k``, plus ``copy_ms(k)`` (ms per tick) to gather and scatter.
    """
    if how == "masked":
        return full_ms
    k = max(1, math.ceil(share * B))
    b = bucket(k, B) if how == "compacted_copy" else k
    extra = copy_ms(k) if how == "compacted_copy" else 0.0
    return full_ms - scale * speech_ms(B) + scale * speech_ms(b) + extra


def sim_part() -> list[dict]:
    prof = er.read_rows(FLAGS.profile_rows)
    fit = fits.fit_models(prof)
    comps = fit.components
    fa, fb = lines(comps, SPEECH_FRAME)
    ca, cb = lines(comps, SPEECH_BEAT)
    everything = tuple(
        sorted({r["component"] for r in comps if not r["component"].startswith("admission")})
    )
    ta, tb = lines(comps, everything)  # all components but admission, ms per frame-step
    by = {(r["component"], r["slots"]): r["bytes"] for r in comps}
    tts_name = next(c for c, s in by if c.startswith("TTS backbone"))
    kv_bytes = (by[(tts_name, 32)] - by[(tts_name, 16)]) / 16  # a session's KV read per frame
    copy_tbps = float(np.mean([r["tbps"] for r in prof if r["kind"] == "copy"]))

    def copy_bytes_ms(k: int) -> float:  # per tick: gather and scatter each read and write k KVs
        return 2 * 4 * k * kv_bytes / (copy_tbps * 1e12) * 1e3

    copy_ms = copy_bytes_ms  # the compaction's copy per tick (components, scaled)
    measured: dict = {}
    checks: list[dict] = []
    if FLAGS.speech_cost == "measured":
        engine = er.read_rows(FLAGS.speech_rows)
        checks = speech_checks(engine, (fa, fb), (ca, cb), lambda k: copy_bytes_ms(k) / 2,
                               "components")  # fmt: skip
        m = measured_speech(engine)
        checks += speech_checks(engine, m.frame, m.codec, m.copy_ms, "measured")
        (fa, fb), (ca, cb) = m.frame, m.codec

        def copy_ms(k: int) -> float:  # per tick: two frame-steps of the measured line
            return 2 * m.copy_ms(k)

        commits = sorted({r["commit"] for r in engine if r["kind"] == "speech"})
        measured = {"copy_ms": list(m.copy),
                    "speech_rows": os.path.relpath(FLAGS.speech_rows, _REPO),
                    "speech_rows_commits": commits}  # fmt: skip
    rows = [{**fits.model_row(fit), "speech_cost": FLAGS.speech_cost, "speech_frame_ms": [fa, fb],
             "speech_beat_ms": [ca, cb], "components_ms": [ta, tb],
             "tts_kv_bytes_per_session": kv_bytes, "copy_tbps": copy_tbps, **measured}]  # fmt: skip
    rows += [{"kind": "validation", **v} for v in sim.validate(fit)]
    rows += checks

    def speech_ms(n: float) -> float:  # per tick (2 frames): frame parts twice, codec per beat
        return 2 * (fa + fb * n) + 2 * (ca + cb * n)

    def tick(B: int, share: float, how: str) -> float:
        full = fit.cost.tick_ms(B)
        # the components' ms as measured, or scaled so that they sum to the fitted tick at B
        scale = 1.0 if FLAGS.speech_cost != "scaled" else full / (2 * (ta + tb * B))
        return variant_tick_ms(full, B, share, how, speech_ms, copy_ms, scale)

    for share in (float(x) for x in FLAGS.sim_speaking):
        for how in ("masked", "compacted_index", "compacted_copy"):

            def probe(n, how=how, share=share):
                return [
                    sim.simulate_lockstep(fit.cost, FLAGS.capacity_beats, n, slots=n,
                                          tail=fit.quiet, rng=np.random.default_rng(s),
                                          tick_cost=lambda B: tick(B, share, how)).summary()
                    for s in range(FLAGS.seeds)
                ]  # fmt: skip

            cap = 0
            for n in range(1, 256):
                if any(r["missed"] for r in probe(n)):
                    break
                cap = n
            at_cap = tick(cap, share, how) if cap else None
            rows.append({"kind": "capacity", "speaking": share, "variant": how, "capacity": cap,
                         "tick_ms_at_32": tick(32, share, how),
                         "tick_ms_at_capacity": at_cap})  # fmt: skip
            logging.info("speaking %.1f %s: capacity %d", share, how, cap)
    return rows


def plot(sim_rows: list[dict], engine_rows: list[dict], path: str) -> None:
    """Left: simulated capacity against the share of speaking sessions per variant; right: the
    measured speech decoder's ms per frame step, one bar per way (``experiments.plot``)."""
    fig, ax = draw.figure(1, 2, size=(11, 4.2))
    caps = [r for r in sim_rows if r["kind"] == "capacity"]
    speech = next((r for r in sim_rows if r["kind"] == "model"), {}).get(
        "speech_cost", "components"
    )
    draw.lines(ax[0], caps, "speaking", [draw.Y("capacity", label="{group}")], group="variant",
               sort=False)  # fmt: skip
    title = f"H200, simulated ({fits.fit_label(sim_rows)}; speech ms: {speech})"
    ax[0].set(xlabel="share of sessions whose agent speaks", ylabel="capacity at zero misses")
    # the tick line's title is long: smaller, the others at the axes' title size
    ax[0].set_title(title, **({"fontsize": 9} if len(title) > 75 else {}))
    ax[0].legend(fontsize=8)
    sp = [{**r, "bar": i} for i, r in enumerate(r for r in engine_rows if r["kind"] == "speech")]
    if sp:
        for i, v in enumerate(("full", "masked", "compacted", "small")):
            draw.bars(ax[1], sp, "bar", f"tts_{v}_ms", xs=range(len(sp)), offset=0.2 * i,
                      width=0.2, label=f"tts {v}")  # fmt: skip
        labels = [f"B={r['slots']} k={r['speaking']}" for r in sp]
        ax[1].set_xticks(np.arange(len(sp)) + 0.3, labels, rotation=30, fontsize=7)
    model = engine_rows[0]["model"] if engine_rows else "?"
    dev = engine_rows[0]["device"] if engine_rows else "?"
    ax[1].set(ylabel="ms per frame step", title=f"measured: {model} on {dev}")
    ax[1].legend(fontsize=7)
    draw.save(fig, path, dpi=110)


def print_tables(sim_rows: list[dict], engine_rows: list[dict]) -> None:
    if engine_rows:
        r0 = engine_rows[0]
        print(f"measured: {r0['model']} on {r0['device']}, jax {r0['jax']}, commit {r0['commit']}")
        print(f"{'B':>3} {'k':>3} {'b':>3} {'tts full':>8} {'masked':>7} {'compact':>7} "
              f"{'small':>6} {'codec full':>10} {'compact':>7} {'small':>6}")  # fmt: skip
        for r in engine_rows:
            print(f"{r['slots']:>3} {r['speaking']:>3} {r['bucket']:>3} {r['tts_full_ms']:>8.2f} "
                  f"{r['tts_masked_ms']:>7.2f} {r['tts_compacted_ms']:>7.2f} "
                  f"{r['tts_small_ms']:>6.2f} {r['codec_full_ms']:>10.2f} "
                  f"{r['codec_compacted_ms']:>7.2f} {r['codec_small_ms']:>6.2f}")  # fmt: skip
    if sim_rows:
        m = next(r for r in sim_rows if r["kind"] == "model")
        print(f"simulated H200, fit to {fits.fit_label(sim_rows)}, speech cost "
              f"{m.get('speech_cost', 'components')}")  # fmt: skip
        fits.print_validation(sim_rows)
        checks = [r for r in sim_rows if r["kind"] == "speech_check"]
        if checks:
            print("measured H200 calls (ms) against the component model and the measured lines")
            print(f"{'call':>16} {'k':>3} {'n':>3} {'measured':>8} {'components':>10} {'error':>7} "
                  f"{'lines':>6} {'error':>7}")  # fmt: skip
            by = {(r["model"], r["call"], r["speaking"]): r for r in checks}
            for r in (r for r in checks if r["model"] == "components"):
                m = by[("measured", r["call"], r["speaking"])]
                print(f"{r['call']:>16} {r['speaking']:>3} {r['rows']:>3} {r['measured_ms']:>8.2f} "
                      f"{r['model_ms']:>10.2f} {100 * r['error']:>+6.1f}% {m['model_ms']:>6.2f} "
                      f"{100 * m['error']:>+6.1f}%")  # fmt: skip
        print("capacity at zero misses")
        for r in (r for r in sim_rows if r["kind"] == "capacity"):
            print(f"speaking {r['speaking']:.1f} {r['variant']:>16}: {r['capacity']:>4} "
                  f"(tick at 32: {r['tick_ms_at_32']:.1f} ms)")  # fmt: skip


def measured_name(path: str) -> str:
    """``path`` with ``_measured`` before its suffix (the outputs of ``--speech_cost=measured``)."""
    p = pathlib.Path(path)
    return str(p.with_name(f"{p.stem}_measured{p.suffix}"))


def main(argv):
    del argv
    sim_out, plot_path = fits.sim_files(_HERE, "idle_speech")
    if FLAGS.speech_cost == "measured":  # the fit's names with _measured, where not given
        if FLAGS.sim_out is None:
            sim_out = measured_name(sim_out)
        if FLAGS.plot is None:
            plot_path = measured_name(plot_path)
    er.run_parts(
        FLAGS.parts,
        out=FLAGS.out,
        sim_out=sim_out,
        plot_path=plot_path,
        engine_part=engine_part,
        sim_part=sim_part,
        plot=plot,
        print_tables=print_tables,
    )


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    app.run(main)
