"""The release ``config.json`` (NeMo's nested Hydra config) <-> ``ModelConfig``.

The public checkpoint ships the whole training config of ``NemotronVoiceChat`` (docs/model.md §4):
``data.*``, ``model.stt.model.*`` (``DuplexSTTModel``: LLM id, perception, channel weights),
``model.speech_generation.*`` (``DuplexEARTTS``: codec, EarTTS, sampler), ``_rnnt_merge_info``
(the RNNT head grafted on after training). The LLM's sizes live in the LLM's own HF
``config.json`` (``NemotronHConfig`` keys), which NeMo reads through ``AutoConfig``.

Reading rules (style.md "Config"):

- a size the port needs that is missing raises ``ValueError`` naming its full dotted path;
- a key that NeMo / transformers give a constructor default (an eps, a RoPE base, a flag) falls
  back to that library default, and each such fallback is logged: it is what NeMo itself would
  build from the same file;
- a value the port does not implement (``conv_norm_type: batch_norm``, a logit boost, ...) raises
  ``ValueError`` naming the path and the value;
- every key that is not read is collected and logged once as one list.

``config_to_release`` writes the inverse: a config that NeMo 3.0's ``NemotronVoiceChat(cfg)``
builds offline (no pretrained weights are fetched), laid out as the release is, plus the LLM's
``config.json``. ``config_from_release(*config_to_release(c)) == c``. Each section's reader
(``_read_mel``, ``_read_encoder``, ``_read_llm``, ``_read_rnnt``, ``_read_codec``, ``_read_tts``)
has its writer beside it (``_write_mel``, ..., ``llm_config``, ``codec_config``), so the round trip
reads as one table.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np
from absl import logging

from voicechat_jax.config import (
    BOS_ID,
    EOS_ID,
    CodecConfig,
    EncoderConfig,
    LLMConfig,
    MelConfig,
    ModelConfig,
    RNNTConfig,
    SpeechDecoderConfig,
    voicechat_11b,
)

# The LLM whose sizes are known without its config.json (docs/model.md §1.1).
NANO_9B_V2 = "nvidia/NVIDIA-Nemotron-Nano-9B-v2"

# Dotted prefixes of the release config's sections.
STT = "model.stt.model"
PERCEPTION = f"{STT}.perception"
PRE = f"{PERCEPTION}.preprocessor"
ENC = f"{PERCEPTION}.encoder"
SPEECH = "model.speech_generation"
SPEECH_MODEL = f"{SPEECH}.model"
TTS = f"{SPEECH_MODEL}.tts_config"
BACKBONE = f"{TTS}.backbone_config"
CAS = f"{TTS}.cas_config"
CAS_ENC = f"{CAS}.backbone_config.encoder"
MOG = f"{TTS}.mog_head_config"
CODEC = f"{SPEECH_MODEL}.codec_config"
RNNT = "_rnnt_merge_info"

# NeMo class paths written by ``config_to_release``.
_PERCEPTION_CLS = "nemo.collections.speechlm2.modules.perception.AudioPerceptionModule"
_MEL_CLS = "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor"
_CONFORMER_CLS = "nemo.collections.asr.modules.ConformerEncoder"
_IDENTITY_CLS = "nemo.collections.speechlm2.modules.perception.IdentityConnector"
_RNNT_DECODER_CLS = "nemo.collections.asr.modules.RNNTDecoder"
_RNNT_JOINT_CLS = "nemo.collections.asr.modules.RNNTJoint"

_MISSING = object()


class _Reader:
    """Reads dotted paths from a nested dict, remembering which leaves were read."""

    def __init__(self, tree: dict, name: str):
        self.tree = tree
        self.name = name
        self.used: set[str] = set()

    def _lookup(self, path: str) -> Any:
        node: Any = self.tree
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def has(self, path: str) -> bool:
        return self._lookup(path) is not _MISSING

    def _mark(self, path: str, value: Any) -> None:
        # a dict read whole (e.g. rope_parameters) uses all its leaves
        if isinstance(value, dict) and value:
            for k, v in value.items():
                self._mark(f"{path}.{k}", v)
        else:
            self.used.add(path)

    def need(self, path: str) -> Any:
        """The value at ``path``; a missing key raises, naming the full path."""
        value = self._lookup(path)
        if value is _MISSING:
            raise ValueError(f"{self.name} lacks {path!r}, which the port needs")
        self._mark(path, value)
        return value

    def get(self, path: str, default: Any, source: str) -> Any:
        """The value at ``path``, or ``source``'s constructor default (logged)."""
        value = self._lookup(path)
        if value is _MISSING:
            logging.info("%s: %r absent, using the %s default %r", self.name, path, source, default)
            return default
        self._mark(path, value)
        return value

    def expect(self, path: str, allowed: tuple, default: Any = _MISSING, source: str = "") -> Any:
        """The value at ``path``, which must be one of ``allowed`` (the port has no other)."""
        value = self.need(path) if default is _MISSING else self.get(path, default, source)
        if not any(_same(value, a) for a in allowed):
            raise ValueError(
                f"{self.name}: {path!r} is {value!r}; the port implements only {list(allowed)}"
            )
        return value

    def expect_class(self, path: str, cls: str) -> None:
        """A Hydra ``_target_`` that must name ``cls`` (short or dotted)."""
        value = self.need(path)
        if not isinstance(value, str) or value.rsplit(".", 1)[-1] != cls.rsplit(".", 1)[-1]:
            raise ValueError(f"{self.name}: {path!r} is {value!r}; the port implements {cls}")

    def equal(self, path: str, expected: Any, what: str) -> None:
        """An optional key that, when present, must equal a value read elsewhere."""
        value = self._lookup(path)
        if value is _MISSING:
            return
        self._mark(path, value)
        if not _same(value, expected):
            raise ValueError(f"{self.name}: {path!r} is {value!r} but {what} is {expected!r}")

    def unused(self) -> list[str]:
        return sorted(p for p in _leaves(self.tree) if p not in self.used)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or (math.isinf(a) and math.isinf(b) and (a > 0) == (b > 0))
    return a == b


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out += _leaves(v, path + ".")
        else:
            out.append(path)
    return out


