"""Decode attention at the 11B shapes: XLA, cuDNN and the Pallas kernels, by slot count and fill.

For each attention of the model (``tts``: the speech decoder, 2 CFG rows per slot, K 16, G 1,
H 72, S 1537, fp32 activations over an fp32 or bf16 cache; ``llm``: the LLM, K 8, G 5, H 128,
S 1500, bf16), each slot count, cache dtype, window, fill (how many rows each slot has written)
and implementation (``voicechat_jax.model.attention.attend``'s 'xla', 'cudnn', 'pallas', and
'pallas_mha', the G = 1 kernel of ``pallas_kernels/mha_decode_attention.py``, run for the speech
decoder only: at G > 1 it is the 'pallas' kernel): one jitted call that attends over
``--layers`` distinct layer caches in turn (as the model's unrolled layers do), timed as the
median of ``--repeats`` calls, each blocked on. Reports ms per layer, the bytes a layer must read
(the rows each slot attends to, in k and v, plus q and the output: what a kernel that skips
unattended rows needs; XLA reads the whole cache whatever the fill), the achieved TB/s on those
bytes, and each output's error against XLA's. A plain device copy is timed in the same process
for scale. Rows go to ``--out`` as JSON lines as they are measured, each with its provenance
(``experiments.harness``); a table is printed last. A
configuration that fails to compile or run (cuDNN's shape rules, a Triton error) is recorded as
a row with its error and the run goes on.

``--tiny`` runs small shapes on the CPU (the kernels in the Pallas interpreter, no cuDNN): a
check that the script works, not a measurement. See README.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import harness
from experiments.beat_profile.components import device_copy_tbps, rel_err, time_calls
from pallas_kernels.decode_attention import DecodeAttentionBlocks
from pallas_kernels.mha_decode_attention import MHABlocks, plan
from voicechat_jax import config as config_lib
from voicechat_jax.model.attention import AttentionImpl, attend

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["tts", "llm"], "Attentions to measure: tts (speech decoder), llm.")
flags.DEFINE_list("slots", ["16", "56", "112"], "Slot counts (the speech decoder has 2 rows each).")
flags.DEFINE_list(
    "fills",
    ["full", "half", "mixed"],
    "Rows written per slot: full = S, half = S // 2, mixed = uniform in [1, S] per slot (seeded).",
)
flags.DEFINE_list("tts_kv", ["float32", "bfloat16"], "Speech-decoder cache dtypes.")
flags.DEFINE_list(
    "tts_windows",
    ["config"],
    "Speech-decoder windows: 'config' (the preset's "
    "sliding window; at 11B 7500 > S, so it cuts nothing), 'none', or ints.",
)
flags.DEFINE_list("impls", ["xla", "cudnn", "pallas", "pallas_mha"], "Implementations.")
flags.DEFINE_list(
    "pallas_blocks",
    ["64:256:4", "32:128:4", "128:512:4", "64:256:8"],
    "Pallas tilings block_s:split_s:num_warps; the first runs every configuration, "
    "the others only at fill 'full' (a sweep).",
)
flags.DEFINE_list(
    "mha_blocks",
    [
        "64:1:auto:4",
        "32:1:auto:4",
        "32:2:auto:4",
        "128:1:auto:8",
        "2:32:auto:4",
        "64:1:one:4",
        "64:1:auto:4:s3",
        "64:1:auto:4:w16",
        "32:1:auto:4:w16",
        "128:1:auto:8:w16",
        "64:1:auto:4:w32",
        "64:1:auto:4:w128",
        "32:1:auto:4:w128",
    ],
    "G = 1 kernel ('pallas_mha') tilings, MHABlocks.label()'s "
    "block_s:heads:split:num_warps[:sN][:wN]: split 'auto' (S split when there are fewer than "
    "4096 head groups), 'one' (never split) or rows; sN num_stages; wN lanes per head-dim piece "
    "(default: 8 at H 72; w128 pads H to 128 lanes). The first runs every configuration, the "
    "others only at fill 'full' (a sweep).",
)
flags.DEFINE_integer("layers", 8, "Distinct layer caches attended per timed call.")
flags.DEFINE_integer("repeats", 20, "Timed calls per row (median), after 2 warm-up calls.")
flags.DEFINE_float("copy_gib", 4.0, "Size of the device-copy reference (0: skip).")
flags.DEFINE_bool("tiny", False, "Small shapes on the CPU, kernel interpreted (checks the script).")
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention of the model: rows per slot, heads, cache length, dtypes, scale."""

    model: str
    rows_per_slot: int
    K: int
    G: int
    H: int
    S: int
    q_dtype: str
    scale: float


