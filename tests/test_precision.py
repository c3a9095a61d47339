"""The precision policies: named, checked, and reaching every program the engine traces."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import shared
from voicechat_jax import precision as precision_lib
from voicechat_jax import state as state_lib
from voicechat_jax import step as step_lib
from voicechat_jax.config import ServeConfig, tiny
from voicechat_jax.engine import Engine
from voicechat_jax.model import codec, common, conformer, ear_tts, mog, voicechat
from voicechat_jax.precision import POLICIES, Precision, lax_precision, policy

CFG = tiny()
SERVE = ServeConfig(slots=2, frames_per_tick=2, context_frames=16)


def test_policies_by_name():
    assert set(POLICIES) == {
        "reference",
        "fp32",
        "tf32",
        "bf16_tts_kv",
        "tf32_bf16_tts_kv",
        "tf32_codec",
        "tf32x3_codec",
        "bf16_tts_kv_tf32_codec",
        "bf16_tts_kv_tf32x3_codec",
        "tf32x3_tts_codec",
        "bf16_tts_kv_tf32x3_tts_codec",
        "tf32pair_tts",
        "pallas_tf32x3_tts_codec",
        "pallas_tf32x3",
        "tf32x3_steps",
    }
    assert policy("tf32pair_tts") == Precision(tts_matmul="tf32_pair")
    assert policy("tf32x3_tts_codec") == Precision(tts_matmul="tf32_x3", codec_matmul="tf32_x3")
    assert policy("bf16_tts_kv_tf32x3_tts_codec").tts_kv == jnp.bfloat16
    with pytest.raises(ValueError, match="tts_matmul must be one of"):
        Precision(tts_matmul="bf16_x6")
    assert policy("bf16_tts_kv_tf32x3_codec") == Precision(
        tts_kv=jnp.bfloat16, codec_matmul="tf32_x3"
    )
    assert policy("tf32_codec") == Precision(codec_matmul="tensorfloat32")
    assert policy("tf32x3_codec") == Precision(codec_matmul="tf32_x3")
    assert policy("bf16_tts_kv_tf32_codec") == Precision(
        tts_kv=jnp.bfloat16, codec_matmul="tensorfloat32"
    )
    assert policy("reference") == Precision.reference()
    assert policy("tf32").matmul == "tensorfloat32"
    assert policy("bf16_tts_kv").tts_kv == jnp.bfloat16
    assert policy("reference").matmul == "float32"  # faithful: fp32 products, as torch's default
    with pytest.raises(ValueError, match="precision must be one of reference, fp32"):
        policy("fp8")
    with pytest.raises(ValueError, match="matmul must be one of"):
        Precision(matmul="bfloat16")
    with pytest.raises(ValueError, match="codec_matmul must be one of"):
        Precision(codec_matmul="bfloat16")
    assert Precision(codec_matmul="tf32_x3").codec_matmul == "tf32_x3"
    with pytest.raises(ValueError, match="matmul must be one of"):
        Precision(matmul="tf32_x3")  # multi-pass products: the codec's decoder only


def test_lax_precision_per_platform():
    """The codec's product precision: a ``DotAlgorithmPreset`` on a GPU, full fp32 elsewhere."""
    H = jax.lax.Precision
    assert lax_precision("float32") == H.HIGHEST
    assert lax_precision("tensorfloat32") == H.HIGH
    assert lax_precision("tf32_x3", "cpu") == H.HIGHEST
    assert lax_precision("tf32_x3", "gpu") == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert lax_precision("bf16_x6", "gpu") == jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
    assert lax_precision("pallas_tf32x3", "gpu") is precision_lib.KernelProduct.TF32X3
    assert lax_precision("pallas_tf32x3", "cpu") == H.HIGHEST
    with pytest.raises(ValueError, match="matmul must be one of"):
        lax_precision("fp8")


