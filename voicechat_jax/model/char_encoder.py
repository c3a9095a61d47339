"""EarTTS's text side: NeMo's ``CharAwareSubwordEncoder``, one text token id -> one [D] embedding.

Mirrors ``nemo/collections/speechlm2/modules/ear_tts_model.py``:

- ``char_table`` is ``build_vocabs``: the char vocabulary is every single-character token of the
  text tokenizer, sorted by id; a token's char row is its characters that are in that vocabulary
  (others are skipped), padded with the char padding index ``len(char vocab)``
  (``cfg.char_vocab - 1``). Ids absent from the tokenizer get an all-padding row.
- ``encode`` is ``CharAwareSubwordEncoder.forward`` for valid (``subword_mask``) positions:
  ``embed_tokens`` then HF ``T5GemmaEncoderModel`` (``T5GemmaEncoder``: inputs scaled by
  ``sqrt(D)``; ``cas_layers`` bidirectional ``T5GemmaEncoderLayer``s with RoPE, padding-key mask,
  pre/post ``(1 + w)`` RMSNorms, GeGLU; then ``norm``), a masked mean over the chars,
  ``proj_embedding``, then ``SubwordFlagEmbedding`` (``cont_emb[is_continuation[id]]``) and
  ``BOSEOSEmbedding`` (``special_emb[special_flags[id]]``), each with its out-of-range clamp to
  its ``pad_tensor``.
- ``flags`` is those two additions alone: NeMo's output at a position whose ``subword_mask`` is
  False is zero plus the flags (the caller selects).
- ``subword_table`` evaluates ``encode`` for every id, since the result depends on the id only.

Notes on matching NeMo 3.0 exactly:

- The T5Gemma encoder's ``attn_logit_softcapping`` (50) is *not* applied by NeMo 3.0: it builds
  the encoder with HF's default ``sdpa`` attention, which ignores the softcap.
  ``cfg.cas_apply_softcap`` selects (False: as NeMo; True: as HF ``eager``).
- The one layer is a T5Gemma "sliding_attention" layer (bidirectional window 4096 by default);
  no token has that many chars, so the window never bites and is not applied.
- A token's length is its count of non-padding chars. NeMo's own padding subword
  (id ``V``, one padding char) is outside the table; its embedding row is zero in a trained model
  (``nn.Embedding(padding_idx=...)``), so it encodes as an empty row would (pooled zero).

Axes: ``V`` text ids, ``J`` chars per token, ``D`` model dim, ``N``/``K``/``H`` heads, ``F`` MLP
dim, ``L`` encoder layers (``cas_layers``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from voicechat_jax.config import BOS_ID, EOS_ID, SpeechDecoderConfig
from voicechat_jax.model.attention import masked_softmax
from voicechat_jax.model.common import fan_in_normal, normal, rms_norm
from voicechat_jax.model.gemma import apply_rope, rope_inv_freq
from voicechat_jax.precision import Precision


@struct.dataclass
class CharEncoderParams:
    """``CharAwareSubwordEncoder``'s weights and its int buffers (from the checkpoint)."""

    embed: jax.Array  # [char_vocab, D]  embed_tokens (the padding row, last, is zero)
    pre_attn_norm: jax.Array  # [L, D]  pre_self_attn_layernorm
    q: jax.Array  # [L, D, N*H]  self_attn.q_proj, transposed
    k: jax.Array  # [L, D, K*H]
    v: jax.Array  # [L, D, K*H]
    o: jax.Array  # [L, N*H, D]
    post_attn_norm: jax.Array  # [L, D]  post_self_attn_layernorm
    pre_ff_norm: jax.Array  # [L, D]  pre_feedforward_layernorm
    gate: jax.Array  # [L, D, F]  mlp.gate_proj, transposed
    up: jax.Array  # [L, D, F]
    down: jax.Array  # [L, F, D]
    post_ff_norm: jax.Array  # [L, D]  post_feedforward_layernorm
    final_norm: jax.Array  # [D]  backbone.encoder.norm
    proj: jax.Array  # [D, D]  proj_embedding, transposed
    cont_emb: jax.Array  # [2, D]  subword_flag_emb.cont_emb (row 0: word start, zero)
    special_emb: jax.Array  # [3, D]  bos_eos_emb.special_emb (rows: regular, BOS, EOS)
    is_continuation: jax.Array  # [V + 1] int32  subword_flag_emb.is_continuation
    special_flags: jax.Array  # [V] int32  bos_eos_emb.special_flags (0 / 1 BOS / 2 EOS)
    cont_pad: jax.Array  # [] int32  subword_flag_emb.pad_tensor (= V)
    special_pad: jax.Array  # [] int32  bos_eos_emb.pad_tensor (= V - 1, NeMo's max-id quirk)