def _integral(x: float, path: str) -> int:
    n = round(x)
    if abs(x - n) > 1e-6:
        raise ValueError(f"{path} gives a non-integral size {x!r}")
    return n


def _token_id(token: str, path: str) -> int:
    """Id of a Nemotron special token: '<s>' 1, '</s>' 2, '<SPECIAL_n>' n (docs/model.md §2)."""
    if token == "<s>":
        return BOS_ID
    if token == "</s>":
        return EOS_ID
    m = re.fullmatch(r"<SPECIAL_(\d+)>", token)
    if m is None:
        raise ValueError(f"{path} is {token!r}, not a Nemotron special token")
    return int(m.group(1))


def _int_if_whole(x: float) -> int | float:
    # transformers' strict configs type query_pre_attn_scalar as int
    return int(x) if float(x).is_integer() else x


def _token_name(i: int) -> str:
    return {BOS_ID: "<s>", EOS_ID: "</s>"}.get(i, f"<SPECIAL_{i}>")


def _token_names(llm: LLMConfig) -> dict:
    """The special tokens as both sections of the release name them."""
    return {
        "bos_token": _token_name(llm.bos_id),
        "eos_token": _token_name(llm.eos_id),
        "pad_token": _token_name(llm.pad_id),
    }


# ---------------------------------------------------------------------------------------------
# release <-> ModelConfig: the whole file, then each section's reader with its writer beside it


def read_release(release_cfg: dict, llm_cfg: dict | None = None) -> tuple[ModelConfig, list[str]]:
    """``config_from_release`` plus the dotted paths of the keys not read (release, then LLM)."""
    r = _Reader(release_cfg, "release config.json")
    frame_s = float(r.need("data.frame_length"))
    frame_ms = _integral(frame_s * 1000, "data.frame_length")
    mel = _read_mel(r, frame_s)
    encoder = _read_encoder(r, mel)
    llm, lr = _read_llm(r, llm_cfg)
    codec = _read_codec(r)
    tts = _read_tts(r, codec, llm.vocab_size)
    rnnt = _read_rnnt(r)
    cfg = ModelConfig(encoder=encoder, llm=llm, rnnt=rnnt, tts=tts, codec=codec, frame_ms=frame_ms)
    unused = r.unused() + ([f"llm:{p}" for p in lr.unused()] if lr is not None else [])
    return cfg, unused


def config_from_release(release_cfg: dict, llm_cfg: dict | None = None) -> ModelConfig:
    """``ModelConfig`` of a release ``config.json`` (and the LLM's ``config.json``).

    Without ``llm_cfg`` the LLM must be ``nvidia/NVIDIA-Nemotron-Nano-9B-v2``, whose sizes are
    ``voicechat_11b().llm``'s. Keys that are not read are logged once as one list.
    """
    cfg, unused = read_release(release_cfg, llm_cfg)
    if unused:
        logging.info("release config keys the port does not use (%d): %s", len(unused), unused)
    return cfg


def config_to_release(cfg: ModelConfig, pretrained_llm: str = NANO_9B_V2) -> tuple[dict, dict]:
    """(release ``config.json``, LLM ``config.json``) for ``cfg``; NeMo 3.0 builds the first.

    ``pretrained_llm`` is the id NeMo resolves through ``AutoConfig``/``AutoTokenizer``; keep
    "Nemotron" in it (NeMo's Nemotron code paths key on it). Paths that NeMo reads but that carry
    no architecture (log directories) are set to ".".
    """
    if "Nemotron" not in pretrained_llm:
        raise ValueError(f"pretrained_llm {pretrained_llm!r} must contain 'Nemotron'")
    _check_expressible(cfg)
    release = {
        "data": {
            "frame_length": cfg.frame_ms / 1000,
            "source_sample_rate": cfg.encoder.mel.sample_rate,
            "target_sample_rate": cfg.codec.sample_rate,
        },
        "exp_manager": {"explicit_log_dir": "."},
        "trainer": {},
        "model": {
            "inference_speaker_name": cfg.tts.speaker_name,
            "inference_speaker_reference": None,
            "stt": _write_llm(cfg, pretrained_llm),
            "speech_generation": _write_tts(cfg, pretrained_llm),
        },
        RNNT: _write_rnnt(cfg.rnnt),
    }
    return release, llm_config(cfg)


