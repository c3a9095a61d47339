"""The decode step's large projections, one entry point with the implementation switch.

``matmul(x, w, layer=j, impl=...)`` is ``x @ w[j]`` for a stacked [L, D, F] weight (or ``x @ w``
for a [D, F] one), x [..., D] with few rows (the slots of one frame). It serves the LLM's MLP
(``up``, ``down``) and Mamba (``in_proj``, ``out_proj``) projections, the weights a decode step
streams (``docs/serving.md`` §3), picked by ``ServeConfig.projection`` (``ProjectionImpl``):

- ``'xla'``: ``common.dense(x, w[j])``, the model's own product (bit-identical to it): XLA's dot.
- ``'pallas'``: ``pallas_kernels.matmul``, the weight-streaming Triton kernel; it reads the
  stacked weight in place (no slice of it is materialised), accumulates in fp32 and rounds once
  to x's dtype, as ``dense`` does. fp32 products follow ``jax_default_matmul_precision``
  (``Precision.scope()``). Interpreted on the CPU (decided at trace time). It matches 'xla' to
  rounding, not bit for bit.
"""

from __future__ import annotations

import jax

from pallas_kernels.matmul import MatmulBlocks
from pallas_kernels.matmul import matmul as matmul_kernel
from voicechat_jax.config import ProjectionImpl
from voicechat_jax.model.common import dense


def matmul(
    x: jax.Array,
    w: jax.Array | tuple[jax.Array, ...],
    *,
    layer: int | None = None,
    impl: ProjectionImpl | str = ProjectionImpl.XLA,
    blocks: MatmulBlocks | None = None,
) -> jax.Array:
    """``x @ w[layer]`` (or ``x @ w`` with ``layer=None``) in x's dtype.

    Args:
      x: [..., D] activations.
      w: [L, D, F] stacked weights with a static ``layer``, a tuple of L [D, F] (the serving
        layout, ``common.per_layer``) with a static ``layer``, or [D, F].
      layer: static index into w's L axis, or None.
      impl: 'xla' | 'pallas' (static).
      blocks: the kernel's tiling ('pallas' only); default ``matmul.default_blocks``.

    Returns:
      [..., F] in x's dtype.

    Raises:
      ValueError: on an unknown ``impl`` (and, from the kernel, inconsistent shapes).
    """
    impl = ProjectionImpl(impl)
    if isinstance(w, tuple):  # the serving layout (``common.per_layer``): the layer's own leaf
        w, layer = w[layer], None
    if impl == ProjectionImpl.PALLAS:
        return matmul_kernel(
            x, w, layer=layer, interpret=jax.default_backend() == "cpu", blocks=blocks
        )
    return dense(x, w if layer is None else w[layer])
