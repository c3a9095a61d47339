"""The fused Mamba-2 decode step (conv, SSM update, gated norm in one kernel) against XLA.

At the 11B Mamba shapes (``voicechat_11b`` preset: N 128 heads, H 80, P 128, K 8 groups, conv
width 4, 27 layers), for each slot count B, two measurements, each one jitted call over all the
layers it covers with the states donated and threaded from call to call (as ``nano.step`` carries
them: one [B, N, H, P] SSM leaf per layer, the conv states stacked [B, L, k-1, C]):

- ``step``: the part of a Mamba layer between its two projections, for ``--layers`` (27) layers:
  'xla' is ``pallas_kernels.mamba_step.mamba_step_reference`` (the model's jnp operations: conv,
  SSM update, gated norm; XLA fuses them as it likes), 'fused' is the kernel. GB/s counts the
  bytes a step must move: the SSM state and the layer's conv state read and written, fp32.
  With ``--idle`` fractions above 0, that share of the slots does not run: the kernel skips them
  (their state is neither read nor written), XLA computes them with dt = 0 and selects.
- ``layer``: the whole Mamba layer, projections included, for ``--layer_layers`` (8) layers with
  random weights: ``nano._mamba_step`` with ``ssm_kernel`` 'xla' or 'pallas' (the SSM-update
  kernel alone), and ``nano._mamba_step_fused``, each with ``projection`` 'xla' or 'pallas'
  (``pallas_kernels.matmul``). GB/s counts the weights (in_proj and out_proj, bf16) plus the
  state bytes.

Times are the median of ``--repeats`` calls, each blocked on, after 2 warm-up calls (the first
call's seconds, compile included, are kept in the rows). Each row of an implementation other than
XLA carries its error against XLA's on the first layer's output and the last layer's SSM state.
Rows go to ``--out`` as JSON lines as they are measured, each with its provenance
(``experiments.harness``); a table is printed last. ``--small`` runs the tiny preset's
Mamba shapes on the CPU with the kernels interpreted: a check that the script works, not a
measurement. See README.md.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import harness
from pallas_kernels.mamba_step import mamba_step, mamba_step_reference
from voicechat_jax import config as config_lib
from voicechat_jax.model import nano

FLAGS = flags.FLAGS
flags.DEFINE_list("batch", ["1", "16", "32", "56", "112"], "Slot counts B.")
flags.DEFINE_integer("layers", 27, "Mamba layers of the 'step' measurement (27 at 11B).")
flags.DEFINE_integer("layer_layers", 8, "Mamba layers of the 'layer' measurement (with weights).")
flags.DEFINE_list("idle", ["0", "0.5"], "Fractions of idle slots ('step' only; 0.5 at B >= 16).")
flags.DEFINE_list(
    "variants",
    ["xla:xla", "pallas:xla", "fused:xla", "xla:pallas", "fused:pallas"],
    "'layer' variants ssm_kernel:projection.",
)
flags.DEFINE_integer("repeats", 20, "Timed calls per row (median), after 2 warm-up calls.")
flags.DEFINE_bool(
    "small", False, "Tiny shapes on the CPU, kernels interpreted (checks the script)."
)
flags.DEFINE_string("out", None, "JSON-lines file the rows are appended to.")

F32, BF16 = jnp.float32, jnp.bfloat16


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random(key, shape: tuple[int, ...], dtype, scale: float, offset: float = 0.0) -> jax.Array:
    """A random array made on the device."""
    return (offset + scale * jax.random.normal(key, shape, F32)).astype(dtype)


def _params(cfg: config_lib.LLMConfig, L: int, with_proj: bool) -> nano.MambaParams:
    """Random stacked Mamba weights at ``cfg``'s shapes (projections zero-sized when unused)."""
    D, N, NH, C, k = cfg.d_model, cfg.mamba_heads, cfg.d_inner, cfg.conv_dim, cfg.conv_kernel
    ks = iter(jax.random.split(jax.random.key(11), 10))
    proj_in = (L, D, cfg.in_proj_dim) if with_proj else (L, 0, 0)
    proj_out = (L, NH, D) if with_proj else (L, 0, 0)
    return nano.MambaParams(
        norm=_random(next(ks), (L, D), BF16, 0.1, 1.0),
        in_proj=_random(next(ks), proj_in, BF16, D**-0.5),
        conv_w=_random(next(ks), (L, k, C), BF16, k**-0.5),
        conv_b=_random(next(ks), (L, C), BF16, 0.1),
        A_log=jnp.log(jax.random.uniform(next(ks), (L, N), F32, 1.0, 16.0)),
        D=_random(next(ks), (L, N), F32, 0.1, 1.0),
        dt_bias=_random(next(ks), (L, N), F32, 1.0, -4.0),
        gate_norm=_random(next(ks), (L, NH), BF16, 0.1, 1.0),
        out_proj=_random(next(ks), proj_out, BF16, NH**-0.5),
    )


