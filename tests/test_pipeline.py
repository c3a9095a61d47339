"""The whole model frame by frame against NeMo on a tiny random ``NemotronVoiceChat`` (fp32).

The reference is ``tests.reference.nemo_ref``: NeMo's cache-aware streaming perception
(``cache_aware_stream_step``), its per-frame LLM loop (``DuplexSTTStreamingInference``, plus the
release's function channel), its RNNT greedy decoding (``GreedyRNNTInfer``), its EarTTS loop
(``NemotronVoiceChat.offline_inference``, deterministic sampling) and its offline codec decode.
Our side loads NeMo's state dict through the one release key table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import shared
from tests.reference import nemo_ref
from voicechat_jax.config import EOS_ID, PAD_ID
from voicechat_jax.keys import load_params
from voicechat_jax.model import char_encoder, codec, conformer, ear_tts, nano, rnnt, voicechat
from voicechat_jax.precision import Precision
from voicechat_jax.serving import audio as audio_lib
from voicechat_jax.serving import runner

F32 = Precision.fp32()
N_FRAMES = 64  # 5.12 s of input
SPF = 1280


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """The bundled speech recording, padded with low noise to 64 frames (5.12 s)."""
    path = runner.default_wav()
    x = audio_lib.read_wav(path)
    n = N_FRAMES * SPF
    rng = np.random.default_rng(0)
    x = np.concatenate([x[:n], 1e-3 * rng.standard_normal(max(0, n - x.size))])
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def params(nemo_tiny, tiny_cfg):
    """Our params from NeMo's release-layout state dict, through the release key table."""
    tokenizer_dir = nemo_tiny.release_cfg["model"]["stt"]["model"]["pretrained_llm"]
    chars = char_encoder.char_table(tokenizer_dir)
    return load_params(tiny_cfg, nemo_ref.release_state_dict(nemo_tiny), F32, np.asarray(chars))


@pytest.fixture(scope="module")
def reference(nemo_tiny, tiny_cfg, speech):
    """NeMo's outputs for the speech clip: perception, listen loop, RNNT, speak loop."""
    proj, enc = nemo_ref.nemo_streaming_perception(nemo_tiny, speech, return_encoder=True)
    listen = nemo_ref.nemo_listen(nemo_tiny, proj)
    speak = nemo_ref.nemo_speak(nemo_tiny, listen["text"])
    transcript = nemo_ref.nemo_rnnt_frames(nemo_tiny, enc, tiny_cfg.rnnt.max_symbols)
    return {"proj": proj, "enc": enc, "transcript": transcript, **listen, **speak}


@pytest.fixture(scope="module")
def ours(params, tiny_cfg, speech):
    """Our whole model over the clip, two frames per call (the default beat), deterministic."""
    template = shared.initial_state(
        params, cfg=tiny_cfg, precision=F32, max_len=N_FRAMES, deterministic=True
    )
    advance = jax.jit(
        functools.partial(voicechat.advance, cfg=tiny_cfg, precision=F32, deterministic=True)
    )
    state, outs = template, []
    key = jnp.zeros((1, 2), jnp.uint32)
    for t in range(0, N_FRAMES, 2):
        state, out = advance(params, state, jnp.asarray(speech[None, t * SPF : (t + 2) * SPF]), key)
        outs.append(jax.device_get(out))
    cat = lambda f: np.concatenate([getattr(o, f)[0] for o in outs])  # noqa: E731
    return {f: cat(f) for f in ("text", "function", "codes", "wav", "transcript", "n_transcript")}