def _dots(jaxpr, primitive: str = "dot_general") -> list:
    """Every ``primitive`` equation of ``jaxpr`` and of the jaxprs nested in it."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == primitive:
            found.append(e)
        for sub in shared.sub_jaxprs(e):
            found += _dots(sub, primitive)
    return found


def test_tf32x3_reaches_the_speech_decoders_weight_products_alone(monkeypatch):
    """``tts_matmul='tf32_x3'``: on a GPU every weight product of the speech decoder's backbone
    (4 a layer in the serving layout) and of the MoG trunk (2 a layer, every head round) carries
    the three-pass algorithm, on fp32 operands; its attention and every other product keep the
    scope's. Off the GPU the policy's tick is the reference tick, op for op."""
    X3, HIGHEST = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, jax.lax.Precision.HIGHEST
    prec = Precision.tf32x3_tts_codec()
    assert Precision.reference().tts_product() is None  # the scope's, as before
    assert prec.tts_product("gpu") == X3
    assert prec.tts_product("cpu") == HIGHEST
    assert _lowered_tick(prec) == _lowered_tick(Precision.reference())

    params = voicechat.serving_layout(shared.params("fp32"))
    template = _abstract_template(params)
    lax_precision_gpu = functools.partial(lax_precision, platform="gpu")
    monkeypatch.setattr(precision_lib, "lax_precision", lambda m, _=None: lax_precision_gpu(m))
    step = functools.partial(voicechat.advance, cfg=CFG, precision=prec, deterministic=False)
    audio, key = jnp.zeros((1, 1280), jnp.float32), jax.random.key_data(jax.random.key(0))[None]
    dots = _dots(jax.make_jaxpr(step)(params, template, audio, key).jaxpr)
    x3 = [e for e in dots if e.params["precision"] == X3]
    t = CFG.tts
    assert len(x3) == 4 * t.n_layers + 2 * t.mog_mlp_layers * len(ear_tts.schedule(t))
    assert all(v.aval.dtype == jnp.float32 for e in x3 for v in e.invars)
    assert len(dots) > len(x3)  # the attention, the encoder, the LLM, the codec: as before


def test_pallas_tf32x3_reaches_the_encoder_the_speech_decoder_and_the_codec(monkeypatch):
    """``pallas_tf32x3_tts_codec``: on a GPU every weight product of the speech decoder's
    backbone and MoG trunk and every product of the codec's decoder trunk is one
    ``pallas_kernels.matmul`` call (traced here as on a GPU); ``pallas_tf32x3`` adds the
    Conformer layers'; nothing else is. In the interpreter the encoder's frames
    equal XLA's to fp32 summation order. Off the GPU the policies' tick is the reference tick,
    op for op."""
    both = Precision.pallas_tf32x3_tts_codec(), Precision.pallas_tf32x3()
    assert both[0].tts_product("gpu") is precision_lib.KernelProduct.TF32X3
    assert both[0].encoder_product("gpu") is None
    assert both[1].encoder_product("gpu") is precision_lib.KernelProduct.TF32X3
    assert both[1].encoder_product("cpu") == jax.lax.Precision.HIGHEST
    assert _lowered_tick(both[1]) == _lowered_tick(Precision.reference())

    params = voicechat.serving_layout(shared.params("fp32"))
    template = shared.initial_state(params, cfg=CFG, precision=Precision.fp32(), max_len=16)
    gpu = functools.partial(lax_precision, platform="gpu")
    monkeypatch.setattr(precision_lib, "lax_precision", lambda m, _=None: gpu(m))
    monkeypatch.setattr(codec, "lax_precision", lambda m, _=None: gpu(m))
    audio, key = jnp.zeros((1, 1280), jnp.float32), jax.random.key_data(jax.random.key(0))[None]

    def kernel_calls(precision):
        step = functools.partial(
            voicechat.advance, cfg=CFG, precision=precision, deterministic=False
        )
        jaxpr = jax.make_jaxpr(step)(params, template, audio, key).jaxpr
        return len(_dots(jaxpr, "pallas_call"))

    t, c = CFG.tts, CFG.codec
    stages = len(codec._decoder_dims(c))
    codec_products = stages * (1 + 2 * c.num_blocks) + 1  # upsampling, blocks, output
    tts_products = 4 * t.n_layers + 2 * t.mog_mlp_layers * len(ear_tts.schedule(t))
    assert kernel_calls(Precision.reference()) == 0
    assert kernel_calls(both[0]) == tts_products + codec_products
    # the CPU's layout scans the encoder's stacked layers: one layer's products in the body
    # (q, k and v apart: ten; a GPU's layout unrolls the layers and fuses q|k|v, eight a layer)
    assert kernel_calls(both[1]) == tts_products + codec_products + 10

    _assert_encoder_frames_match_fp32(params, template.encoder, "pallas_tf32x3")


def _assert_encoder_frames_match_fp32(params, enc, encoder_matmul: str) -> None:
    """Two frames of the encoder with its weight products under ``encoder_matmul`` (as
    ``lax_precision`` gives it where this runs) equal full fp32's to summation order."""
    samples = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2 * 1280)), jnp.float32)
    step = functools.partial(conformer.encoder_step, cfg=CFG.encoder)
    _, want, _ = step(params.encoder, enc, samples, precision=Precision.fp32())
    asked = dataclasses.replace(Precision.fp32(), encoder_matmul=encoder_matmul)
    _, got, _ = step(params.encoder, enc, samples, precision=asked)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_tf32x3_steps_reach_the_encoder_the_speech_decoder_and_the_codec(monkeypatch):
    """``tf32x3_steps``: on a GPU every product that ``pallas_tf32x3`` gives our kernel is one
    batched dot over steps of the contraction (``common.dense_in_steps``, traced here as on a
    GPU; the CPU runs the steps in full fp32), and the encoder's frames equal full fp32's to
    summation order. Off the GPU the policy's tick is the reference tick, op for op."""
    prec = Precision.tf32x3_steps()
    assert policy("tf32x3_steps") == prec
    steps = precision_lib.KernelProduct.TF32X3_STEPS
    assert prec.tts_product("gpu") is steps
    assert prec.encoder_product("gpu") is steps
    assert prec.encoder_product("cpu") == jax.lax.Precision.HIGHEST
    assert _lowered_tick(prec) == _lowered_tick(Precision.reference())

    params = voicechat.serving_layout(shared.params("fp32"))
    gpu = functools.partial(lax_precision, platform="gpu")
    monkeypatch.setattr(precision_lib, "lax_precision", lambda m, _=None: gpu(m))
    monkeypatch.setattr(codec, "lax_precision", lambda m, _=None: gpu(m))
    audio, key = jnp.zeros((1, 1280), jnp.float32), jax.random.key_data(jax.random.key(0))[None]
    step = functools.partial(voicechat.advance, cfg=CFG, precision=prec, deterministic=False)
    jaxpr = jax.make_jaxpr(step)(params, _abstract_template(params), audio, key).jaxpr
    # dense_in_steps's one batched dot: "mnd,ndf->nmf", the steps as its batch dimension
    stepped = [e for e in _dots(jaxpr) if e.params["dimension_numbers"][1] == ((1,), (0,))]
    t, c = CFG.tts, CFG.codec
    codec_products = len(codec._decoder_dims(c)) * (1 + 2 * c.num_blocks) + 1
    tts_products = 4 * t.n_layers + 2 * t.mog_mlp_layers * len(ear_tts.schedule(t))
    assert len(stepped) == tts_products + codec_products + 10  # the encoder: as pallas_tf32x3

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 3, 1152)), jnp.float32)  # steps of 128: 9
    w = jnp.asarray(rng.standard_normal((1152, 40)) / 34, jnp.float32)
    want = jnp.einsum("...i,io->...o", x, w, precision=jax.lax.Precision.HIGHEST)
    got = common.dense(x, w, precision=steps)
    assert got.shape == (2, 3, 40)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)

    enc = shared.initial_state(params, cfg=CFG, precision=Precision.fp32(), max_len=16).encoder
    _assert_encoder_frames_match_fp32(params, enc, "tf32_x3_steps")


