"""Products that ride in the speech decoder's attention launches (issue 33's overlap).

The faithful tick's speech-decoder attention reads its fp32 cache at the memory's rate and
leaves the SMs' arithmetic idle; the codec's full-fp32 products are the opposite. ``Beside``
holds a generator of products (``codec.decode_step_products``: the previous frame's codec) and
hands them, one per layer, to the attention launches of the next frame's speech decoder
(``gemma.forward``): where the attention runs ``pallas_kernels.mha_decode_attention`` (G = 1,
``impl='pallas_mha'``) and the product tiles, one launch computes both
(``pallas_kernels.attention_product``, the product's programs interleaved with the attention's);
elsewhere (XLA's attention, the CPU) the product runs by XLA's dot at the same place in the
program. ``finish`` runs what is left with XLA and returns the generator's result.

Tracing only: a ``Beside`` lives while one program is traced and is used once.
"""

from __future__ import annotations

from collections.abc import Generator

import jax
import jax.numpy as jnp

from pallas_kernels.attention_product import ProductBlocks, attention_and_product
from voicechat_jax.config import AttentionImpl
from voicechat_jax.model.attention import attend

_HIGHEST = jax.lax.Precision.HIGHEST


def xla_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` in full fp32 as XLA runs it (the tick's products at the faithful policy)."""
    return jnp.dot(x, w, precision=_HIGHEST, preferred_element_type=jnp.float32)


def product_blocks(C: int, F: int) -> ProductBlocks | None:
    """The fused launch's tile for a [C, F] weight: 64 x 64 outputs, 32 contracted a step (the
    tiling measured at XLA's speed, ``experiments/role_split``), narrower where the weight is
    (the tiny model's 16-32 channels); None where 16 does not divide C and F."""
    block_f = next((b for b in (64, 32, 16) if F % b == 0), None)
    block_k = next((b for b in (32, 16) if C % b == 0), None)
    if block_f is None or block_k is None:
        return None
    return ProductBlocks(block_m=64, block_f=block_f, block_k=block_k)


class Beside:
    """A generator of fp32 products, advanced one product per attention call."""

    def __init__(self, products: Generator[tuple[jax.Array, jax.Array], jax.Array, object]):
        self._gen = products
        self._result = None
        self._request = None
        self.asked = 0  # products asked for (for tests and logs)
        self.fused = 0  # of them, run inside an attention launch
        self._advance(None)

    def _advance(self, y: jax.Array | None) -> None:
        try:
            self._request = next(self._gen) if y is None else self._gen.send(y)
            self.asked += 1
        except StopIteration as stop:
            self._request, self._result = None, stop.value

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        lengths: jax.Array,
        *,
        window: int | None,
        scale: float,
        impl: AttentionImpl | str,
    ) -> jax.Array:
        """``attention.attend(q, k, v, lengths, ...)``, with the next product beside it."""
        out = None
        if self._request is not None:
            x, w = self._request
            blocks = product_blocks(*w.shape)
            fusable = AttentionImpl(impl) == AttentionImpl.PALLAS_MHA and q.shape[2] == 1
            if fusable and blocks is not None:
                out, y = attention_and_product(
                    q, k, v, lengths, x, w, window=window, scale=scale, product=blocks,
                    interpret=jax.default_backend() == "cpu",
                )  # fmt: skip
                self.fused += 1
            else:
                y = xla_product(x, w)
            self._advance(y)
        if out is None:
            out = attend(q, k, v, lengths, window=window, scale=scale, impl=impl)
        return out

    def finish(self):
        """The generator's result, its products not yet run taken by XLA's dot."""
        while self._request is not None:
            self._advance(xla_product(*self._request))
        return self._result