def _check_expressible(cfg: ModelConfig) -> None:
    """Fields the release config cannot carry must keep the values NeMo derives or fixes."""
    d_enc, d_rnnt, d_tts = EncoderConfig(), RNNTConfig(), SpeechDecoderConfig()
    fixed = (
        ("encoder.pre_encode_cache", cfg.encoder.pre_encode_cache, d_enc.pre_encode_cache),
        ("encoder.drop_pre_encoded", cfg.encoder.drop_pre_encoded, d_enc.drop_pre_encoded),
        ("encoder.ln_eps", cfg.encoder.ln_eps, d_enc.ln_eps),
        ("rnnt.max_symbols", cfg.rnnt.max_symbols, d_rnnt.max_symbols),
        # the char vocabulary is the tokenizer's 256 single characters + padding
        ("tts.char_vocab", cfg.tts.char_vocab, d_tts.char_vocab),
        # NeMo 3.0 runs the char encoder with HF's default attention, which drops the softcap
        ("tts.cas_apply_softcap", cfg.tts.cas_apply_softcap, d_tts.cas_apply_softcap),
        # GatedProjectedSumRMSNorm keeps its default num_codebooks (RVQEARTTSModel's call)
        ("tts.fusion_audio_divisor", cfg.tts.fusion_audio_divisor, d_tts.fusion_audio_divisor),
    )
    for name, value, want in fixed:
        if value != want:
            raise ValueError(f"the release config cannot express {name}={value!r} (NeMo: {want!r})")


def _read_mel(r: _Reader, frame_s: float) -> MelConfig:
    sr = int(r.need("data.source_sample_rate"))
    r.equal(f"{STT}.source_sample_rate", sr, "data.source_sample_rate")
    r.equal("model.stt.data.source_sample_rate", sr, "data.source_sample_rate")
    r.equal(f"{PRE}.sample_rate", sr, "data.source_sample_rate")
    mel_src = "NeMo AudioToMelSpectrogramPreprocessor"
    r.expect_class(f"{PRE}._target_", _MEL_CLS)
    # per-utterance normalisation would not stream; 'NA' is what the release uses
    r.expect(f"{PRE}.normalize", ("NA",), "per_feature", mel_src)
    r.expect(f"{PRE}.window", ("hann",), "hann", mel_src)
    r.expect(f"{PRE}.log", (True,), True, mel_src)
    r.expect(f"{PRE}.log_zero_guard_type", ("add",), "add", mel_src)
    r.expect(f"{PRE}.frame_splicing", (1,), 1, mel_src)
    r.expect(f"{PRE}.mel_norm", ("slaney",), "slaney", mel_src)
    r.expect(f"{PRE}.lowfreq", (0,), 0, mel_src)
    r.expect(f"{PRE}.highfreq", (None, sr / 2), None, mel_src)
    r.expect(f"{PRE}.exact_pad", (False,), False, mel_src)
    window_s = float(r.get(f"{PRE}.window_size", 0.02, mel_src))
    stride_s = float(r.get(f"{PRE}.window_stride", 0.01, mel_src))
    return MelConfig(
        sample_rate=sr,
        n_fft=int(r.need(f"{PRE}.n_fft")),
        win_length=_integral(window_s * sr, f"{PRE}.window_size"),
        hop_length=_integral(stride_s * sr, f"{PRE}.window_stride"),
        n_mels=int(r.need(f"{PRE}.features")),
        preemph=float(r.get(f"{PRE}.preemph", 0.97, mel_src)),
        mag_power=float(r.get(f"{PRE}.mag_power", 2.0, mel_src)),
        log_zero_guard=_guard_value(r.get(f"{PRE}.log_zero_guard_value", 2.0**-24, mel_src)),
        samples_per_frame=_integral(frame_s * sr, "data.frame_length"),
    )


def _write_mel(mel: MelConfig) -> dict:
    """``_read_mel``'s ``preprocessor`` section (the sample rate's copies are in their sections)."""
    return {
        "_target_": _MEL_CLS,
        "sample_rate": mel.sample_rate,
        "normalize": "NA",
        "window_size": mel.win_length / mel.sample_rate,
        "window_stride": mel.hop_length / mel.sample_rate,
        "window": "hann",
        "features": mel.n_mels,
        "n_fft": mel.n_fft,
        "log": True,
        "log_zero_guard_type": "add",
        "log_zero_guard_value": mel.log_zero_guard,
        "frame_splicing": 1,
        "dither": 1e-05,
        "pad_to": 0,
        "pad_value": 0.0,
        "preemph": mel.preemph,
        "mag_power": mel.mag_power,
    }


def _guard_value(value: float | str) -> float:
    # NeMo also accepts the names of float32 constants
    named = {"tiny": float(np.finfo(np.float32).tiny), "eps": float(np.finfo(np.float32).eps)}
    return named[value] if isinstance(value, str) else float(value)