def test_a_tf32_pair_product_has_fp32s_error():
    """``dense_tf32_pair``: both halves of the pair exact in TF32 (rounding them again changes
    nothing), the pair within 2^-21 of the weight, and the product's error against float64 at
    most 1.5x a full-fp32 product's at a speech decoder's shape (on the CPU)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 576)).astype(np.float32)
    w = (rng.standard_normal((576, 640)) / 24).astype(np.float32)
    pair = common.tf32_pair(jnp.asarray(w))
    tf32 = functools.partial(jax.lax.reduce_precision, exponent_bits=8, mantissa_bits=10)
    np.testing.assert_array_equal(tf32(pair), pair)
    hi, lo = np.split(np.asarray(pair, np.float64), 2, axis=-1)
    assert np.abs(hi + lo - w).max() <= 2.0**-21 * np.abs(w).max()
    ref = x.astype(np.float64) @ w.astype(np.float64)

    def err(y):
        return np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max()

    full = err(jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    y = common.dense(jnp.asarray(x)[None], common.TF32Pair(pair=pair))
    assert y.shape == (1, 48, 640)
    assert y.dtype == jnp.float32
    assert err(y[0]) <= 1.5 * full


def test_tf32_pair_reaches_the_speech_decoders_weight_products_alone():
    """``tts_matmul='tf32_pair'``: the serving layout pairs the backbone's four products a layer
    and the MoG trunk's two (and pairs nothing twice); each runs as one product of the split
    input (two roundings to TF32 each, every head round), the trunk's result within fp32
    rounding of the fp32 weights'."""
    prec = Precision.tf32pair_tts()
    assert prec.tts_product("gpu") is None  # the pairs carry their product
    fp32 = voicechat.serving_layout(shared.params("fp32"))
    params = voicechat.serving_layout(shared.params("fp32"), prec)
    b, m = params.tts.backbone, params.tts.mog
    for ws in (b.qkv, b.o, b.gate_up, b.down, m.gate_up, m.down):
        assert all(isinstance(w, common.TF32Pair) for w in ws)
    assert voicechat.serving_layout(params, prec).tts.mog.down[0] is m.down[0]
    t = CFG.tts
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, t.d_model)), jnp.float32)
    want = mog.trunk(fp32.tts.mog, x, cfg=t)
    np.testing.assert_allclose(mog.trunk(m, x, cfg=t), want, rtol=2e-5, atol=2e-5)

    template = _abstract_template(params)
    step = functools.partial(voicechat.advance, cfg=CFG, precision=prec, deterministic=False)
    audio, key = jnp.zeros((1, 1280), jnp.float32), jax.random.key_data(jax.random.key(0))[None]
    jaxpr = jax.make_jaxpr(step)(params, template, audio, key).jaxpr
    rounded = _dots(jaxpr, "reduce_precision")
    assert len(rounded) == 2 * (4 * t.n_layers + 2 * t.mog_mlp_layers * len(ear_tts.schedule(t)))


