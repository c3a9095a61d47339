"""The EarTTS speech decoder against NeMo 3.0's ``DuplexEARTTS`` / ``RVQEARTTSModel`` (fp32).

The reference is NeMo's own ``DuplexEARTTS`` built tiny (random weights, the tiny tokenizer, a
tiny codec), loaded into our params through the release key tables (``keys.tts`` +
``keys.tts_backbone``). The test config is ``tiny()`` with 12 quantizers, so that the refinement
runs 4 head rounds ({0}, {1}, {2}, {3..11}) instead of tiny's single one.

Exact-code comparisons use NeMo's deterministic setting (``top_p_or_k=1``, ``noise_scale=0``,
docs/model.md §8) or, for the faithful sampler, NeMo run on our own random draws
(``torch.rand_like`` / ``torch.randn_like`` patched to return them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import shared
from tests.reference.tiny_tokenizer import make_tiny_tokenizer
from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig, tiny, voicechat_11b
from voicechat_jax.keys import fill, to_layout, tts_backbone
from voicechat_jax.keys import tts as tts_keys
from voicechat_jax.model import char_encoder, ear_tts, mog
from voicechat_jax.model.common import count_params
from voicechat_jax.precision import Precision
from voicechat_jax.release_config import codec_config

_etm = functools.partial(shared.nemo_module, "nemo.collections.speechlm2.modules.ear_tts_model")


B = 2
MAX_LEN = 64
FP32 = Precision.fp32()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_config() -> ModelConfig:
    cfg = tiny()
    return dataclasses.replace(
        cfg,
        tts=dataclasses.replace(cfg.tts, n_quantizers=12),
        codec=dataclasses.replace(cfg.codec, n_quantizers=12),
    )


def nemo_config(cfg: ModelConfig, tokenizer_dir: str, log_dir: str) -> dict:
    """The ``speech_generation`` config ``NemotronVoiceChat`` hands to ``DuplexEARTTS``.

    Laid out as the release (docs/model.md §4): gated fusion, no EOS head, BOS/EOS and subword-flag
    embeddings, the frozen audio-prompt projection, a Gemma-3 backbone and a one-layer T5Gemma
    char encoder (both with HF's default attention implementation, as NeMo builds them).
    """
    t, c = cfg.tts, cfg.codec
    return {
        "data": {
            "target_sample_rate": c.sample_rate,
            "source_sample_rate": 16000,
            "frame_length": 0.08,
            "audio_prompt_duration": 3.0,
        },
        "exp_manager": {"explicit_log_dir": log_dir},
        "model": {
            "pretrained_lm_name": tokenizer_dir,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": f"<SPECIAL_{PAD_ID}>",
            "inference_guidance_scale": t.guidance_scale,
            "inference_noise_scale": t.noise_scale,
            "inference_top_p_or_k": t.top_p,
            "inference_force_speech_silence_on_eos": True,
            "codec_config": codec_config(c),
            "tts_config": tts_config(cfg),
        },
    }


def tts_config(cfg: ModelConfig, *, with_char_encoder: bool = True) -> dict:
    """``speech_generation.model.tts_config`` (``RVQEARTTSModel``'s config)."""
    t = cfg.tts
    cas = {
        "backbone_type": "t5gemma",
        "backbone_model_class": None,
        "backbone_config_class": None,
        "backbone_config": {
            "is_encoder_decoder": False,
            "encoder": {
                "hidden_size": t.d_model,
                "intermediate_size": t.mlp_dim,
                "num_hidden_layers": t.cas_layers,
                "num_attention_heads": t.n_heads,
                "num_key_value_heads": t.n_kv_heads,
                "head_dim": t.head_dim,
                "use_cache": False,
            },
        },
    }
    return {
        "use_gated_fusion_for_text_audio": True,
        "disable_eos_prediction": True,
        "use_bos_eos_emb": True,
        "use_subword_flag_emb": True,
        "num_delay_speech_tokens": 2,
        "use_audio_prompt_frozen_projection": True,
        "backbone_type": "gemma3_text",
        "backbone_model_class": None,
        "backbone_config_class": None,
        "backbone_config": {
            "hidden_size": t.d_model,
            "intermediate_size": t.mlp_dim,
            "num_hidden_layers": t.n_layers,
            "num_attention_heads": t.n_heads,
            "num_key_value_heads": t.n_kv_heads,
            "head_dim": t.head_dim,
            "sliding_window": t.sliding_window,
            "use_cache": False,
            "layer_types": [
                "full_attention" if g else "sliding_attention" for g in t.layer_is_global
            ],
        },
        "latent_size": t.latent_size,
        "codebook_size": t.codebook_size,
        "num_quantizers": t.n_quantizers,
        "context_hidden_size": None,
        "cas_config": cas if with_char_encoder else None,
        "mog_head_config": {
            "intermediate_size": t.mlp_dim,
            "num_layers": t.mog_mlp_layers,
            "low_rank": t.mog_rank,
            "num_predictions": t.mog_components,
            "min_log_std": t.mog_min_log_std,
            "eps": t.norm_eps,
        },
        "p_uncond": 0.1,
        "label_smoothing": 0.01,
        "max_training_rate": 0.8,
        "quantizer_dropout": 0.5,
        "random_target_masking": False,
        "exponent": t.exponent,
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights: vectors (norms, biases, gates, flag rows) ~0.3 N(0, 1), matrices
    ``N(0, 1 / fan_in)``. ``rvq_embs`` keeps the codec's codebooks it was copied from."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=gen)
            if p.ndim <= 1:
                p.copy_(0.3 * x)
            elif "embed_subword.embed_tokens" in name:
                x[-1] = 0  # the char padding row stays zero (nn.Embedding padding_idx)
                p.copy_(x)
            else:
                p.copy_(x / np.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return test_config()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, cfg) -> str:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), cfg.tts.text_vocab)


@pytest.fixture(scope="module")
def ref(cfg, tokenizer_dir, tmp_path_factory):
    from nemo.collections.speechlm2.models.duplex_ear_tts import DuplexEARTTS

    torch.manual_seed(0)
    log = str(tmp_path_factory.mktemp("log"))
    model = DuplexEARTTS(nemo_config(cfg, tokenizer_dir, log)).eval()
    _randomize(model.tts_model, 1)
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn((1, cfg.tts.prompt_frames, cfg.tts.d_model), generator=gen)
    model.audio_prompt_latents[cfg.tts.speaker_name] = torch.nn.Parameter(latent, False)
    return model


@pytest.fixture(scope="module")
def release_tensors(ref) -> dict[str, np.ndarray]:
    """The reference's ``DuplexEARTTS`` state dict under release names, codec left out."""
    return {
        f"tts_model.{k}": v.numpy()
        for k, v in ref.state_dict().items()
        if not k.startswith("audio_codec.")
    }


@pytest.fixture(scope="module")
def params(cfg, release_tensors, tokenizer_dir) -> ear_tts.TTSParams:
    rules = tts_keys.rules(cfg) + tts_backbone.rules(cfg)
    loaded = fill(
        ear_tts.abstract(cfg, FP32, text_table=False), rules, release_tensors, param_prefix="tts"
    )
    loaded = jax.tree_util.tree_map(jnp.asarray, loaded)
    chars = char_encoder.char_table(tokenizer_dir)
    return ear_tts.with_text_table(loaded, jnp.asarray(chars), cfg=cfg)


TEXT = np.array([BOS_ID, EOS_ID, PAD_ID, 300, 301, 450], np.int32)


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------


def test_drops_only_the_frozen_prompt_projection(cfg):
    dropped = [r.release for r in tts_keys.rules(cfg) if r.param is None]
    assert dropped == ["tts_model.tts_model.audio_prompt_projection_W"]


def test_embed_frame_matches_nemo(cfg, ref, params):
    tm = ref.tts_model
    n, Q, C = len(TEXT), cfg.tts.n_quantizers, cfg.tts.codebook_size
    rng = np.random.default_rng(3)
    prev = rng.integers(0, C, (n, Q)).astype(np.int32)
    prev[0] = C  # the mask frame
    prev[1, 5:] = C  # partly masked
    with torch.no_grad():
        code = torch.from_numpy(prev).long()[:, None]
        code_embeds = torch.cat([tm.embed_code(tm.depthsum_embedding(code))] * 2)
        ids = torch.from_numpy(TEXT).long()[:, None].repeat(2, 1)
        uncond = torch.cat([torch.zeros(n, 1, 1), torch.ones(n, 1, 1)]).bool()
        text = tm._prepare_conditioning(None, ids, torch.ones_like(ids).bool(), uncond, None)
        fused = tm.gated_fusion_audio_text(code_embeds, text)[:, 0].numpy()
    cond, unc = jax.jit(ear_tts.embed_frame, static_argnames="cfg")(
        params, jnp.asarray(prev), jnp.asarray(TEXT), cfg=cfg
    )
    err_c, err_u = rel_err(cond, fused[:n]), rel_err(unc, fused[n:])
    assert err_c <= 1e-5, err_c
    assert err_u <= 1e-5, err_u


def _head_input(cfg, n: int, seed: int) -> np.ndarray:
    return (
        np.random.default_rng(seed).standard_normal((2 * n, 1, cfg.tts.d_model)).astype(np.float32)
    )


def test_mog_head_matches_nemo(cfg, ref, params):
    """Trunk + CFG + logits, the chosen component's mean, and z with noise: against MoGHead."""
    t, head = cfg.tts, ref.tts_model.mog_head
    n = 5
    x = _head_input(cfg, n, 4)
    eps = np.random.default_rng(5).standard_normal((n, t.latent_size)).astype(np.float32)
    scale = 0.5  # large enough that the noise term is visible in z
    with torch.no_grad():
        xt = head.mlp_stack(torch.from_numpy(x))
        guided = xt[:n] + t.guidance_scale * (xt[:n] - xt[n:])
        ref_logits = head.proj_logits(guided)[:, 0].numpy()
        ref_mu, ref_logs = head.infer(
            torch.from_numpy(x), guidance_scale=t.guidance_scale, top_p_or_k=1
        )
        ref_z = ref_mu + torch.exp(ref_logs) * torch.from_numpy(eps)[:, None] * scale
    xj = mog.trunk(params.mog, jnp.asarray(x[:, 0]), cfg=t)
    xj = mog.guide(xj[:n], xj[n:], t.guidance_scale)
    logits = mog.logits(params.mog, xj)
    comp = mog.choose(logits, None, top_p=t.top_p, deterministic=True)
    mu = mog.sample_latent(params.mog, xj, comp, None, noise_scale=0.0, cfg=t)
    z = mog.sample_latent(params.mog, xj, comp, jnp.asarray(eps), noise_scale=scale, cfg=t)
    errs = {
        "logits": rel_err(logits, ref_logits),
        "mu": rel_err(mu, ref_mu[:, 0]),
        "z": rel_err(z, ref_z[:, 0]),
    }
    assert max(errs.values()) <= 1e-4, errs
    assert np.array_equal(np.asarray(comp), ref_logits.argmax(-1))


def test_top_p_filter_matches_transformers(cfg):
    from transformers.generation.logits_process import TopPLogitsWarper

    rng = np.random.default_rng(6)
    x = (3.0 * rng.standard_normal((16, cfg.tts.mog_components))).astype(np.float32)
    want = TopPLogitsWarper(cfg.tts.top_p)(None, torch.from_numpy(x)).numpy()
    got = np.asarray(mog.top_p_filter(jnp.asarray(x), cfg.tts.top_p))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert 0 < np.isinf(want).sum() < want.size  # the filter did drop some, not all
    assert np.array_equal(got[~np.isinf(got)], want[~np.isinf(want)])


@pytest.mark.parametrize("preset", ["voicechat_11b", "tiny", "test"])
def test_schedule_matches_nemo(preset):
    t = {"voicechat_11b": voicechat_11b, "tiny": tiny, "test": test_config}[preset]().tts
    rates = torch.linspace(0.0, 1.0, t.num_iter + 1)[:-1].unsqueeze(-1)
    nemo = torch.ceil(_etm().get_masking_rate(rates, exponent=t.exponent) * t.n_quantizers).long()
    assert ear_tts.masked_counts(t) == tuple(nemo[:, 0].tolist())
    if preset == "voicechat_11b":
        assert ear_tts.masked_counts(t) == (31, 31, 31, 31, 30, 29, 26, 22)
        assert ear_tts.schedule(t) == ((0, 1), (1, 1), (2, 3), (5, 4), (9, 22))  # 5 head rounds
    if preset == "tiny":
        assert ear_tts.schedule(t) == ((0, 3),)


def _nemo_generate(ref, h: np.ndarray, cfg, *, deterministic: bool, draws=None, monkeypatch=None):
    """``RVQEARTTSModel.generate_step`` on [cond; uncond] hidden states; records its rounds."""
    t = cfg.tts
    rounds = []
    real_step = _etm().depthsum_encoding_step

    def recording_step(embs, r, code, depth_str=0, k=72):
        rounds.append((depth_str, k))
        return real_step(embs, r, code, depth_str, k)

    monkeypatch.setattr(_etm(), "depthsum_encoding_step", recording_step)
    if draws is not None:
        u, eps = (iter(torch.from_numpy(np.asarray(a))) for a in draws)
        monkeypatch.setattr(torch, "rand_like", lambda x: next(u).view_as(x).to(x))
        monkeypatch.setattr(torch, "randn_like", lambda x: next(eps).view_as(x).to(x))
    with torch.no_grad():
        codes, _, _ = ref.tts_model.generate_step(
            torch.from_numpy(h),
            num_iter=t.num_iter,
            guidance_scale=t.guidance_scale,
            top_p_or_k=1 if deterministic else t.top_p,
            noise_scale=0.0 if deterministic else t.noise_scale,
            exponent=t.exponent,
        )
    monkeypatch.undo()
    return codes[:, 0].numpy(), tuple(rounds)


def test_generate_codes_deterministic_matches_nemo(cfg, ref, params, monkeypatch):
    n = 6
    h = _head_input(cfg, n, 7)
    want, rounds = _nemo_generate(ref, h, cfg, deterministic=True, monkeypatch=monkeypatch)
    assert rounds == ear_tts.schedule(cfg.tts) == ((0, 1), (1, 1), (2, 1), (3, 9))
    got = ear_tts.generate_codes(
        params, jnp.asarray(h[:n, 0]), jnp.asarray(h[n:, 0]), None, cfg=cfg, deterministic=True
    )
    np.testing.assert_array_equal(np.asarray(got), want)


def test_generate_codes_faithful_matches_nemo_on_same_draws(cfg, ref, params, monkeypatch):
    """Top-p 0.95, Gumbel-max and noise 0.001 as NeMo draws them, fed our per-row draws."""
    n = 6
    h = _head_input(cfg, n, 8)
    keys = jax.random.split(jax.random.key(9), n)
    draws = ear_tts.sampling_noise(keys, cfg=cfg)  # [R, n, E], [R, n, Z]
    shaped = (np.asarray(draws[0])[:, :, None], np.asarray(draws[1])[:, :, None])
    want, _ = _nemo_generate(
        ref, h, cfg, deterministic=False, draws=shaped, monkeypatch=monkeypatch
    )
    got = ear_tts.generate_codes(
        params, jnp.asarray(h[:n, 0]), jnp.asarray(h[n:, 0]), keys, cfg=cfg, deterministic=False
    )
    np.testing.assert_array_equal(np.asarray(got), want)


def test_faithful_rows_are_independent(cfg, params):
    """A row's codes depend on its own key only: alone == in a batch of 3 with other rows."""
    h = _head_input(cfg, 3, 10)
    keys = jax.random.split(jax.random.key(11), 3)
    gen = jax.jit(ear_tts.generate_codes, static_argnames=("cfg", "deterministic"))
    batch = gen(params, h[:3, 0], h[3:, 0], keys, cfg=cfg, deterministic=False)
    alone = gen(params, h[1:2, 0], h[4:5, 0], keys[1:2], cfg=cfg, deterministic=False)
    np.testing.assert_array_equal(np.asarray(batch[1]), np.asarray(alone[0]))
    other = gen(params, h[:3, 0], h[3:, 0], keys[::-1], cfg=cfg, deterministic=False)
    assert not np.array_equal(np.asarray(other[0]), np.asarray(batch[0]))  # keys matter


def test_replace_control_codes_matches_nemo(cfg, ref, params):
    from nemo.collections.speechlm2.models.duplex_ear_tts import replace_control_speech_codes

    C, Q = cfg.tts.codebook_size, cfg.tts.n_quantizers
    codes = np.random.default_rng(12).integers(0, C + 3, (4, 3, Q))
    want = replace_control_speech_codes(
        torch.from_numpy(codes), ref._control_codes, ref.codec_silence_tokens
    ).numpy()
    got = ear_tts.replace_control_codes(params, jnp.asarray(codes, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.array_equal(np.asarray(params.control_codes), [C + 2, C + 1, C])


# ---------------------------------------------------------------------------------------------
# Warm-up and frames
# ---------------------------------------------------------------------------------------------


def _prompt_codes(ref, cfg) -> np.ndarray:
    """The codec's codes of ``prompt_samples`` samples of silence, as ``set_init_inputs`` makes."""
    n = ear_tts.prompt_samples(cfg)
    with torch.no_grad():
        codes, _ = ref.audio_codec.encode(torch.zeros(1, 1, n), torch.tensor([n]))
    return codes[0].numpy().astype(np.int32)


# Text tokens per frame (frame 0 is the skipped one); EOS at frame 3 for slot 0, 2 for slot 1.
FRAMES = np.array(
    [[PAD_ID, BOS_ID, 300, EOS_ID, PAD_ID, 301], [PAD_ID, 450, EOS_ID, PAD_ID, 302, 12]],
    np.int32,
)


@pytest.fixture(scope="module")
def nemo_run(ref, cfg):
    """NeMo's warm-up and ``offline_inference`` loop (``infer_codes_one_step`` from t = 1)."""
    ref.set_init_inputs(speaker_name=cfg.tts.speaker_name)
    init = ref.get_init_inputs(B=B)
    init.update(use_cache=True, past_key_values=None, guidance_enabled=True)
    gen_cfg = ref._get_generation_config(True)
    gen_cfg.update(top_p_or_k=1, noise_scale=0.0)  # docs/model.md §8: deterministic
    with torch.no_grad():
        out = ref.tts_model(**init)
    cache = out.past_key_values
    warm = [(layer.keys.clone().numpy(), layer.values.clone().numpy()) for layer in cache.layers]
    code = init["code"][:, -1:]
    codes = np.zeros((B, FRAMES.shape[1], cfg.tts.n_quantizers), np.int64)
    for t in range(1, FRAMES.shape[1]):
        ids = torch.from_numpy(FRAMES[:, t : t + 1]).long()
        code, cache = ref.infer_codes_one_step(
            current_subword_id=ids,
            prev_subword_id=ids,
            current_subword_mask=torch.ones_like(ids).bool(),
            prev_audio_tokens=code,
            past_key_values=cache,
            guidance_enabled=True,
            generation_config=gen_cfg,
            ignore_eos_flag_stop=True,
        )
        codes[:, t] = code[:, 0].numpy()
    return init, warm, codes


@pytest.fixture(scope="module")
def warm_state(ref, cfg, params):
    return jax.jit(ear_tts.warmup_state, static_argnames=("cfg", "precision", "batch", "max_len"))(
        params,
        jnp.asarray(_prompt_codes(ref, cfg)),
        cfg=cfg,
        precision=FP32,
        batch=B,
        max_len=MAX_LEN,
    )


def test_prompt_codes_are_what_nemo_warms_up_with(ref, cfg, nemo_run):
    init, _, _ = nemo_run
    P, C = cfg.tts.prompt_frames, cfg.tts.codebook_size
    codes = _prompt_codes(ref, cfg)
    want = init["code"][0].numpy()
    np.testing.assert_array_equal(want[1 : P - 1], codes[1 : P - 1])
    assert np.all(want[0] == C)
    assert np.all(want[P - 1] == C)


def test_warmup_cache_matches_nemo(cfg, warm_state, nemo_run):
    """The prefill's keys/values of every layer (global layers whole, sliding ones as HF keeps)."""
    _, warm, _ = nemo_run
    P = cfg.tts.prompt_frames
    ours_k = np.stack([np.asarray(a) for a in warm_state.k], axis=2)  # [B, 2, L, K, S, H]
    ours_v = np.stack([np.asarray(a) for a in warm_state.v], axis=2)
    assert np.all(np.asarray(warm_state.pos) == P)
    for l, (k_ref, v_ref) in enumerate(warm):  # [2B, K, S_l, H], rows cond then uncond
        kept = k_ref.shape[2]
        for row in range(2):
            for b in range(B):
                k = ours_k[b, row, l, :, P - kept : P]
                v = ours_v[b, row, l, :, P - kept : P]
                err = max(rel_err(k, k_ref[row * B + b]), rel_err(v, v_ref[row * B + b]))
                assert err <= 1e-5, (l, row, b, err)
    assert {w[0].shape[2] for w in warm} == {P, cfg.tts.sliding_window - 1}  # both kinds checked


def _run_frames(params, state, cfg, *, deterministic: bool, keys=None, jit=True):
    step = ear_tts.tts_step
    if jit:
        step = jax.jit(step, static_argnames=("cfg", "deterministic"))
    out, dec = [], []
    for t in range(FRAMES.shape[1]):
        k = None if keys is None else jax.vmap(jax.random.fold_in)(keys, jnp.full(B, t))
        state, codes, for_codec = step(
            params, state, jnp.asarray(FRAMES[:, t]), k, cfg=cfg, deterministic=deterministic
        )
        out.append(np.asarray(codes))
        dec.append(np.asarray(for_codec))
    return state, np.stack(out, 1), np.stack(dec, 1)


def test_frames_match_nemo_offline_inference(cfg, params, warm_state, nemo_run):
    """Frame 0 skipped (zero codes), EOS -> silence input, deterministic codes equal NeMo's."""
    _, _, want = nemo_run
    state, codes, for_codec = _run_frames(params, warm_state, cfg, deterministic=True)
    np.testing.assert_array_equal(codes, want)
    assert np.all(codes[:, 0] == 0)
    np.testing.assert_array_equal(for_codec, codes)  # generated codes hold no control code
    assert np.all(np.asarray(state.pos) == cfg.tts.prompt_frames + FRAMES.shape[1] - 1)
    assert np.all(np.asarray(state.frame) == FRAMES.shape[1])


def test_frame_zero_leaves_the_cache_untouched(cfg, params, warm_state):
    state, codes, _ = jax.jit(ear_tts.tts_step, static_argnames=("cfg", "deterministic"))(
        params, warm_state, jnp.asarray(FRAMES[:, 0]), None, cfg=cfg, deterministic=True
    )
    for name in ("k", "v", "pos", "prev_codes"):
        np.testing.assert_array_equal(
            np.asarray(getattr(state, name)), np.asarray(getattr(warm_state, name))
        )
    assert np.all(np.asarray(codes) == 0)
    assert np.all(np.asarray(state.prev_codes) == cfg.tts.codebook_size)  # still the mask frame


def test_eos_replaces_this_steps_previous_codes(cfg, params, warm_state):
    """On EOS the step reads codec_silence_tokens whatever the previous codes were."""
    step = jax.jit(ear_tts.tts_step, static_argnames=("cfg", "deterministic"))
    state, _, _ = step(
        params, warm_state, jnp.asarray(FRAMES[:, 0]), None, cfg=cfg, deterministic=True
    )
    eos = jnp.full((B,), EOS_ID, jnp.int32)
    other = state.replace(prev_codes=jnp.zeros_like(state.prev_codes))
    a = step(params, state, eos, None, cfg=cfg, deterministic=True)
    b = step(params, other, eos, None, cfg=cfg, deterministic=True)
    silence = state.replace(
        prev_codes=jnp.broadcast_to(params.silence_codes, state.prev_codes.shape)
    )
    c = step(params, silence, jnp.full((B,), PAD_ID, jnp.int32), None, cfg=cfg, deterministic=True)
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1]))  # the text token still counts


