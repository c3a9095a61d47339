"""The contraction in steps (``--algorithms=<algorithm>_c<N>`` of ``run.py``): each step's
product under an XLA algorithm, the steps added by a compensated sum. Apart from ``run.py``, which
defines absl flags, so that tests import it beside other experiments."""

from __future__ import annotations

import jax.numpy as jnp

from voicechat_jax.model.common import dense_steps


def chunked_weight(w, chunk: int):
    """[D, F] -> [n, chunk, F]: the contraction cut into n steps of ``chunk`` rows, the last
    padded with zeros (exact: a zero row adds nothing). Laid out once, before the clock, as the
    engine would lay out its params."""
    D, F = w.shape
    n = -(-D // chunk)
    return jnp.pad(w, ((0, n * chunk - D), (0, 0))).reshape(n, chunk, F)


def chunked_products(x, wcs, *, precision):
    """``products`` with each contraction cut into steps (``chunked_weight``), as
    ``common.dense_steps`` runs them: every step's product under ``precision`` in one batched dot
    (each step's running sum held in the matrix units for ``chunk`` terms only), the steps' fp32
    partials added by a compensated (Kahan) sum. Where a multi-pass preset loses to full fp32 on
    a long contraction, the loss gathered over the whole contraction inside the matrix units;
    this keeps it to one step's."""
    return tuple(dense_steps(x, wc, precision) for wc in wcs)