def test_the_policy_lives_in_serve_config():
    """``ServeConfig.precision``: faithful by default, a policy name or a ``Precision``."""
    assert ServeConfig().precision == Precision.reference()
    assert ServeConfig(precision="bf16_tts_kv").precision == Precision.bf16_tts_kv()
    assert ServeConfig(precision=Precision.tf32()).precision.matmul == "tensorfloat32"
    with pytest.raises(ValueError, match="precision must be one of"):
        ServeConfig(precision="fp8")


def _abstract_template(params):
    """The fresh-session state's shapes, for tests that only trace a frame (computing it op by
    op compiles some 500 primitives)."""
    return jax.eval_shape(
        lambda p: voicechat.initial_state(p, cfg=CFG, precision=Precision.fp32(), max_len=16),
        params,
    )


@functools.cache  # each policy's tick is lowered once for the file (the faithful one: 3 tests)
def _lowered_tick(precision: Precision) -> str:
    params = jax.eval_shape(lambda: voicechat.init(jax.random.key(0), CFG, precision))
    template = jax.eval_shape(
        lambda p: voicechat.initial_state(p, cfg=CFG, precision=precision, max_len=16), params
    )
    state = jax.eval_shape(lambda t: state_lib.from_template(t, SERVE.slots), template)
    beat = state_lib.empty_beat(SERVE.slots, 2 * 1280)
    return (
        step_lib.make_tick(CFG, dataclasses.replace(SERVE, precision=precision))
        .lower(params, state, template, beat, state_lib.masks_of(beat))
        .as_text()
    )