def init(key: jax.Array, cfg: SpeechDecoderConfig, precision: Precision) -> CharEncoderParams:
    """Random weights at a sane scale; buffers laid out as for the Nemotron tokenizer's ids."""
    L, D, F, V = cfg.cas_layers, cfg.d_model, cfg.mlp_dim, cfg.text_vocab
    NH, KH = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    dt = precision.tts
    ks = iter(jax.random.split(key, 16))
    embed = normal(next(ks), (cfg.char_vocab, D), dt, 1.0).at[cfg.char_vocab - 1].set(0)
    special_flags = jnp.zeros((V,), jnp.int32).at[BOS_ID].set(1).at[EOS_ID].set(2)
    return CharEncoderParams(
        embed=embed,
        pre_attn_norm=normal(next(ks), (L, D), dt, 0.1),
        q=fan_in_normal(next(ks), (L, D, NH), dt, D),
        k=fan_in_normal(next(ks), (L, D, KH), dt, D),
        v=fan_in_normal(next(ks), (L, D, KH), dt, D),
        o=fan_in_normal(next(ks), (L, NH, D), dt, NH),
        post_attn_norm=normal(next(ks), (L, D), dt, 0.1),
        pre_ff_norm=normal(next(ks), (L, D), dt, 0.1),
        gate=fan_in_normal(next(ks), (L, D, F), dt, D),
        up=fan_in_normal(next(ks), (L, D, F), dt, D),
        down=fan_in_normal(next(ks), (L, F, D), dt, F),
        post_ff_norm=normal(next(ks), (L, D), dt, 0.1),
        final_norm=normal(next(ks), (D,), dt, 0.1),
        proj=fan_in_normal(next(ks), (D, D), dt, D),
        cont_emb=normal(next(ks), (2, D), dt, D**-0.5).at[0].set(0),
        special_emb=normal(next(ks), (3, D), dt, D**-0.5).at[0].set(0),
        is_continuation=jnp.zeros((V + 1,), jnp.int32),
        special_flags=special_flags,
        cont_pad=jnp.asarray(V, jnp.int32),
        special_pad=jnp.asarray(V - 1, jnp.int32),
    )


def abstract(cfg: SpeechDecoderConfig, precision: Precision) -> CharEncoderParams:
    """The params' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves); allocates nothing."""
    return jax.eval_shape(lambda k: init(k, cfg, precision), jax.random.key(0))


def load_vocab(tokenizer: str | os.PathLike | Mapping[str, int]) -> dict[str, int]:
    """A HF tokenizer's ``get_vocab()`` (model vocabulary plus added tokens) from its JSON.

    ``tokenizer``: a ``tokenizer.json`` path, a directory holding one, or a ready token -> id map.
    """
    if isinstance(tokenizer, Mapping):
        return dict(tokenizer)
    path = os.fspath(tokenizer)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model_vocab = spec["model"]["vocab"]
    if isinstance(model_vocab, list):  # Unigram: [[piece, score], ...], id = index
        vocab = {piece: i for i, (piece, _) in enumerate(model_vocab)}
    else:  # BPE / WordPiece / WordLevel: {piece: id}
        vocab = dict(model_vocab)
    for tok in spec.get("added_tokens", []):
        vocab[tok["content"]] = tok["id"]
    return vocab


def char_vocab(vocab: Mapping[str, int]) -> dict[str, int]:
    """``build_vocabs._build_char_vocab``: single-character tokens, sorted by id, numbered."""
    singles = sorted((i, tok) for tok, i in vocab.items() if len(tok) == 1)
    return {tok: n for n, (_, tok) in enumerate(singles)}


def char_table(tokenizer: str | os.PathLike | Mapping[str, int]) -> np.ndarray:
    """Every text id's char ids, [V, J] int32 padded with ``len(char vocab)``; ``V`` = max id + 1.

    Mirrors ``build_vocabs`` (without torch or NeMo): a row lists the token's characters that are
    in the char vocabulary, in order; ids with none (or absent) are all padding.
    """
    vocab = load_vocab(tokenizer)
    chars = char_vocab(vocab)
    pad = len(chars)
    rows = {i: [chars[c] for c in tok if c in chars] for tok, i in vocab.items()}
    width = max(1, max(len(r) for r in rows.values()))
    table = np.full((max(vocab.values()) + 1, width), pad, np.int32)
    for i, r in rows.items():
        table[i, : len(r)] = r
    return table


def flags(params: CharEncoderParams, ids: jax.Array) -> jax.Array:
    """``cont_emb[is_continuation[id]] + special_emb[special_flags[id]]`` [..., D] for ids [...].

    Ids past each table clamp to its ``pad_tensor`` (flag 0), as NeMo's ``torch.where`` does.
    """
    cont_ids = jnp.where(ids >= params.cont_pad, params.cont_pad, ids)
    special_ids = jnp.where(ids >= params.special_pad, params.special_pad, ids)
    cont = params.cont_emb[params.is_continuation[cont_ids]]
    return cont + params.special_emb[params.special_flags[special_ids]]


