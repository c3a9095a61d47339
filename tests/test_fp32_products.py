"""experiments/fp32_products' list of the codec's products against the codec decoder's own step
at the release's shapes (traced, not run): the experiment times the products the tick runs; and its
chunked products against the whole one."""

from __future__ import annotations

import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from experiments.fp32_products import chunked
from experiments.fp32_products import shapes as fp32_products
from voicechat_jax import config as config_lib
from voicechat_jax.model import codec as codec_lib
from voicechat_jax.precision import Precision


def _products(jaxpr) -> list[tuple[int, int]]:
    """(contracted size, output size) of each dot_general ``jaxpr`` runs, once per time it runs
    (a scan's body counts its length times). Which operand is the weight is einsum's choice, so
    rows and columns are not told apart."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            found.append((math.prod(lhs[d] for d in lc), math.prod(eqn.outvars[0].aval.shape)))
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _products(sub) * times
    return found


def test_the_codec_rows_are_the_codec_steps_products():
    cfg = config_lib.voicechat_11b()
    precision = Precision.fp32()
    state = jax.eval_shape(lambda: codec_lib.init_state(cfg.codec, 1, precision))
    codes = jax.ShapeDtypeStruct((1, 1, cfg.codec.n_quantizers), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, s, c: codec_lib.decode_step(p, s, c, cfg=cfg.codec))(
        codec_lib.abstract(cfg.codec, precision), state, codes
    )
    ran = _products(jaxpr.jaxpr)  # one slot's code frame
    listed = fp32_products.selected(fp32_products.shapes(cfg), ["codec"])
    assert [name for name, *_ in listed] == [
        f"codec_{p}{s}" for s in (1, 2, 3) for p in ("up", "pw1_", "pw2_")
    ]
    for name, rows, D, F, count in listed:
        assert ran.count((D, rows * F)) == count, name
    flops = sum(2 * k * n for k, n in ran)
    covered = sum(2 * rows * D * F * count for _, rows, D, F, count in listed)
    # what is left out: the output projection to the spectrum and the inverse FFT's two products
    assert 0.99 * flops <= covered <= flops, (covered, flops)


def test_chunked_products_equal_the_whole_product():
    """``<algorithm>_c<N>``: a contraction of 100 in steps of 32 (the last padded with zeros),
    each step's product apart and the steps added by a compensated sum, equals the one product
    to fp32 rounding, and is no further from float64 than 2e-7 of the largest value."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 100)).astype(np.float32)
    w = (rng.standard_normal((100, 40)) / 10).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    whole = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    wc = chunked.chunked_weight(jnp.asarray(w), 32)
    assert wc.shape == (4, 32, 40)
    run = functools.partial(chunked.chunked_products, precision=jax.lax.Precision.HIGHEST)
    (got,) = jax.jit(run)(jnp.asarray(x), (wc,))
    np.testing.assert_allclose(got, whole, rtol=0, atol=2e-6)
    assert np.abs(np.asarray(got, np.float64) - ref).max() <= 2e-7 * np.abs(ref).max()
