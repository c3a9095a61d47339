"""experiments/role_split: the two-role kernel computes what each role computes alone, in either
order of its programs, and what its jnp reference computes (Pallas interpreter)."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.role_split import kernel

BLOCKS = kernel.Blocks(block_n=4, read_steps=3, block_m=16, block_f=16, block_k=16, num_warps=4)


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((4 * 3 * 5, 8)), jnp.float32)  # 5 read programs
    x = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)  # 2 x 2 product tiles, 3 K steps
    w = jnp.asarray(rng.standard_normal((48, 32)), jnp.float32)
    return cache, x, w


def test_each_role_matches_its_reference_alone_and_together(operands):
    cache, x, w = operands
    ref_sums, ref_y = kernel.reference(cache, x, w, blocks=BLOCKS)
    sums, none = kernel.two_roles(cache, None, None, blocks=BLOCKS, interpret=True)
    assert none is None
    none, y = kernel.two_roles(None, x, w, blocks=BLOCKS, interpret=True)
    assert none is None
    np.testing.assert_allclose(sums, ref_sums, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    for order in kernel.ORDERS:  # one launch: the same bits as each role alone
        chex.assert_trees_all_equal(
            kernel.two_roles(cache, x, w, order=order, blocks=BLOCKS, interpret=True), (sums, y)
        )


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((4 * 3 * 5 + 1, 8), None, None), "must be a multiple of block_n"),
        ((None, (30, 48), (48, 32)), "M=30 must be a multiple"),
        ((None, (32, 48), (40, 32)), "disagree"),
        ((None, None, None), "nothing to do"),
    ],
)
def test_shapes_off_the_blocks_are_refused(shapes, message):
    args = [None if s is None else jnp.zeros(s, jnp.float32) for s in shapes]
    with pytest.raises(ValueError, match=message):
        kernel.two_roles(*args, blocks=BLOCKS, interpret=True)
