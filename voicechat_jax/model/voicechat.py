"""The whole model, one frame at a time: listening half, speaking half, and their carried state.

Per frame ``t`` (docs/model.md §3; NeMo ``NemotronVoiceChat.offline_inference`` with the streaming
perception of ``ConformerEncoder.cache_aware_stream_step``):

1. ``enc_t, a_t = encoder_step(pcm_t)``        streaming log-mel + cache-aware FastConformer + proj
2. transcript tokens from the RNNT head on ``enc_t`` (greedy, <= max_symbols per frame)
3. ``e_t = w_text E[text_{t-1}] + w_user a_t + w_func E[func_{t-1}]``   (``DuplexSTTModel``)
4. ``h_t = nano_step(e_t)``; ``text_t, func_t = argmax`` of the text and function heads
5. ``codes_t = tts_step(text_t)``               EarTTS with CFG, MoG head, RVQ refinement
6. ``wav_t = codec.decode_step(codes_t)``        streaming codec, 1764 samples per frame

The encoder, RNNT head and codec take the beat's frames together; the LLM and the speech decoder
step one frame at a time (frame t+1 needs frame t's tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from voicechat_jax.config import (
    PAD_ID,
    XLA_KERNELS,
    Kernels,
    ModelConfig,
    check_codec_placement,
)
from voicechat_jax.model import codec, conformer, ear_tts, gemma, mog, nano, rnnt, streams
from voicechat_jax.model.beside import Beside
from voicechat_jax.model.common import keep_rows, tf32_pairs
from voicechat_jax.precision import Precision

# The speech decoder's steps over system-prompt positions are shared by every session (they are in
# the template); in faithful mode they sample with this fixed key.
TEMPLATE_KEY = 0


@struct.dataclass
class ModelParams:
    """Every parameter of the model; the release key table fills these paths."""

    encoder: conformer.EncoderParams
    llm: nano.NanoParams
    rnnt: rnnt.RNNTParams
    tts: ear_tts.TTSParams
    codec: codec.CodecParams


def init(key: jax.Array, cfg: ModelConfig, precision: Precision) -> ModelParams:
    """Random weights for the whole model (tests and benchmarks)."""
    k = jax.random.split(key, 5)
    return ModelParams(
        encoder=conformer.init(k[0], cfg.encoder, precision),
        llm=nano.init(k[1], cfg.llm, precision),
        rnnt=rnnt.init(k[2], cfg.rnnt, precision),
        tts=ear_tts.init(k[3], cfg, precision),
        codec=codec.init(k[4], cfg.codec, precision),
    )


# Each sub-network's ``init`` as one program (its config and precision static). The serving
# layout is split from their outputs, not inside them: a speech-decoder init that returned its
# layers apart took over 7 minutes to compile on an H200 (2026-12-05), against ~1 minute.
_COMPILED_INITS = tuple(
    jax.jit(f, static_argnums=(1, 2))
    for f in (conformer.init, nano.init, rnnt.init, ear_tts.init, codec.init)
)


def init_compiled(
    key: jax.Array, cfg: ModelConfig, precision: Precision, *, serving: bool = False
) -> ModelParams:
    """``init`` as one jitted program per sub-network: what the CLI and the benchmarks use.

    Op by op, ``init`` compiles every random draw on its own (~30 s for the tiny model on a
    2-core CPU, ~45 s at 11B on an H200). The first compile of these five programs takes about
    as long on the CPU, but JAX's persistent compilation cache keeps them for the next process
    (a cached tiny ``voicechat-serve`` run: 33 s -> 9.4 s). The values equal ``init``'s up to
    float rounding (XLA fuses the scaling into the draws). ``serving``: in the serving layout
    (``serving_layout``); the stacked copy is dropped on return, before anything else is built.
    """
    k = jax.random.split(key, 5)
    sub = (cfg.encoder, cfg.llm, cfg.rnnt, cfg, cfg.codec)
    enc, llm, head, tts, cod = (
        f(k[i], c, precision) for i, (f, c) in enumerate(zip(_COMPILED_INITS, sub, strict=True))
    )
    params = ModelParams(encoder=enc, llm=llm, rnnt=head, tts=tts, codec=cod)
    return serving_layout(params, precision) if serving else params


def abstract(cfg: ModelConfig, precision: Precision, *, text_table: bool = True) -> ModelParams:
    """Shapes and dtypes of every parameter; allocates nothing.

    ``text_table=False`` leaves out the speech decoder's derived subword table: the tree that the
    release key table fills (``keys.table.release_table``).
    """
    tree = jax.eval_shape(lambda: init(jax.random.key(0), cfg, precision))
    return tree if text_table else tree.replace(tts=tree.tts.replace(text_table=None))


def serving_layout(params: ModelParams, precision: Precision | None = None) -> ModelParams:
    """The params as the engine serves them: the products of the LLM, the speech decoder backbone
    and the MoG trunk one leaf per layer, the speech decoder's that share an input fused
    (``nano.per_layer``, ``gemma.per_layer``, ``mog.per_layer``), and on a GPU the encoder's
    layers one ``LayerParams`` each (``conformer.serving_layout``) and the RNNT's LSTM layers one
    leaf each (``rnnt.serving_layout``); the rest as stored.

    Every function of the model takes either layout; on the CPU both give the same bits (on a
    GPU a fused product may round its fp32 sums differently). The stored layout (stacked on L)
    is what checkpoints, the converter and the key table use. On a GPU the serving layout saves
    the copy of each layer's weight out of its stack before its product. Params already in it
    are returned as they are.

    ``precision``: the policy served; under ``tts_matmul='tf32_pair'`` the speech decoder's
    weight products (the backbone's and the MoG trunk's) are laid out as TF32 pairs
    (``common.tf32_pairs``: twice their fp32 bytes, 2.6 GB more at the release's shapes).
    """
    tts = params.tts
    tts = tts.replace(backbone=gemma.per_layer(tts.backbone), mog=mog.per_layer(tts.mog))
    if precision is not None and precision.tts_matmul == "tf32_pair":
        backbone = tf32_pairs(tts.backbone, ("qkv", "o", "gate_up", "down"))
        tts = tts.replace(backbone=backbone, mog=tf32_pairs(tts.mog, ("gate_up", "down")))
    encoder = conformer.serving_layout(params.encoder)
    head = rnnt.serving_layout(params.rnnt)
    return params.replace(encoder=encoder, llm=nano.per_layer(params.llm), rnnt=head, tts=tts)


@struct.dataclass
class FrameState:
    """What one session carries from frame to frame (``B`` first on every leaf)."""

    encoder: conformer.EncoderState
    llm: nano.NanoState
    rnnt: rnnt.RNNTState
    tts: ear_tts.TTSState
    codec: codec.CodecState
    text_prev: jax.Array  # [B] int32: text token of the previous frame (PAD before the first)
    func_prev: jax.Array  # [B] int32: function token of the previous frame (PAD before the first)
    frame: jax.Array  # [B] int32: frames done since the session started


@struct.dataclass
class FrameOutputs:
    """The outputs of ``T`` frames."""

    text: jax.Array  # [B, T] int32: greedy text token per frame
    function: jax.Array  # [B, T] int32: greedy function-channel token per frame
    codes: jax.Array  # [B, T, Q] int32: the frame's audio codes
    wav: jax.Array  # [B, T * 1764] float32: 22.05 kHz audio
    transcript: jax.Array  # [B, T, O] int32: RNNT tokens of the frame (first n valid)
    n_transcript: jax.Array  # [B, T] int32


def listen_frame(
    params: ModelParams,
    llm_state,
    text_prev,
    func_prev,
    audio_proj,
    run=None,
    *,
    cfg,
    kernels: Kernels = XLA_KERNELS,
):
    """One LLM frame: input sum, Nano step, greedy heads (``DuplexSTTStreamingInference``).

    ``run`` [B] bool masks the state update (``nano.step``); ``kernels`` (static) picks the Mamba
    step update, the attention layers' implementation and the MLP and Mamba projections'.
    """
    e = nano.input_embedding(params.llm, text_prev, func_prev, audio_proj, cfg=cfg.llm)
    llm_state, h = nano.step(
        params.llm,
        llm_state,
        e,
        run,
        cfg=cfg.llm,
        ssm_kernel=kernels.ssm_kernel,
        attention=kernels.attention,
        projection=kernels.projection,
    )
    text, func = nano.greedy(params.llm, h)
    return llm_state, text, func, h


def advance(
    params: ModelParams,
    state: FrameState,
    audio: jax.Array,
    key: jax.Array,
    run: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    precision: Precision,
    deterministic: bool,
    kernels: Kernels = XLA_KERNELS,
) -> tuple[FrameState, FrameOutputs]:
    """Advance the rows in ``run`` by ``T = audio.shape[1] // 1280`` frames, in place.

    Args:
      audio: [B, T * 1280] float32 at 16 kHz.
      key: [B, 2] uint32 per-session sampling keys; frame ``n`` of a session samples with
        ``fold_in(key, n)``, so a session's output never depends on its neighbours.
      run: [B] bool, the rows that advance (default all). Every leaf of the others comes back
        bit-identical: each update masks itself where it happens (no select over the whole
        state), so under ``jit`` with the state donated the state is updated in place. Their
        outputs are meaningless.
      kernels: the kernels (static, ``config.Kernels``, every choice made: ``ServeConfig.kernels``):
        the LLM's Mamba step update and decode attention (``model.attention``), the speech
        decoder's attention, and the LLM's MLP and Mamba projections.
    """
    check_codec_placement(
        kernels.codec_stream,
        kernels.codec_in_attention,
        precision.codec_matmul,
        kernels.codec_frame_behind,
    )
    _check_pending(state.codec, kernels.codec_frame_behind)
    B = audio.shape[0]
    run = jnp.ones((B,), bool) if run is None else run
    enc_state, enc, proj = conformer.encoder_step(
        params.encoder, state.encoder, audio, run, cfg=cfg.encoder, precision=precision
    )
    rnnt_state, transcript, n_transcript = rnnt.rnnt_step(
        params.rnnt, state.rnnt, enc, cfg=cfg.rnnt
    )
    rnnt_state = keep_rows(run, rnnt_state, state.rnnt)
    step = run.astype(jnp.int32)

    def one(carry, xs, beside=None):
        llm_state, tts_state, text_prev, func_prev, frame = carry
        a_t = xs
        llm_state, text, func, _ = listen_frame(
            params,
            llm_state,
            text_prev,
            func_prev,
            a_t,
            run,
            cfg=cfg,
            kernels=kernels,
        )
        frame_keys = None if deterministic else _frame_keys(key, frame)
        tts_state, codes, dec_codes = ear_tts.tts_step(
            params.tts,
            tts_state,
            text,
            frame_keys,
            run,
            cfg=cfg,
            deterministic=deterministic,
            attention=kernels.tts_attention,
            product=precision.tts_product(),
            beside=beside,
        )
        text_prev, func_prev = keep_rows(run, (text, func), (text_prev, func_prev))
        return (llm_state, tts_state, text_prev, func_prev, frame + step), (
            text,
            func,
            codes,
            dec_codes,
        )

    carry = (state.llm, state.tts, state.text_prev, state.func_prev, state.frame)
    decode = functools.partial(codec.decode_step, cfg=cfg.codec, matmul=precision.codec_matmul)
    if kernels.codec_stream:
        # The frames unrolled, each frame's codes decoded on a second stream as soon as they
        # exist: frame t's codec step beside frame t+1's LLM and speech decoder, which do not
        # depend on it (``streams.on_stream``).
        outs, wavs, codec_state = [], [], state.codec
        decode_beside = streams.on_stream(decode)
        for t in range(proj.shape[1]):
            carry, out_t = one(carry, proj[:, t])
            codec_state, wav_t = decode_beside(params.codec, codec_state, out_t[3][:, None])
            outs.append(out_t)
            wavs.append(wav_t)
        text, func, codes, dec_codes = (jnp.stack(x) for x in zip(*outs, strict=True))
        wav = jnp.concatenate(wavs, axis=1)
    elif kernels.codec_in_attention:
        # The frames unrolled; each frame's codec products ride in the next frame's speech
        # decoder attention launches (``model.beside``), the last frame's run after it, or, a
        # frame behind, the previous beat's last frame's (``CodecState.pending``) in this beat's
        # first and this beat's last frame's left pending.
        codec_state, T = state.codec, proj.shape[1]
        behind = kernels.codec_frame_behind
        codes_in = jnp.maximum(codec_state.pending, 0) if behind else None
        has = codec_state.pending[:, 0] >= 0 if behind else None  # [B] a frame is pending
        outs, wavs = [], []
        for t in range(T + (0 if behind else 1)):
            beside = None
            if codes_in is not None:
                beside = Beside(
                    codec.decode_step_products(
                        params.codec,
                        codec_state,
                        codes_in[:, None],
                        cfg=cfg.codec,
                        # one attention launch a layer, none after the last frame
                        launches=cfg.tts.n_layers if t < T else None,
                    )
                )
            if t < T:
                carry, out_t = one(carry, proj[:, t], beside)
                outs.append(out_t)
                codes_in = out_t[3]
            if beside is not None:
                decoded, wav_t = beside.finish()
                if has is not None:  # a session's first frame: nothing was pending
                    decoded = keep_rows(has, decoded, codec_state)
                    wav_t = jnp.where(has[:, None], wav_t, 0.0)
                    has = None
                codec_state = decoded
                wavs.append(wav_t)
        if behind:
            codec_state = codec_state.replace(pending=codes_in)
        text, func, codes, dec_codes = (jnp.stack(x) for x in zip(*outs, strict=True))
        wav = jnp.concatenate(wavs, axis=1)
    else:
        carry, (text, func, codes, dec_codes) = jax.lax.scan(one, carry, jnp.swapaxes(proj, 0, 1))
        codec_state, wav = decode(params.codec, state.codec, jnp.swapaxes(dec_codes, 0, 1))
    llm_state, tts_state, text_prev, func_prev, frame = carry
    codec_state = keep_rows(run, codec_state, state.codec)
    new_state = FrameState(
        encoder=enc_state,
        llm=llm_state,
        rnnt=rnnt_state,
        tts=tts_state,
        codec=codec_state,
        text_prev=text_prev,
        func_prev=func_prev,
        frame=frame,
    )
    out = FrameOutputs(
        text=jnp.swapaxes(text, 0, 1),
        function=jnp.swapaxes(func, 0, 1),
        codes=jnp.swapaxes(codes, 0, 1),
        wav=wav,
        transcript=transcript,
        n_transcript=n_transcript,
    )
    return new_state, out


def _check_pending(codec_state: codec.CodecState, frame_behind: bool) -> None:
    """The state has a pending codec frame exactly when the codec runs a frame behind."""
    if (codec_state.pending is not None) != frame_behind:
        has = "has" if codec_state.pending is not None else "has no"
        raise ValueError(
            f"the state {has} a pending codec frame (CodecState.pending) and the kernels' "
            f"codec_frame_behind is {frame_behind}: build the template with the same choice"
        )


def _frame_keys(key: jax.Array, frame: jax.Array) -> jax.Array:
    """[B] typed keys: session key ``key[b]`` folded with the session's frame index."""
    return jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key), frame)


