"""Release keys of the LLM: ``stt_model.llm.*`` (``NemotronHModel`` without its embedding), the
token embedding ``stt_model.embed_tokens`` and the two heads ``stt_model.{lm_head,function_head}``.

Layer ``i`` of the release is the ``j``-th layer of its kind in ``cfg.llm.pattern``; its tensors
land at index ``j`` of that kind's stacked params (``voicechat_jax.model.nano``). Names follow
transformers' ``NemotronHBlock`` (``norm``, ``mixer``) and mixers (``NemotronHMamba2Mixer``,
``NemotronHMLP``, ``NemotronHAttention``); NeMo's ``DuplexSTTModel`` moves the backbone's
``embeddings`` out to ``stt_model.embed_tokens``.
"""

from __future__ import annotations

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys.core import KeyRule, Layout

_LIN = Layout.LINEAR

# per kind: (release name under ``mixer.``, our field, layout)
_MAMBA = (
    ("in_proj.weight", "in_proj", _LIN),
    ("conv1d.weight", "conv_w", Layout.DEPTHWISE_CONV1D),
    ("conv1d.bias", "conv_b", Layout.IDENTITY),
    ("A_log", "A_log", Layout.IDENTITY),
    ("D", "D", Layout.IDENTITY),
    ("dt_bias", "dt_bias", Layout.IDENTITY),
    ("norm.weight", "gate_norm", Layout.IDENTITY),
    ("out_proj.weight", "out_proj", _LIN),
)
_MLP = (("up_proj.weight", "up", _LIN), ("down_proj.weight", "down", _LIN))
_ATTN = (
    ("q_proj.weight", "q", _LIN),
    ("k_proj.weight", "k", _LIN),
    ("v_proj.weight", "v", _LIN),
    ("o_proj.weight", "o", _LIN),
)
_KINDS = {"M": ("mamba", _MAMBA), "-": ("mlp", _MLP), "*": ("attn", _ATTN)}


def rules(cfg: ModelConfig) -> list[KeyRule]:
    """The key table of the LLM, its embedding and heads (release 339 + 3 tensors)."""
    out = [
        KeyRule("stt_model.embed_tokens.weight", "llm.embed"),
        KeyRule("stt_model.lm_head.weight", "llm.lm_head", layout=_LIN),
        KeyRule("stt_model.function_head.weight", "llm.function_head", layout=_LIN),
        KeyRule("stt_model.llm.norm_f.weight", "llm.norm_f"),
    ]
    seen = {kind: 0 for kind in _KINDS}
    for i, kind in enumerate(cfg.llm.pattern):
        field, mixer = _KINDS[kind]
        j = seen[kind]
        seen[kind] += 1
        prefix = f"stt_model.llm.layers.{i}"
        out.append(KeyRule(f"{prefix}.norm.weight", f"llm.{field}.norm", (j,)))
        for name, param, layout in mixer:
            out.append(KeyRule(f"{prefix}.mixer.{name}", f"llm.{field}.{param}", (j,), layout))
    return out
