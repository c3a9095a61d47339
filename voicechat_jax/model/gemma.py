"""The EarTTS speech-decoder backbone: a Gemma-3 text decoder fed with embeddings, with a KV cache.

Mirrors ``transformers.models.gemma3.modeling_gemma3.Gemma3TextModel`` as NeMo's
``RVQEARTTSModel`` builds and calls it (``nemo/collections/speechlm2/modules/ear_tts_model.py``):
``embed_tokens`` is deleted (``find_and_delete_module``) and the model is always called with
``inputs_embeds``. Gemma-3 scales by ``sqrt(D)`` inside its embedding module
(``Gemma3TextScaledWordEmbedding``), not in ``Gemma3TextModel.forward``, so embeddings passed in
directly are *not* scaled, and neither are they here.

Per layer ``i`` (``Gemma3DecoderLayer``), all norms Gemma's ``(1 + w)`` RMSNorm in fp32:

    a = o(attn(rope(q_norm(q(input_norm(x)))), rope(k_norm(k(input_norm(x)))), v(input_norm(x))))
    x = x + post_attn_norm(a)
    x = x + post_ff_norm(down(gelu_tanh(gate(pre_ff_norm(x))) * up(pre_ff_norm(x))))

then ``final_norm``. Layer ``i`` is global iff ``(i + 1) % global_every == 0``: RoPE base
``rope_global_base`` and full causal attention; the others use ``rope_local_base`` and a causal
sliding window of ``sliding_window`` positions including the query's own (a key at position ``j``
is seen from position ``p`` iff ``p - window < j <= p``, HF's ``sliding_window_overlay``). The
attention scale is ``query_pre_attn_scalar ** -0.5``; there is no logit softcap. The layer kind is
data (a per-layer RoPE table and window); the layers are unrolled, each with its own cache leaf.

The cache is a plain array of ``S`` positions per slot (no ring buffer): position ``p`` lives at
index ``p``, and the sliding window is applied by the mask, so a sliding layer keeps (and reads)
more than it needs. ``S`` must cover the longest session: a write past ``S`` is dropped. NeMo's
``DynamicCache`` keeps ``window - 1`` positions for sliding layers; the attention is the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from voicechat_jax.config import SpeechDecoderConfig
from voicechat_jax.model import common
from voicechat_jax.model.attention import attend, gqa
from voicechat_jax.model.common import dense, fan_in_normal, normal, rms_norm
from voicechat_jax.precision import Precision, ProductPrecision

# A window wider than any cache: global layers attend to everything before them.
_NO_WINDOW = np.iinfo(np.int32).max


@struct.dataclass
class GemmaParams:
    """``Gemma3TextModel`` without ``embed_tokens``; per-layer weights stacked on ``L``.

    In the serving layout (``per_layer``) ``q``, ``k``, ``v``, ``gate`` and ``up`` are None and
    ``qkv`` and ``gate_up`` hold them fused, ``o`` and ``down`` are tuples of L layers; as stored
    (checkpoints, the key table) the two fused fields are None.
    """

    input_norm: jax.Array  # [L, D]  input_layernorm
    q: jax.Array  # [L, D, N*H]  self_attn.q_proj, transposed
    k: jax.Array  # [L, D, K*H]  self_attn.k_proj, transposed
    v: jax.Array  # [L, D, K*H]  self_attn.v_proj, transposed
    o: jax.Array  # [L, N*H, D]  self_attn.o_proj, transposed
    q_norm: jax.Array  # [L, H]  self_attn.q_norm
    k_norm: jax.Array  # [L, H]  self_attn.k_norm
    post_attn_norm: jax.Array  # [L, D]  post_attention_layernorm
    pre_ff_norm: jax.Array  # [L, D]  pre_feedforward_layernorm
    gate: jax.Array  # [L, D, F]  mlp.gate_proj, transposed
    up: jax.Array  # [L, D, F]  mlp.up_proj, transposed
    down: jax.Array  # [L, F, D]  mlp.down_proj, transposed
    post_ff_norm: jax.Array  # [L, D]  post_feedforward_layernorm
    final_norm: jax.Array  # [D]  norm
    qkv: tuple[jax.Array, ...] | None = None  # L x [D, (N + 2K) * H]  q | k | v (serving)
    gate_up: tuple[jax.Array, ...] | None = None  # L x [D, 2F]  gate | up (serving)


_LAYER_FIELDS = (
    "input_norm",
    "q",
    "k",
    "v",
    "o",
    "q_norm",
    "k_norm",
    "post_attn_norm",
    "pre_ff_norm",
    "gate",
    "up",
    "down",
    "post_ff_norm",
)


def per_layer(params: GemmaParams) -> GemmaParams:
    """The serving layout (``common.per_layer``): the products that share an input fused, one
    per layer (``qkv``, ``gate_up``), ``o`` and ``down`` one leaf per layer."""
    return common.per_layer(
        params, ("o", "down"), fused={"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
    )


@struct.dataclass
class GemmaCache:
    """Keys (after RoPE) and values of every layer, per slot; slot axis first.

    One leaf per layer, each [B, K, S, H] (a whole buffer per layer, the layout a decode attention
    reads: each slot's head is one contiguous [S, H] block).
    """

    k: tuple[jax.Array, ...]  # L x [B, K, S, H]  position p of a slot at index p
    v: tuple[jax.Array, ...]  # L x [B, K, S, H]
    pos: jax.Array  # [B] int32: positions already in the cache (the next position's index)


def init(key: jax.Array, cfg: SpeechDecoderConfig, precision: Precision) -> GemmaParams:
    """Random weights at a sane scale (norm weights near 0, i.e. scales near 1)."""
    L, D, F = cfg.n_layers, cfg.d_model, cfg.mlp_dim
    NH, KH, H = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
    dt = precision.tts
    ks = iter(jax.random.split(key, 16))
    return GemmaParams(
        input_norm=normal(next(ks), (L, D), dt, 0.1),
        q=fan_in_normal(next(ks), (L, D, NH), dt, D),
        k=fan_in_normal(next(ks), (L, D, KH), dt, D),
        v=fan_in_normal(next(ks), (L, D, KH), dt, D),
        o=fan_in_normal(next(ks), (L, NH, D), dt, NH),
        q_norm=normal(next(ks), (L, H), dt, 0.1),
        k_norm=normal(next(ks), (L, H), dt, 0.1),
        post_attn_norm=normal(next(ks), (L, D), dt, 0.1),
        pre_ff_norm=normal(next(ks), (L, D), dt, 0.1),
        gate=fan_in_normal(next(ks), (L, D, F), dt, D),
        up=fan_in_normal(next(ks), (L, D, F), dt, D),
        down=fan_in_normal(next(ks), (L, F, D), dt, F),
        post_ff_norm=normal(next(ks), (L, D), dt, 0.1),
        final_norm=normal(next(ks), (D,), dt, 0.1),
    )


def abstract(cfg: SpeechDecoderConfig, precision: Precision) -> GemmaParams:
    """The params' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves); allocates nothing."""
    return jax.eval_shape(lambda k: init(k, cfg, precision), jax.random.key(0))


def init_cache(
    cfg: SpeechDecoderConfig, batch: int, max_len: int, precision: Precision
) -> GemmaCache:
    """An empty cache of ``max_len`` positions for ``batch`` slots."""
    shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    dt = precision.tts_kv
    return GemmaCache(
        k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers)),
        v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers)),
        pos=jnp.zeros((batch,), jnp.int32),
    )


