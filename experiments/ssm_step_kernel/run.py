"""Mamba-2 decode SSM update: the jnp reference (XLA) against the Pallas kernel, in place.

At the 11B Mamba layer shape (N 128 heads, H 80, P 128, K 8 groups; 27 layers stacked as
``NanoState.ssm``), for each slot count B: one jitted call updating one layer, and one jitted call
updating all layers in turn (the model's pattern), the stacked fp32 state donated and threaded
through the calls. Prints ms per call, the achieved GB/s (state bytes read + written, fp32) and the
XLA / Pallas time ratio; then a sweep of the kernel's ``block_heads`` on the one-layer call. Rows go
to ``--out`` (rewritten) as they are measured, each with its provenance (``experiments.harness``).
``--small`` runs tiny shapes in the Pallas interpreter on the CPU (a check that the script works,
not a measurement). See README.md.
"""

from __future__ import annotations

import functools
import pathlib
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import harness
from pallas_kernels.ssm_step import ssm_step, ssm_step_reference

FLAGS = flags.FLAGS
flags.DEFINE_list("batch", ["1", "8", "32", "64"], "Slot counts B.")
flags.DEFINE_integer("layers", 27, "Stacked Mamba layers (27 at 11B).")
flags.DEFINE_integer("reps", 50, "Timed calls per row (after one warm-up call).")
flags.DEFINE_list("sweep_block_heads", ["1", "2", "4", "8", "16"], "block_heads of the sweep.")
flags.DEFINE_integer("num_warps", 4, "Triton warps per program.")
flags.DEFINE_bool("small", False, "Tiny shapes in interpret mode on the CPU (checks the script).")
flags.DEFINE_string("out", None, "Optional JSON-lines file for the rows (rewritten).")

# (N heads, H head dim, P state, K groups)
SHAPE_11B = (128, 80, 128, 8)
SHAPE_SMALL = (8, 8, 16, 2)


def _inputs(key, Bsz: int, L: int, shape):
    """Per-layer inputs [L, ...] as the model feeds them (fp32, dt after softplus)."""
    N, H, P, K = shape
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (L, Bsz, N, H), jnp.float32)
    dt = jax.nn.softplus(jax.random.normal(ks[1], (L, Bsz, N), jnp.float32) - 3.0)
    A = -jnp.exp(jax.random.uniform(ks[2], (L, N), jnp.float32, 0.0, 2.7))
    b = jax.random.normal(ks[3], (L, Bsz, K, P), jnp.float32)
    c = jax.random.normal(ks[4], (L, Bsz, K, P), jnp.float32)
    D = 1.0 + 0.1 * jax.random.normal(ks[5], (L, N), jnp.float32)
    return x, dt, A, b, c, D


@functools.partial(jax.jit, static_argnums=(1,))
def _state(key, shape: tuple[int, ...]) -> jax.Array:
    """A random fp32 stacked state of ``shape`` [B, L, N, H, P], made on the device."""
    return 0.1 * jax.random.normal(key, shape, jnp.float32)


def _update(impl: str, layers: tuple[int, ...], interpret: bool, block_heads, num_warps):
    """jit(state, inputs) -> (state, y [len(layers), B, N, H]); the state is donated."""
    if impl == "pallas":
        one = functools.partial(
            ssm_step, interpret=interpret, block_heads=block_heads, num_warps=num_warps
        )
    else:
        one = ssm_step_reference

    def fn(state, x, dt, A, b, c, D):
        ys = []
        for j in layers:
            state, y = one(state, x[j], dt[j], A[j], b[j], c[j], D[j], layer=j)
            ys.append(y)
        return state, jnp.stack(ys)

    return jax.jit(fn, donate_argnums=(0,))