def shapes(tiny: bool) -> tuple[dict[str, Shape], int]:
    """The model's two decode attentions (from the preset) and the speech decoder's window."""
    cfg = config_lib.tiny() if tiny else config_lib.voicechat_11b()
    tts, llm = cfg.tts, cfg.llm
    cap = 40 if tiny else config_lib.ServeConfig().context_frames
    return {
        "tts": Shape(
            "tts",
            2,  # cond and uncond (CFG) rows
            tts.n_kv_heads,
            tts.n_heads // tts.n_kv_heads,
            tts.head_dim,
            tts.prompt_frames + cap,  # the speaker prompt, then the capped conversation
            "float32",
            tts.query_pre_attn_scalar**-0.5,
        ),
        "llm": Shape(
            "llm",
            1,
            llm.n_kv_heads,
            llm.n_heads // llm.n_kv_heads,
            llm.head_dim,
            cap,
            "bfloat16",
            llm.head_dim**-0.5,
        ),
    }, tts.sliding_window


def fill_lengths(fill: str, Bsz: int, S: int, seed: int) -> np.ndarray:
    if fill == "full":
        return np.full((Bsz,), S, np.int32)
    if fill == "half":
        return np.full((Bsz,), S // 2, np.int32)
    if fill == "mixed":
        return np.random.default_rng(seed).integers(1, S + 1, Bsz).astype(np.int32)
    raise ValueError(f"unknown fill {fill!r}")


def needed_bytes(sh: Shape, lengths: np.ndarray, window: int | None, kv_dtype) -> int:
    """Bytes one layer must move: attended k and v rows, q read and the output written."""
    hi = np.minimum(lengths, sh.S)
    lo = np.zeros_like(hi) if window is None else np.clip(lengths - window, 0, sh.S)
    rows = int(np.sum(np.maximum(hi - lo, 0)))
    kv = 2 * rows * sh.K * sh.H * jnp.dtype(kv_dtype).itemsize
    qo = 2 * len(lengths) * sh.K * sh.G * sh.H * jnp.dtype(sh.q_dtype).itemsize
    return kv + qo


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random(key, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


def make_layers(sh: Shape, Bsz: int, kv_dtype, layers: int, seed: int):
    """Per-layer q [B, K, G, H] and caches k, v [B, K, S, H], random, made on the device."""
    key = jax.random.key(seed)
    qs, ks, vs = [], [], []
    for i in range(layers):
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, i), 3)
        qs.append(_random(kq, (Bsz, sh.K, sh.G, sh.H), jnp.dtype(sh.q_dtype), 1.0))
        ks.append(_random(kk, (Bsz, sh.K, sh.S, sh.H), jnp.dtype(kv_dtype), 1.0))
        vs.append(_random(kv, (Bsz, sh.K, sh.S, sh.H), jnp.dtype(kv_dtype), 1.0))
    return tuple(qs), tuple(ks), tuple(vs)


