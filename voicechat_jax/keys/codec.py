"""Key rules for the RVQ-VAE codec: ``tts_model.audio_codec.*`` -> ``codec.*``.

The release holds 214 codec tensors (docs/model.md §4): encoder 76, decoder 76, ``prvq.mus_list``
31 and ``prvq._variance_list`` 31. The variances only give the training-time log-std; their 31
rules drop them (``param=None``: consumed, not loaded). Layer indices follow NeMo's
``Wav2Latent.layers`` ([in conv] + per stage [blocks..., down conv]) and ``Latent2Wav.layers``
(per stage [ConvTranspose, blocks...] + [out conv]).
"""

from __future__ import annotations

from voicechat_jax.config import ModelConfig
from voicechat_jax.keys.core import KeyRule, Layout

PREFIX = "tts_model.audio_codec."


def _block_rules(release: str, param: str, j: int) -> list[KeyRule]:
    """One ``ConvNeXt1d`` (release ``...layers.{i}``) into slot ``j`` of a stage's stack."""
    conv, plain = Layout.CONV1D, Layout.IDENTITY
    return [
        KeyRule(f"{release}.{name}", f"{param}.{slot}", (j,), layout)
        for name, slot, layout in (
            ("dwconv.weight", "dw", Layout.DEPTHWISE_CONV1D),  # [C, 1, k] -> [k, C]
            ("dwconv.bias", "dw_b", plain),
            ("norm.weight", "norm_w", plain),
            ("norm.bias", "norm_b", plain),
            ("pwconv1.weight", "pw1", conv),  # [F, C, 1] -> [1, C, F]
            ("pwconv1.bias", "pw1_b", plain),
            ("pwconv2.weight", "pw2", conv),  # [C, F, 1] -> [1, F, C]
            ("pwconv2.bias", "pw2_b", plain),
        )
    ]


def rules(cfg: ModelConfig) -> list[KeyRule]:
    """Every ``tts_model.audio_codec.*`` tensor of the release, the variances dropped."""
    c = cfg.codec
    n_stages, nb = len(c.rates), c.num_blocks
    out: list[KeyRule] = []
    for q in range(c.n_quantizers):
        out.append(KeyRule(f"{PREFIX}prvq.mus_list.{q}", "codec.mus", (q,)))
        out.append(KeyRule(f"{PREFIX}prvq._variance_list.{q}.variance", None))

    enc = f"{PREFIX}encoder.layers"
    out.append(KeyRule(f"{enc}.0.weight", "codec.encoder.inp", layout=Layout.CONV1D))
    i = 1
    for s in range(n_stages):
        stage = f"codec.encoder.stages.{s}"
        for j in range(nb):
            out += _block_rules(f"{enc}.{i}", f"{stage}.blocks", j)
            i += 1
        out.append(KeyRule(f"{enc}.{i}.weight", f"{stage}.down", layout=Layout.CONV1D))
        i += 1

    dec = f"{PREFIX}decoder.layers"
    i = 0
    for s in range(n_stages):
        stage = f"codec.decoder.stages.{s}"
        # ConvTranspose1d keeps torch's [in, out, k] (kernel = stride: one matmul, see model.codec)
        out.append(KeyRule(f"{dec}.{i}.weight", f"{stage}.up"))
        i += 1
        for j in range(nb):
            out += _block_rules(f"{dec}.{i}", f"{stage}.blocks", j)
            i += 1
    out.append(KeyRule(f"{dec}.{i}.weight", "codec.decoder.out", layout=Layout.CONV1D))
    return out
