"""The hybrid LLM (``model.nano``) against transformers' ``NemotronHForCausalLM`` (torch path).

The reference is built from a config matching ``tiny().llm`` with random non-trivial weights,
loaded into our params through the release key table (``keys.llm``). Its ``time_step_min`` is set
tiny: transformers clamps dt there, the release does not (docs/model.md §8, "Mamba dt").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers  # its models load when first named (lazily), not at collection

from voicechat_jax.config import PAD_ID, tiny, voicechat_11b
from voicechat_jax.keys import KeyRule, fill
from voicechat_jax.keys import llm as llm_keys
from voicechat_jax.model import nano
from voicechat_jax.model.common import count_params
from voicechat_jax.precision import Precision

B, T = 2, 12
MAX_LEN = 16
# The invariants run jitted (compiled once per shape); ``test_jit_equals_eager`` checks eager too.
PREFILL = jax.jit(nano.prefill, static_argnames=("cfg", "chunk"))
STEP = jax.jit(nano.step, static_argnames=("cfg",))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def hf_config(cfg, time_step_min: float) -> transformers.NemotronHConfig:
    c = cfg.llm
    return transformers.NemotronHConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        hybrid_override_pattern=c.pattern,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.mlp_dim,
        mamba_num_heads=c.mamba_heads,
        mamba_head_dim=c.mamba_head_dim,
        ssm_state_size=c.ssm_state,
        n_groups=c.n_groups,
        conv_kernel=c.conv_kernel,
        layer_norm_epsilon=c.norm_eps,
        time_step_min=time_step_min,
        chunk_size=5,  # several chunks (and a ragged last one) in the reference's own scan
        attn_implementation="eager",
    )


def randomize(model: torch.nn.Module) -> None:
    """Non-trivial weights: norms near 1, biases non-zero, dt on both sides of 1e-3."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith("dt_bias"):
                p.uniform_(-10.0, 0.5)  # softplus from 4.5e-5 to 0.97
            elif name.endswith("mixer.D"):
                p.normal_(1.0, 0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("conv1d.bias"):
                p.normal_(0.0, 0.1)
            elif "embeddings" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            else:  # Linear [out, in]: unit-scale outputs (transformers' init is std 0.02)
                p.normal_(0.0, p.shape[1] ** -0.5)
        # One group of heads per Mamba layer lives on small dt alone (dt < 1e-3, almost no D skip):
        # the gated norm rescales its output, so a dt clamp would show at full size.
        for layer in model.model.layers:
            if hasattr(layer.mixer, "dt_bias"):
                group = layer.mixer.num_heads // layer.mixer.n_groups
                layer.mixer.dt_bias[:group].uniform_(-10.0, -8.0)
                layer.mixer.D[:group].normal_(0.0, 0.01)


def release_names(model: transformers.NemotronHForCausalLM, function_head: torch.nn.Linear) -> dict:
    """The torch state dict under the release's names (NeMo moves the embedding out of the LLM)."""
    out = {}
    for k, v in model.state_dict().items():
        if k == "model.embeddings.weight":
            k = "stt_model.embed_tokens.weight"
        elif k == "lm_head.weight":
            k = "stt_model.lm_head.weight"
        else:
            k = "stt_model.llm." + k.removeprefix("model.")
        out[k] = v.detach().numpy()
    out["stt_model.function_head.weight"] = function_head.weight.detach().numpy()
    return out


def load(cfg, tensors: dict, precision: Precision) -> nano.NanoParams:
    abstract = nano.abstract(cfg.llm, precision)
    params = fill(abstract, llm_keys.rules(cfg), tensors, param_prefix="llm")
    return jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope="module")