def _state(cfg: config_lib.LLMConfig, Bsz: int, L: int, seed: int):
    """(ssm: L x [B, N, H, P], conv [B, L, k-1, C]) random fp32, as ``NanoState`` holds them."""
    shape = (Bsz, cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state)
    ssm = tuple(_random(jax.random.key(seed + j), shape, F32, 0.1) for j in range(L))
    conv = _random(jax.random.key(seed + L), (Bsz, L, cfg.conv_kernel - 1, cfg.conv_dim), F32, 1.0)
    return ssm, conv


def step_fn(impl: str, cfg: config_lib.LLMConfig, L: int, interpret: bool):
    """jit((ssm, conv), zxbcdt [L, B, ...], params, run) -> ((ssm, conv), y of layer 0)."""
    fn = (
        mamba_step_reference
        if impl == "xla"
        else functools.partial(mamba_step, interpret=interpret)
    )

    def run_all(states, zxbcdt, p, run):
        ssm, conv = list(states[0]), states[1]
        ys = []
        for j in range(L):
            conv, ssm[j], y = fn(
                zxbcdt[j], conv, ssm[j], p.conv_w, p.conv_b, p.dt_bias, p.A_log, p.D,
                p.gate_norm, run, layer=j, n_groups=cfg.n_groups, eps=cfg.norm_eps,
            )  # fmt: skip
            ys.append(y)
        return (tuple(ssm), conv), ys[0]

    return jax.jit(run_all, donate_argnums=(0,))


def layer_fn(ssm_kernel: str, projection: str, cfg: config_lib.LLMConfig, L: int):
    """jit((ssm, conv), h [B, D], params, run) -> ((ssm, conv), out of layer 0): whole layers."""

    def run_all(states, h, p, run):
        ssm, conv = list(states[0]), states[1]
        outs = []
        for j in range(L):
            if ssm_kernel == "fused":
                conv, ssm[j], out = nano._mamba_step_fused(
                    p, j, h, conv, ssm[j], run, cfg, projection
                )
            else:
                c_j, ssm[j], out = nano._mamba_step(
                    p, j, h, conv[:, j], ssm[j], run, cfg, ssm_kernel, projection
                )
                conv = conv.at[:, j].set(c_j)
            outs.append(out)
        return (tuple(ssm), conv), outs[0]

    return jax.jit(run_all, donate_argnums=(0,))


def time_threaded(fn, states, args, repeats: int):
    """Threads the donated states through 2 + repeats calls.

    Returns (states, seconds of the timed calls, first call's seconds, first output, first states'
    last SSM leaf): the first call's outputs are kept (as host arrays) for the error columns.
    """
    t = time.perf_counter()
    states, out = fn(states, *args)
    jax.block_until_ready((states, out))
    first_s = time.perf_counter() - t
    first = (np.asarray(out, np.float32), np.asarray(states[0][-1][:, :, :2], np.float32))
    states, out = fn(states, *args)
    jax.block_until_ready((states, out))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        states, out = fn(states, *args)
        jax.block_until_ready((states, out))
        times.append(time.perf_counter() - t)
    return states, np.asarray(times), first_s, first


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@functools.cache
def _rows() -> harness.RowLog:
    return harness.RowLog(FLAGS.out)


def _write(row: dict) -> dict:
    """``row`` with its provenance, appended to ``--out``."""
    logging.info("%s", row)
    return _rows().write(row)


def _run(row, make_fn, states_of, args, nbytes, reference, key, layers, repeats) -> dict:
    """Times one configuration (fresh states), fills ``row``; XLA's first outputs go in
    ``reference[key]``, the others' errors against them in the row."""
    try:
        fn = make_fn()
        states, times, first_s, first = time_threaded(fn, states_of(), args, repeats)
        del states
    except Exception as e:  # any compile or run failure is recorded, and the run goes on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return _write(row)
    ms = float(np.median(times)) * 1e3 / layers
    row.update(
        ms=ms,
        ms_p10=float(np.percentile(times, 10)) * 1e3 / layers,
        ms_p90=float(np.percentile(times, 90)) * 1e3 / layers,
        first_call_s=first_s,
        GB=nbytes / 1e9,  # every layer's bytes: the rate divides them by every layer's time
        GBps=nbytes / (ms * layers * 1e-3) / 1e9,
    )
    if row["impl"] in ("xla", "xla:xla"):
        reference[key] = first
    elif key in reference:
        row["err_out"] = _rel(first[0], reference[key][0])
        row["err_state"] = _rel(first[1], reference[key][1])
    return _write(row)


