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

from voicechat_jax import config as config_lib
from voicechat_jax.model import codec
from voicechat_jax.model.streams import inlined
from voicechat_jax.precision import Precision


def test_inlined_codec_step_makes_no_call_and_matches():
    c = config_lib.tiny().codec
    prec = Precision.reference()
    params = codec.init(jax.random.key(1), c, prec)
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
