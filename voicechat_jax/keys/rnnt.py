"""Release keys of the RNNT head: ``stt_model.rnnt_decoder.*`` and ``stt_model.rnnt_joint.*``.

15 tensors (docs/model.md §4, ``_rnnt_merge_info``), named as NeMo's ``RNNTDecoder`` and
``RNNTJoint`` name them: the embedding, per LSTM layer ``weight_ih``/``weight_hh``/``bias_ih``/
``bias_hh`` (torch's gate order i, f, g, o is kept; the two biases are summed into one slot), the
joint's ``pred``/``enc`` Linears, and ``joint_net.2`` (the output Linear; index 2 because the
trained joint had dropout between its ReLU and that Linear).
"""

from __future__ import annotations

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys.core import KeyRule, Layout

DECODER = "stt_model.rnnt_decoder"
JOINT = "stt_model.rnnt_joint"


def rules(cfg: ModelConfig) -> list[KeyRule]:
    """The key table of the RNNT head; param paths start with ``rnnt.``."""
    out = [KeyRule(f"{DECODER}.prediction.embed.weight", "rnnt.embed")]
    lstm = f"{DECODER}.prediction.dec_rnn.lstm"
    for l in range(cfg.rnnt.pred_layers):
        out += [
            KeyRule(f"{lstm}.weight_ih_l{l}", "rnnt.lstm.w_in", (l,), Layout.LINEAR),
            KeyRule(f"{lstm}.weight_hh_l{l}", "rnnt.lstm.w_hidden", (l,), Layout.LINEAR),
            KeyRule(f"{lstm}.bias_ih_l{l}", "rnnt.lstm.b", (l,), reduce="sum"),
            KeyRule(f"{lstm}.bias_hh_l{l}", "rnnt.lstm.b", (l,), reduce="sum"),
        ]
    out += [
        KeyRule(f"{JOINT}.enc.weight", "rnnt.joint.enc", layout=Layout.LINEAR),
        KeyRule(f"{JOINT}.enc.bias", "rnnt.joint.enc_b"),
        KeyRule(f"{JOINT}.pred.weight", "rnnt.joint.pred", layout=Layout.LINEAR),
        KeyRule(f"{JOINT}.pred.bias", "rnnt.joint.pred_b"),
        KeyRule(f"{JOINT}.joint_net.2.weight", "rnnt.joint.out", layout=Layout.LINEAR),
        KeyRule(f"{JOINT}.joint_net.2.bias", "rnnt.joint.out_b"),
    ]
    return out