def ref():
    """The torch reference, our params loaded from its weights, inputs and reference outputs."""
    cfg = tiny()
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(hf_config(cfg, time_step_min=1e-30)).eval()
    randomize(model)
    function_head = torch.nn.Linear(cfg.llm.d_model, cfg.llm.vocab_size, bias=False)
    tensors = release_names(model, function_head)
    x = torch.randn(B, T, cfg.llm.d_model)
    with torch.no_grad():
        full = model.model(inputs_embeds=x).last_hidden_state
        cache = transformers.DynamicCache(config=model.config)
        frames = [
            model.model(
                inputs_embeds=x[:, t : t + 1], past_key_values=cache, use_cache=True
            ).last_hidden_state
            for t in range(T)
        ]
        stepped = torch.cat(frames, 1)
        text_logits, func_logits = model.lm_head(full), function_head(full)
    return {
        "cfg": cfg,
        "model": model,
        "tensors": tensors,
        "params": load(cfg, tensors, Precision.fp32()),
        "x": x.numpy(),
        "full": full.numpy(),
        "stepped": stepped.numpy(),
        "text_logits": text_logits.numpy(),
        "func_logits": func_logits.numpy(),
    }


def run_prefill(params, cfg, x, precision=None, lengths=None, chunk=nano.DEFAULT_CHUNK, fn=PREFILL):
    state = nano.init_state(cfg.llm, x.shape[0], MAX_LEN, precision or Precision.fp32())
    return fn(params, state, jnp.asarray(x), lengths, cfg=cfg.llm, chunk=chunk)


def run_steps(params, cfg, x, precision=None, fn=STEP):
    step_fn = functools.partial(fn, cfg=cfg.llm)
    state = nano.init_state(cfg.llm, x.shape[0], MAX_LEN, precision or Precision.fp32())
    outs = []
    for t in range(x.shape[1]):
        state, h = step_fn(params, state, jnp.asarray(x[:, t]))
        outs.append(h)
    return state, jnp.stack(outs, 1)


@pytest.fixture(scope="module")
def ours(ref):
    cfg, params, x = ref["cfg"], ref["params"], ref["x"]
    return {"prefill": run_prefill(params, cfg, x), "steps": run_steps(params, cfg, x)}


# ----------------------------------------------------------------------------- parity with torch


@pytest.mark.parametrize("chunk", [5, nano.DEFAULT_CHUNK])
def test_prefill_matches_transformers(ref, chunk):
    _, hidden = run_prefill(ref["params"], ref["cfg"], ref["x"], chunk=chunk)
    assert rel_err(hidden, ref["full"]) <= 1e-4


def test_step_matches_transformers_cached(ref, ours):
    _, hidden = ours["steps"]
    assert rel_err(hidden, ref["stepped"]) <= 1e-4


def test_heads_match_transformers(ref, ours):
    _, hidden = ours["prefill"]
    text, func = nano.heads(ref["params"], hidden)
    assert rel_err(text, ref["text_logits"]) <= 1e-4
    assert rel_err(func, ref["func_logits"]) <= 1e-4
    text_t, func_t = nano.greedy(ref["params"], hidden)
    np.testing.assert_array_equal(text_t, np.argmax(ref["text_logits"], -1))
    np.testing.assert_array_equal(func_t, np.argmax(ref["func_logits"], -1))


def test_dt_is_not_clamped(ref, ours):
    """transformers with its default ``time_step_min`` (1e-3) clamps small dt: we must not match it.

    The random dt_bias puts many heads' dt below 1e-3, so the clamp changes the result by far more
    than the parity tolerance; this shows the parity tests would catch a clamp.
    """
    clamped = transformers.NemotronHForCausalLM(hf_config(ref["cfg"], time_step_min=1e-3)).eval()
    clamped.load_state_dict(ref["model"].state_dict())
    with torch.no_grad():
        full = clamped.model(inputs_embeds=torch.from_numpy(ref["x"])).last_hidden_state.numpy()
    _, hidden = ours["prefill"]
    assert rel_err(hidden, full) > 1e-2


