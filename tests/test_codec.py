"""The RVQ-VAE codec against NeMo 3.0's ``RVQVAEModel`` (tiny random weights, fp32).

Alignment of streaming and offline decoding (docs/model.md §8; see ``voicechat_jax.model.codec``):
the stream is the offline waveform delayed by 8 samples. The stream's first 8 samples are the part
of frame 0 that offline trims, and offline samples 0..5 are normalised by a partial window envelope,
so the compared ranges are ``stream[14:]`` and ``offline[6:-8]``.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from tests import shared
from voicechat_jax.config import CodecConfig, tiny, voicechat_11b
from voicechat_jax.keys import KeyRule, fill
from voicechat_jax.keys import codec as codec_keys
from voicechat_jax.model import beside, codec
from voicechat_jax.model.common import count_params
from voicechat_jax.precision import KernelProduct, Precision, lax_precision
from voicechat_jax.release_config import codec_config

_ear = functools.partial(shared.nemo_module, "nemo.collections.speechlm2.modules.ear_tts_vae_codec")


T = 20  # code frames per decode test
B = 2
DELAY = 8  # stream[m] == offline[m - DELAY]
EDGE = 6  # offline samples with a partial window envelope
TOL = 1e-4


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def nemo_config(c: CodecConfig) -> DictConfig:
    """The ``codec_config`` ``DuplexEARTTS`` hands to ``RVQVAEModel``."""
    return DictConfig(codec_config(c))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial random weights: norm weights off one, biases off zero, convs at fan-in scale.

    ``ConvNeXt1d``'s pwconv2 starts at zero in NeMo (identity init); the output conv is scaled so
    the iSTFT clamp (``constrain_value_range``) bites on some samples, not all.
    """
    g = torch.Generator().manual_seed(seed)
    out_conv = model.decoder.layers[-1]

    def randn(p, std):
        p.copy_(std * torch.randn(p.shape, generator=g))

    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.ConvTranspose1d):  # [in, out, k]: each output sums `in`
                randn(m.weight, m.weight.shape[0] ** -0.5)
            elif isinstance(m, torch.nn.Conv1d):  # [out, in/g, k]
                scale = 1.5 if m is out_conv else 0.5 if name.endswith("pwconv2") else 1.0
                randn(m.weight, scale * (m.weight.shape[1] * m.weight.shape[2]) ** -0.5)
            elif isinstance(m, _ear().LayerNormNd):
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=g))
            elif isinstance(m, _ear().PreTrainedEMAVariance):
                m.variance.copy_(0.5 + torch.rand((), generator=g))
            if getattr(m, "bias", None) is not None and not isinstance(
                m, _ear().PreTrainedEMAVariance
            ):
                randn(m.bias, 0.1)
        # prvq.mus_list keeps NeMo's own init: unit rows scaled by (Q - q) / Q


@pytest.fixture(scope="module")
def step():
    return jax.jit(codec.decode_step, static_argnames="cfg")


@pytest.fixture(scope="module")
def encode():
    return jax.jit(codec.encode, static_argnames="cfg")


@pytest.fixture(scope="module")
def cfg() -> CodecConfig:
    return tiny().codec


@pytest.fixture(scope="module")
def ref(cfg):
    torch.manual_seed(0)
    model = _ear().RVQVAEModel(nemo_config(cfg)).eval()
    _randomize(model, seed=1)
    return model


@pytest.fixture(scope="module")
def params(cfg, ref):
    tensors = {codec_keys.PREFIX + k: v.numpy() for k, v in ref.state_dict().items()}
    abstract = codec.abstract(cfg, Precision.fp32())
    filled = fill(abstract, codec_keys.rules(tiny()), tensors, param_prefix="codec")
    return jax.tree_util.tree_map(jnp.asarray, filled)


@pytest.fixture(scope="module")
def codes(cfg):
    rng = np.random.default_rng(2)
    return rng.integers(0, cfg.codebook_size, (B, T, cfg.n_quantizers)).astype(np.int32)


@pytest.fixture(scope="module")
def nemo_offline(ref, codes):
    with torch.no_grad():
        wav, _ = ref.decode(torch.from_numpy(codes).long())
    return wav[:, 0].numpy()  # [B, T * 1764]


@pytest.fixture(scope="module")
def ours_offline(cfg, params, codes):
    decode = jax.jit(codec.decode_offline, static_argnames="cfg")
    return np.asarray(decode(params, jnp.asarray(codes), cfg=cfg))


@pytest.fixture(scope="module")
def ours_stream(cfg, params, codes, step):
    state = codec.init_state(cfg, B, Precision.fp32())
    out = []
    for t in range(T):
        state, wav = step(params, state, jnp.asarray(codes[:, t : t + 1]), cfg=cfg)
        out.append(np.asarray(wav))
    return np.concatenate(out, axis=1)


