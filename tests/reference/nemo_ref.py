"""A tiny random NeMo ``NemotronVoiceChat`` built offline, and pure-NeMo reference runners.

The whole-pipeline parity tests compare the JAX port against what this module computes with
NeMo 3.0 (fp32, CPU, ``.eval()``):

- ``build_tiny_nemo``: ``NemotronVoiceChat(config_to_release(cfg))`` with a local stand-in LLM
  (``make_tiny_llm_config``) and tokenizer (``make_tiny_tokenizer``) in a directory whose name
  holds "Nemotron" (NeMo's Nemotron code paths key on it), random weights of non-trivial scale,
  plus the two heads NeMo 3.0 lacks (docs/model.md §8): ``stt_model.function_head`` (one more
  vocabulary projection of the LLM's last hidden state, a ``torch.nn.Linear`` like ``lm_head``)
  and the RNNT head ``stt_model.rnnt_decoder`` / ``stt_model.rnnt_joint`` (NeMo ASR's
  ``RNNTDecoder`` / ``RNNTJoint`` built from ``_rnnt_merge_info``). Neither runs inside NeMo's
  own loops; ``nemo_listen`` runs the function head.
- ``release_state_dict`` / ``save_release``: the release checkpoint's layout (docs/model.md §4).
- ``nemo_streaming_perception``: NeMo's cache-aware streaming encoder, one-frame chunks.
- ``nemo_listen``: the per-frame LLM loop of ``DuplexSTTStreamingInference`` with the function
  channel added.
- ``nemo_speak``: the EarTTS loop and codec decode of ``NemotronVoiceChat.offline_inference``.
- ``nemo_offline_inference``: NeMo's own ``offline_inference``, to cross-check the runners.
- ``nemo_full_size_key_shapes``: the release's 1,632 key names and shapes, built with its
  parameters on the meta device from ``config_to_release(voicechat_11b())``.

Speech sampling is made deterministic (docs/model.md §8): ``top_p_or_k=1`` (an int selects the top
component) and ``noise_scale=0.0``; the guidance scale stays the release's
(``deterministic_generation_config``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import tempfile
from unittest import mock

import numpy as np
import torch

from tests.reference.tiny_tokenizer import make_tiny_llm_config, make_tiny_tokenizer
from voicechat_jax.config import ModelConfig, voicechat_11b
from voicechat_jax.release_config import RNNT, config_to_release

# The directory name of the stand-in LLM: NeMo branches on "Nemotron" in pretrained_llm.
LLM_DIR_NAME = "Tiny-Nemotron-H"
FULL_LLM_DIR_NAME = "NVIDIA-Nemotron-Nano-9B-v2"


def _nemo():
    # NeMo is imported lazily: importing it costs seconds and the env must be set first
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from nemo.collections.speechlm2.models.nemotron_voicechat import NemotronVoiceChat

    return NemotronVoiceChat


def _write_llm_dir(cfg: ModelConfig, directory: pathlib.Path) -> str:
    make_tiny_tokenizer(directory, cfg.llm.vocab_size)
    with open(directory / "config.json", "w") as f:
        json.dump(make_tiny_llm_config(cfg), f, indent=1)
    return str(directory)


def _rnnt_modules(release_cfg: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """NeMo's ``RNNTDecoder`` and ``RNNTJoint`` as ``_rnnt_merge_info`` describes them."""
    from nemo.collections.asr.modules import RNNTDecoder, RNNTJoint

    info = release_cfg[RNNT]
    dec = {k: v for k, v in info["decoder_config"].items() if k != "_target_"}
    joint = {k: v for k, v in info["joint_config"].items() if k != "_target_"}
    return RNNTDecoder(**dec), RNNTJoint(**joint)