def _read_encoder(r: _Reader, mel: MelConfig) -> EncoderConfig:
    src = "NeMo ConformerEncoder"
    if r.has(f"{PERCEPTION}._target_"):
        r.expect_class(f"{PERCEPTION}._target_", _PERCEPTION_CLS)
    r.expect_class(f"{ENC}._target_", _CONFORMER_CLS)
    r.expect_class(f"{PERCEPTION}.modality_adapter._target_", _IDENTITY_CLS)
    d_model = int(r.need(f"{ENC}.d_model"))
    r.equal(f"{PERCEPTION}.modality_adapter.d_model", d_model, f"{ENC}.d_model")
    r.equal(f"{ENC}.feat_in", mel.n_mels, f"{PRE}.features")
    r.expect(f"{ENC}.feat_out", (-1,), -1, src)
    r.expect(f"{ENC}.subsampling", ("dw_striding",), "striding", src)
    r.expect(f"{ENC}.causal_downsampling", (True,), False, src)
    r.expect(f"{ENC}.self_attention_model", ("rel_pos",), "rel_pos", src)
    # with zero lookahead, chunked_limited (chunk 1) and regular masks are the same
    r.expect(f"{ENC}.att_context_style", ("chunked_limited", "regular"), "regular", src)
    r.expect(f"{ENC}.untie_biases", (True,), True, src)
    r.expect(f"{ENC}.use_bias", (False,), True, src)
    r.expect(f"{ENC}.conv_norm_type", ("layer_norm",), "batch_norm", src)
    r.expect(f"{ENC}.reduction", (None,), None, src)
    r.expect(f"{ENC}.global_tokens", (0,), 0, src)
    conv_kernel = int(r.need(f"{ENC}.conv_kernel_size"))
    r.expect(f"{ENC}.conv_context_size", ("causal", [conv_kernel - 1, 0]), None, src)
    ctx = r.need(f"{ENC}.att_context_size")
    if not (
        isinstance(ctx, list | tuple) and len(ctx) == 2 and all(isinstance(c, int) for c in ctx)
    ):
        raise ValueError(f"{ENC}.att_context_size is {ctx!r}; the port needs one [left, 0] pair")
    if ctx[1] != 0:
        raise ValueError(f"{ENC}.att_context_size is {ctx!r}; the port implements no lookahead")
    channels = int(r.get(f"{ENC}.subsampling_conv_channels", -1, src))
    return EncoderConfig(
        mel=mel,
        d_model=d_model,
        n_layers=int(r.need(f"{ENC}.n_layers")),
        n_heads=int(r.need(f"{ENC}.n_heads")),
        ff_expansion=int(r.get(f"{ENC}.ff_expansion_factor", 4, src)),
        conv_kernel=conv_kernel,
        subsampling_factor=int(r.need(f"{ENC}.subsampling_factor")),
        subsampling_channels=d_model if channels == -1 else channels,
        att_left_context=int(ctx[0]),
        xscaling=bool(r.get(f"{ENC}.xscaling", True, src)),
        pos_emb_max_len=int(r.get(f"{ENC}.pos_emb_max_len", 5000, src)),
        output_dim=int(r.need(f"{PERCEPTION}.output_dim")),
    )


def _write_encoder(enc: EncoderConfig) -> dict:
    """``_read_encoder``'s ``perception`` section, the mel preprocessor inside it."""
    return {
        "_target_": _PERCEPTION_CLS,
        "output_dim": enc.output_dim,
        "preprocessor": _write_mel(enc.mel),
        "encoder": {
            "_target_": _CONFORMER_CLS,
            "feat_in": enc.mel.n_mels,
            "feat_out": -1,
            "n_layers": enc.n_layers,
            "d_model": enc.d_model,
            "subsampling": "dw_striding",
            "subsampling_factor": enc.subsampling_factor,
            "subsampling_conv_channels": enc.subsampling_channels,
            "causal_downsampling": True,
            "ff_expansion_factor": enc.ff_expansion,
            "self_attention_model": "rel_pos",
            "n_heads": enc.n_heads,
            "att_context_size": [enc.att_left_context, 0],
            "att_context_style": "chunked_limited",
            "xscaling": enc.xscaling,
            "untie_biases": True,
            "pos_emb_max_len": enc.pos_emb_max_len,
            "conv_kernel_size": enc.conv_kernel,
            "conv_norm_type": "layer_norm",
            "conv_context_size": "causal",
            "use_bias": False,
            "dropout": 0.1,
            "dropout_pre_encoder": 0.1,
            "dropout_emb": 0.0,
            "dropout_att": 0.1,
        },
        "modality_adapter": {"_target_": _IDENTITY_CLS, "d_model": enc.d_model},
    }