def rope_inv_freq(base: float, head_dim: int) -> np.ndarray:
    """``1 / base ** (2i / H)`` in fp32, as HF's ``compute_default_rope_parameters`` makes it."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(base) ** exponent)).astype(np.float32)  # [H/2]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """HF's ``apply_rotary_pos_emb`` (rotate-half layout) on ``x`` [B, T, N, H], computed in fp32.

    ``positions`` [B, T] int32, ``inv_freq`` [H/2] fp32.
    """
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def layer_kinds(cfg: SpeechDecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer RoPE inverse frequencies [L, H/2] and attention windows [L] (int32)."""
    inv = np.stack(
        [
            rope_inv_freq(cfg.rope_global_base if g else cfg.rope_local_base, cfg.head_dim)
            for g in cfg.layer_is_global
        ]
    )
    window = np.array(
        [_NO_WINDOW if g else cfg.sliding_window for g in cfg.layer_is_global], np.int32
    )
    return inv, window


def forward(
    params: GemmaParams,
    cache: GemmaCache,
    x: jax.Array,
    *,
    cfg: SpeechDecoderConfig,
    valid: jax.Array | None = None,
    attention: str = "xla",
    product: ProductPrecision = None,
    beside=None,
) -> tuple[GemmaCache, jax.Array]:
    """Runs ``T`` new positions per slot through the backbone, reading and extending the cache.

    Row ``b``'s new positions are ``cache.pos[b] .. cache.pos[b] + T - 1``, so slots at different
    positions share one call. ``T = 1`` is one decoding step, ``T = prompt length`` a prefill.
    The layers are unrolled (each has its own cache leaf, written in place).

    Args:
      params: the backbone weights.
      cache: the KV cache; ``cache.pos[b] + T`` must not exceed ``S`` (later writes are dropped).
      x: [B, T, D] input embeddings (already fused; no scaling is applied).
      cfg: the speech-decoder config (static under ``jit``).
      valid: optional [B, T] (or [B]) bool, a per-row prefix of the ``T`` positions that are real.
        Only those are written to the cache and counted in ``pos``; a row with none leaves its
        cache bit-identical. Outputs at invalid positions are computed but meaningless.
      attention: the decode step's attention implementation (``attention.attend``, T = 1 only;
        'xla' is bit-identical to the masked softmax below).
      product: the weight products' ``precision=`` (static; ``Precision.tts_product``), None for
        the scope's. The attention's own products keep the scope's.
      beside: a ``model.beside.Beside`` whose products ride in the decode step's attention
        launches, one a layer (T = 1 only; the caller finishes it), or None.

    Returns:
      (the new cache, h [B, T, D] the final-norm hidden states).
    """
    B, T, _ = x.shape
    S = cache.k[0].shape[2]
    K, H = cfg.n_kv_heads, cfg.head_dim
    G = cfg.n_heads // K
    if valid is None:
        valid = jnp.ones((B, T), bool)
    elif valid.ndim == 1:
        valid = jnp.broadcast_to(valid[:, None], (B, T))
    positions = cache.pos[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    # An index of S is out of bounds: the scatter drops it (invalid or overflowing positions).
    write_at = jnp.where(valid, positions, S)  # [B, T]
    rows = jnp.arange(B)[:, None]  # [B, 1]
    key_pos = jnp.arange(S, dtype=jnp.int32)  # [S]
    causal = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    distance = positions[:, :, None] - key_pos[None, None, :]  # [B, T, S]
    inv_freq, window = layer_kinds(cfg)
    scale = cfg.query_pre_attn_scalar**-0.5
    eps = cfg.norm_eps
    masks = {int(w): causal & (distance < w) for w in set(window.tolist())}  # [B, T, S] per kind

    h = x
    ks, vs = list(cache.k), list(cache.v)
    for l in range(cfg.n_layers):
        w = {f: getattr(params, f)[l] for f in _LAYER_FIELDS if getattr(params, f) is not None}
        inv = jnp.asarray(inv_freq[l])
        y = rms_norm(h, w["input_norm"], eps, offset=1.0)
        if params.qkv is not None:  # the serving layout: one product, its columns split
            qkv = dense(y, params.qkv[l], precision=product)
            q, k, v = jnp.split(qkv, [cfg.n_heads * H, (cfg.n_heads + K) * H], axis=-1)
        else:
            q = dense(y, w["q"], precision=product)
            k = dense(y, w["k"], precision=product)
            v = dense(y, w["v"], precision=product)
        q = q.reshape(B, T, cfg.n_heads, H)
        k, v = k.reshape(B, T, K, H), v.reshape(B, T, K, H)
        q = apply_rope(rms_norm(q, w["q_norm"], eps, offset=1.0), positions, inv)
        k = apply_rope(rms_norm(k, w["k_norm"], eps, offset=1.0), positions, inv)
        # Advanced indices on axes 0 and 2 around a slice: the update is [B, T, K, H].
        ks[l] = ks[l].at[rows, :, write_at].set(k.astype(ks[l].dtype), mode="drop")
        vs[l] = vs[l].at[rows, :, write_at].set(v.astype(vs[l].dtype), mode="drop")
        qg = q.reshape(B, T, K, G, H)
        if T == 1:
            win = None if int(window[l]) == _NO_WINDOW else int(window[l])
            step = attend if beside is None else beside.attend
            a = step(
                qg[:, 0], ks[l], vs[l], positions[:, 0] + 1, window=win, scale=scale, impl=attention
            )
        else:
            mask = masks[int(window[l])][:, None, None]  # [B, 1, 1, T, S]
            a = gqa(qg, ks[l], vs[l], mask, scale=scale)
        a = a.reshape(B, T, cfg.n_heads * H)
        a = dense(a, w["o"], precision=product)
        h = h + rms_norm(a, w["post_attn_norm"], eps, offset=1.0)
        y = rms_norm(h, w["pre_ff_norm"], eps, offset=1.0)
        if params.gate_up is not None:
            gu = dense(y, params.gate_up[l], precision=product)
            g, u = jnp.split(gu, 2, axis=-1)
        else:
            g = dense(y, w["gate"], precision=product)
            u = dense(y, w["up"], precision=product)
        m = dense(jax.nn.gelu(g, approximate=True) * u, w["down"], precision=product)
        h = h + rms_norm(m, w["post_ff_norm"], eps, offset=1.0)
    h = rms_norm(h, params.final_norm, eps, offset=1.0)
    pos = cache.pos + jnp.sum(valid, axis=-1, dtype=jnp.int32)
    return GemmaCache(k=tuple(ks), v=tuple(vs), pos=pos), h
