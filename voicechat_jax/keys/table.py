"""The one release key table: all sub-networks' rules, in release order.

``release_table(cfg)`` is what the converter and the loaders apply; ``load_release`` fills a whole
``ModelParams`` from a release state dict (a mapping or a loader function), strictly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys import KeyRule, fill
from voicechat_jax.keys import codec as codec_keys
from voicechat_jax.keys import encoder as encoder_keys
from voicechat_jax.keys import llm as llm_keys
from voicechat_jax.keys import rnnt as rnnt_keys
from voicechat_jax.keys import tts as tts_keys
from voicechat_jax.keys import tts_backbone as tts_backbone_keys

PARTS = (encoder_keys, llm_keys, rnnt_keys, tts_backbone_keys, tts_keys, codec_keys)


def release_table(cfg: ModelConfig) -> list[KeyRule]:
    """Every release tensor of ``model.safetensors`` and where it lands (or that it is dropped)."""
    return [rule for part in PARTS for rule in part.rules(cfg)]


def load_release(
    abstract_params,
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
    *,
    keys: Iterable[str] | None = None,
    on_tensor=None,
):
    """A whole ``ModelParams`` (NumPy leaves) from release tensors; see ``keys.fill``."""
    return fill(abstract_params, release_table(cfg), tensors, keys=keys, on_tensor=on_tensor)