def _read_llm(r: _Reader, llm_cfg: dict | None) -> tuple[LLMConfig, _Reader | None]:
    nemo = "NeMo DuplexSTTModel"
    pretrained = r.need(f"{STT}.pretrained_llm")
    r.expect(f"{STT}.predict_user_text", (False,), False, nemo)
    for boost in ("inference_pad_boost", "inference_bos_boost", "inference_eos_boost"):
        r.expect(f"{STT}.{boost}", (None, 0), None, nemo)
    ids = {}
    for name, default in (("bos", BOS_ID), ("eos", EOS_ID), ("pad", LLMConfig().pad_id)):
        found = []
        for section in (STT, SPEECH_MODEL):
            path = f"{section}.{name}_token"
            if r.has(path):
                found.append(_token_id(r.need(path), path))
        if len(set(found)) > 1:
            raise ValueError(f"{STT} and {SPEECH_MODEL} disagree on the {name} token")
        ids[name] = found[0] if found else default
    weights = dict(
        text_weight=float(r.get(f"{STT}.duplex_text_channel_weight", 1.0, nemo)),
        user_weight=float(r.get(f"{STT}.duplex_user_channel_weight", 1.0, nemo)),
        # NeMo 3.0 has no function channel: the release must say how it weighs it
        function_weight=float(r.need(f"{STT}.duplex_function_channel_weight")),
        use_function_head=bool(r.need(f"{STT}.use_function_head")),
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
    )
    if llm_cfg is None:
        if pretrained != NANO_9B_V2:
            raise ValueError(
                f"{STT}.pretrained_llm is {pretrained!r}: pass its config.json as llm_cfg "
                f"(only {NANO_9B_V2}'s sizes are built in)"
            )
        return dataclasses.replace(voicechat_11b().llm, **weights), None

    lr = _Reader(llm_cfg, f"LLM config.json ({pretrained})")
    hf = "transformers NemotronHConfig"
    lr.expect("model_type", ("nemotron_h",), "nemotron_h", hf)
    if lr.has("hybrid_override_pattern"):
        pattern = lr.need("hybrid_override_pattern")
    else:
        kinds = {"linear_attention": "M", "mlp": "-", "full_attention": "*", "mamba": "M"}
        pattern = "".join(kinds.get(k, "?") for k in lr.need("layers_block_type"))
    if not isinstance(pattern, str) or not set(pattern) <= set("M-*"):
        raise ValueError(f"LLM layer pattern {pattern!r}: the port implements only M, -, *")
    lr.equal("num_hidden_layers", len(pattern), "the layer pattern's length")
    lr.expect("mlp_hidden_act", ("relu2",), "relu2", hf)
    lr.expect("mamba_hidden_act", ("silu",), "silu", hf)
    lr.expect("use_conv_bias", (True,), True, hf)
    lr.expect("mamba_conv_bias", (True,), True, hf)
    for flag in (
        "use_bias",
        "mamba_proj_bias",
        "attention_bias",
        "mlp_bias",
        "tie_word_embeddings",
    ):
        lr.expect(flag, (False,), False, hf)
    # NVIDIA's Mamba code does not clamp dt; a finite limit would change the maths
    lr.expect("time_step_limit", ([0.0, math.inf],), [0.0, math.inf], hf)
    lr.expect("num_nextn_predict_layers", (0,), 0, hf)

    def alias(name: str, other: str) -> Any:
        return lr.need(other) if not lr.has(name) and lr.has(other) else lr.need(name)

    head_dim = alias("head_dim", "attention_head_dim")
    lr.equal("attention_head_dim", head_dim, "head_dim")
    llm = LLMConfig(
        vocab_size=int(lr.need("vocab_size")),
        d_model=int(lr.need("hidden_size")),
        pattern=pattern,
        n_heads=int(lr.need("num_attention_heads")),
        n_kv_heads=int(lr.need("num_key_value_heads")),
        head_dim=int(head_dim),
        mlp_dim=int(lr.need("intermediate_size")),
        mamba_heads=int(lr.need("mamba_num_heads")),
        mamba_head_dim=int(lr.need("mamba_head_dim")),
        ssm_state=int(lr.need("ssm_state_size")),
        n_groups=int(alias("n_groups", "mamba_n_groups")),
        conv_kernel=int(alias("conv_kernel", "mamba_d_conv")),
        norm_eps=float(lr.get("layer_norm_epsilon", 1e-5, hf)),
        **weights,
    )
    return llm, lr


def _write_llm(cfg: ModelConfig, pretrained_llm: str) -> dict:
    """``_read_llm``'s release keys: the ``model.stt`` section, the perception inside it.

    The LLM's own sizes are ``llm_config``'s (its ``config.json``).
    """
    llm, mel = cfg.llm, cfg.encoder.mel
    return {
        "data": {"source_sample_rate": mel.sample_rate},
        "exp_manager": {"explicit_log_dir": "."},
        "model": {
            "pretrained_llm": pretrained_llm,
            "pretrained_weights": False,
            "source_sample_rate": mel.sample_rate,
            "validation_save_path": ".",
            # transformers' native NemotronHForCausalLM: .model, whose input table is .embeddings
            "llm_attr_name": "model",
            "embed_tokens_attr_name": "embeddings",
            "predict_user_text": False,
            "use_function_head": llm.use_function_head,
            "duplex_text_channel_weight": llm.text_weight,
            "duplex_user_channel_weight": llm.user_weight,
            "duplex_function_channel_weight": llm.function_weight,
            **_token_names(llm),
            "perception": _write_encoder(cfg.encoder),
        },
    }


def llm_config(cfg: ModelConfig) -> dict:
    """``_read_llm``'s LLM ``config.json`` (HF ``NemotronHConfig`` keys) of ``cfg.llm``.

    ``time_step_min`` is tiny because transformers' ``nemotron_h`` clamps dt at it, which the
    release's own model code does not (docs/model.md §8 "Mamba dt").
    """
    llm = cfg.llm
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": llm.vocab_size,
        "hidden_size": llm.d_model,
        "hybrid_override_pattern": llm.pattern,
        "num_hidden_layers": llm.n_layers,
        "num_attention_heads": llm.n_heads,
        "num_key_value_heads": llm.n_kv_heads,
        "head_dim": llm.head_dim,
        "intermediate_size": llm.mlp_dim,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": llm.mamba_heads,
        "mamba_head_dim": llm.mamba_head_dim,
        "ssm_state_size": llm.ssm_state,
        "n_groups": llm.n_groups,
        "conv_kernel": llm.conv_kernel,
        "expand": 2,
        "chunk_size": 128,
        "mamba_hidden_act": "silu",
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "use_bias": False,
        "mlp_bias": False,
        "attention_bias": False,
        "layer_norm_epsilon": llm.norm_eps,
        "time_step_min": 1e-30,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "time_step_limit": [0.0, math.inf],
        "mamba_ssm_cache_dtype": "float32",
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "bos_token_id": llm.bos_id,
        "eos_token_id": llm.eos_id,
        "pad_token_id": 0,
        "use_cache": True,
        "num_logits_to_keep": 1,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