def test_clamp_is_exercised(cfg, ref, codes):
    """The reference's iSTFT clamp must bite on some frame samples (else it goes untested)."""
    with torch.no_grad():
        latent = ref.dequantize(torch.from_numpy(codes).long()).transpose(1, 2)
        x = latent
        for layer in ref.decoder.layers:
            x = layer(x)
        R = cfg.n_fft // 2 + 1
        mag = 100.0 * torch.exp(-torch.nn.functional.softplus(-x[:, :R] + math.log(100.0)))
        spec = torch.polar(mag, x[:, R:])
        frames = torch.fft.irfft(spec, n=cfg.n_fft, dim=1)
        window = torch.hann_window(cfg.n_fft)[None, :, None]
        clamped = float((frames.abs() > window).float().mean())
    assert 0.001 < clamped < 0.5, clamped


def test_offline_decode_matches_nemo(cfg, ours_offline, nemo_offline):
    ours = ours_offline
    assert ours.shape == (B, T * cfg.samples_per_frame)
    assert rel_err(ours, nemo_offline) <= TOL


def test_streaming_matches_nemo_offline_delayed(cfg, ours_stream, nemo_offline):
    assert ours_stream.shape == (B, T * cfg.samples_per_frame)
    assert rel_err(ours_stream[:, DELAY + EDGE :], nemo_offline[:, EDGE:-DELAY]) <= TOL


def test_streaming_matches_own_offline_delayed(ours_stream, ours_offline):
    offline = ours_offline
    assert rel_err(ours_stream[:, DELAY + EDGE :], offline[:, EDGE:-DELAY]) <= TOL
    # The edge really differs (a partial envelope offline): the alignment above is not slack.
    assert rel_err(ours_stream[:, DELAY : DELAY + EDGE], offline[:, :EDGE]) > 1e-3


def test_streaming_matches_nemo_streaming(cfg, ref, codes, ours_stream):
    cache = _ear().CausalConv1dCache()
    out = []
    with torch.no_grad():
        for t in range(T):
            wav, _ = ref.decode(torch.from_numpy(codes[:, t : t + 1]).long(), cache=cache)
            assert wav.shape[-1] == cfg.samples_per_frame
            out.append(wav[:, 0].numpy())
    nemo_stream = np.concatenate(out, axis=1)
    for t in range(T):
        sl = slice(t * cfg.samples_per_frame, (t + 1) * cfg.samples_per_frame)
        assert rel_err(ours_stream[:, sl], nemo_stream[:, sl]) <= TOL, t


def test_k_frames_per_call_equal_single_calls(cfg, params, codes, ours_stream, step):
    state = codec.init_state(cfg, B, Precision.fp32())
    out, t = [], 0
    for k in (5, 10, 5):
        state, wav = step(params, state, jnp.asarray(codes[:, t : t + k]), cfg=cfg)
        assert wav.shape == (B, k * cfg.samples_per_frame)
        out.append(np.asarray(wav))
        t += k
    assert t == T
    assert rel_err(np.concatenate(out, axis=1), ours_stream) <= 1e-5


def test_jit_equals_eager(cfg, params, codes, ours_stream):
    state = codec.init_state(cfg, B, Precision.fp32())
    eager = []
    for t in range(2):
        state, wav = codec.decode_step(params, state, jnp.asarray(codes[:, t : t + 1]), cfg=cfg)
        eager.append(np.asarray(wav))
    spf = cfg.samples_per_frame
    assert rel_err(np.concatenate(eager, axis=1), ours_stream[:, : 2 * spf]) <= 1e-5


def test_the_trunk_through_our_kernel_equals_xlas(cfg, params, codes, ours_stream):
    """``codec_matmul='pallas_tf32x3'`` runs the decoder trunk's products (the upsampling ones
    with their weight laid out step-major) through ``pallas_kernels.matmul``; in the Pallas
    interpreter its steps are full fp32, so the trunk equals XLA's to fp32 summation order. Off a
    GPU the choice is XLA's full fp32: ``decode_step`` gives the stream bit for bit."""
    latent = codec.codes_to_latent(params, jnp.asarray(codes[:, :2]))
    conv = codec.init_state(cfg, B, Precision.fp32()).conv
    want, want_conv = codec._decoder_trunk(params.decoder, latent, conv)
    got, got_conv = codec._decoder_trunk(params.decoder, latent, conv, KernelProduct.TF32X3)
    assert rel_err(got, want) < 1e-5
    assert max(rel_err(a, b) for a, b in zip(got_conv, want_conv, strict=True)) < 1e-5
    assert lax_precision("pallas_tf32x3", "gpu") is KernelProduct.TF32X3
    state = codec.init_state(cfg, B, Precision.fp32())
    _, wav = codec.decode_step(
        params, state, jnp.asarray(codes[:, :1]), cfg=cfg, matmul="pallas_tf32x3"
    )
    np.testing.assert_array_equal(wav, ours_stream[:, : wav.shape[1]])