def test_the_policy_reaches_the_tick():
    """Faithful: every fp32 product is lowered at HIGHEST; TF32: only the explicit ones stay."""
    faithful = _lowered_tick(Precision.reference())
    fast = _lowered_tick(Precision.tf32())
    n_faithful, n_fast = faithful.count("HIGHEST"), fast.count("HIGHEST")
    assert n_fast > 0  # the codec's and the SSM's explicit HIGHEST products
    assert n_faithful > n_fast
    assert "HIGH," in fast or "HIGH]" in fast


def test_tf32_codec_reaches_only_the_codec_decoder():
    """``tf32_codec``: the codec decoder's products are lowered at HIGH (TF32 on a GPU), every
    other fp32 product of the tick stays at HIGHEST; ``decode_step`` alone has no HIGHEST left,
    and the codec's encoder (whose nearest-neighbour search flips codes under TF32) keeps it."""
    faithful = _lowered_tick(Precision.reference())
    codec_tf32 = _lowered_tick(Precision.tf32_codec())
    assert "HIGH," not in faithful
    assert "HIGH]" not in faithful
    n_high = codec_tf32.count("HIGH,") + codec_tf32.count("HIGH]")
    assert n_high > 0
    assert faithful.count("HIGHEST") - codec_tf32.count("HIGHEST") == n_high  # 2 per product each
    p = jax.eval_shape(lambda: codec.init(jax.random.key(0), CFG.codec, Precision.reference()))
    st = codec.init_state(CFG.codec, 2, Precision.reference())
    codes = jnp.zeros((2, 1, CFG.codec.n_quantizers), jnp.int32)
    decode = jax.jit(codec.decode_step, static_argnames=("cfg", "matmul"))
    lowered = decode.lower(p, st, codes, cfg=CFG.codec, matmul="tensorfloat32").as_text()
    assert "HIGHEST" not in lowered
    assert "HIGH" in lowered
    encode = jax.jit(codec.encode_latent_to_codes).lower(
        p, jnp.zeros((2, 1, CFG.codec.latent_size))
    )
    assert "HIGHEST" in encode.as_text()


def test_bf16_speech_decoder_kv_serves():
    params = shared.params(Precision.bf16_tts_kv())
    engine = Engine(params, CFG, dataclasses.replace(SERVE, precision="bf16_tts_kv"))
    assert {a.dtype for a in (*engine.state.model.tts.k, *engine.state.model.tts.v)} == {
        jnp.dtype(jnp.bfloat16)
    }
    beat = engine.empty_beat()
    beat.admit[:] = True
    beat.key[:] = np.arange(4, dtype=np.uint32).reshape(2, 2)
    beat.audio[:] = 0.1 * np.sin(np.arange(beat.audio.shape[1]) / 9.0)
    for _ in range(3):
        out = jax.device_get(engine.tick(beat))
        beat.admit[:] = False
    assert out.ran.all()
    assert np.all(np.isfinite(out.frames.wav))