def _read_rnnt(r: _Reader) -> RNNTConfig:
    dec, joint = f"{RNNT}.decoder_config", f"{RNNT}.joint_config"
    vocab = int(r.need(f"{dec}.vocab_size"))
    r.equal(f"{joint}.num_classes", vocab, f"{dec}.vocab_size")
    r.equal(f"{RNNT}.rnnt_vocab_size", vocab, f"{dec}.vocab_size")
    pred_hidden = int(r.need(f"{dec}.prednet.pred_hidden"))
    r.equal(f"{joint}.jointnet.pred_hidden", pred_hidden, f"{dec}.prednet.pred_hidden")
    r.expect(f"{joint}.jointnet.activation", ("relu",))
    return RNNTConfig(
        vocab_size=vocab,
        pred_hidden=pred_hidden,
        pred_layers=int(r.need(f"{dec}.prednet.pred_rnn_layers")),
        joint_hidden=int(r.need(f"{joint}.jointnet.joint_hidden")),
        encoder_hidden=int(r.need(f"{joint}.jointnet.encoder_hidden")),
        blank_as_pad=bool(r.get(f"{dec}.blank_as_pad", True, "NeMo RNNTDecoder")),
    )


def _write_rnnt(rnnt: RNNTConfig) -> dict:
    """``_read_rnnt``'s ``_rnnt_merge_info`` section."""
    return {
        "decoder_config": {
            "_target_": _RNNT_DECODER_CLS,
            "vocab_size": rnnt.vocab_size,
            "blank_as_pad": rnnt.blank_as_pad,
            "prednet": {
                "pred_hidden": rnnt.pred_hidden,
                "pred_rnn_layers": rnnt.pred_layers,
                "dropout": 0.2,
            },
        },
        "joint_config": {
            "_target_": _RNNT_JOINT_CLS,
            "num_classes": rnnt.vocab_size,
            # the real list is the RNNT tokenizer's (rnnt_tokenizer/); placeholders here
            "vocabulary": [f"<rnnt_{i}>" for i in range(rnnt.vocab_size)],
            "jointnet": {
                "joint_hidden": rnnt.joint_hidden,
                "activation": "relu",
                # dropout > 0 puts the output Linear at joint_net.2, as in the release
                "dropout": 0.2,
                "encoder_hidden": rnnt.encoder_hidden,
                "pred_hidden": rnnt.pred_hidden,
            },
        },
        "rnnt_vocab_size": rnnt.vocab_size,
    }


def _read_codec(r: _Reader) -> CodecConfig:
    sr = int(r.need("data.target_sample_rate"))
    r.equal(f"{SPEECH}.data.target_sample_rate", sr, "data.target_sample_rate")
    r.expect(f"{CODEC}.groups", (1,))
    r.expect(f"{SPEECH_MODEL}.audio_codec_run_dtype", ("float32",), "float32", "NeMo DuplexEARTTS")
    codec = CodecConfig(
        sample_rate=sr,
        n_fft=int(r.need(f"{CODEC}.n_fft")),
        hop_length=int(r.need(f"{CODEC}.hop_length")),
        base_hidden=int(r.need(f"{CODEC}.base_hidden_size")),
        channel_mult=tuple(int(c) for c in r.need(f"{CODEC}.channel_mult")),
        rates=tuple(int(c) for c in r.need(f"{CODEC}.rates")),
        num_blocks=int(r.need(f"{CODEC}.num_blocks")),
        kernel_size=int(r.need(f"{CODEC}.kernel_size")),
        latent_size=int(r.need(f"{CODEC}.latent_size")),
        n_quantizers=int(r.need(f"{CODEC}.num_quantizers")),
        codebook_size=int(r.need(f"{CODEC}.codebook_size")),
    )
    r.expect(f"{CODEC}.wav_to_token_ratio", (codec.samples_per_frame,))
    return codec


def codec_config(codec: CodecConfig) -> dict:
    """``_read_codec``'s section: what ``DuplexEARTTS`` hands to ``RVQVAEModel``."""
    return {
        "latent_size": codec.latent_size,
        "n_fft": codec.n_fft,
        "hop_length": codec.hop_length,
        "base_hidden_size": codec.base_hidden,
        "channel_mult": list(codec.channel_mult),
        "rates": list(codec.rates),
        "num_blocks": codec.num_blocks,
        "kernel_size": codec.kernel_size,
        "groups": 1,
        "codebook_size": codec.codebook_size,
        "num_quantizers": codec.n_quantizers,
        "wav_to_token_ratio": codec.samples_per_frame,
    }