def _add_missing_heads(model, release_cfg: dict, cfg: ModelConfig) -> None:
    """The function head and RNNT head the release has and NeMo 3.0 lacks (docs/model.md §8)."""
    stt = model.stt_model
    # the release's function_head starts as a deepcopy of lm_head: same module type and shape
    stt.function_head = copy.deepcopy(stt.lm_head)
    stt.rnnt_decoder, stt.rnnt_joint = _rnnt_modules(release_cfg)
    # the baked voice: tts_model.audio_prompt_latents.<speaker> [1, prompt_frames, D]
    latent = torch.zeros(1, cfg.tts.prompt_frames, cfg.tts.d_model)
    model.tts_model.audio_prompt_latents[cfg.tts.speaker_name] = torch.nn.Parameter(
        latent, requires_grad=False
    )


def _inv_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


@torch.no_grad()
def _randomize(model, cfg: ModelConfig, gen: torch.Generator) -> None:
    """Random weights that keep activations at unit scale and token choices non-degenerate.

    Matrices: N(0, 1/fan_in) (unit gain); embedding tables N(0, 1); 1-D weights (norms, gates,
    scales): their init plus N(0, 0.1), so (1+w) and plain norms are both not all ones; biases
    N(0, 0.05). Mamba dt_bias is drawn as softplus^-1 of U(1e-3, 1e-1) (the usual dt range; the
    stand-in's tiny time_step_min would otherwise give dt ~ 0), A_log stays log(1..H). The text
    heads are scaled x3 so the argmax margins are wide and vary over frames.
    """

    def randn(shape):
        return torch.randn(tuple(shape), generator=gen)

    tables = {
        f"{mod_name}.weight"
        for mod_name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Embedding)
    }
    for name, p in model.named_parameters():
        if name.endswith("dt_bias"):
            u = torch.rand(p.shape, generator=gen)
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(_inv_softplus(dt))
        elif name.endswith("A_log"):
            continue
        elif p.ndim >= 2:
            if name in tables or "audio_prompt_latents" in name:
                p.copy_(randn(p.shape))
            else:
                fan_in = p[0].numel()
                p.copy_(randn(p.shape) / math.sqrt(fan_in))
        elif name.endswith("bias"):
            p.copy_(0.05 * randn(p.shape))
        else:
            p.add_(0.1 * randn(p.shape))
    for mod in model.modules():
        # a padding row gets no gradient in training: it stays zero
        if isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None:
            mod.weight[mod.padding_idx].zero_()
    stt = model.stt_model
    stt.lm_head.weight.mul_(3.0)
    stt.function_head.weight.mul_(3.0)
    # the RNNT embedding's blank row is the padding row (blank_as_pad): keep it zero
    if cfg.rnnt.blank_as_pad:
        stt.rnnt_decoder.prediction["embed"].weight[cfg.rnnt.blank_id].zero_()
    # buffers derived from the codec: re-derive them from the randomized codec, as NeMo does
    tts = model.tts_model
    tts.tts_model.set_rvq_embs(torch.stack([m.detach() for m in tts.audio_codec.prvq.mus_list], 0))
    tts.codec_silence_tokens = tts.get_codec_silence_frame()


def build_tiny_nemo(cfg: ModelConfig, workdir: str | os.PathLike, seed: int = 0):
    """A random NeMo ``NemotronVoiceChat`` of ``cfg``: CPU, fp32, ``.eval()``, offline.

    ``workdir/Tiny-Nemotron-H/`` receives the stand-in LLM ``config.json`` and tokenizer; its
    path is the model's ``pretrained_llm``. ``model.release_cfg`` holds the release config the
    model was built from (with that path).
    """
    NemotronVoiceChat = _nemo()
    workdir = pathlib.Path(workdir)
    llm_dir = _write_llm_dir(cfg, workdir / LLM_DIR_NAME)
    release_cfg, _ = config_to_release(cfg, pretrained_llm=llm_dir)
    log_dir = str(workdir / "logs")
    release_cfg["exp_manager"]["explicit_log_dir"] = log_dir
    for part in ("stt", "speech_generation"):
        release_cfg["model"][part]["exp_manager"]["explicit_log_dir"] = log_dir
    release_cfg["model"]["stt"]["model"]["validation_save_path"] = log_dir
    torch.manual_seed(seed)
    model = NemotronVoiceChat(copy.deepcopy(release_cfg))
    _add_missing_heads(model, release_cfg, cfg)
    gen = torch.Generator().manual_seed(seed)
    _randomize(model, cfg, gen)
    model = model.float().eval()
    model.release_cfg = release_cfg
    return model


