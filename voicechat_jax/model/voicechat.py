"""The whole model, one frame at a time: listening half, speaking half, and their carried state.

Per frame ``t`` (model-spec §3; NeMo ``NemotronVoiceChat.offline_inference`` with the streaming
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

import jax
import jax.numpy as jnp
from flax import struct

from voicechat_jax.config import ModelConfig
from voicechat_jax.model import codec, conformer, ear_tts, nano, rnnt
from voicechat_jax.precision import Precision


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


def abstract(cfg: ModelConfig, precision: Precision) -> ModelParams:
    """Shapes and dtypes of every parameter; allocates nothing."""
    return jax.eval_shape(lambda: init(jax.random.key(0), cfg, precision))


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
    transcript: jax.Array  # [B, T, M] int32: RNNT tokens of the frame (first n valid)
    n_transcript: jax.Array  # [B, T] int32


def listen_frame(params: ModelParams, llm_state, text_prev, func_prev, audio_proj, *, cfg):
    """One LLM frame: input sum, Nano step, greedy heads (``DuplexSTTStreamingInference``)."""
    e = nano.input_embedding(params.llm, text_prev, func_prev, audio_proj, cfg=cfg.llm)
    llm_state, h = nano.step(params.llm, llm_state, e, cfg=cfg.llm)
    text_logits, func_logits = nano.heads(params.llm, h, cfg=cfg.llm)
    text = jnp.argmax(text_logits, axis=-1).astype(jnp.int32)
    func = jnp.argmax(func_logits, axis=-1).astype(jnp.int32)
    return llm_state, text, func, h


def advance(
    params: ModelParams,
    state: FrameState,
    audio: jax.Array,
    key: jax.Array,
    *,
    cfg: ModelConfig,
    precision: Precision,
    deterministic: bool,
    attention: str = "xla",
) -> tuple[FrameState, FrameOutputs]:
    """Advance every row by ``T = audio.shape[1] // 1280`` frames.

    Args:
      audio: [B, T * 1280] float32 at 16 kHz.
      key: [B, 2] uint32 per-session sampling keys; frame ``n`` of a session samples with
        ``fold_in(key, n)``, so a session's output never depends on its neighbours.
    """
    del attention  # one implementation for now; the switch lives in ServeConfig
    n_frames = audio.shape[1] // cfg.encoder.mel.samples_per_frame
    enc_state, enc, proj = conformer.encoder_step(
        params.encoder, state.encoder, audio, cfg=cfg.encoder, precision=precision
    )
    rnnt_state, transcript, n_transcript = rnnt.rnnt_step(
        params.rnnt, state.rnnt, enc, cfg=cfg.rnnt
    )

    def one(carry, xs):
        llm_state, tts_state, text_prev, func_prev, frame = carry
        a_t = xs
        llm_state, text, func, _ = listen_frame(
            params, llm_state, text_prev, func_prev, a_t, cfg=cfg
        )
        frame_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key), frame)
        tts_state, codes, dec_codes = ear_tts.tts_step(
            params.tts,
            tts_state,
            text,
            frame_keys,
            cfg=cfg,
            deterministic=deterministic,
        )
        return (llm_state, tts_state, text, func, frame + 1), (text, func, codes, dec_codes)

    carry = (state.llm, state.tts, state.text_prev, state.func_prev, state.frame)
    carry, (text, func, codes, dec_codes) = jax.lax.scan(one, carry, jnp.swapaxes(proj, 0, 1))
    llm_state, tts_state, text_prev, func_prev, frame = carry
    codec_state, wav = codec.decode_step(
        params.codec, state.codec, jnp.swapaxes(dec_codes, 0, 1), cfg=cfg.codec
    )
    del n_frames
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