def _read_tts(r: _Reader, codec: CodecConfig, text_vocab: int) -> SpeechDecoderConfig:
    nemo, hf, t5 = "NeMo DuplexEARTTS", "transformers Gemma3TextConfig", "transformers T5Gemma"
    # the flags NeMo reads as attributes (no default) and the port's fixed choices
    r.expect(f"{TTS}.backbone_type", ("gemma3_text",))
    r.expect(f"{TTS}.use_gated_fusion_for_text_audio", (True,))
    r.expect(f"{TTS}.disable_eos_prediction", (True,))
    r.expect(f"{TTS}.use_subword_flag_emb", (True,))
    r.expect(f"{TTS}.use_bos_eos_emb", (True,))
    r.expect(f"{TTS}.context_hidden_size", (None,))
    r.expect(f"{TTS}.random_target_masking", (False,))
    r.expect(f"{TTS}.pretrained_text_name", (None,), None, nemo)
    r.expect(f"{SPEECH_MODEL}.inference_force_speech_silence_on_eos", (True,), True, nemo)
    r.expect(f"{SPEECH_MODEL}.inference_skip_first_code_prediction_on_init", (True,), True, nemo)
    for special in ("custom_speech_bos_id", "custom_speech_eos_id", "custom_speech_pad_id"):
        r.expect(f"{SPEECH_MODEL}.{special}", (None,), None, nemo)
    r.expect(f"{BACKBONE}.hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh", hf)
    r.expect(f"{BACKBONE}.attention_bias", (False,), False, hf)
    r.expect(f"{BACKBONE}.attn_logit_softcapping", (None,), None, hf)
    r.expect(f"{BACKBONE}.use_bidirectional_attention", (False,), False, hf)

    d_model = int(r.need(f"{BACKBONE}.hidden_size"))
    n_layers = int(r.need(f"{BACKBONE}.num_hidden_layers"))
    n_heads = int(r.need(f"{BACKBONE}.num_attention_heads"))
    n_kv = int(r.need(f"{BACKBONE}.num_key_value_heads"))
    head_dim = int(r.need(f"{BACKBONE}.head_dim"))
    mlp_dim = int(r.need(f"{BACKBONE}.intermediate_size"))
    norm_eps = float(r.get(f"{BACKBONE}.rms_norm_eps", 1e-6, hf))
    scalar = float(r.get(f"{BACKBONE}.query_pre_attn_scalar", 256, hf))
    global_every = _read_global_every(r, n_layers)
    rope_global, rope_local = _read_gemma_rope(r)

    # the char-aware encoder's layer is built like the backbone's (same widths and norms)
    r.expect(f"{CAS}.backbone_type", ("t5gemma",), "t5gemma", "NeMo CharAwareSubwordEncoder")
    r.expect(f"{CAS}.backbone_config.is_encoder_decoder", (False,))
    for key, value in (
        ("hidden_size", d_model),
        ("num_attention_heads", n_heads),
        ("num_key_value_heads", n_kv),
        ("head_dim", head_dim),
        ("intermediate_size", mlp_dim),
    ):
        r.expect(f"{CAS_ENC}.{key}", (value,))
    r.expect(f"{CAS_ENC}.rms_norm_eps", (norm_eps,), 1e-6, t5)
    r.expect(f"{CAS_ENC}.query_pre_attn_scalar", (scalar,), 256, t5)
    r.expect(f"{CAS_ENC}.hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh", t5)
    r.expect(f"{MOG}.intermediate_size", (mlp_dim,))
    r.expect(f"{MOG}.eps", (norm_eps,), 1e-6, "NeMo MoGHead")

    latent = int(r.need(f"{TTS}.latent_size"))
    r.equal(f"{TTS}.hidden_size", d_model, f"{BACKBONE}.hidden_size")
    # NeMo's warm-up: prompt_audio_size // samples_per_frame code frames of the speaker prompt
    r.equal(
        f"{SPEECH}.data.frame_length", codec.samples_per_frame / codec.sample_rate, "a codec frame"
    )
    prompt_s = float(r.need(f"{SPEECH}.data.audio_prompt_duration"))
    prompt_frames = int((prompt_s * codec.sample_rate) // codec.samples_per_frame)
    return SpeechDecoderConfig(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        mlp_dim=mlp_dim,
        norm_eps=norm_eps,
        query_pre_attn_scalar=scalar,
        sliding_window=int(r.get(f"{BACKBONE}.sliding_window", 4096, hf)),
        global_every=global_every,
        rope_local_base=rope_local,
        rope_global_base=rope_global,
        cas_layers=int(r.need(f"{CAS_ENC}.num_hidden_layers")),
        cas_softcap=float(r.get(f"{CAS_ENC}.attn_logit_softcapping", 50.0, t5)),
        cas_rope_base=float(r.get(f"{CAS_ENC}.rope_theta", 1e4, t5)),
        text_vocab=text_vocab,
        latent_size=latent,
        n_quantizers=int(r.need(f"{TTS}.num_quantizers")),
        codebook_size=int(r.need(f"{TTS}.codebook_size")),
        mog_components=int(r.need(f"{MOG}.num_predictions")),
        mog_rank=int(r.need(f"{MOG}.low_rank")),
        mog_mlp_layers=int(r.need(f"{MOG}.num_layers")),
        mog_min_log_std=float(r.get(f"{MOG}.min_log_std", -4.0, "NeMo MoGHead")),
        # NeMo's _get_generation_config hard-codes 8 iterations
        num_iter=int(r.get(f"{SPEECH_MODEL}.inference_num_iterations", 8, nemo)),
        exponent=float(r.need(f"{TTS}.exponent")),
        guidance_scale=float(r.get(f"{SPEECH_MODEL}.inference_guidance_scale", 0.5, nemo)),
        top_p=float(r.get(f"{SPEECH_MODEL}.inference_top_p_or_k", 0.8, nemo)),
        noise_scale=float(r.get(f"{SPEECH_MODEL}.inference_noise_scale", 0.8, nemo)),
        prompt_frames=prompt_frames,
        speaker_name=str(r.need("model.inference_speaker_name")),
    )


def _write_tts(cfg: ModelConfig, pretrained_llm: str) -> dict:
    """``_read_tts``'s keys: the ``model.speech_generation`` section, the codec's inside it."""
    tts, codec = cfg.tts, cfg.codec
    frame_s = cfg.frame_ms / 1000
    backbone = {
        "hidden_size": tts.d_model,
        "intermediate_size": tts.mlp_dim,
        "num_hidden_layers": tts.n_layers,
        "num_attention_heads": tts.n_heads,
        "num_key_value_heads": tts.n_kv_heads,
        "head_dim": tts.head_dim,
        "rms_norm_eps": tts.norm_eps,
        "query_pre_attn_scalar": _int_if_whole(tts.query_pre_attn_scalar),
        "sliding_window": tts.sliding_window,
        "sliding_window_pattern": tts.global_every,
        "rope_theta": tts.rope_global_base,
        "rope_local_base_freq": tts.rope_local_base,
        "attention_dropout": 0.1,
        "use_cache": False,
    }
    cas_encoder = {
        "hidden_size": tts.d_model,
        "intermediate_size": tts.mlp_dim,
        "num_hidden_layers": tts.cas_layers,
        "num_attention_heads": tts.n_heads,
        "num_key_value_heads": tts.n_kv_heads,
        "head_dim": tts.head_dim,
        "rms_norm_eps": tts.norm_eps,
        "query_pre_attn_scalar": _int_if_whole(tts.query_pre_attn_scalar),
        "attn_logit_softcapping": tts.cas_softcap,
        "rope_theta": tts.cas_rope_base,
        "use_cache": False,
        "attention_dropout": 0.1,
    }
    tts_config = {
        "use_gated_fusion_for_text_audio": True,
        "disable_eos_prediction": True,
        "use_bos_eos_emb": True,
        "use_subword_flag_emb": True,
        "use_audio_prompt_frozen_projection": True,
        "num_delay_speech_tokens": 2,
        "backbone_type": "gemma3_text",
        "backbone_model_class": None,
        "backbone_config_class": None,
        "backbone_config": backbone,
        "latent_size": tts.latent_size,
        "codebook_size": tts.codebook_size,
        "num_quantizers": tts.n_quantizers,
        "context_hidden_size": None,
        "cas_config": {
            "backbone_type": "t5gemma",
            "backbone_model_class": None,
            "backbone_config_class": None,
            "backbone_config": {"is_encoder_decoder": False, "encoder": cas_encoder},
        },
        "mog_head_config": {
            "intermediate_size": tts.mlp_dim,
            "num_layers": tts.mog_mlp_layers,
            "low_rank": tts.mog_rank,
            "num_predictions": tts.mog_components,
            "min_log_std": tts.mog_min_log_std,
            "eps": tts.norm_eps,
        },
        "p_uncond": 0.1,
        "label_smoothing": 0.01,
        "max_training_rate": 0.8,
        "quantizer_dropout": 0.5,
        "random_target_masking": False,
        "exponent": tts.exponent,
    }
    speech_model = {
        "pretrained_lm_name": pretrained_llm,
        "pretrained_codec_model": None,
        **_token_names(cfg.llm),
        "audio_codec_run_dtype": "float32",
        "inference_guidance_scale": tts.guidance_scale,
        "inference_top_p_or_k": tts.top_p,
        "inference_noise_scale": tts.noise_scale,
        "inference_force_speech_silence_on_eos": True,
        "codec_config": codec_config(codec),
        "tts_config": tts_config,
    }
    if tts.num_iter != 8:
        speech_model["inference_num_iterations"] = tts.num_iter
    # the prompt duration NeMo floors to whole code frames: a half frame over keeps it exact
    prompt_s = (tts.prompt_frames + 0.5) * codec.samples_per_frame / codec.sample_rate
    return {
        "data": {
            "audio_prompt_duration": prompt_s,
            "frame_length": frame_s,
            "source_sample_rate": codec.sample_rate,
            "target_sample_rate": codec.sample_rate,
        },
        "exp_manager": {"explicit_log_dir": "."},
        "model": speech_model,
    }


def _read_global_every(r: _Reader, n_layers: int) -> int:
    """Gemma-3 makes layer i global iff (i + 1) % sliding_window_pattern == 0 (default 6)."""
    path = f"{BACKBONE}.layer_types"
    if r.has(path):
        types = r.need(path)
        globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
        if len(types) != n_layers or not globals_:
            raise ValueError(f"{path} must list {n_layers} layers with at least one global one")
        every = globals_[0] + 1
        want = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
        if list(types) != want:
            raise ValueError(f"{path} is not periodic ((i + 1) % n == 0 global): {types}")
        return every
    return int(r.get(f"{BACKBONE}.sliding_window_pattern", 6, "transformers Gemma3TextConfig"))


def _read_gemma_rope(r: _Reader) -> tuple[float, float]:
    """(global, local) RoPE bases as Gemma3TextConfig resolves them."""
    hf = "transformers Gemma3TextConfig"
    params = f"{BACKBONE}.rope_parameters"
    if r.has(params):
        for kind in ("full_attention", "sliding_attention"):
            r.expect(f"{params}.{kind}.rope_type", ("default",), "default", hf)
        return (
            float(r.get(f"{params}.full_attention.rope_theta", 1e6, hf)),
            float(r.get(f"{params}.sliding_attention.rope_theta", 1e4, hf)),
        )
    r.expect(f"{BACKBONE}.rope_scaling", (None,), None, hf)
    return (
        float(r.get(f"{BACKBONE}.rope_theta", 1e6, hf)),
        float(r.get(f"{BACKBONE}.rope_local_base_freq", 1e4, hf)),
    )
