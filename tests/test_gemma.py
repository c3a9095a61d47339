"""The EarTTS Gemma-3 backbone against HF ``Gemma3TextModel`` (random weights, fp32)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers  # its models load when first named (lazily), not at collection

from voicechat_jax.config import SpeechDecoderConfig, tiny, voicechat_11b
from voicechat_jax.keys import fill
from voicechat_jax.keys.tts_backbone import BACKBONE, backbone_rules
from voicechat_jax.model import common, gemma
from voicechat_jax.model.common import count_params
from voicechat_jax.precision import KernelProduct, Precision

B = 2
PREFILL = 20
STEPS = 10
TOTAL = PREFILL + STEPS  # > tiny sliding window (8): sliding layers drop early positions
S = 32


def hf_config(cfg: SpeechDecoderConfig) -> transformers.Gemma3TextConfig:
    """The ``Gemma3TextConfig`` NeMo builds from the release's ``backbone_config``."""
    return transformers.Gemma3TextConfig(
        vocab_size=16,  # embed_tokens is deleted by NeMo; any size
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        sliding_window=cfg.sliding_window,
        layer_types=["full_attention" if g else "sliding_attention" for g in cfg.layer_is_global],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_base},
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_global_base},
        },
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=4096,
        attn_implementation="eager",
    )


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def setup():
    cfg = tiny()
    tcfg = cfg.tts
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(hf_config(tcfg)).eval()
    del model.embed_tokens  # as NeMo's find_and_delete_module does
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    tensors = {f"{BACKBONE}.{k}": v.numpy() for k, v in model.state_dict().items()}
    params = fill(
        gemma.abstract(tcfg, Precision.fp32()),
        backbone_rules(cfg),
        tensors,
        param_prefix="tts.backbone",
    )
    params = jax.tree_util.tree_map(jnp.asarray, params)
    x = np.random.default_rng(0).standard_normal((B, TOTAL, tcfg.d_model)).astype(np.float32)
    with torch.no_grad():
        ref = model(inputs_embeds=torch.from_numpy(x)).last_hidden_state.numpy()
    return cfg, model, params, x, ref


def run_prefill_then_steps(params, cfg, x, fwd, steps=STEPS):
    cache = gemma.init_cache(cfg, x.shape[0], S, Precision.fp32())
    cache, h = fwd(params, cache, jnp.asarray(x[:, :PREFILL]))
    outs = [h]
    for t in range(PREFILL, PREFILL + steps):
        cache, h = fwd(params, cache, jnp.asarray(x[:, t : t + 1]))
        outs.append(h)
    return cache, np.concatenate([np.asarray(o) for o in outs], axis=1)


def test_matches_hf_full_sequence(setup):
    cfg, _, params, x, ref = setup
    fwd = jax.jit(gemma.forward, static_argnames="cfg")
    cache, h = run_prefill_then_steps(
        params, cfg.tts, x, lambda p, c, xx: fwd(p, c, xx, cfg=cfg.tts)
    )
    assert np.all(np.asarray(cache.pos) == TOTAL)
    err = rel_err(h, ref)
    assert err <= 1e-4, err
    # one pass over the whole sequence (no cache use) is the same function
    _, h_full = fwd(
        params, gemma.init_cache(cfg.tts, B, S, Precision.fp32()), jnp.asarray(x), cfg=cfg.tts
    )
    err_full = rel_err(h_full, ref)
    assert err_full <= 1e-4, err_full