def layered(impl: str, window: int | None, scale: float, blocks):
    """jit(qs, ks, vs, lengths) -> one output per layer, each layer attended in turn.

    ``blocks``: a ``DecodeAttentionBlocks`` ('pallas'), an ``MHABlocks`` ('pallas_mha') or None.
    """
    tiling = {"mha_blocks" if isinstance(blocks, MHABlocks) else "blocks": blocks}

    def fn(qs, ks, vs, lengths):
        return tuple(
            attend(q, k, v, lengths, window=window, scale=scale, impl=impl, **tiling)
            for q, k, v in zip(qs, ks, vs, strict=True)
        )

    return jax.jit(fn)


def _blocks(spec: str) -> DecodeAttentionBlocks:
    block_s, split_s, num_warps = (int(x) for x in spec.split(":"))
    return DecodeAttentionBlocks(block_s=block_s, split_s=split_s, num_warps=num_warps)


@functools.cache
def _rows() -> harness.RowLog:
    return harness.RowLog(FLAGS.out)


def _write(row: dict) -> dict:
    """``row`` with its provenance, appended to ``--out``."""
    logging.info("%s", row)
    return _rows().write(row)


def _windows(sh: Shape, config_window: int) -> list[int | None]:
    if sh.model != "tts":
        return [None]  # the LLM's attention is global (NoPE)
    out = []
    for w in FLAGS.tts_windows:
        out.append(config_window if w == "config" else None if w == "none" else int(w))
    return list(dict.fromkeys(out))


def run_config(sh, slots, kv_dtype, window, rows, base) -> None:
    """Every fill and implementation of one (shape, slots, cache dtype, window); rows appended."""
    Bsz = slots * sh.rows_per_slot
    layers = 2 if FLAGS.tiny else FLAGS.layers
    qs, ks, vs = make_layers(sh, Bsz, kv_dtype, layers, seed=slots)
    cache_bytes = 2 * Bsz * sh.K * sh.S * sh.H * jnp.dtype(kv_dtype).itemsize
    on_gpu = jax.default_backend() == "gpu"
    tilings = {
        AttentionImpl.PALLAS: [(_blocks(b), b) for b in FLAGS.pallas_blocks],
        AttentionImpl.PALLAS_MHA: [(MHABlocks.parse(b), b) for b in FLAGS.mha_blocks],
    }
    full = [f for f in FLAGS.fills if f == "full"]
    plans = []  # (impl, blocks or None, label, fills)
    for impl in (AttentionImpl(i) for i in FLAGS.impls):
        if impl == AttentionImpl.PALLAS_MHA and sh.G != 1:
            continue  # at G > 1 'pallas_mha' runs the 'pallas' kernel
        if impl in tilings:
            (first, label), *rest = tilings[impl]
            plans.append((impl, first, label, FLAGS.fills))
            plans += [(impl, t, lab, full) for t, lab in rest]
        else:
            plans.append((impl, None, "", FLAGS.fills))
    reference = {}  # fill -> xla's output of layer 0
    for impl, blocks, label, fills in plans:
        common = dict(
            base,
            impl=str(impl),
            blocks=label,
            kv_dtype=jnp.dtype(kv_dtype).name,
            window=window,
            slots=slots,
            B=Bsz,
            layers=layers,
        )
        if isinstance(blocks, MHABlocks):  # the grid it resolves to at these shapes
            p = plan(Bsz * sh.K, sh.S, blocks)
            common.update(heads_per_program=p.P, split_s=p.split_s, n_splits=p.n_splits)
        skip = None
        if impl == AttentionImpl.CUDNN and not on_gpu:
            skip = "cuDNN needs a GPU"
        elif impl == AttentionImpl.CUDNN and jnp.dtype(kv_dtype) == jnp.float32:
            skip = "cuDNN flash attention takes fp16/bf16 only"
        if skip:
            for fill in fills:
                rows.append(_write(dict(common, fill=fill, skipped=skip)))
            continue
        fn = layered(str(impl), window, sh.scale, blocks)
        for fill in fills:
            lengths = fill_lengths(fill, Bsz, sh.S, seed=slots)
            row = dict(common, fill=fill, mean_length=float(np.mean(lengths)))
            try:
                times, first_s, out = time_calls(
                    fn, (qs, ks, vs, jnp.asarray(lengths)), 1 if FLAGS.tiny else FLAGS.repeats
                )
            except Exception as e:  # any compile or run failure is recorded, and the run goes on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                rows.append(_write(row))
                continue
            ms = float(np.median(times)) * 1e3 / layers
            need = needed_bytes(sh, lengths, window, kv_dtype)
            row.update(
                ms=ms,
                ms_p10=float(np.percentile(times, 10)) * 1e3 / layers,
                ms_p90=float(np.percentile(times, 90)) * 1e3 / layers,
                first_call_s=first_s,
                needed_GB=need / 1e9,
                cache_GB=cache_bytes / 1e9,
                TBps=need / (ms * 1e-3) / 1e12,
            )
            if impl == AttentionImpl.XLA:
                reference[fill] = np.asarray(out[0], np.float32)
            elif fill in reference:
                row["err_vs_xla"] = rel_err(out[0], reference[fill])
            rows.append(_write(row))
            del out
    del qs, ks, vs