def release_state_dict(model) -> dict[str, np.ndarray]:
    """Every tensor of the model under its release name (``stt_model.*``, ``tts_model.*``)."""
    out = {}
    for name, t in model.state_dict().items():
        if not name.startswith(("stt_model.", "tts_model.")):
            raise ValueError(f"unexpected tensor {name}")
        out[name] = t.detach().cpu().numpy().copy()
    return out


def save_release(model, cfg: ModelConfig, directory: str | os.PathLike) -> None:
    """Writes ``config.json`` (``model.release_cfg``) + ``model.safetensors`` like the release.

    The LLM's ``config.json`` and tokenizer stay where ``pretrained_llm`` points.
    """
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    release_cfg = getattr(model, "release_cfg", None) or config_to_release(cfg)[0]
    with open(directory / "config.json", "w") as f:
        json.dump(release_cfg, f, indent=1)
    # ascontiguousarray alone would turn a 0-d buffer into shape [1]; the release keeps []
    tensors = {
        k: np.ascontiguousarray(v).reshape(v.shape) for k, v in release_state_dict(model).items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# reference runners


@torch.no_grad()
def nemo_offline_perception(model, audio_16k: np.ndarray) -> np.ndarray:
    """``perception`` over the whole clip, as ``offline_inference`` runs it: [T, D_llm]."""
    signal = torch.as_tensor(np.asarray(audio_16k, np.float32))[None]
    lens = torch.tensor([signal.shape[1]])
    encoded, _ = model.stt_model.perception(input_signal=signal, input_signal_length=lens)
    return encoded[0].numpy()


class _PerceptionAsASR:
    """What ``CacheAwareStreamingAudioBuffer`` reads from an ASR model, over the perception."""

    def __init__(self, perception):
        from omegaconf import DictConfig

        self.encoder = perception.encoder
        self.preprocessor = perception.preprocessor
        self._cfg = DictConfig({"preprocessor": perception.cfg.preprocessor})
        self.from_config_dict = perception.from_config_dict
        self.device = next(perception.parameters()).device


@torch.no_grad()
def nemo_streaming_perception(model, audio_16k: np.ndarray, *, return_encoder: bool = False):
    """Perception through NeMo's cache-aware streaming path: [T, D_llm].

    With ``return_encoder`` also the encoder frames [T, D_enc] (what the RNNT head reads).

    Mirrors NeMo's ``speech_to_text_cache_aware_streaming_infer.py``: the encoder's default
    ``setup_streaming_params()`` (one encoder frame per chunk: mel frame 0 alone, then 8 new
    mel frames after 9 cached ones, 2 pre-encoded frames dropped),
    ``CacheAwareStreamingAudioBuffer`` over the whole clip's mel (dither 0, pad_to 0),
    ``get_initial_cache_state`` and
    ``cache_aware_stream_step`` per chunk (nothing dropped at step 0, all outputs kept on the
    last chunk); then ``modality_adapter`` (identity) and ``perception.proj`` per frame.
    """
    from nemo.collections.asr.parts.utils.streaming_utils import CacheAwareStreamingAudioBuffer

    perception = model.stt_model.perception
    encoder = perception.encoder
    encoder.setup_streaming_params()
    buffer = CacheAwareStreamingAudioBuffer(
        model=_PerceptionAsASR(perception), online_normalization=False
    )
    buffer.append_audio(np.asarray(audio_16k, np.float32))
    cache_channel, cache_time, cache_len = encoder.get_initial_cache_state(batch_size=1)
    frames = []
    for step, (chunk, chunk_len) in enumerate(buffer):
        out = encoder.cache_aware_stream_step(
            processed_signal=chunk,
            processed_signal_length=chunk_len,
            cache_last_channel=cache_channel,
            cache_last_time=cache_time,
            cache_last_channel_len=cache_len,
            keep_all_outputs=buffer.is_buffer_empty(),
            drop_extra_pre_encoded=0 if step == 0 else encoder.streaming_cfg.drop_extra_pre_encoded,
        )
        encoded, encoded_len, cache_channel, cache_time, cache_len = out
        frames.append(encoded[0, :, : int(encoded_len[0])])
    encoded = torch.cat(frames, dim=-1)[None]  # [1, C, T]
    adapted, _ = perception.modality_adapter(audio_signal=encoded, length=None)
    proj = perception.proj(adapted.transpose(1, 2))[0].numpy()
    return (proj, encoded[0].T.numpy()) if return_encoder else proj


@torch.no_grad()
def nemo_rnnt_frames(model, encoder_frames: np.ndarray, max_symbols: int) -> list[list[int]]:
    """NeMo's greedy RNNT decoding (``GreedyRNNTInfer``) of [T, D_enc]: labels per frame."""
    from nemo.collections.asr.parts.submodules import rnnt_greedy_decoding as greedy

    dec, joint = model.stt_model.rnnt_decoder, model.stt_model.rnnt_joint
    enc = torch.as_tensor(np.asarray(encoder_frames, np.float32)).T[None]  # [1, D, T]
    T = enc.shape[-1]
    infer = greedy.GreedyRNNTInfer(
        dec, joint, blank_index=dec.blank_idx, max_symbols_per_step=max_symbols
    )
    (hyp,) = infer(encoder_output=enc, encoded_lengths=torch.tensor([T]))[0]
    out: list[list[int]] = [[] for _ in range(T)]
    labels, stamps = np.asarray(hyp.y_sequence).tolist(), np.asarray(hyp.timestamp).tolist()
    for k, t in zip(labels, stamps, strict=True):
        out[int(t)].append(int(k))
    return out


@torch.no_grad()
def nemo_listen(
    model,
    perception_frames: np.ndarray,
    system_prompt_ids: list[int] | None = None,
    *,
    function_channel: bool = True,
) -> dict[str, np.ndarray]:
    """The per-frame LLM loop of ``DuplexSTTStreamingInference``, plus the function channel.

    Mirrors ``_init_inference`` (the prompt's token embeddings occupy the user-audio slot of
    the first positions, whose outputs are not taken; the user channel is weighted;
    ``_get_bos_embedding`` adds E[PAD] at position 0), ``_step_zero`` and ``_step_inference``
    (position t adds E[text_{t-1}]; the whole prefix is re-run without a cache, as NeMo does
    for Nemotron; greedy argmax). The function channel (docs/model.md §2; absent from NeMo 3.0) is
    added the same way: E[PAD] at position 0, E[func_{t-1}] at t, both times
    ``duplex_function_channel_weight``, and ``func_t = argmax function_head(h_t)`` on the same
    last hidden state. ``function_channel=False`` leaves NeMo's loop as it is.

    ``perception_frames`` [T, D]: ``perception`` outputs. ``system_prompt_ids``: the ids placed
    on the user slot (docs/model.md §2 uses [BOS] + tokens + [EOS]). Returns the T audio
    positions' ``text`` [T], ``function`` [T] (PAD when ``function_channel`` is off) and
    ``hidden`` [T, D] (the LLM's last hidden state, before the heads).
    """
    stt = model.stt_model
    cfg = stt.cfg
    text_w = cfg.get("duplex_text_channel_weight", 1.0)
    user_w = cfg.get("duplex_user_channel_weight", 1.0)
    func_w = cfg.get("duplex_function_channel_weight", 1.0)
    pad = stt.text_pad_id
    source = torch.as_tensor(np.asarray(perception_frames, np.float32))[None]
    prompt = list(system_prompt_ids or [])
    if prompt:
        prompt_emb = stt.embed_tokens(torch.tensor([prompt]))
        source = torch.cat([prompt_emb, source], dim=1)
    n_prompt, T = len(prompt), source.shape[1]
    embeds = source * user_w
    text = torch.full((T,), pad, dtype=torch.long)
    func = torch.full((T,), pad, dtype=torch.long)
    hidden = torch.zeros(T, embeds.shape[-1])
    embeds[:, 0] += stt._get_bos_embedding()[0] * text_w
    if function_channel:
        embeds[:, 0] += stt._get_bos_embedding()[0] * func_w
    for t in range(T):
        if t > 0:
            embeds[:, t] += stt.embed_tokens(text[t - 1 : t])[0] * text_w
            if function_channel:
                embeds[:, t] += stt.embed_tokens(func[t - 1 : t])[0] * func_w
        # DuplexSTTModel.forward with cache=None, keeping the hidden state
        out = stt.llm(inputs_embeds=embeds[:, : t + 1], use_cache=False, return_dict=True)
        h = out["last_hidden_state"][0, -1]
        hidden[t] = h
        if t < n_prompt:
            continue
        text[t] = stt.lm_head(h).argmax(-1)
        if function_channel:
            func[t] = stt.function_head(h).argmax(-1)
    return {
        "text": text[n_prompt:].numpy(),
        "function": func[n_prompt:].numpy(),
        "hidden": hidden[n_prompt:].numpy(),
    }


def _speaker_name(model) -> str:
    return model.cfg.get("inference_speaker_name")


@torch.no_grad()
def nemo_speak(
    model, text_tokens: np.ndarray, generation_config: dict | None = None
) -> dict[str, np.ndarray]:
    """EarTTS per frame and the codec decode, as ``NemotronVoiceChat.offline_inference`` runs it.

    Warm-up: ``set_init_inputs(speaker_name=...)`` (the baked latent) + ``get_init_inputs``,
    one prefill of the backbone with CFG; the first "previous code" is the warm-up's last code
    frame (the mask frame) and the first "previous subword" the warm-up's last subword.
    Frame 0 is skipped: its codes stay 0. Frames t >= 1 call ``infer_codes_one_step`` with
    ``text[t]`` (inside it, when ``text[t]`` is EOS the step's previous codes are replaced by
    ``codec_silence_tokens`` before the step runs). Then one offline ``audio_codec.decode`` of all
    T frames (no control-code replacement, as in ``offline_inference``).

    ``text_tokens`` [T]; ``generation_config`` defaults to
    ``deterministic_generation_config(model)``. Returns ``codes`` [T, Q] and ``wav``
    [T * samples_per_frame].
    """
    from nemo.collections.speechlm2.parts.precision import fp32_precision

    tts = model.tts_model
    if generation_config is None:
        generation_config = deterministic_generation_config(model)
    text = torch.as_tensor(np.asarray(text_tokens, np.int64))[None]  # [1, T]
    T = text.shape[1]
    tts.set_init_inputs(
        speaker_audio=None, speaker_audio_lens=None, speaker_name=_speaker_name(model)
    )
    init_inputs = tts.get_init_inputs(B=1)
    init_inputs.update({"use_cache": True, "past_key_values": None, "guidance_enabled": True})
    outputs = tts.tts_model(**init_inputs)
    code = init_inputs["code"][:, -1:]
    past_key_values = outputs.past_key_values
    codes = torch.zeros(1, T, tts.tts_model.config.num_quantizers, dtype=torch.long)
    first_context_subword_id = init_inputs["subword_ids"][:, -1].unsqueeze(-1)
    for t in range(1, T):
        prev = first_context_subword_id if t == 1 else text[:, t - 1 : t]
        code, past_key_values = tts.infer_codes_one_step(
            current_subword_id=text[:, t : t + 1],
            prev_subword_id=prev,
            current_subword_mask=torch.ones(1, 1, dtype=torch.bool),
            prev_audio_tokens=code,
            past_key_values=past_key_values,
            guidance_enabled=True,
            generation_config=generation_config,
            ignore_eos_flag_stop=True,
        )
        codes[:, t] = code.squeeze(1)
    with fp32_precision():
        wav, _ = tts.audio_codec.decode(codes, torch.tensor([T]))
    return {"codes": codes[0].numpy(), "wav": wav.reshape(-1).numpy()}


def deterministic_generation_config(model) -> dict:
    """``DuplexEARTTS._get_generation_config(True)`` with top-1 components and no noise."""
    return {
        "num_iter": 8,  # NeMo hard-codes it
        "guidance_scale": model.tts_model.cfg.get("inference_guidance_scale"),
        "top_p_or_k": 1,
        "noise_scale": 0.0,
        "eos_threshold": -3.0,
    }


@torch.no_grad()
def nemo_offline_inference(
    model, audio_16k: np.ndarray, system_prompt_ids: list[int] | None = None
) -> dict[str, np.ndarray]:
    """NeMo's own ``NemotronVoiceChat.offline_inference`` (deterministic speech sampling).

    Returns ``text`` [T] (NeMo's ``tokens_text``: the T audio positions), ``codes`` [P + T, Q]
    (recorded from the ``infer_codes_one_step`` calls; NeMo's EarTTS runs over the P prompt
    positions too, with PAD text, and frame 0 stays 0) and ``wav`` (all P + T frames). So
    ``nemo_speak([PAD] * P + text)`` reproduces ``codes`` and ``wav``.
    """
    signal = torch.as_tensor(np.asarray(audio_16k, np.float32))[None]
    kwargs = {}
    if system_prompt_ids:
        kwargs = {
            "prompt_tokens": torch.tensor([list(system_prompt_ids)]),
            "prompt_token_lens": torch.tensor([len(system_prompt_ids)]),
        }
    recorded = []
    step = model.tts_model.infer_codes_one_step

    def recording_step(*args, **kw):
        code, cache = step(*args, **kw)
        recorded.append(code[0, 0].clone())
        return code, cache

    with mock.patch.object(model.tts_model, "infer_codes_one_step", recording_step):
        ans = model.offline_inference(
            signal,
            torch.tensor([signal.shape[1]]),
            generation_config=deterministic_generation_config(model),
            **kwargs,
        )
    codes = np.zeros((1 + len(recorded), model.tts_model.tts_model.config.num_quantizers), np.int64)
    for i, c in enumerate(recorded):
        codes[1 + i] = c.numpy()
    return {"text": ans["tokens_text"][0].numpy(), "codes": codes, "wav": ans["audio"][0].numpy()}


# ---------------------------------------------------------------------------------------------
# full-size layout


def nemo_full_size_key_shapes() -> dict[str, tuple[int, ...]]:
    """Names and shapes of the release's tensors, from NeMo built on the meta device.

    ``NemotronVoiceChat(config_to_release(voicechat_11b()))`` with its parameters on the meta device
    (allocates no weights; NeMo 3.0 yields 1,616 tensors), the stand-in 9B LLM config and a
    full-size (131,072-id) stand-in tokenizer, plus ``function_head`` and the RNNT head's 15
    tensors: 1,632 names. The codec's silence frame, which NeMo computes by encoding 10 s of
    zeros, cannot be computed without weights and is stubbed (its shape [Q] is kept).
    """

    with tempfile.TemporaryDirectory() as workdir:
        return _full_size_key_shapes(pathlib.Path(workdir))


def _full_size_key_shapes(workdir: pathlib.Path) -> dict[str, tuple[int, ...]]:
    from accelerate import init_empty_weights
    from nemo.collections.speechlm2.models.duplex_ear_tts import DuplexEARTTS

    NemotronVoiceChat = _nemo()
    cfg = voicechat_11b()
    llm_dir = _write_llm_dir(cfg, workdir / FULL_LLM_DIR_NAME)
    release_cfg, _ = config_to_release(cfg, pretrained_llm=llm_dir)
    release_cfg["exp_manager"]["explicit_log_dir"] = str(workdir / "logs")

    def silence_frame(self):
        return torch.zeros(cfg.codec.n_quantizers, dtype=torch.long)

    # parameters on the meta device, buffers real: NeMo's ConvSubsampling sizes its Linear from
    # a tensor computation (``int(calc_length(torch.tensor(feat_in)))``), which a global
    # ``torch.device("meta")`` cannot evaluate
    with (
        init_empty_weights(include_buffers=False),
        mock.patch.object(DuplexEARTTS, "get_codec_silence_frame", silence_frame),
    ):
        model = NemotronVoiceChat(copy.deepcopy(release_cfg))
        _add_missing_heads(model, release_cfg, cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