def test_streaming_perception_matches_nemo(params, tiny_cfg, speech, reference):
    """Encoder + proj frame by frame vs NeMo's cache-aware streaming step, one-frame chunks."""
    state = conformer.init_state(tiny_cfg.encoder, 1, F32)
    step = jax.jit(functools.partial(conformer.encoder_step, cfg=tiny_cfg.encoder, precision=F32))
    enc, proj = [], []
    for t in range(N_FRAMES):
        pcm = jnp.asarray(speech[None, t * SPF : (t + 1) * SPF])
        state, e, p = step(params.encoder, state, pcm)
        enc.append(np.asarray(e[0, 0]))
        proj.append(np.asarray(p[0, 0]))
    n = min(N_FRAMES, reference["proj"].shape[0])
    assert n >= N_FRAMES - 1
    assert _rel(np.stack(enc)[:n], reference["enc"][:n]) <= 1e-4
    assert _rel(np.stack(proj)[:n], reference["proj"][:n]) <= 1e-4


def test_listening_half_matches_nemo(params, tiny_cfg, reference):
    """Text and function tokens on every frame and hidden states vs NeMo's per-frame LLM loop.

    Our LLM is fed NeMo's streaming perception here, so that this test isolates the LLM loop;
    ``test_whole_model_matches_nemo`` feeds our own perception end to end.
    """
    cfg = tiny_cfg
    proj = jnp.asarray(reference["proj"])
    T = proj.shape[0]
    state = nano.init_state(cfg.llm, 1, T, F32)
    text_prev = func_prev = jnp.full((1,), PAD_ID, jnp.int32)
    frame = jax.jit(functools.partial(voicechat.listen_frame, cfg=cfg))
    text, func, hidden = [], [], []
    for t in range(T):
        state, tx, fx, h = frame(params, state, text_prev, func_prev, proj[t][None])
        text.append(int(tx[0]))
        func.append(int(fx[0]))
        hidden.append(np.asarray(h[0]))
        text_prev, func_prev = tx, fx
    np.testing.assert_array_equal(text, reference["text"])
    np.testing.assert_array_equal(func, reference["function"])
    assert _rel(np.stack(hidden), reference["hidden"]) <= 1e-4
    assert len(set(text)) >= 3, "a degenerate reference (one repeated token) proves little"


def test_transcript_head_matches_nemo(params, tiny_cfg, reference):
    """RNNT greedy tokens per frame on NeMo's encoder frames vs NeMo's ``GreedyRNNTInfer``."""
    state = rnnt.init_state(tiny_cfg.rnnt, 1, F32)
    state, tokens, n = jax.jit(functools.partial(rnnt.rnnt_step, cfg=tiny_cfg.rnnt))(
        params.rnnt, state, jnp.asarray(reference["enc"])[None]
    )
    ours = [np.asarray(tokens[0, t, : int(n[0, t])]).tolist() for t in range(tokens.shape[1])]
    assert ours == reference["transcript"]


def test_speaking_half_matches_nemo(params, tiny_cfg, nemo_tiny):
    """Deterministic codes on every frame of 72 text frames (PAD, words, EOS) vs NeMo's loop."""
    cfg = tiny_cfg
    rng = np.random.default_rng(3)
    text = rng.integers(23, cfg.llm.vocab_size, size=72)
    text[rng.random(72) < 0.4] = PAD_ID
    text[[20, 50]] = EOS_ID
    ref = nemo_ref.nemo_speak(nemo_tiny, text)
    template = shared.initial_state(
        params, cfg=cfg, precision=F32, max_len=len(text), deterministic=True
    )
    tts_state, codec_state = template.tts, template.codec
    step = jax.jit(functools.partial(ear_tts.tts_step, cfg=cfg, deterministic=True))
    decode = jax.jit(functools.partial(codec.decode_step, cfg=cfg.codec))
    codes, wav = [], []
    for t in range(len(text)):
        tts_state, c, dec = step(params.tts, tts_state, jnp.asarray([text[t]]), None)
        codec_state, w = decode(params.codec, codec_state, dec[:, None])
        codes.append(np.asarray(c[0]))
        wav.append(np.asarray(w[0]))
    np.testing.assert_array_equal(np.stack(codes), ref["codes"])
    _assert_wav_matches(np.concatenate(wav), ref["wav"])


