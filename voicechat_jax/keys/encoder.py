"""Release keys of the perception: ``stt_model.perception.*`` (docs/model.md §1.2, §4).

Names are those of NeMo's ``AudioPerceptionModule`` state dict: the featurizer's two buffers,
``encoder.pre_encode`` (``conv.{0,2,3,5,6}`` of the ``MaskedConvSequential``: the ReLUs sit at
indices 1, 4 and 7; then ``out``), ``encoder.layers.{j}.*`` (26 tensors each) and ``proj``. The
``modality_adapter`` is an ``IdentityConnector`` and has no tensors. 2 + 12 + 26 L + 2 tensors:
640 for the release's 24 layers.
"""

from __future__ import annotations

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys.core import KeyRule, Layout

PERCEPTION = "stt_model.perception"

# ConformerLayer tensor -> (param path under encoder.layers, layout)
_LAYER = {
    "norm_feed_forward1.weight": ("ff1.norm", Layout.IDENTITY),
    "norm_feed_forward1.bias": ("ff1.norm_b", Layout.IDENTITY),
    "feed_forward1.linear1.weight": ("ff1.up", Layout.LINEAR),
    "feed_forward1.linear2.weight": ("ff1.down", Layout.LINEAR),
    "norm_self_att.weight": ("attn.norm", Layout.IDENTITY),
    "norm_self_att.bias": ("attn.norm_b", Layout.IDENTITY),
    "self_attn.linear_q.weight": ("attn.q", Layout.LINEAR),
    "self_attn.linear_k.weight": ("attn.k", Layout.LINEAR),
    "self_attn.linear_v.weight": ("attn.v", Layout.LINEAR),
    "self_attn.linear_out.weight": ("attn.o", Layout.LINEAR),
    "self_attn.linear_pos.weight": ("attn.pos", Layout.LINEAR),
    "self_attn.pos_bias_u": ("attn.pos_bias_u", Layout.IDENTITY),
    "self_attn.pos_bias_v": ("attn.pos_bias_v", Layout.IDENTITY),
    "norm_conv.weight": ("conv.norm", Layout.IDENTITY),
    "norm_conv.bias": ("conv.norm_b", Layout.IDENTITY),
    "conv.pointwise_conv1.weight": ("conv.pw1", Layout.CONV1D),
    "conv.depthwise_conv.weight": ("conv.dw", Layout.CONV1D),
    "conv.batch_norm.weight": ("conv.ln", Layout.IDENTITY),
    "conv.batch_norm.bias": ("conv.ln_b", Layout.IDENTITY),
    "conv.pointwise_conv2.weight": ("conv.pw2", Layout.CONV1D),
    "norm_feed_forward2.weight": ("ff2.norm", Layout.IDENTITY),
    "norm_feed_forward2.bias": ("ff2.norm_b", Layout.IDENTITY),
    "feed_forward2.linear1.weight": ("ff2.up", Layout.LINEAR),
    "feed_forward2.linear2.weight": ("ff2.down", Layout.LINEAR),
    "norm_out.weight": ("out_norm", Layout.IDENTITY),
    "norm_out.bias": ("out_norm_b", Layout.IDENTITY),
}


def rules(cfg: ModelConfig) -> list[KeyRule]:
    """The key table of the perception; param paths start with ``encoder.``."""
    featurizer = f"{PERCEPTION}.preprocessor.featurizer"
    pre = f"{PERCEPTION}.encoder.pre_encode"
    out = [
        KeyRule(f"{featurizer}.fb", "encoder.mel.fb", layout=Layout.SQUEEZE),
        KeyRule(f"{featurizer}.window", "encoder.mel.window"),
        KeyRule(f"{pre}.conv.0.weight", "encoder.sub.conv_in", layout=Layout.CONV2D),
        KeyRule(f"{pre}.conv.0.bias", "encoder.sub.conv_in_b"),
    ]
    for i, (dw, pw) in enumerate([(2, 3), (5, 6)]):
        out += [
            KeyRule(f"{pre}.conv.{dw}.weight", "encoder.sub.dw", (i,), Layout.CONV2D),
            KeyRule(f"{pre}.conv.{dw}.bias", "encoder.sub.dw_b", (i,)),
            KeyRule(f"{pre}.conv.{pw}.weight", "encoder.sub.pw", (i,), Layout.CONV2D),
            KeyRule(f"{pre}.conv.{pw}.bias", "encoder.sub.pw_b", (i,)),
        ]
    out += [
        KeyRule(f"{pre}.out.weight", "encoder.sub.out", layout=Layout.LINEAR),
        KeyRule(f"{pre}.out.bias", "encoder.sub.out_b"),
    ]
    for j in range(cfg.encoder.n_layers):
        for name, (param, layout) in _LAYER.items():
            out.append(
                KeyRule(
                    f"{PERCEPTION}.encoder.layers.{j}.{name}",
                    f"encoder.layers.{param}",
                    (j,),
                    layout,
                )
            )
    out += [
        KeyRule(f"{PERCEPTION}.proj.weight", "encoder.proj", layout=Layout.LINEAR),
        KeyRule(f"{PERCEPTION}.proj.bias", "encoder.proj_b"),
    ]
    return out
