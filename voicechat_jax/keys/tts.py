"""Release keys of the speech decoder outside its backbone and text encoder -> ``tts.*``.

``tts_model`` is NeMo's ``DuplexEARTTS``; ``tts_model.tts_model`` its ``RVQEARTTSModel``. This
table covers ``embed_code``, ``rvq_embs`` (the codec's ``mus_list`` copied by ``set_rvq_embs``),
``bos_emb``, ``null_emb``, ``gated_fusion_audio_text`` (7 tensors), ``mog_head`` (5 per trunk
layer, the trunk's final norm, 5 projections) and ``audio_prompt_projection_W``, plus the
``DuplexEARTTS`` buffers ``audio_prompt_latents.<speaker>`` (``cfg.tts.speaker_name``),
``codec_silence_tokens`` and ``_control_codes``. ``keys.tts_backbone`` covers ``backbone.*``
and ``embed_subword.*``.

``audio_prompt_projection_W`` is dropped: NeMo projects the prompt's code embeddings with it only
when no cached speaker latent exists, and the release runs from its cached latent.
"""

from __future__ import annotations

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys.core import KeyRule, Layout

DUPLEX = "tts_model"
EARTTS = "tts_model.tts_model"

_LINEAR = Layout.LINEAR


def rules(cfg: ModelConfig) -> list[KeyRule]:
    """The key table of the speech decoder's own tensors; param paths start with ``tts.``."""
    fusion = f"{EARTTS}.gated_fusion_audio_text"
    head = f"{EARTTS}.mog_head"
    out = [
        KeyRule(f"{EARTTS}.embed_code.weight", "tts.embed_code", layout=_LINEAR),
        KeyRule(f"{EARTTS}.rvq_embs", "tts.rvq_embs"),
        KeyRule(f"{EARTTS}.bos_emb", "tts.bos_emb"),
        KeyRule(f"{EARTTS}.null_emb", "tts.null_emb"),
        KeyRule(f"{fusion}.audio_proj.weight", "tts.fusion.audio_proj", layout=_LINEAR),
        KeyRule(f"{fusion}.audio_proj.bias", "tts.fusion.audio_proj_b"),
        KeyRule(f"{fusion}.text_proj.weight", "tts.fusion.text_proj", layout=_LINEAR),
        KeyRule(f"{fusion}.text_proj.bias", "tts.fusion.text_proj_b"),
        KeyRule(f"{fusion}.gate", "tts.fusion.gate"),
        KeyRule(f"{fusion}.residual_scale", "tts.fusion.residual_scale"),
        KeyRule(f"{fusion}.final_norm.weight", "tts.fusion.final_norm"),
    ]
    L = cfg.tts.mog_mlp_layers
    for l in range(L):
        pre, i = f"{head}.mlp_stack.{l}", (l,)
        out += [
            KeyRule(f"{pre}.pre_norm.weight", "tts.mog.pre_norm", i),
            KeyRule(f"{pre}.mlp.gate_proj.weight", "tts.mog.gate", i, _LINEAR),
            KeyRule(f"{pre}.mlp.up_proj.weight", "tts.mog.up", i, _LINEAR),
            KeyRule(f"{pre}.mlp.down_proj.weight", "tts.mog.down", i, _LINEAR),
            KeyRule(f"{pre}.post_norm.weight", "tts.mog.post_norm", i),
        ]
    out += [
        KeyRule(f"{head}.mlp_stack.{L}.weight", "tts.mog.final_norm"),  # the Sequential's RMSNorm
        KeyRule(f"{head}.proj_logits.weight", "tts.mog.proj_logits", layout=_LINEAR),
        KeyRule(f"{head}.proj_mus.weight", "tts.mog.proj_mus"),  # kept [E * R, D]
        KeyRule(f"{head}.low_mat", "tts.mog.low_mat"),
        KeyRule(f"{head}.proj_else.weight", "tts.mog.proj_else", layout=_LINEAR),
        KeyRule(f"{head}.proj_logs.weight", "tts.mog.proj_logs", layout=_LINEAR),
        KeyRule(f"{EARTTS}.audio_prompt_projection_W", None),
        KeyRule(
            f"{DUPLEX}.audio_prompt_latents.{cfg.tts.speaker_name}",
            "tts.prompt_latents",
            layout=Layout.SQUEEZE,
        ),
        KeyRule(f"{DUPLEX}.codec_silence_tokens", "tts.silence_codes"),
        KeyRule(f"{DUPLEX}._control_codes", "tts.control_codes"),
    ]
    return out
