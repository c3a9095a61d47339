"""EarTTS, the speech decoder: per-frame input fusion, CFG backbone step, MoG head + RVQ refinement.

Mirrors NeMo 3.0 (``nemo/collections/speechlm2``) as ``NemotronVoiceChat.offline_inference``
runs it:

- ``embed_frame``: ``RVQEARTTSModel.forward`` at inference. The audio side is
  ``embed_code(depthsum_embedding(prev_codes))`` (``rvq_embs`` rows summed over the ``Q``
  quantizers; the mask id ``codebook_size`` reads NeMo's appended zero row); the text side is the
  char-aware subword embedding of the frame's text token, ``null_emb`` on the unconditional row
  (``_prepare_conditioning``); both go through ``GatedProjectedSumRMSNorm`` (``fuse``), which
  divides the audio side by 31 (``cfg.tts.fusion_audio_divisor``: the module's default
  ``num_codebooks``, never overridden: ``RVQEARTTSModel`` passes ``num_quantizers`` positionally
  into its ``final_norm`` flag; 31 is also the release's ``Q``).
- ``generate_codes``: ``RVQEARTTSModel.generate_step`` with ``disable_eos_prediction`` (the
  release has no ``lm_head``) and ``random_target_masking`` off. All ``Q`` codes start masked;
  ``schedule`` is NeMo's masked-count schedule (``num_iter`` 8, ``exponent`` 3: quantizers
  {0}, {1}, {2-4}, {5-8}, {9-30} at release size, 5 head evaluations). Each round the head reads
  ``embed_code(depthsum(codes so far)) + h`` for the cond and the uncond row, applies CFG after
  its MLP trunk, picks a component, samples ``z = mu + e^logs N(0, 1) noise_scale`` and
  ``depthsum_encoding_step`` greedily encodes ``z`` into the round's quantizers.
- ``warmup_state``: ``DuplexEARTTS.set_init_inputs(speaker_name=...)`` + ``get_init_inputs`` and
  the prefill ``RVQEARTTSModel.forward(audio_mask=...)`` with CFG: the speaker's cached
  ``audio_prompt_latents`` on the first ``U - 1`` positions, BOS on the last one, the text side
  ``[PAD] * (U - 1) + [EOS]`` embedded only on the last two positions. The first previous-code
  frame is the mask frame (``code[:, -1:]``).
- ``tts_step``: ``DuplexEARTTS.infer_codes_one_step`` + ``replace_control_speech_codes``, in the
  order of ``NemotronVoiceChat.offline_inference``:

  * frame 0 (the first frame after warm-up) is skipped: the loop starts at ``t = 1``, frame 0's
    codes stay zero and the backbone cache does not move;
  * when the frame's text token is EOS, *this* step's previous codes are replaced by
    ``codec_silence_tokens`` before embedding (``inference_force_speech_silence_on_eos``); the
    codes generated this step become the next step's previous codes as usual;
  * the codes handed to the codec have control codes (speech BOS/EOS/PAD ids) replaced, element
    by element, by ``codec_silence_tokens``.

Classifier-free guidance doubles the backbone rows. The cache keeps them as a second leading axis
``[B, 2, ...]`` (index 0 cond, 1 uncond) so that the slot axis stays first and a slot is one
contiguous block; a step reshapes them to ``2B`` rows for ``gemma.forward`` (a free reshape). Both
rows of a slot are always at the same position.

Sampling keys: row ``b``'s draws come only from ``keys[b]`` (folded with the round index, then
split into the Gumbel and the Gaussian key), so a session's codes do not depend on the other rows.
``deterministic=True`` is NeMo's ``top_p_or_k=1`` (an int: top-1 component) with
``noise_scale=0``; guidance stays on.

Axes (see ``voicechat_jax.model``): ``B`` slots, ``T`` positions, ``S`` cache length, ``D`` model
dim, ``Q`` quantizers, ``V`` text vocabulary, ``L`` layers, ``K`` kv heads, ``H`` head dim; local:
``Y`` codebook size (codes are ``0..Y-1``; ``Y`` is the mask id), ``Z`` latent size, ``U`` speaker
prompt frames.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from voicechat_jax.config import EOS_ID, PAD_ID, ModelConfig, SpeechDecoderConfig
from voicechat_jax.model import char_encoder, gemma, mog
from voicechat_jax.model.common import dense, fan_in_normal, normal, rms_norm
from voicechat_jax.precision import Precision, ProductPrecision

_FUSION_EPS = 1e-6  # GatedProjectedSumRMSNorm's RMSNorm keeps NeMo's default eps
_HIGHEST = jax.lax.Precision.HIGHEST


@struct.dataclass
class FusionParams:
    """``GatedProjectedSumRMSNorm`` (``gated_fusion_audio_text``)."""

    audio_proj: jax.Array  # [D, D]
    audio_proj_b: jax.Array  # [D]
    text_proj: jax.Array  # [D, D]
    text_proj_b: jax.Array  # [D]
    gate: jax.Array  # [D]  sigmoid -> audio weight
    residual_scale: jax.Array  # []  sigmoid -> output scale
    final_norm: jax.Array  # [D]  (1 + w) RMSNorm


@struct.dataclass
class TTSParams:
    """``DuplexEARTTS`` minus the codec: everything the speech decoder reads.

    ``text_table`` is not a release tensor: it is the char-aware encoder's output for every text
    id (``char_encoder.subword_table``), computed once at load by ``with_text_table`` (the
    encoder's result depends on the token id only). It is ``None`` in a tree being filled from
    the release (``abstract(..., text_table=False)``) and a concrete array everywhere else.
    """

    backbone: gemma.GemmaParams
    char_encoder: char_encoder.CharEncoderParams
    text_table: jax.Array | None  # [V, D]  derived at load
    embed_code: jax.Array  # [Z, D]
    rvq_embs: jax.Array  # [Q, Y, Z]  fp32, the codec's mus_list; id Y (mask) embeds as zero
    bos_emb: jax.Array  # [D]
    null_emb: jax.Array  # [D]  text side of the unconditional (CFG) row
    fusion: FusionParams
    mog: mog.MoGParams
    prompt_latents: jax.Array  # [U, D]  audio_prompt_latents.<speaker>
    silence_codes: jax.Array  # [Q] int32  codec_silence_tokens
    control_codes: jax.Array  # [3] int32  _control_codes (speech BOS, EOS, PAD ids)


@struct.dataclass
class TTSState:
    """One session's speech-decoder state per slot, slot axis first."""

    k: tuple[jax.Array, ...]  # L x [B, 2, K, S, H]  backbone keys; [:, 0] cond, [:, 1] uncond
    v: tuple[jax.Array, ...]  # L x [B, 2, K, S, H]  backbone values
    pos: jax.Array  # [B] int32  positions in the cache (prompt + frames run), both rows
    prev_codes: jax.Array  # [B, Q] int32  previous frame's codes (Y = mask before the first)
    frame: jax.Array  # [B] int32  tts_step calls since warm-up (0: the skipped first frame)


# ---------------------------------------------------------------------------------------------
# Params
# ---------------------------------------------------------------------------------------------


def init(key: jax.Array, cfg: ModelConfig, precision: Precision) -> TTSParams:
    """Random weights at a sane scale (norm weights near 0, gates and latents of order one)."""
    t = cfg.tts
    dt = precision.tts
    D, Q, Y, Z, U = t.d_model, t.n_quantizers, t.codebook_size, t.latent_size, t.prompt_frames
    k = jax.random.split(key, 16)
    enc = char_encoder.init(k[1], t, precision)
    params = TTSParams(
        backbone=gemma.init(k[0], t, precision),
        char_encoder=enc,
        text_table=None,
        embed_code=fan_in_normal(k[2], (Z, D), dt, Z),
        # codec codebooks: a Q-deep sum of rows has unit-scale entries
        rvq_embs=normal(k[3], (Q, Y, Z), jnp.float32, std=Q**-0.5),
        bos_emb=normal(k[4], (D,), dt, std=1.0),
        null_emb=normal(k[5], (D,), dt, std=1.0),
        fusion=FusionParams(
            audio_proj=fan_in_normal(k[6], (D, D), dt, D),
            audio_proj_b=normal(k[7], (D,), dt, std=0.1),
            text_proj=fan_in_normal(k[8], (D, D), dt, D),
            text_proj_b=normal(k[9], (D,), dt, std=0.1),
            gate=normal(k[10], (D,), dt, std=1.0),
            residual_scale=jnp.asarray(0.5, dt),
            final_norm=normal(k[11], (D,), dt, std=0.1),
        ),
        mog=mog.init(k[12], t, precision),
        prompt_latents=normal(k[13], (U, D), dt, std=1.0),  # the scale of embed_codes
        silence_codes=jax.random.randint(k[14], (Q,), 0, Y, jnp.int32),
        control_codes=control_code_ids(t),
    )
    return with_text_table(params, _random_chars(k[15], cfg), cfg=cfg)


def _random_chars(key: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A stand-in char table for random models: [V, M] char ids, each row a padded prefix."""
    V, M, pad = cfg.tts.text_vocab, 4, cfg.tts.char_vocab - 1
    chars = jax.random.randint(key, (V, M), 0, pad, jnp.int32)
    lengths = jax.random.randint(jax.random.fold_in(key, 1), (V, 1), 1, M + 1)
    return jnp.where(jnp.arange(M)[None, :] < lengths, chars, pad)


def abstract(cfg: ModelConfig, precision: Precision, *, text_table: bool = True) -> TTSParams:
    """The params' shapes and dtypes; allocates nothing.

    ``text_table=False`` leaves the derived table out (``None``): the tree the release key table
    fills (``keys.tts`` + ``keys.tts_backbone``). Then call ``with_text_table``.
    """
    tree = jax.eval_shape(lambda k: init(k, cfg, precision), jax.random.key(0))
    return tree if text_table else tree.replace(text_table=None)


def with_text_table(params: TTSParams, chars: jax.Array, *, cfg: ModelConfig) -> TTSParams:
    """Fill ``text_table`` [V, D] from the char encoder and ``char_encoder.char_table`` [V, M]."""
    if chars.shape[0] != cfg.tts.text_vocab:
        raise ValueError(f"char table has {chars.shape[0]} ids, text_vocab is {cfg.tts.text_vocab}")
    table = char_encoder.subword_table(params.char_encoder, chars, cfg=cfg.tts)
    return params.replace(text_table=table.astype(params.null_emb.dtype))


def control_code_ids(cfg: SpeechDecoderConfig) -> jax.Array:
    """``DuplexEARTTS._control_codes``: speech BOS ``Y + 2``, EOS ``Y + 1``, PAD ``Y`` ([3])."""
    Y = cfg.codebook_size
    return jnp.asarray([Y + 2, Y + 1, Y], jnp.int32)


# ---------------------------------------------------------------------------------------------
# Frame embedding
# ---------------------------------------------------------------------------------------------


def depthsum(rvq_embs: jax.Array, codes: jax.Array) -> jax.Array:
    """``RVQEARTTSModel.depthsum_embedding``: codes [..., Q] -> [..., Z], sum of codebook rows.

    Ids ``>= Y`` (the mask id ``Y``) read NeMo's appended zero row.
    """
    Q = rvq_embs.shape[0]
    rows = rvq_embs.at[jnp.arange(Q), codes].get(mode="fill", fill_value=0)  # [..., Q, Z]
    return jnp.sum(rows, axis=-2)


def embed_codes(params: TTSParams, codes: jax.Array) -> jax.Array:
    """``embed_code(depthsum_embedding(codes))``: [..., Q] -> [..., D]."""
    dt = params.embed_code.dtype
    return dense(depthsum(params.rvq_embs, codes).astype(dt), params.embed_code)


def fuse(params: FusionParams, audio: jax.Array, text: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """``GatedProjectedSumRMSNorm.forward``: audio, text [..., D] -> [..., D]."""
    a = dense(audio / cfg.tts.fusion_audio_divisor, params.audio_proj, params.audio_proj_b)
    t = dense(text, params.text_proj, params.text_proj_b)
    gate = jax.nn.sigmoid(params.gate.astype(jnp.float32)).astype(a.dtype)
    res = jax.nn.sigmoid(params.residual_scale.astype(jnp.float32)).astype(a.dtype)
    return rms_norm(res * (gate * a + (1 - gate) * t), params.final_norm, _FUSION_EPS, offset=1.0)


def embed_frame(
    params: TTSParams, prev_codes: jax.Array, text_ids: jax.Array, *, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """The backbone input of one frame: prev_codes [B, Q], text_ids [B] -> (cond, uncond) [B, D].

    The two rows share the audio side; the uncond row's text side is ``null_emb``.
    """
    audio = embed_codes(params, prev_codes)
    text = params.text_table[text_ids].astype(audio.dtype)
    null = jnp.broadcast_to(params.null_emb.astype(audio.dtype), text.shape)
    return fuse(params.fusion, audio, text, cfg=cfg), fuse(params.fusion, audio, null, cfg=cfg)


# ---------------------------------------------------------------------------------------------
# Code generation: MoG head + RVQ refinement
# ---------------------------------------------------------------------------------------------


def masked_counts(cfg: SpeechDecoderConfig) -> tuple[int, ...]:
    """NeMo's ``num_maskings`` per iteration: ``ceil((1 - (i / n)^e)^(1/e) * Q)``, i < n.

    Computed in fp32 as torch computes it (``linspace``, ``pow``, ``ceil`` on float32 tensors).
    """
    rates = np.linspace(0.0, 1.0, cfg.num_iter + 1, dtype=np.float32)[:-1]
    e = np.float32(cfg.exponent)
    masking = np.power(np.float32(1) - np.power(rates, e), np.float32(1) / e, dtype=np.float32)
    return tuple(int(x) for x in np.ceil(masking * np.float32(cfg.n_quantizers)))


def schedule(cfg: SpeechDecoderConfig) -> tuple[tuple[int, int], ...]:
    """The rounds that evaluate the head: (first quantizer, count) each, in order.

    NeMo's ``ks = num_maskings - num_maskings[1:] (+ [0])``; iterations with ``k = 0`` are
    skipped, and ``k`` quantizers are fixed from where the previous round stopped.
    """
    n = masked_counts(cfg)
    ks = [a - b for a, b in zip(n, (*n[1:], 0), strict=True)]
    rounds, start = [], 0
    for k in ks:
        if k:
            rounds.append((start, k))
            start += k
    if start != cfg.n_quantizers:
        raise ValueError(f"schedule fixes {start} of {cfg.n_quantizers} quantizers")
    return tuple(rounds)


def rvq_encode(
    rvq_embs: jax.Array, z: jax.Array, codes: jax.Array, start: int, count: int
) -> jax.Array:
    """``depthsum_encoding_step``: greedily encode z [B, Z] into quantizers start..start+count-1.

    Per quantizer: ``argmin_e |e|^2 - 2 <r, e>`` over its codebook, then ``r -= e``.
    """
    r = z.astype(rvq_embs.dtype)
    for q in range(start, start + count):
        e = rvq_embs[q]  # [Y, Z]
        dist = jnp.sum(e * e, axis=-1) - 2 * jnp.einsum("bz,cz->bc", r, e, precision=_HIGHEST)
        idx = jnp.argmin(dist, axis=-1).astype(jnp.int32)  # [B]
        r = r - e[idx]
        codes = codes.at[:, q].set(idx)
    return codes


def _as_keys(keys: jax.Array) -> jax.Array:
    """Typed keys [B] from typed keys or raw uint32 key data [B, 2]."""
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return keys
    return jax.random.wrap_key_data(keys)


def sampling_noise(keys: jax.Array, *, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The random draws of one frame, row by row: (u [R, B, E] uniform, eps [R, B, Z] normal).

    ``R`` is the number of head rounds. Row ``b`` draws from ``keys[b]`` only: round ``r`` folds
    ``r`` into the key and splits it into the Gumbel (``u``) and the Gaussian (``eps``) key.
    """
    t = cfg.tts
    rounds = len(schedule(t))

    def row(key):
        pairs = jax.vmap(lambda r: jax.random.split(jax.random.fold_in(key, r)))(
            jnp.arange(rounds)
        )  # [R, 2]
        u = jax.vmap(lambda k: jax.random.uniform(k, (t.mog_components,), jnp.float32))(pairs[:, 0])
        eps = jax.vmap(lambda k: jax.random.normal(k, (t.latent_size,), jnp.float32))(pairs[:, 1])
        return u, eps

    u, eps = jax.vmap(row)(_as_keys(keys))  # [B, R, ...]
    return jnp.swapaxes(u, 0, 1), jnp.swapaxes(eps, 0, 1)


def generate_codes(
    params: TTSParams,
    h_cond: jax.Array,
    h_uncond: jax.Array,
    keys: jax.Array | None,
    *,
    cfg: ModelConfig,
    deterministic: bool,
    product: ProductPrecision = None,
) -> jax.Array:
    """One frame's codes from the backbone's cond/uncond outputs [B, D] -> [B, Q] int32.

    ``keys``: [B] typed keys (or [B, 2] uint32 key data), one per row; unused (may be None) when
    ``deterministic``. ``product``: the MoG trunk's ``precision=`` (``Precision.tts_product``).
    """
    t = cfg.tts
    B = h_cond.shape[0]
    codes = jnp.full((B, t.n_quantizers), t.codebook_size, jnp.int32)
    if not deterministic:
        u, eps = sampling_noise(keys, cfg=cfg)
    for r, (start, count) in enumerate(schedule(t)):
        m = embed_codes(params, codes)  # [B, D]
        x = mog.trunk(
            params.mog, jnp.concatenate([m + h_cond, m + h_uncond]), cfg=t, product=product
        )
        x = mog.guide(x[:B], x[B:], t.guidance_scale)
        logits = mog.logits(params.mog, x)
        if deterministic:
            comp = mog.choose(logits, None, top_p=t.top_p, deterministic=True)
            z = mog.sample_latent(params.mog, x, comp, None, noise_scale=0.0, cfg=t)
        else:
            comp = mog.choose(logits, u[r], top_p=t.top_p, deterministic=False)
            z = mog.sample_latent(params.mog, x, comp, eps[r], noise_scale=t.noise_scale, cfg=t)
        codes = rvq_encode(params.rvq_embs, z, codes, start, count)
    return codes


def replace_control_codes(params: TTSParams, codes: jax.Array) -> jax.Array:
    """``replace_control_speech_codes`` with silence: codes [..., Q] -> [..., Q].

    Each element equal to a control code becomes the silence code of its quantizer.
    """
    is_control = jnp.any(codes[..., None] == params.control_codes, axis=-1)
    return jnp.where(is_control, params.silence_codes, codes)


# ---------------------------------------------------------------------------------------------
# State: warm-up and one frame
# ---------------------------------------------------------------------------------------------


def prompt_samples(cfg: ModelConfig) -> int:
    """Samples of silence whose codec codes ``warmup_state`` takes: ``(U + 1)`` code frames.

    ``set_init_inputs`` encodes one text-prompt frame of silence followed by the ``U``-frame
    speaker prompt (zeros when a cached speaker latent is used).
    """
    return (cfg.tts.prompt_frames + 1) * cfg.codec.samples_per_frame


def warmup_state(
    params: TTSParams,
    prompt_codes: jax.Array,
    *,
    cfg: ModelConfig,
    precision: Precision,
    batch: int,
    max_len: int,
) -> TTSState:
    """The fresh-session state: speaker-prompt prefill done, first previous codes = mask frame.

    Args:
      prompt_codes: [U + 1, Q] int, the codec's codes of ``prompt_samples(cfg)`` samples of
        silence (``codec.encode``), as ``set_init_inputs`` computes them. With a cached speaker
        latent only row ``U - 2`` is read (the code input of the BOS position).
      batch: slots; every slot gets the same state (the prefill runs once).
      max_len: cache positions per slot, ``U`` prompt positions included.
    """
    t = cfg.tts
    U, Q, Y = t.prompt_frames, t.n_quantizers, t.codebook_size
    if prompt_codes.shape != (U + 1, Q):
        raise ValueError(f"prompt_codes must be [{U + 1}, {Q}], got {prompt_codes.shape}")
    dt = precision.tts
    # Audio side (RVQEARTTSModel.forward with audio_mask): positions before BOS take the speaker
    # latent; the BOS position (U - 1) embeds the shifted code frame U - 2 plus bos_emb.
    bos_audio = embed_codes(params, prompt_codes[U - 2]) + params.bos_emb.astype(dt)
    audio = jnp.concatenate([params.prompt_latents[: U - 1].astype(dt), bos_audio[None]])  # [U, D]
    # Text side: subword ids [PAD] * (U - 1) + [EOS], subword_mask on the last two positions.
    ids = jnp.asarray([PAD_ID] * (U - 1) + [EOS_ID], jnp.int32)
    full = params.text_table[ids].astype(dt)
    flags = char_encoder.flags(params.char_encoder, ids).astype(dt)  # outside subword_mask
    text = jnp.where((jnp.arange(U) >= U - 2)[:, None], full, flags)  # [U, D]
    null = jnp.broadcast_to(params.null_emb.astype(dt), text.shape)
    x = jnp.stack(
        [fuse(params.fusion, audio, text, cfg=cfg), fuse(params.fusion, audio, null, cfg=cfg)]
    )
    cache = gemma.init_cache(t, 2, max_len, precision)
    product = precision.tts_product()
    cache, _ = gemma.forward(params.backbone, cache, x, cfg=t, product=product)  # cond, uncond

    def per_slot(a: jax.Array) -> jax.Array:  # [2, K, S, H] -> [batch, 2, K, S, H]
        return jnp.broadcast_to(a[None], (batch, *a.shape))

    return TTSState(
        k=tuple(per_slot(a) for a in cache.k),
        v=tuple(per_slot(a) for a in cache.v),
        pos=jnp.full((batch,), U, jnp.int32),
        prev_codes=jnp.full((batch, Q), Y, jnp.int32),
        frame=jnp.zeros((batch,), jnp.int32),
    )


def tts_step(
    params: TTSParams,
    state: TTSState,
    text_ids: jax.Array,
    keys: jax.Array | None,
    run: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    deterministic: bool,
    attention: str = "xla",
    product: ProductPrecision = None,
    beside=None,
) -> tuple[TTSState, jax.Array, jax.Array]:
    """One 80 ms frame for the slots in ``run`` (default all); ``attention``, ``product`` (the
    weight products' precision, ``Precision.tts_product``) and ``beside`` (products to run in the
    attention launches) as ``gemma.forward``.

    Args:
      text_ids: [B] int, the frame's text token (the LLM's output for this frame).
      keys: [B] typed keys or [B, 2] uint32 key data, this frame's key per session (None when
        ``deterministic``).
      run: [B] bool, the slots that advance; the others keep their state bit-identical (their
        cache rows are not written, their counters and previous codes are kept) and their codes
        are meaningless.

    Returns:
      (state, codes [B, Q] int32 as generated (zeros on frame 0), codes for the codec [B, Q]
      with control codes replaced by silence).
    """
    t = cfg.tts
    B = text_ids.shape[0]
    run = jnp.ones((B,), bool) if run is None else run
    live = run & (state.frame > 0)  # offline_inference starts its EarTTS loop at t = 1
    prev = jnp.where((text_ids == EOS_ID)[:, None], params.silence_codes, state.prev_codes)
    cond, uncond = embed_frame(params, prev, text_ids, cfg=cfg)
    x = jnp.stack([cond, uncond], axis=1).reshape(2 * B, 1, -1)  # rows 2b, 2b+1 = slot b

    def rows(a: jax.Array) -> jax.Array:  # [B, 2, ...] -> [2B, ...], a free reshape
        return a.reshape(2 * B, *a.shape[2:])

    cache = gemma.GemmaCache(
        k=tuple(rows(a) for a in state.k),
        v=tuple(rows(a) for a in state.v),
        pos=jnp.repeat(state.pos, 2),
    )
    cache, h = gemma.forward(
        params.backbone,
        cache,
        x,
        cfg=t,
        valid=jnp.repeat(live, 2),
        attention=attention,
        product=product,
        beside=beside,
    )
    h = h.reshape(B, 2, -1)
    codes = generate_codes(
        params, h[:, 0], h[:, 1], keys, cfg=cfg, deterministic=deterministic, product=product
    )
    codes = jnp.where(live[:, None], codes, 0)
    new = TTSState(
        k=tuple(a.reshape(old.shape) for a, old in zip(cache.k, state.k, strict=True)),
        v=tuple(a.reshape(old.shape) for a, old in zip(cache.v, state.v, strict=True)),
        pos=cache.pos.reshape(B, 2)[:, 0],
        prev_codes=jnp.where(live[:, None], codes, state.prev_codes),
        frame=state.frame + run.astype(jnp.int32),
    )
    return new, codes, replace_control_codes(params, codes)