def _time(fn, state, args, reps: int):
    """Threads the donated state through 1 + reps calls of fn.

    Returns (state, first, first_s, mean_s): ``first`` is the first call's (y, the state's first
    two head-dim rows), kept for the cross-check; ``first_s`` the first call's seconds (compile
    included); ``mean_s`` the mean over the reps calls that follow, dispatched back to back.
    """
    t = time.perf_counter()
    state, y = fn(state, *args)
    first = (y, state[:, :, :, :2])
    jax.block_until_ready((state, first))
    first_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(reps):
        state, y = fn(state, *args)
    jax.block_until_ready((state, y))
    return state, first, first_s, (time.perf_counter() - t) / reps


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def main(argv):
    del argv
    shape = SHAPE_SMALL if FLAGS.small else SHAPE_11B
    L = min(FLAGS.layers, 3) if FLAGS.small else FLAGS.layers
    batches = [1, 2] if FLAGS.small else [int(b) for b in FLAGS.batch]
    reps = min(FLAGS.reps, 3) if FLAGS.small else FLAGS.reps
    interpret = jax.default_backend() == "cpu"
    N, H, P, K = shape

    def layer_bytes(Bsz: int) -> int:  # fp32 state read + written, one layer
        return 2 * Bsz * N * H * P * 4

    print(
        f"SSM decode update, N {N} H {H} P {P} K {K}, {L} layers, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, interpret={interpret}, "
        f"mean of {reps} calls"
    )
    if FLAGS.out:
        pathlib.Path(FLAGS.out).unlink(missing_ok=True)
    log = harness.RowLog(FLAGS.out)
    rows, sweep = [], []
    for Bsz in batches:
        key = jax.random.key(Bsz)
        args = _inputs(jax.random.fold_in(key, 1), Bsz, L, shape)
        results = {}
        for impl in ("xla", "pallas"):
            row = {"B": Bsz, "impl": impl}
            for name, layers in (("one", (0,)), ("all", tuple(range(L)))):
                fn = _update(impl, layers, interpret, None, FLAGS.num_warps)
                state = _state(key, (Bsz, L, *shape[:3]))
                state, first, first_s, sec = _time(fn, state, args, reps)
                del state
                if name == "all":
                    results[impl] = first  # y reads every layer's new state
                n = len(layers)
                row[f"{name}_ms"] = sec * 1e3
                row[f"{name}_GBps"] = n * layer_bytes(Bsz) / sec / 1e9
                row[f"{name}_first_s"] = first_s
            rows.append(row)
        (y_x, s_x), (y_p, s_p) = results["xla"], results["pallas"]
        rows[-1]["err_y"] = _rel(y_p, y_x)
        rows[-1]["err_state"] = _rel(s_p, s_x)
        for r in rows[-2:]:
            log.write(r)
        del results
        for bh in (int(b) for b in FLAGS.sweep_block_heads):
            if (N // K) % bh:
                continue
            fn = _update("pallas", (0,), interpret, bh, FLAGS.num_warps)
            state = _state(key, (Bsz, L, *shape[:3]))
            state, _, _, sec = _time(fn, state, args, reps)
            del state
            sweep.append(
                {"B": Bsz, "block_heads": bh, "ms": sec * 1e3, "GBps": layer_bytes(Bsz) / sec / 1e9}
            )
            log.write({"sweep": True, **sweep[-1]})

    print(
        f"{'B':>3} {'impl':>6} {'1-layer ms':>10} {'GB/s':>7} {f'{L}-layer ms':>10} {'GB/s':>7} "
        f"{'ms/layer':>9} {'xla/pallas':>10} {'1st call s':>10}"
    )
    by_b = {}
    for r in rows:
        by_b.setdefault(r["B"], {})[r["impl"]] = r
    for Bsz, pair in by_b.items():
        for impl in ("xla", "pallas"):
            r = pair[impl]
            ratio = pair["xla"]["all_ms"] / r["all_ms"]
            print(
                f"{Bsz:>3} {impl:>6} {r['one_ms']:>10.3f} {r['one_GBps']:>7.0f} "
                f"{r['all_ms']:>10.3f} {r['all_GBps']:>7.0f} {r['all_ms'] / L:>9.4f} "
                f"{ratio:>10.2f} {r['all_first_s']:>10.2f}"
            )
        p = pair["pallas"]
        print(f"    pallas vs xla rel err: y {p['err_y']:.1e}, state {p['err_state']:.1e}")
    print(f"\nblock_heads sweep (pallas, 1 layer per call; default block_rows {min(16, H & -H)})")
    print(f"{'B':>3} {'block_heads':>11} {'ms':>8} {'GB/s':>7}")
    for s in sweep:
        print(f"{s['B']:>3} {s['block_heads']:>11} {s['ms']:>8.3f} {s['GBps']:>7.0f}")


if __name__ == "__main__":
    app.run(main)