def test_step_as_products_equals_the_step(cfg, params, codes, ours_stream):
    """``decode_step_products`` driven by XLA's fp32 products (what ``model.beside`` does where
    no attention launch takes them) decodes the stream ``decode_step`` decodes, one frame a call
    and two, with the same state."""

    asked = []

    @functools.partial(jax.jit, static_argnames=("cfg", "launches"))
    def by_products(params, state, codes, cfg, launches):
        gen = codec.decode_step_products(params, state, codes, cfg=cfg, launches=launches)
        products = beside.Beside(gen)
        out = products.finish()  # every product by XLA's dot
        asked.append(products.asked)
        return out

    decode_step = jax.jit(codec.decode_step, static_argnames="cfg")
    spf = cfg.samples_per_frame
    n = len(codec._product_flops(params, B))
    # one frame a call, and two, the second with three places more than products: the three
    # largest then come in halves of their rows
    for k, launches in ((1, None), (2, n + 3)):
        state = codec.init_state(cfg, B, Precision.fp32())
        ref_state = state
        out = []
        for t in range(0, 4, k):
            chunk = jnp.asarray(codes[:, t : t + k])
            state, wav = by_products(params, state, chunk, cfg=cfg, launches=launches)
            ref_state, _ = decode_step(params, ref_state, chunk, cfg=cfg)
            out.append(np.asarray(wav))
        assert rel_err(np.concatenate(out, axis=1), ours_stream[:, : 4 * spf]) <= 1e-5
        chex.assert_trees_all_close(state, ref_state, atol=1e-5, rtol=0)
    assert asked == [n, n + 3]  # each program traced once


@pytest.mark.parametrize("kind", ["noise", "silence"])
def test_encode_matches_nemo(cfg, ref, params, encode, kind):
    n = 6 * cfg.samples_per_frame
    if kind == "noise":
        wav = (0.3 * np.random.default_rng(4).normal(size=(B, n))).astype(np.float32)
    else:
        wav = np.zeros((B, n), np.float32)
    x = torch.from_numpy(wav)[:, None]
    with torch.no_grad():
        nemo_latent = ref.ae_encode(x)
        nemo_codes, _ = ref.encode(x, torch.full((B,), n))
    latent = jax.jit(codec.encode_latent, static_argnames="cfg")(params, jnp.asarray(wav), cfg=cfg)
    assert rel_err(latent, nemo_latent.numpy()) <= TOL
    ours = encode(params, jnp.asarray(wav), cfg=cfg)
    assert ours.shape == (B, 6, cfg.n_quantizers)
    np.testing.assert_array_equal(np.asarray(ours), nemo_codes.numpy())
    # greedy RVQ on NeMo's own latent gives the same codes as well (quantizer alone)
    np.testing.assert_array_equal(
        np.asarray(codec.encode_latent_to_codes(params, jnp.asarray(nemo_latent.numpy()))),
        nemo_codes.numpy(),
    )


def test_codes_to_latent_matches_nemo(params, ref, codes):
    with torch.no_grad():
        want = ref.dequantize(torch.from_numpy(codes).long()).numpy()
    assert rel_err(codec.codes_to_latent(params, jnp.asarray(codes)), want) <= 1e-6


def test_full_size_key_table_matches_nemo():
    """voicechat_11b: every NeMo codec tensor has a rule, shapes fit, counts match minus drops."""
    cfg = voicechat_11b()
    with torch.device("meta"):
        model = _ear().RVQVAEModel(nemo_config(cfg.codec))
    shapes = {codec_keys.PREFIX + k: tuple(v.shape) for k, v in model.state_dict().items()}
    rules = codec_keys.rules(cfg)
    assert len(shapes) == 214  # the release's audio_codec census (docs/model.md §4)
    assert sorted(r.release for r in rules) == sorted(shapes)
    dropped = [r.release for r in rules if r.param is None]
    assert len(dropped) == cfg.codec.n_quantizers
    assert all("_variance_list" in k for k in dropped)
    abstract = codec.abstract(cfg.codec, Precision.reference())
    nemo_total = sum(math.prod(s) for s in shapes.values())
    assert count_params(abstract) == nemo_total - sum(math.prod(shapes[k]) for k in dropped)

    # Shapes of every slot: fill from zero-stride views (the buffers are the only allocation).
    def load(name):
        return np.broadcast_to(np.float32(0), shapes[name])

    filled = fill(abstract, rules, load, keys=shapes, param_prefix="codec")
    assert count_params(filled) == count_params(abstract)


def test_fill_requires_dropped_keys(cfg, ref):
    """A dropped tensor is still part of the table: it must be present, and is consumed."""
    tensors = {codec_keys.PREFIX + k: v.numpy() for k, v in ref.state_dict().items()}
    abstract = codec.abstract(cfg, Precision.fp32())
    rules = codec_keys.rules(tiny())
    gone = next(r.release for r in rules if r.param is None)
    with pytest.raises(ValueError, match="missing"):
        fill(abstract, rules, {k: v for k, v in tensors.items() if k != gone}, param_prefix="codec")
    with pytest.raises(ValueError, match="map nowhere"):
        fill(abstract, [r for r in rules if r.release != gone], tensors, param_prefix="codec")
    assert isinstance(rules[0], KeyRule)