def _encoder_layer(params: CharEncoderParams, l: int, h, mask, positions, *, cfg):
    """One ``T5GemmaEncoderLayer``: h [I, J, D], mask [I, J] (real chars), positions [J]."""
    I, J, _ = h.shape
    G = cfg.n_heads // cfg.n_kv_heads
    eps = cfg.norm_eps
    y = rms_norm(h, params.pre_attn_norm[l], eps, offset=1.0)
    q = jnp.einsum("mcd,de->mce", y, params.q[l].astype(y.dtype))
    k = jnp.einsum("mcd,de->mce", y, params.k[l].astype(y.dtype))
    v = jnp.einsum("mcd,de->mce", y, params.v[l].astype(y.dtype))
    q = q.reshape(I, J, cfg.n_heads, cfg.head_dim)
    k = k.reshape(I, J, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(I, J, cfg.n_kv_heads, cfg.head_dim)
    inv = jnp.asarray(rope_inv_freq(cfg.cas_rope_base, cfg.head_dim))
    pos = jnp.broadcast_to(positions, (I, J))
    q, k = apply_rope(q, pos, inv), apply_rope(k, pos, inv)
    qg = q.reshape(I, J, cfg.n_kv_heads, G, cfg.head_dim)
    logits = jnp.einsum("mckgh,mskh->mkgcs", qg, k, preferred_element_type=jnp.float32)
    logits = logits * cfg.query_pre_attn_scalar**-0.5
    if cfg.cas_apply_softcap:
        logits = jnp.tanh(logits / cfg.cas_softcap) * cfg.cas_softcap
    # bidirectional; padding chars are masked as keys only (a row with no chars stays finite)
    probs = masked_softmax(logits, mask[:, None, None, None, :], q.dtype)
    a = jnp.einsum("mkgcs,mskh->mckgh", probs, v).reshape(I, J, cfg.n_heads * cfg.head_dim)
    a = jnp.einsum("mce,ed->mcd", a, params.o[l].astype(a.dtype))
    h = h + rms_norm(a, params.post_attn_norm[l], eps, offset=1.0)
    y = rms_norm(h, params.pre_ff_norm[l], eps, offset=1.0)
    g = jnp.einsum("mcd,df->mcf", y, params.gate[l].astype(y.dtype))
    u = jnp.einsum("mcd,df->mcf", y, params.up[l].astype(y.dtype))
    m = jnp.einsum(
        "mcf,fd->mcd", jax.nn.gelu(g, approximate=True) * u, params.down[l].astype(y.dtype)
    )
    return h + rms_norm(m, params.post_ff_norm[l], eps, offset=1.0)


def encode(
    params: CharEncoderParams, chars: jax.Array, ids: jax.Array, *, cfg: SpeechDecoderConfig
) -> jax.Array:
    """Text embeddings [..., D] of tokens ``ids`` [...] whose char rows are ``chars`` [..., J].

    ``chars`` are rows of ``char_table`` (``chars[...] = table[ids]``), padded with
    ``cfg.char_vocab - 1``. Equals NeMo's ``CharAwareSubwordEncoder(ids)`` at masked-in positions.
    """
    lead, J = chars.shape[:-1], chars.shape[-1]
    chars = chars.reshape(-1, J)  # [I, J]
    mask = chars != cfg.char_vocab - 1  # [I, J]
    dt = params.embed.dtype
    h = params.embed[chars] * jnp.asarray(cfg.d_model**0.5, dt)  # [I, J, D]
    positions = jnp.arange(J, dtype=jnp.int32)
    for l in range(cfg.cas_layers):
        h = _encoder_layer(params, l, h, mask, positions, cfg=cfg)
    h = rms_norm(h, params.final_norm, cfg.norm_eps, offset=1.0)
    maskf = mask[..., None].astype(h.dtype)
    count = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1).astype(h.dtype)  # [I, 1]
    pooled = jnp.sum(h * maskf, axis=1) / count  # [I, D]
    out = jnp.einsum("md,de->me", pooled, params.proj.astype(pooled.dtype))
    out = out + flags(params, ids.reshape(-1)).astype(out.dtype)
    return out.reshape(*lead, out.shape[-1])


def subword_table(
    params: CharEncoderParams,
    chars_table: jax.Array,
    *,
    cfg: SpeechDecoderConfig,
    chunk: int = 256,
) -> jax.Array:
    """``encode`` for every id 0..V-1: the [V, D] lookup table the step uses, ``chunk`` ids at once.

    ``chars_table`` is ``char_table(tokenizer)`` [V, J]; memory is bounded by ``chunk * J``
    positions per pass.
    """
    if isinstance(chars_table, np.ndarray) and chars_table.max(initial=0) > cfg.char_vocab - 1:
        raise ValueError(
            f"char ids up to {chars_table.max()} but cfg.char_vocab is {cfg.char_vocab}"
        )
    V, J = chars_table.shape
    n = -(-V // chunk)
    pad_rows = n * chunk - V
    chars = jnp.pad(
        jnp.asarray(chars_table), ((0, pad_rows), (0, 0)), constant_values=cfg.char_vocab - 1
    )
    ids = jnp.arange(n * chunk, dtype=jnp.int32)
    out = jax.lax.map(
        lambda a: encode(params, a[0], a[1], cfg=cfg),
        (chars.reshape(n, chunk, J), ids.reshape(n, chunk)),
    )
    return out.reshape(n * chunk, -1)[:V]