def test_matches_hf_with_cache(setup):
    cfg, model, params, x, _ = setup
    with torch.no_grad():
        past = transformers.DynamicCache(config=model.config)
        out = model(
            inputs_embeds=torch.from_numpy(x[:, :PREFILL]), past_key_values=past, use_cache=True
        )
        refs = [out.last_hidden_state.numpy()]
        for t in range(PREFILL, TOTAL):
            out = model(
                inputs_embeds=torch.from_numpy(x[:, t : t + 1]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            refs.append(out.last_hidden_state.numpy())
    ref = np.concatenate(refs, axis=1)
    fwd = jax.jit(gemma.forward, static_argnames="cfg")
    _, h = run_prefill_then_steps(params, cfg.tts, x, lambda p, c, xx: fwd(p, c, xx, cfg=cfg.tts))
    err = rel_err(h, ref)
    assert err <= 1e-4, err


def test_serving_layout_matches_hf_and_the_stored_layout(setup):
    """``per_layer``'s fused q|k|v and gate|up products give HF's outputs, and on the CPU the
    stored layout's bit for bit."""
    cfg, _, params, x, ref = setup
    fwd = jax.jit(gemma.forward, static_argnames="cfg")

    def run(p):
        return run_prefill_then_steps(p, cfg.tts, x, lambda p, c, xx: fwd(p, c, xx, cfg=cfg.tts))[1]

    serving = gemma.per_layer(params)
    assert serving.q is None
    assert len(serving.qkv) == cfg.tts.n_layers
    h = run(serving)
    assert rel_err(h, ref) <= 1e-4
    np.testing.assert_array_equal(h, run(params))
    # the ``tf32pair_tts`` layout: the four products by TF32 pairs meet HF's bar as well
    paired = common.tf32_pairs(serving, ("qkv", "o", "gate_up", "down"))
    assert isinstance(paired.down[0], common.TF32Pair)
    assert rel_err(run(paired), ref) <= 1e-4
    # ``tts_matmul='pallas_tf32x3'`` on a GPU: every weight product in ``pallas_kernels.matmul``
    # (full-fp32 steps in the Pallas interpreter here)
    kernel = jax.jit(
        functools.partial(gemma.forward, product=KernelProduct.TF32X3), static_argnames="cfg"
    )
    h = run_prefill_then_steps(serving, cfg.tts, x, lambda p, c, xx: kernel(p, c, xx, cfg=cfg.tts))
    assert rel_err(h[1], ref) <= 1e-4


def test_jit_equals_eager(setup):
    cfg, _, params, x, _ = setup
    eager = lambda p, c, xx: gemma.forward(p, c, xx, cfg=cfg.tts)  # noqa: E731
    jitted = jax.jit(eager)
    c1, h1 = run_prefill_then_steps(params, cfg.tts, x, eager, steps=2)
    c2, h2 = run_prefill_then_steps(params, cfg.tts, x, jitted, steps=2)
    assert rel_err(h2, h1) <= 1e-6
    assert rel_err(c2.k, c1.k) <= 1e-6


def test_rows_at_different_positions(setup):
    """Row 0 prefilled with 20 positions, row 1 with 13 (a valid prefix): then 10 shared steps,
    one of which row 1 skips. Each row must equal itself run alone, and a skipped row's cache must
    stay bit-identical."""
    cfg, _, params, x, _ = setup
    tcfg = cfg.tts
    fwd = jax.jit(gemma.forward, static_argnames="cfg")
    n1 = 13
    cache = gemma.init_cache(tcfg, B, S, Precision.fp32())
    valid = np.ones((B, PREFILL), bool)
    valid[1, n1:] = False
    cache, h = fwd(params, cache, jnp.asarray(x[:, :PREFILL]), cfg=tcfg, valid=jnp.asarray(valid))
    assert list(np.asarray(cache.pos)) == [PREFILL, n1]
    got = [[np.asarray(h[0, :PREFILL])], [np.asarray(h[1, :n1])]]
    steps = np.random.default_rng(1).standard_normal((B, STEPS, tcfg.d_model)).astype(np.float32)
    skip = 4
    for t in range(STEPS):
        step_valid = np.array([True, t != skip])
        before = jax.tree_util.tree_map(lambda a: np.asarray(a[1]), cache)
        cache, h = fwd(
            params, cache, jnp.asarray(steps[:, t : t + 1]), cfg=tcfg, valid=jnp.asarray(step_valid)
        )
        if t == skip:
            after = jax.tree_util.tree_map(lambda a: np.asarray(a[1]), cache)
            for field in ("k", "v", "pos"):
                np.testing.assert_array_equal(getattr(before, field), getattr(after, field))
        for r in range(B):
            if step_valid[r]:
                got[r].append(np.asarray(h[r]))
    for r, n in enumerate([PREFILL, n1]):
        row_steps = [t for t in range(STEPS) if r == 0 or t != skip]
        xs = np.concatenate([x[r : r + 1, :n], steps[r : r + 1, row_steps]], axis=1)
        _, alone = fwd(
            params, gemma.init_cache(tcfg, 1, S, Precision.fp32()), jnp.asarray(xs), cfg=tcfg
        )
        err = rel_err(np.concatenate(got[r], axis=0), np.asarray(alone[0]))
        assert err <= 1e-5, (r, err)


def test_full_size_param_count():
    tcfg = voicechat_11b().tts
    ours = count_params(gemma.abstract(tcfg, Precision.reference()))
    with torch.device("meta"):
        model = transformers.Gemma3TextModel(hf_config(tcfg))
    del model.embed_tokens
    theirs = sum(p.numel() for p in model.parameters())
    assert ours == theirs
    release = {f"{BACKBONE}.{k}" for k in model.state_dict()}
    assert release == {r.release for r in backbone_rules(voicechat_11b())}
    assert ours == 28 * (4 * 1152 * 1152 + 3 * 1152 * 4608 + 4 * 1152 + 2 * 72) + 1152
