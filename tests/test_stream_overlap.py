"""experiments/stream_overlap: the codec's step, inlined for a stream of its own, lowers with no
call in it (jax 0.11.2's GPU runtime refuses an annotated region that calls, 2026-12-05) and
computes exactly what the codec's step computes."""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from voicechat_jax import config as config_lib
from voicechat_jax.model import codec
from voicechat_jax.model.streams import _scan_counts, inlined
from voicechat_jax.precision import Precision


def test_inlined_codec_step_makes_no_call_and_matches():
    c = config_lib.tiny().codec
    prec = Precision.reference()
    params = jax.jit(codec.init, static_argnums=(1, 2))(jax.random.key(1), c, prec)
    state = codec.init_state(c, 2, prec)
    codes = jnp.asarray(
        np.random.default_rng(0).integers(0, c.codebook_size, (2, 2, c.n_quantizers))
    )
    step = functools.partial(codec.decode_step, cfg=c)
    flat = inlined(step)

    def calls(fn):
        return len(re.findall(r"call @", jax.jit(fn).lower(params, state, codes).as_text()))

    assert calls(step) > 0  # jnp.pad, dynamic_index_in_dim, the scans' bodies
    assert calls(flat) == 0
    chex.assert_trees_all_equal(
        jax.jit(flat)(params, state, codes), jax.jit(step)(params, state, codes)
    )


def test_scan_counts_read_either_jax_layout():
    """A scan equation's (consts, carry) counts: by name before jax 0.11, from the operands'
    grouping (``ft_in``) after; a grouping that does not cover the operands is refused."""

    class Groups:  # the part of jax 0.11's FlatTree that is read: unpack() -> the groups
        def __init__(self, *sizes):
            self.groups = tuple((None,) * n for n in sizes)

        def unpack(self):
            return self.groups

    assert _scan_counts({"num_consts": 2, "num_carry": 3}, 7) == (2, 3)
    assert _scan_counts({"ft_in": Groups(1, 2, 4)}, 7) == (1, 2)
    with pytest.raises(NotImplementedError, match="cannot unroll"):
        _scan_counts({"ft_in": Groups(1, 2, 3)}, 7)