def initial_state(
    params: ModelParams,
    *,
    cfg: ModelConfig,
    precision: Precision,
    max_len: int,
    system_prompt: tuple[int, ...] = (),
    deterministic: bool = False,
    codec_frame_behind: bool = False,
) -> FrameState:
    """The fresh-session state (batch 1): computed once at start-up, copied in on admission.

    - the speech decoder's speaker-prompt prefill (``DuplexEARTTS.set_init_inputs`` /
      ``get_init_inputs``; the codec's codes of silence from ``codec.encode``);
    - with a system prompt, its ``U`` positions run as NeMo's ``offline_inference`` runs them
      (``DuplexSTTStreamingInference._init_inference``): the LLM reads ``w_user E[token]`` with PAD
      on the text and function channels, no outputs are taken, and the speech decoder and codec
      step over those positions with PAD text (their audio is not emitted);
    - empty encoder, RNNT and codec streams; previous text and function tokens PAD.

    Args:
      max_len: the context cap in frames (``ServeConfig.context_frames``); caches get room for it
        plus the prompts.
      system_prompt: token ids, passed as NeMo takes them (it adds no BOS/EOS itself).
      codec_frame_behind: the codec state with room for a pending frame (none yet), for
        ``Kernels.codec_frame_behind``.
    """
    U = len(system_prompt)
    silence = jnp.zeros((1, ear_tts.prompt_samples(cfg)), jnp.float32)
    prompt_codes = codec.encode(params.codec, silence, cfg=cfg.codec)[0]
    tts_state = ear_tts.warmup_state(
        params.tts,
        prompt_codes,
        cfg=cfg,
        precision=precision,
        batch=1,
        max_len=cfg.tts.prompt_frames + U + max_len,
    )
    llm_state = nano.init_state(cfg.llm, 1, U + max_len, precision)
    codec_state = codec.init_state(cfg.codec, 1, precision, pending=codec_frame_behind)
    pad = jnp.full((1,), PAD_ID, jnp.int32)
    if U:
        ids = jnp.asarray(system_prompt, jnp.int32)[None]  # [1, U]
        prompt = nano.embed(params.llm, ids).astype(jnp.float32)  # scaled by w_user below
        pads = jnp.full((1, U), PAD_ID, jnp.int32)
        e = nano.input_embedding(params.llm, pads, pads, prompt, cfg=cfg.llm)
        llm_state, _ = nano.prefill(params.llm, llm_state, e, cfg=cfg.llm)

        template_key = jnp.asarray([[0, TEMPLATE_KEY]], jnp.uint32)  # [1, 2] raw key data

        def prompt_frame(carry, n):
            tts_s, codec_s = carry
            keys = None if deterministic else _frame_keys(template_key, n[None])
            tts_s, _, dec = ear_tts.tts_step(
                params.tts,
                tts_s,
                pad,
                keys,
                cfg=cfg,
                deterministic=deterministic,
                product=precision.tts_product(),
            )
            codec_s, _ = codec.decode_step(
                params.codec, codec_s, dec[:, None], cfg=cfg.codec, matmul=precision.codec_matmul
            )
            return (tts_s, codec_s), None

        (tts_state, codec_state), _ = jax.lax.scan(
            prompt_frame, (tts_state, codec_state), jnp.arange(U, dtype=jnp.int32)
        )
    return FrameState(
        encoder=conformer.init_state(cfg.encoder, 1, precision),
        llm=llm_state,
        rnnt=rnnt.init_state(cfg.rnnt, 1, precision),
        tts=tts_state,
        codec=codec_state,
        text_prev=pad,
        func_prev=pad,
        frame=jnp.zeros((1,), jnp.int32),
    )
