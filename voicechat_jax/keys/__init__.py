"""The release key table: each tensor of ``model.safetensors`` -> one place in our params.

The table is assembled from one module per sub-network (``keys.encoder``, ``keys.llm``, ...), each
exporting ``rules(cfg) -> list[KeyRule]``. A rule names one release tensor, the dotted path of the
parameter it fills (``llm.mamba.in_proj``), the position on that parameter's leading stacked axes
(the layer index for stacked layers), and the layout transform from torch's layout to ours
(docs/model.md §4). Release names appear nowhere else in the package.

``fill`` (``keys.core``) applies a table strictly: a source key with no rule, a rule whose key is
missing, a parameter slot filled twice or never, and a shape that does not match are all errors
that name the tensors. ``load_params`` (``keys.table``) loads a whole model from a release through
``release_table``; the converter (``voicechat-convert``) and the parity tests both load through
here.
"""

from voicechat_jax.keys.core import KeyRule, KeyTableError, Layout, fill, to_layout
from voicechat_jax.keys.table import load_params, release_table

__all__ = [
    "KeyRule",
    "KeyTableError",
    "Layout",
    "fill",
    "load_params",
    "release_table",
    "to_layout",
]