def _table(rows: list[dict]) -> None:
    head = (
        f"{'model':>5} {'slots':>5} {'kv':>8} {'window':>6} {'fill':>5} {'impl':>10} "
        f"{'blocks':>15} {'ms/layer':>9} {'GB':>6} {'TB/s':>5} {'vs xla':>7} {'err':>8}"
    )
    print(head)
    xla = {}
    for r in rows:
        if r["impl"] == "xla" and "ms" in r:
            xla[(r["model"], r["slots"], r["kv_dtype"], r["window"], r["fill"])] = r["ms"]
    for r in rows:
        key = (r["model"], r["slots"], r["kv_dtype"], r["window"], r["fill"])
        start = (
            f"{r['model']:>5} {r['slots']:>5} {r['kv_dtype']:>8} {r['window']!s:>6} "
            f"{r['fill']:>5} {r['impl']:>10} {r['blocks']:>15}"
        )
        if "ms" not in r:
            print(f"{start}  {r.get('skipped') or r.get('error')}")
            continue
        speedup = xla[key] / r["ms"] if key in xla else float("nan")
        err = f"{r['err_vs_xla']:.1e}" if "err_vs_xla" in r else ""
        print(
            f"{start} {r['ms']:>9.4f} {r['needed_GB']:>6.3f} {r['TBps']:>5.2f} "
            f"{speedup:>6.2f}x {err:>8}"
        )


def main(argv):
    del argv
    all_shapes, config_window = shapes(FLAGS.tiny)
    slot_counts = [2] if FLAGS.tiny else [int(s) for s in FLAGS.slots]
    device = jax.devices()[0]
    copy = device_copy_tbps(FLAGS.copy_gib) if FLAGS.copy_gib > 0 and not FLAGS.tiny else None
    logging.info("device %s, jax %s, copy %s TB/s", device.device_kind, jax.__version__, copy)
    if copy is not None:
        _write({"device_copy_TBps": copy})
    rows: list[dict] = []
    for name in FLAGS.models:
        sh = all_shapes[name]
        base_sh = dataclasses.asdict(sh)
        kv_dtypes = [jnp.dtype(d) for d in FLAGS.tts_kv] if name == "tts" else [jnp.bfloat16]
        for slots in slot_counts:
            for kv_dtype in kv_dtypes:
                for window in _windows(sh, config_window):
                    run_config(sh, slots, kv_dtype, window, rows, base_sh)
    print(
        f"decode attention, {device.device_kind}, jax {jax.__version__}, "
        f"device copy {copy if copy is None else f'{copy:.2f}'} TB/s; ms per layer (median), "
        "GB = attended k/v rows + q + out per layer, TB/s on those bytes"
    )
    _table(rows)


if __name__ == "__main__":
    app.run(main)