def test_input_embedding_matches_nemo_sum(ref):
    """NeMo's sum: audio * user_w + E[text] * text_w (+ E[func] * 2.0, the release's channel)."""
    cfg, params = ref["cfg"], ref["params"]
    rng = np.random.default_rng(1)
    text = rng.integers(0, cfg.llm.vocab_size, (B, T))
    func = rng.integers(0, cfg.llm.vocab_size, (B, T))
    text[:, 0] = func[:, 0] = PAD_ID
    audio = rng.standard_normal((B, T, cfg.llm.d_model)).astype(np.float32)
    emb = torch.nn.Embedding.from_pretrained(
        torch.from_numpy(ref["tensors"]["stt_model.embed_tokens.weight"])
    )
    with torch.no_grad():
        want = torch.from_numpy(audio) * cfg.llm.user_weight
        want += emb(torch.from_numpy(text)) * cfg.llm.text_weight
        want += emb(torch.from_numpy(func)) * cfg.llm.function_weight
    got = nano.input_embedding(params, text, func, audio, cfg.llm)
    assert cfg.llm.function_weight == 2.0
    assert got.dtype == jnp.float32
    assert rel_err(got, want.numpy()) <= 1e-6


# ----------------------------------------------------------------------------- invariants


def test_step_equals_prefill(ours):
    """T single-frame steps == one T-frame prefill: hidden states and the whole final state."""
    state_p, hidden_p = ours["prefill"]
    state_s, hidden_s = ours["steps"]
    assert rel_err(hidden_s, hidden_p) <= 1e-5
    for name in ("ssm", "conv", "k", "v"):
        assert rel_err(getattr(state_s, name), getattr(state_p, name)) <= 1e-5, name
    np.testing.assert_array_equal(state_s.length, [T, T])
    np.testing.assert_array_equal(state_p.length, [T, T])


def test_prefill_continues_and_respects_lengths(ref, ours):
    """prefill(6) then prefill(6) == prefill(12); a padded slot's state ignores its padding."""
    cfg, params, x = ref["cfg"], ref["params"], ref["x"]
    half = T // 2
    state_full, hidden_full = ours["prefill"]
    state_half, h1 = run_prefill(params, cfg, x[:, :half])
    state, h2 = PREFILL(params, state_half, jnp.asarray(x[:, half:]), cfg=cfg.llm)
    assert rel_err(jnp.concatenate([h1, h2], 1), hidden_full) <= 1e-5
    for name in ("ssm", "conv", "k", "v"):
        assert rel_err(getattr(state, name), getattr(state_full, name)) <= 1e-5, name

    # slot 1 holds only `half` real frames, then junk that must not leak into its state
    junk = x.copy()
    junk[1, half:] = 100.0
    state_pad, hidden_pad = run_prefill(params, cfg, junk, lengths=jnp.array([T, half]))
    np.testing.assert_array_equal(state_pad.length, [T, half])
    assert rel_err(hidden_pad[0], hidden_full[0]) <= 1e-6
    assert rel_err(hidden_pad[1, :half], h1[1]) <= 1e-6
    for name in ("ssm", "conv", "k", "v"):
        pad_1, half_1 = (
            jax.tree.map(lambda a: a[1], getattr(st, name)) for st in (state_pad, state_half)
        )
        assert rel_err(pad_1, half_1) <= 1e-6, name
    # ... and the next frame carries on as if the padding had never been there
    nxt = jnp.asarray(x[:, half])
    _, after_pad = STEP(params, state_pad, nxt, cfg=cfg.llm)
    _, after_half = STEP(params, state_half, nxt, cfg=cfg.llm)
    assert rel_err(after_pad[1], after_half[1]) <= 1e-6
    assert rel_err(after_half, ours["steps"][1][:, half]) <= 1e-5


def test_jit_equals_eager(ref, ours):
    cfg, params, x = ref["cfg"], ref["params"], ref["x"]
    _, hidden = run_steps(params, cfg, x[:, :2], fn=nano.step)
    assert rel_err(hidden, ours["steps"][1][:, :2]) <= 1e-6
    _, hidden = run_prefill(params, cfg, x, fn=nano.prefill)
    assert rel_err(hidden, ours["prefill"][1]) <= 1e-6