def _assert_wav_matches(stream: np.ndarray, offline: np.ndarray) -> None:
    """Streaming decode = NeMo's offline decode delayed by 8 samples (past the first 6)."""
    n = min(stream.size, offline.size) - 14
    assert n > 0.9 * offline.size
    assert _rel(stream[14 : 14 + n], offline[6 : 6 + n]) <= 1e-4


def test_whole_model_matches_nemo(ours, reference):
    """Our perception, LLM, RNNT, EarTTS and codec end to end, two frames per call, vs NeMo.

    NeMo's clip has one more frame (its end-of-stream flush); the 64 live frames are compared.
    """
    n = N_FRAMES
    assert reference["text"].shape[0] >= n
    np.testing.assert_array_equal(ours["text"], reference["text"][:n])
    np.testing.assert_array_equal(ours["function"], reference["function"][:n])
    np.testing.assert_array_equal(ours["codes"], reference["codes"][:n])
    transcript = [ours["transcript"][t, : ours["n_transcript"][t]].tolist() for t in range(n)]
    assert transcript == reference["transcript"][:n]
    _assert_wav_matches(ours["wav"], reference["wav"][: n * 1764])


def test_one_frame_per_call_equals_two(params, tiny_cfg, speech, ours):
    """k frames in one call equal k calls of one frame, for the whole model."""
    template = shared.initial_state(
        params, cfg=tiny_cfg, precision=F32, max_len=N_FRAMES, deterministic=True
    )
    advance = jax.jit(
        functools.partial(voicechat.advance, cfg=tiny_cfg, precision=F32, deterministic=True)
    )
    state, key, text, codes = template, jnp.zeros((1, 2), jnp.uint32), [], []
    for t in range(16):
        state, out = advance(params, state, jnp.asarray(speech[None, t * SPF : (t + 1) * SPF]), key)
        text.append(int(out.text[0, 0]))
        codes.append(np.asarray(out.codes[0, 0]))
    np.testing.assert_array_equal(text, ours["text"][:16])
    np.testing.assert_array_equal(np.stack(codes), ours["codes"][:16])


def test_system_prompt_template_matches_nemo(params, tiny_cfg, nemo_tiny, speech, reference):
    """A session started from a system-prompt template matches NeMo's run with that prompt.

    NeMo's ``offline_inference`` with prompt tokens puts their embeddings on the user channel of
    the first P positions (text PAD), and its EarTTS loop runs over those positions with PAD
    text; the audio frames then follow. Our template holds all of that; the session's frames
    must equal NeMo's frames P.. of the same run.
    """
    prompt = (1, 40, 77, 123, 2)
    n = 24
    listen = nemo_ref.nemo_listen(nemo_tiny, reference["proj"][:n], system_prompt_ids=list(prompt))
    speak = nemo_ref.nemo_speak(nemo_tiny, np.concatenate([[PAD_ID] * len(prompt), listen["text"]]))
    template = shared.initial_state(
        params, cfg=tiny_cfg, precision=F32, max_len=n, system_prompt=prompt, deterministic=True
    )
    advance = jax.jit(
        functools.partial(voicechat.advance, cfg=tiny_cfg, precision=F32, deterministic=True)
    )
    state, key, text, func, codes = template, jnp.zeros((1, 2), jnp.uint32), [], [], []
    for t in range(0, n, 2):
        state, out = advance(params, state, jnp.asarray(speech[None, t * SPF : (t + 2) * SPF]), key)
        text.extend(np.asarray(out.text[0]).tolist())
        func.extend(np.asarray(out.function[0]).tolist())
        codes.append(np.asarray(out.codes[0]))
    np.testing.assert_array_equal(text, listen["text"])
    np.testing.assert_array_equal(func, listen["function"])
    np.testing.assert_array_equal(np.concatenate(codes), speak["codes"][len(prompt) :])
    assert not np.array_equal(listen["text"], reference["text"][:n]), "the prompt changed nothing"
