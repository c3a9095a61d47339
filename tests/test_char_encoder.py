"""EarTTS's char-aware text encoder against NeMo's ``CharAwareSubwordEncoder`` (random, fp32)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.reference.tiny_tokenizer import make_tiny_tokenizer
from voicechat_jax.config import SpeechDecoderConfig, tiny, voicechat_11b
from voicechat_jax.keys import fill
from voicechat_jax.keys.tts_backbone import CHAR_ENCODER, char_encoder_rules
from voicechat_jax.model import char_encoder
from voicechat_jax.precision import Precision


def nemo_encoder(cfg: SpeechDecoderConfig, tokenizer):
    """The module as ``RVQEARTTSModel`` builds it from ``cas_config`` (T5Gemma, one layer): a
    NeMo ``CharAwareSubwordEncoder`` (NeMo imported here, not when the file is collected: its
    import takes ~13 s, and every pytest-xdist worker collects every file)."""
    from nemo.collections.speechlm2.modules.ear_tts_model import CharAwareSubwordEncoder
    from omegaconf import OmegaConf

    encoder = {
        "vocab_size": 16,  # its embed_tokens is deleted by NeMo; any size
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.cas_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar),
        "attn_logit_softcapping": cfg.cas_softcap,
    }
    backbone_config = OmegaConf.create({"encoder": encoder, "is_encoder_decoder": False})
    return CharAwareSubwordEncoder(
        out_size=cfg.d_model,
        tokenizer=tokenizer,
        backbone_type="t5gemma",
        backbone_config=backbone_config,
    )


encode = jax.jit(char_encoder.encode, static_argnames="cfg")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from nemo.collections.common.tokenizers import AutoTokenizer

    cfg = tiny()
    tcfg = cfg.tts
    tok_dir = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), cfg.llm.vocab_size)
    tokenizer = AutoTokenizer(tok_dir)
    torch.manual_seed(0)
    module = nemo_encoder(tcfg, tokenizer).eval()
    rope = module.backbone.config.encoder.rope_parameters["rope_theta"]
    assert rope == tcfg.cas_rope_base
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                # large attention logits, so that the softcap visibly matters
                p.copy_(4.0 * torch.randn_like(p) / np.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
        module.embed_tokens.weight[module.char_padding_idx] = 0  # padding_idx row, as trained
    tensors = {f"{CHAR_ENCODER}.{k}": v.numpy() for k, v in module.state_dict().items()}
    params = fill(
        char_encoder.abstract(tcfg, Precision.fp32()),
        char_encoder_rules(cfg),
        tensors,
        param_prefix="tts.char_encoder",
    )
    params = jax.tree_util.tree_map(jnp.asarray, params)
    table = char_encoder.char_table(tok_dir)
    return cfg, tokenizer, tok_dir, module, params, table


def token_ids(tokenizer) -> np.ndarray:
    """A [2, 12] batch: <unk>, BOS, EOS, PAD and other specials, single chars, word starts
    ('Ġ' and '▁'), continuations, and the last id (which NeMo's BOS/EOS table treats as OOV)."""
    vocab = tokenizer.tokenizer.get_vocab()
    multi = sorted((t for t in vocab if len(t) > 1 and not t.startswith("<")), key=vocab.get)
    word_starts = sorted((t for t in multi if t[0] == "Ġ"), key=len, reverse=True)[:5]
    pieces = [t for t in multi if t[0] == "▁"][:2]
    continuations = [t for t in multi if t[0] not in "Ġ▁"][:5]
    singles = ["a", "Ġ", "~"]
    pick = [0, 1, 2, 3, 12, 20, 22, max(vocab.values())]
    pick += [vocab[t] for t in singles + word_starts + pieces + continuations]
    assert len(set(pick)) == len(pick) == 23
    pick.append(vocab[word_starts[0]])  # a repeat
    return np.array(pick, np.int64).reshape(2, 12)


def test_char_table_matches_build_vocabs(setup):
    from nemo.collections.speechlm2.modules.ear_tts_model import build_vocabs

    cfg, tokenizer, _, _, _, table = setup
    id_to_chars, chars, subword_pad = build_vocabs(tokenizer)
    assert len(chars) + 1 == cfg.tts.char_vocab
    assert table.shape[0] == subword_pad == cfg.llm.vocab_size
    assert table.shape[1] == max(len(v) for k, v in id_to_chars.items() if k != subword_pad)
    for i in range(table.shape[0]):
        want = list(id_to_chars.get(i, ()))
        row = table[i]
        assert list(row[: len(want)]) == want, i
        assert np.all(row[len(want) :] == len(chars)), i


def test_encode_matches_nemo(setup):
    cfg, tokenizer, _, module, params, table = setup
    ids = token_ids(tokenizer)
    with torch.no_grad():
        ref = module(torch.from_numpy(ids)).numpy()
    got = encode(params, jnp.asarray(table[ids]), jnp.asarray(ids), cfg=cfg.tts)
    err = rel_err(got, ref)
    assert err <= 1e-4, err
    # masked-out positions: NeMo adds the flag embeddings to zeros
    mask = np.ones(ids.shape, bool)
    mask[:, ::3] = False
    with torch.no_grad():
        ref_m = module(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    want = np.where(mask[..., None], np.asarray(got), np.asarray(char_encoder.flags(params, ids)))
    err_m = rel_err(want, ref_m)
    assert err_m <= 1e-4, err_m


def test_softcap_as_hf_eager(setup):
    """With ``cas_apply_softcap`` the encoder equals HF's eager T5Gemma attention (which applies
    the softcap); the default equals NeMo's (sdpa, no softcap), and the two visibly differ."""
    cfg, tokenizer, _, module, params, table = setup
    ids = token_ids(tokenizer)
    attn_cfg = module.backbone.encoder.config
    assert attn_cfg._attn_implementation == "sdpa"  # what NeMo 3.0 runs
    attn_cfg._attn_implementation = "eager"
    try:
        with torch.no_grad():
            ref = module(torch.from_numpy(ids)).numpy()
    finally:
        attn_cfg._attn_implementation = "sdpa"
    capped = dataclasses.replace(cfg.tts, cas_apply_softcap=True)
    got = encode(params, jnp.asarray(table[ids]), jnp.asarray(ids), cfg=capped)
    err = rel_err(got, ref)
    assert err <= 1e-4, err
    plain = encode(params, jnp.asarray(table[ids]), jnp.asarray(ids), cfg=cfg.tts)
    assert rel_err(plain, ref) > 1e-3


def test_subword_table_equals_encode(setup):
    cfg, tokenizer, _, module, params, table = setup
    V = table.shape[0]
    full = char_encoder.subword_table(params, table, cfg=cfg.tts, chunk=96)  # 512 = 5*96 + 32
    assert full.shape == (V, cfg.tts.d_model)
    direct = encode(params, jnp.asarray(table), jnp.arange(V, dtype=jnp.int32), cfg=cfg.tts)
    err = rel_err(full, direct)
    assert err <= 1e-6, err
    ids = token_ids(tokenizer)
    with torch.no_grad():
        ref = module(torch.from_numpy(ids)).numpy()
    err_lookup = rel_err(np.asarray(full)[ids], ref)
    assert err_lookup <= 1e-4, err_lookup


def test_jit_equals_eager(setup):
    cfg, tokenizer, _, _, params, table = setup
    ids = token_ids(tokenizer)
    chars, jids = jnp.asarray(table[ids]), jnp.asarray(ids)
    eager = char_encoder.encode(params, chars, jids, cfg=cfg.tts)
    jitted = jax.jit(char_encoder.encode, static_argnames="cfg")(params, chars, jids, cfg=cfg.tts)
    assert rel_err(jitted, eager) <= 1e-6


def test_full_size_param_count(setup):
    """Float parameters equal NeMo's module at full size (built on the meta device; the tiny
    tokenizer also has 256 single-char tokens, so the char embedding has the release's 257 rows)."""
    _, tokenizer, _, _, _, _ = setup
    tcfg = voicechat_11b().tts
    shapes = char_encoder.abstract(tcfg, Precision.reference())
    leaves = jax.tree_util.tree_leaves(shapes)
    ours = sum(int(x.size) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))
    with torch.device("meta"):
        module = nemo_encoder(tcfg, tokenizer)
    theirs = sum(p.numel() for p in module.parameters())
    assert ours == theirs
    release = {f"{CHAR_ENCODER}.{k}" for k in module.state_dict()}
    assert release == {r.release for r in char_encoder_rules(voicechat_11b())}
    D, F = 1152, 4608
    assert ours == 257 * D + 4 * D * D + 3 * D * F + 4 * D + D + D * D + 5 * D
    assert shapes.is_continuation.shape == (131073,)
    assert shapes.special_flags.shape == (131072,)