def test_bf16_reference_precision(ref, ours):
    """The serving policy (bf16 weights/activations/KV, fp32 residual and SSM state) stays close."""
    cfg, x = ref["cfg"], ref["x"]
    precision = Precision.reference()
    params = load(cfg, ref["tensors"], precision)
    assert params.mamba.in_proj.dtype == jnp.bfloat16
    assert params.mamba.A_log.dtype == jnp.float32
    state, hidden = run_prefill(params, cfg, x, precision)
    assert {a.dtype for a in state.ssm} == {jnp.dtype(jnp.float32)}
    assert {a.dtype for a in state.k} == {jnp.dtype(jnp.bfloat16)}
    assert np.all(np.isfinite(hidden))
    assert rel_err(hidden, ours["prefill"][1]) <= 5e-2
    _, hidden_s = run_steps(params, cfg, x, precision)
    assert np.all(np.isfinite(hidden_s))
    assert rel_err(hidden_s, ours["steps"][1]) <= 5e-2
    assert rel_err(hidden_s, hidden) <= 5e-2
    text, func = nano.heads(params, hidden)
    assert text.dtype == jnp.float32
    assert np.all(np.isfinite(text))
    assert np.all(np.isfinite(func))


def test_init_keeps_unit_scale(ref):
    """``init``'s random model (used by pipeline tests) keeps hidden states and logits near 1."""
    cfg = ref["cfg"]
    params = nano.init(jax.random.key(0), cfg.llm, Precision.fp32())
    abstract = nano.abstract(cfg.llm, Precision.fp32())
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(
        lambda a: (a.shape, a.dtype), abstract
    )
    pad = jnp.full((B, T), PAD_ID)
    e = nano.input_embedding(params, pad, pad, jnp.asarray(ref["x"]), cfg.llm)
    _, hidden = run_prefill(params, cfg, e)
    text, func = nano.heads(params, hidden)
    for a in (hidden, text, func):
        assert 0.3 < float(jnp.std(a)) < 3.0


# ----------------------------------------------------------------------------- full-size shapes


def test_release_shapes_and_key_table():
    """``jax.eval_shape`` on the 11B preset: 7,713,822,208 backbone params + 3 x [131072, 4480]."""
    cfg = voicechat_11b()
    abstract = nano.abstract(cfg.llm, Precision.reference())
    mats = (abstract.embed, abstract.lm_head, abstract.function_head)
    assert [m.shape for m in mats] == [(131072, 4480), (4480, 131072), (4480, 131072)]
    assert count_params(abstract) - sum(m.size for m in mats) == 7_713_822_208
    assert abstract.mamba.in_proj.shape == (27, 4480, 22656)
    assert abstract.mamba.conv_w.shape == (27, 4, 12288)
    assert abstract.mlp.up.shape == (25, 4480, 15680)
    assert abstract.attn.q.shape == (4, 4480, 5120)

    rules = llm_keys.rules(cfg)
    assert len(rules) == 342
    assert sum(r.release.startswith("stt_model.llm.") for r in rules) == 339
    assert [r.release for r in rules if r.release.startswith("stt_model.llm.layers.14.")] == [
        f"stt_model.llm.layers.14.{n}"
        for n in ("norm.weight", *(f"mixer.{m}_proj.weight" for m in "qkvo"))
    ]
    # every parameter slot of the abstract tree is named by exactly one rule (nothing loaded)
    slots = {}
    for r in rules:
        slots.setdefault(r.param, []).append(r.index)
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    for path, leaf in leaves:
        name = "llm." + ".".join(k.name for k in path)
        idx = slots.pop(name)
        if name.split(".")[1] in ("mamba", "mlp", "attn"):  # stacked: one rule per layer
            assert sorted(idx) == [(j,) for j in range(leaf.shape[0])], name
        else:
            assert idx == [()], name
    assert not slots


def test_key_table_names_match_transformers(ref):
    """Our release names are exactly transformers' state-dict names (plus NeMo's moves)."""
    cfg = ref["cfg"]
    assert {r.release for r in llm_keys.rules(cfg)} == set(ref["tensors"])
    assert all(isinstance(r, KeyRule) for r in llm_keys.rules(cfg))