def main(argv):
    del argv
    cfg = (config_lib.tiny() if FLAGS.small else config_lib.voicechat_11b()).llm
    batches = [1, 3] if FLAGS.small else [int(b) for b in FLAGS.batch]
    L = 2 if FLAGS.small else FLAGS.layers
    L_layer = 2 if FLAGS.small else FLAGS.layer_layers
    repeats = 1 if FLAGS.small else FLAGS.repeats
    interpret = jax.default_backend() == "cpu"
    device = jax.devices()[0]
    N, H, P, C = cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state, cfg.conv_dim
    km1 = cfg.conv_kernel - 1
    in_dim = cfg.in_proj_dim
    p_step = _params(cfg, L, with_proj=False)
    p_layer = _params(cfg, L_layer, with_proj=True)
    weight_bytes = (p_layer.in_proj[0].nbytes + p_layer.out_proj[0].nbytes) * L_layer
    rows, reference = [], {}
    for Bsz in batches:
        per_slot = 2 * (N * H * P + km1 * C) * 4  # fp32 state + conv state, read and written
        zxbcdt = _random(jax.random.key(Bsz), (L, Bsz, in_dim), BF16, 1.0)
        for idle in (float(f) for f in FLAGS.idle):
            n_run = Bsz - int(idle * Bsz)
            if idle > 0 and (n_run == Bsz or (Bsz < 16 and not FLAGS.small)):
                continue
            run = jnp.arange(Bsz) < n_run
            for impl in ("xla", "fused"):
                row = dict(kind="step", B=Bsz, running=n_run, impl=impl, layers=L)
                rows.append(_run(
                    row, lambda impl=impl: step_fn(impl, cfg, L, interpret),
                    lambda b=Bsz: _state(cfg, b, L, seed=b), (zxbcdt, p_step, run),
                    L * n_run * per_slot, reference, ("step", Bsz, idle), L, repeats,
                ))  # fmt: skip
        del zxbcdt
        h = _random(jax.random.key(Bsz + 1), (Bsz, cfg.d_model), BF16, 1.0)
        run = jnp.ones((Bsz,), bool)
        for variant in FLAGS.variants:
            ssm_kernel, projection = variant.split(":")
            row = dict(kind="layer", B=Bsz, running=Bsz, impl=variant, layers=L_layer)
            rows.append(_run(
                row, lambda s=ssm_kernel, p=projection: layer_fn(s, p, cfg, L_layer),
                lambda b=Bsz: _state(cfg, b, L_layer, seed=b), (h, p_layer, run),
                weight_bytes + L_layer * Bsz * per_slot, reference, ("layer", Bsz), L_layer,
                repeats,
            ))  # fmt: skip
    print(
        f"Mamba-2 decode step, N {N} H {H} P {P} K {cfg.n_groups} C {C}, {device.device_kind}, "
        f"jax {jax.__version__}, interpret={interpret}; ms per layer (median of {repeats}); "
        "GB/s on the state bytes (step) or weights + state (layer)"
    )
    print(
        f"{'kind':>5} {'B':>4} {'run':>4} {'impl':>13} {'ms/layer':>9} {'GB/s':>6} "
        f"{'xla/this':>8} {'err out':>8} {'err state':>9} {'1st call s':>10}"
    )
    xla = {}
    for r in rows:
        if r["impl"] in ("xla", "xla:xla") and "ms" in r:
            xla[(r["kind"], r["B"], r["running"])] = r["ms"]
    for r in rows:
        start = f"{r['kind']:>5} {r['B']:>4} {r['running']:>4} {r['impl']:>13}"
        if "ms" not in r:
            print(f"{start}  {r['error']}")
            continue
        ref = xla.get((r["kind"], r["B"], r["running"]))
        ratio = f"{ref / r['ms']:.2f}x" if ref else ""
        eo = f"{r['err_out']:.1e}" if "err_out" in r else ""
        es = f"{r['err_state']:.1e}" if "err_state" in r else ""
        print(
            f"{start} {r['ms']:>9.4f} {r['GBps']:>6.0f} {ratio:>8} {eo:>8} {es:>9} "
            f"{r['first_call_s']:>10.2f}"
        )


if __name__ == "__main__":
    app.run(main)
