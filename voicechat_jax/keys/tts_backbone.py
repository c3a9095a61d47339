"""Release keys of the EarTTS backbone and its char-aware text encoder.

``tts_model.tts_model.backbone.*`` is HF ``Gemma3TextModel`` without ``embed_tokens``: 13 tensors
per layer plus the final ``norm`` (365 in the release). ``tts_model.tts_model.embed_subword.*`` is
NeMo's ``CharAwareSubwordEncoder``: the char embedding, the one-layer ``T5GemmaEncoderModel``
(under transformers 5.18 its keys are ``backbone.encoder.layers.{l}.*`` and
``backbone.encoder.norm``), ``proj_embedding``, and the ``SubwordFlagEmbedding`` /
``BOSEOSEmbedding`` tables with their int buffers (``is_continuation``, ``special_flags`` and each
module's scalar ``pad_tensor``): 20 tensors. Linears are [out, in] in torch and [in, out] here.
"""

from __future__ import annotations

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys.core import KeyRule, Layout

BACKBONE = "tts_model.tts_model.backbone"
CHAR_ENCODER = "tts_model.tts_model.embed_subword"

_LINEAR = Layout.LINEAR


def backbone_rules(cfg: ModelConfig) -> list[KeyRule]:
    """``Gemma3TextModel`` (no embedding) -> ``tts.backbone.*``."""
    out = []
    for l in range(cfg.tts.n_layers):
        pre, dst, i = f"{BACKBONE}.layers.{l}", "tts.backbone", (l,)
        out += [
            KeyRule(f"{pre}.input_layernorm.weight", f"{dst}.input_norm", i),
            KeyRule(f"{pre}.self_attn.q_proj.weight", f"{dst}.q", i, _LINEAR),
            KeyRule(f"{pre}.self_attn.k_proj.weight", f"{dst}.k", i, _LINEAR),
            KeyRule(f"{pre}.self_attn.v_proj.weight", f"{dst}.v", i, _LINEAR),
            KeyRule(f"{pre}.self_attn.o_proj.weight", f"{dst}.o", i, _LINEAR),
            KeyRule(f"{pre}.self_attn.q_norm.weight", f"{dst}.q_norm", i),
            KeyRule(f"{pre}.self_attn.k_norm.weight", f"{dst}.k_norm", i),
            KeyRule(f"{pre}.post_attention_layernorm.weight", f"{dst}.post_attn_norm", i),
            KeyRule(f"{pre}.pre_feedforward_layernorm.weight", f"{dst}.pre_ff_norm", i),
            KeyRule(f"{pre}.mlp.gate_proj.weight", f"{dst}.gate", i, _LINEAR),
            KeyRule(f"{pre}.mlp.up_proj.weight", f"{dst}.up", i, _LINEAR),
            KeyRule(f"{pre}.mlp.down_proj.weight", f"{dst}.down", i, _LINEAR),
            KeyRule(f"{pre}.post_feedforward_layernorm.weight", f"{dst}.post_ff_norm", i),
        ]
    out.append(KeyRule(f"{BACKBONE}.norm.weight", "tts.backbone.final_norm"))
    return out


def char_encoder_rules(cfg: ModelConfig) -> list[KeyRule]:
    """``CharAwareSubwordEncoder`` -> ``tts.char_encoder.*``."""
    dst = "tts.char_encoder"
    out = [KeyRule(f"{CHAR_ENCODER}.embed_tokens.weight", f"{dst}.embed")]
    for l in range(cfg.tts.cas_layers):
        pre, i = f"{CHAR_ENCODER}.backbone.encoder.layers.{l}", (l,)
        out += [
            KeyRule(f"{pre}.pre_self_attn_layernorm.weight", f"{dst}.pre_attn_norm", i),
            KeyRule(f"{pre}.self_attn.q_proj.weight", f"{dst}.q", i, _LINEAR),
            KeyRule(f"{pre}.self_attn.k_proj.weight", f"{dst}.k", i, _LINEAR),
            KeyRule(f"{pre}.self_attn.v_proj.weight", f"{dst}.v", i, _LINEAR),
            KeyRule(f"{pre}.self_attn.o_proj.weight", f"{dst}.o", i, _LINEAR),
            KeyRule(f"{pre}.post_self_attn_layernorm.weight", f"{dst}.post_attn_norm", i),
            KeyRule(f"{pre}.pre_feedforward_layernorm.weight", f"{dst}.pre_ff_norm", i),
            KeyRule(f"{pre}.mlp.gate_proj.weight", f"{dst}.gate", i, _LINEAR),
            KeyRule(f"{pre}.mlp.up_proj.weight", f"{dst}.up", i, _LINEAR),
            KeyRule(f"{pre}.mlp.down_proj.weight", f"{dst}.down", i, _LINEAR),
            KeyRule(f"{pre}.post_feedforward_layernorm.weight", f"{dst}.post_ff_norm", i),
        ]
    out += [
        KeyRule(f"{CHAR_ENCODER}.backbone.encoder.norm.weight", f"{dst}.final_norm"),
        KeyRule(f"{CHAR_ENCODER}.proj_embedding.weight", f"{dst}.proj", layout=_LINEAR),
        KeyRule(f"{CHAR_ENCODER}.subword_flag_emb.cont_emb.weight", f"{dst}.cont_emb"),
        KeyRule(f"{CHAR_ENCODER}.subword_flag_emb.is_continuation", f"{dst}.is_continuation"),
        KeyRule(f"{CHAR_ENCODER}.subword_flag_emb.pad_tensor", f"{dst}.cont_pad"),
        KeyRule(f"{CHAR_ENCODER}.bos_eos_emb.special_emb.weight", f"{dst}.special_emb"),
        KeyRule(f"{CHAR_ENCODER}.bos_eos_emb.special_flags", f"{dst}.special_flags"),
        KeyRule(f"{CHAR_ENCODER}.bos_eos_emb.pad_tensor", f"{dst}.special_pad"),
    ]
    return out


def rules(cfg: ModelConfig) -> list[KeyRule]:
    """Both tables; param paths start with ``tts.backbone.`` or ``tts.char_encoder.``."""
    return backbone_rules(cfg) + char_encoder_rules(cfg)