def test_faithful_step_rows_independent_and_jit_equals_eager(cfg, params, ref):
    """tts_step, faithful sampler: a slot alone == the same slot among 3; jitted == eager."""
    warm = jax.jit(ear_tts.warmup_state, static_argnames=("cfg", "precision", "batch", "max_len"))
    prompt = jnp.asarray(_prompt_codes(ref, cfg))
    warm3 = warm(params, prompt, cfg=cfg, precision=FP32, batch=3, max_len=MAX_LEN)
    keys = jax.random.split(jax.random.key(13), 3)
    texts = jnp.asarray([[PAD_ID, 300, 301], [PAD_ID, 450, EOS_ID], [PAD_ID, BOS_ID, 302]])
    step = jax.jit(ear_tts.tts_step, static_argnames=("cfg", "deterministic"))
    s3, s1, s_eager = warm3, jax.tree_util.tree_map(lambda x: x[1:2], warm3), warm3
    for t in range(texts.shape[1]):
        k = jax.vmap(jax.random.fold_in)(keys, jnp.full(3, t))
        s3, c3, _ = step(params, s3, texts[:, t], k, cfg=cfg, deterministic=False)
        s1, c1, _ = step(params, s1, texts[1:2, t], k[1:2], cfg=cfg, deterministic=False)
        np.testing.assert_array_equal(np.asarray(c3[1]), np.asarray(c1[0]))
        if t < 2:  # eager is slow: frame 0 (skipped) and one real frame
            s_eager, ce, _ = ear_tts.tts_step(
                params, s_eager, texts[:, t], k, cfg=cfg, deterministic=False
            )
            np.testing.assert_array_equal(np.asarray(c3), np.asarray(ce))
            assert rel_err(s_eager.k, s3.k) <= 1e-6
    assert len({tuple(r) for r in np.asarray(c3).tolist()}) == 3  # rows did differ


