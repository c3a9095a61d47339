"""The one release key table: all sub-networks' rules, in release order.

``release_table(cfg)`` is what the converter and the loaders apply; ``load_params`` builds the
device params of a whole model from a release state dict (a mapping or a loader function),
strictly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys import codec as codec_keys
from voicechat_jax.keys import encoder as encoder_keys
from voicechat_jax.keys import llm as llm_keys
from voicechat_jax.keys import rnnt as rnnt_keys
from voicechat_jax.keys import tts as tts_keys
from voicechat_jax.keys import tts_backbone as tts_backbone_keys
from voicechat_jax.keys.core import KeyRule, fill
from voicechat_jax.model import ear_tts, voicechat
from voicechat_jax.precision import Precision

PARTS = (encoder_keys, llm_keys, rnnt_keys, tts_backbone_keys, tts_keys, codec_keys)


def release_table(cfg: ModelConfig) -> list[KeyRule]:
    """Every release tensor of ``model.safetensors`` and where it lands (or that it is dropped)."""
    return [rule for part in PARTS for rule in part.rules(cfg)]


def load_params(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
    precision: Precision,
    char_table: np.ndarray,
) -> voicechat.ModelParams:
    """Device params from release tensors (a mapping or a loader), strictly, plus the text table.

    ``char_table`` [V, M] is ``char_encoder.char_table(tokenizer)``: the speech decoder's
    per-token characters, from the text tokenizer (the release does not store them).
    """
    abstract = voicechat.abstract(cfg, precision, text_table=False)
    host = fill(abstract, release_table(cfg), tensors)
    params = jax.tree_util.tree_map(jnp.asarray, host)
    tts = ear_tts.with_text_table(params.tts, jnp.asarray(char_table), cfg=cfg)
    return params.replace(tts=tts)