# ---------------------------------------------------------------------------------------------
# Full size
# ---------------------------------------------------------------------------------------------


def test_full_size_shapes_and_count_match_nemo():
    """voicechat_11b: our rules fit NeMo's RVQEARTTSModel shapes; the counts close exactly."""
    cfg = voicechat_11b()
    t = cfg.tts
    with torch.device("meta"):
        model = _etm().RVQEARTTSModel(_dict_config(tts_config(cfg, with_char_encoder=False)))
        model.set_rvq_embs(torch.empty(t.n_quantizers, t.codebook_size, t.latent_size))
    nemo = {f"tts_model.tts_model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    nemo[f"tts_model.audio_prompt_latents.{t.speaker_name}"] = (1, t.prompt_frames, t.d_model)
    nemo["tts_model.codec_silence_tokens"] = (t.n_quantizers,)
    nemo["tts_model._control_codes"] = (3,)
    ours = ear_tts.abstract(cfg, Precision.reference(), text_table=False)
    rules = tts_keys.rules(cfg) + tts_backbone.backbone_rules(cfg)
    assert {r.release for r in rules} == set(nemo)  # every NeMo tensor has a rule and vice versa
    for r in rules:  # shapes fit (without allocating: to_layout on zero-stride views)
        if r.param is None:
            continue
        slot = ours
        for name in r.param.split(".")[1:]:
            slot = getattr(slot, name)
        torch_like = np.broadcast_to(np.zeros((), np.float32), nemo[r.release])
        assert to_layout(torch_like, r.layout).shape == slot.shape[len(r.index) :], r.release
    n_nemo = sum(int(np.prod(s)) for s in nemo.values())
    dropped = t.d_model * t.d_model  # audio_prompt_projection_W
    n_ours = count_params(ours) - count_params(ours.char_encoder)
    assert n_ours + dropped == n_nemo
    # The char encoder as NeMo builds it: HF's T5Gemma encoder (its token embedding replaced by
    # the char embedding), proj_embedding, the 2 + 3 flag rows and the int buffers
    # (is_continuation [V + 1], special_flags [V], two scalar pad_tensors).
    from transformers import AutoConfig, AutoModelForTextEncoding

    enc_cfg = tts_config(cfg)["cas_config"]["backbone_config"]
    with torch.device("meta"):
        enc = AutoModelForTextEncoding.from_config(AutoConfig.for_model("t5gemma", **enc_cfg))
    n_enc = sum(p.numel() for n, p in enc.named_parameters() if "embed_tokens" not in n)
    D, V = t.d_model, t.text_vocab
    n_cas = n_enc + t.char_vocab * D + D * D + 5 * D + (V + 1) + V + 2
    assert count_params(ours.char_encoder) == n_cas
    # docs/model.md §1 "797 M": every tensor of tts_model.tts_model (buffers included)
    extras = ours.prompt_latents.size + ours.silence_codes.size + ours.control_codes.size
    total = n_nemo - extras + n_cas
    assert total == count_params(ours) + dropped - extras
    assert round(total / 1e6) == 797, total


def _dict_config(d: dict):
    from omegaconf import DictConfig

    return DictConfig(d)
