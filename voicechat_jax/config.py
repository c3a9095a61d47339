"""Frozen, hashable configs: the model architecture and the two named presets.

``ModelConfig`` gathers one dataclass per sub-network. Field names are this project's; the mapping
to and from the release's nested ``config.json`` (plus the LLM's own ``config.json``) lives in
``voicechat_jax.release_config``. Derived sizes are properties; invariants are checked in
``__post_init__``. ``voicechat_11b()`` holds the release's values, ``tiny()`` a small random-weight
model with every kind of layer present, used by the tests.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax

from voicechat_jax import precision as precision_lib
from voicechat_jax.precision import Precision

# Special token ids of the Nemotron text tokenizer (docs/model.md §2): <s>, </s>, <SPECIAL_12>.
BOS_ID = 1
EOS_ID = 2
PAD_ID = 12


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class MelConfig:
    """NeMo ``AudioToMelSpectrogramPreprocessor`` as the release configures it (eval mode)."""

    sample_rate: int = 16000
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    n_mels: int = 128
    preemph: float = 0.97
    mag_power: float = 2.0
    log_zero_guard: float = 2.0**-24  # NeMo's 'add' guard
    samples_per_frame: int = 1280  # one 80 ms model frame

    def __post_init__(self):
        _check(self.samples_per_frame % self.hop_length == 0, "frame must be whole mel hops")

    @property
    def n_freq(self) -> int:
        return self.n_fft // 2 + 1

    @property
    def mels_per_frame(self) -> int:
        return self.samples_per_frame // self.hop_length


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Cache-aware causal FastConformer (``ConformerEncoder``) plus ``perception.proj``."""

    mel: MelConfig = MelConfig()
    d_model: int = 1024
    n_layers: int = 24
    n_heads: int = 8
    ff_expansion: int = 4
    conv_kernel: int = 9
    subsampling_factor: int = 8
    subsampling_channels: int = 256
    att_left_context: int = 70  # att_context_size [70, 0]: 70 frames left, no lookahead
    xscaling: bool = True  # rel-pos encoding scales its input by sqrt(d_model)
    pos_emb_max_len: int = 5000
    output_dim: int = 4480  # perception.proj out = LLM width
    pre_encode_cache: int = 9  # mel frames kept for the subsampling convs (NeMo streaming cfg)
    drop_pre_encoded: int = 2
    ln_eps: float = 1e-5

    def __post_init__(self):
        _check(self.d_model % self.n_heads == 0, "encoder d_model must divide by n_heads")
        _check(self.subsampling_factor == 8, "only dw_striding x8 is supported")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        return self.d_model * self.ff_expansion

    @property
    def subsampled_freq(self) -> int:
        f = self.mel.n_mels
        for _ in range(int(math.log2(self.subsampling_factor))):
            f = (f + 2 + 1 - 3) // 2 + 1  # causal padding (2 before, 1 after), k 3, stride 2
        return f


@dataclasses.dataclass(frozen=True)
class LLMConfig:
    """Nemotron-H hybrid backbone (Nemotron-Nano-9B-v2) with the duplex input sum and heads."""

    vocab_size: int = 131072
    d_model: int = 4480
    pattern: str = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
    n_heads: int = 40
    n_kv_heads: int = 8
    head_dim: int = 128
    mlp_dim: int = 15680
    mamba_heads: int = 128
    mamba_head_dim: int = 80
    ssm_state: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    norm_eps: float = 1e-5
    text_weight: float = 1.0  # duplex_text_channel_weight
    user_weight: float = 1.0  # duplex_user_channel_weight
    function_weight: float = 2.0  # duplex_function_channel_weight
    use_function_head: bool = True
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID

    def __post_init__(self):
        _check(set(self.pattern) <= set("M-*"), f"unknown layer kind in pattern {self.pattern!r}")
        _check(self.n_heads % self.n_kv_heads == 0, "LLM n_heads must divide by n_kv_heads")
        _check(self.mamba_heads % self.n_groups == 0, "mamba heads must divide by n_groups")
        _check(max(self.bos_id, self.eos_id, self.pad_id) < self.vocab_size, "special ids >= V")

    @property
    def n_layers(self) -> int:
        return len(self.pattern)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of one kind: 'M' Mamba-2, '-' MLP, '*' attention."""
        return tuple(i for i, k in enumerate(self.pattern) if k == kind)

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state

    @property
    def in_proj_dim(self) -> int:
        return self.d_inner + self.conv_dim + self.mamba_heads


@dataclasses.dataclass(frozen=True)
class RNNTConfig:
    """The RNNT transcript side head: LSTM prediction net + joint, greedy decoding."""

    vocab_size: int = 1024  # blank is id vocab_size
    pred_hidden: int = 640
    pred_layers: int = 2
    joint_hidden: int = 640
    encoder_hidden: int = 1024
    max_symbols: int = 10  # per encoder frame
    # _rnnt_merge_info.decoder_config.blank_as_pad: the prediction embedding has a zero blank row
    blank_as_pad: bool = True

    @property
    def blank_id(self) -> int:
        return self.vocab_size


@dataclasses.dataclass(frozen=True)
class SpeechDecoderConfig:
    """EarTTS (``RVQEARTTSModel``): Gemma-3 backbone, char-aware text side, MoG head, sampler."""

    d_model: int = 1152
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 16
    head_dim: int = 72
    mlp_dim: int = 4608
    norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 7500
    global_every: int = 6  # layer i is global iff (i + 1) % global_every == 0
    rope_local_base: float = 10000.0
    rope_global_base: float = 1000000.0
    # char-aware subword encoder
    char_vocab: int = 257  # 256 single-char tokens + padding
    cas_layers: int = 1
    cas_softcap: float = 50.0  # attn_logit_softcapping of the release's T5Gemma encoder config
    # NeMo 3.0 runs that encoder with HF's default 'sdpa' attention, which ignores the softcap:
    # False mirrors NeMo; True applies it (HF 'eager', and ports such as mlx-vlm)
    cas_apply_softcap: bool = False
    cas_rope_base: float = 10000.0  # T5Gemma encoder's default rope_theta
    # text token ids (Nemotron tokenizer): sizes the char encoder's flag buffers ([V + 1] / [V])
    text_vocab: int = 131072
    # heads and codes
    latent_size: int = 512
    n_quantizers: int = 31
    codebook_size: int = 1024  # id codebook_size is the mask / speech pad
    mog_components: int = 1024
    mog_rank: int = 64
    mog_mlp_layers: int = 3
    mog_min_log_std: float = -4.0
    # sampler (released values; docs/model.md §3)
    num_iter: int = 8
    exponent: float = 3.0
    guidance_scale: float = 0.2
    top_p: float = 0.95
    noise_scale: float = 0.001
    prompt_frames: int = 37  # audio_prompt_latents length (3.0 s)
    # GatedProjectedSumRMSNorm divides the audio side by its num_codebooks, which keeps its
    # default 31 whatever n_quantizers is (RVQEARTTSModel passes n_quantizers into final_norm)
    fusion_audio_divisor: int = 31
    # model.inference_speaker_name: the baked voice, tts_model.audio_prompt_latents.<name>
    speaker_name: str = "Aria"

    def __post_init__(self):
        _check(self.n_heads % self.n_kv_heads == 0, "speech decoder heads must divide by kv heads")

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.global_every == 0

    @property
    def layer_is_global(self) -> tuple[bool, ...]:
        return tuple(self.is_global(i) for i in range(self.n_layers))


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """RVQ-VAE codec (``RVQVAEModel``): 22.05 kHz, one code frame = prod(rates) * hop samples."""

    sample_rate: int = 22050
    n_fft: int = 16
    hop_length: int = 4
    base_hidden: int = 384
    channel_mult: tuple[int, ...] = (1, 2, 4)
    rates: tuple[int, ...] = (7, 7, 9)
    num_blocks: int = 3
    kernel_size: int = 7
    latent_size: int = 512
    n_quantizers: int = 31
    codebook_size: int = 1024

    def __post_init__(self):
        _check(len(self.channel_mult) == len(self.rates), "one channel_mult per rate")

    @property
    def samples_per_frame(self) -> int:
        return self.hop_length * math.prod(self.rates)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The whole Nemotron VoiceChat model."""

    encoder: EncoderConfig = EncoderConfig()
    llm: LLMConfig = LLMConfig()
    rnnt: RNNTConfig = RNNTConfig()
    tts: SpeechDecoderConfig = SpeechDecoderConfig()
    codec: CodecConfig = CodecConfig()
    frame_ms: int = 80

    def __post_init__(self):
        _check(self.encoder.output_dim == self.llm.d_model, "perception.proj must emit LLM width")
        _check(self.rnnt.encoder_hidden == self.encoder.d_model, "RNNT joint reads encoder width")
        _check(self.tts.latent_size == self.codec.latent_size, "speech decoder/codec latent")
        _check(self.tts.text_vocab == self.llm.vocab_size, "speech decoder reads LLM text ids")
        _check(self.tts.n_quantizers == self.codec.n_quantizers, "speech decoder/codec Q")
        _check(self.tts.codebook_size == self.codec.codebook_size, "speech decoder/codec codebook")
        _check(
            self.encoder.mel.samples_per_frame * 1000
            == self.frame_ms * self.encoder.mel.sample_rate,
            "input frame must be one model frame",
        )
        _check(
            self.codec.samples_per_frame * 1000 == self.frame_ms * self.codec.sample_rate,
            "codec frame must be one model frame",
        )


def voicechat_11b() -> ModelConfig:
    """The released Nemotron VoiceChat 11B (docs/model.md §1)."""
    return ModelConfig()


def tiny() -> ModelConfig:
    """A small model with every kind of layer, for tests on the CPU.

    LLM: Mamba-2, MLP and attention layers; speech decoder: sliding and global layers (window 8,
    so a 60-frame test crosses it); codec: three quantizers; encoder: left context 8 frames.
    """
    return ModelConfig(
        encoder=EncoderConfig(
            d_model=32,
            n_layers=2,
            n_heads=4,
            ff_expansion=4,
            conv_kernel=9,
            subsampling_channels=8,
            att_left_context=8,
            output_dim=64,
        ),
        llm=LLMConfig(
            vocab_size=512,
            d_model=64,
            pattern="M-*M-*",
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            mlp_dim=96,
            mamba_heads=8,
            mamba_head_dim=8,
            ssm_state=16,
            n_groups=2,
            conv_kernel=4,
        ),
        rnnt=RNNTConfig(
            vocab_size=32, pred_hidden=16, pred_layers=2, joint_hidden=16, encoder_hidden=32
        ),
        tts=SpeechDecoderConfig(
            d_model=48,
            n_layers=4,
            n_heads=4,
            n_kv_heads=4,
            head_dim=12,
            mlp_dim=96,
            sliding_window=8,
            global_every=2,
            latent_size=16,
            n_quantizers=3,
            codebook_size=32,
            mog_components=8,
            mog_rank=4,
            mog_mlp_layers=2,
            text_vocab=512,
        ),
        codec=CodecConfig(
            base_hidden=8,
            channel_mult=(1, 2, 4),
            rates=(7, 7, 9),
            num_blocks=1,
            latent_size=16,
            n_quantizers=3,
            codebook_size=32,
        ),
    )


PRESETS = {"voicechat_11b": voicechat_11b, "tiny": tiny}


class AtCap(enum.StrEnum):
    """What happens to a session whose context reaches the cap (``serving.memory``)."""

    END = "end"  # the session ends with an event
    ROLLOVER = "rollover"  # the device rolls it over at the cap (empty capsule) and it goes on
    RESET = "reset"  # the host rolls it over before the cap, at a pause, with an empty capsule
    MEMORY = "memory"  # the same, with a capsule of the conversation; the cap as a fallback


class SpeechSampling(enum.StrEnum):
    """The speech decoder's sampler."""

    FAITHFUL = "faithful"  # NeMo's sampler (top-p component, Gaussian noise)
    DETERMINISTIC = "deterministic"  # the most likely component, no noise


class AttentionImpl(enum.StrEnum):
    """Which implementation every decode-step attention runs (``model.attention.attend``)."""

    AUTO = "auto"  # the choice measured best for the platform and slot count (``resolved``)
    XLA = "xla"  # jnp, the reference
    CUDNN = "cudnn"  # jax.nn.dot_product_attention on cuDNN (bf16/fp16 caches only)
    PALLAS = "pallas"  # pallas_kernels.decode_attention (split-K, skips unread rows)
    # pallas_kernels.mha_decode_attention where G = 1 (the speech decoder), the kernel above
    # where G > 1 (the LLM)
    PALLAS_MHA = "pallas_mha"


class SSMKernel(enum.StrEnum):
    """The LLM's Mamba-2 decode update."""

    AUTO = "auto"  # the choice measured best for the platform and slot count (``resolved``)
    XLA = "xla"  # jnp
    PALLAS = "pallas"  # the in-place Pallas kernel (the SSM update alone)
    FUSED = "fused"  # one Pallas kernel per layer: conv, SSM update and gated norm, in place


class ProjectionImpl(enum.StrEnum):
    """The LLM's large decode-step projections (MLP up/down, Mamba in/out)."""

    XLA = "xla"  # XLA's dot (``common.dense``)
    PALLAS = "pallas"  # pallas_kernels.matmul (weight-streaming Triton kernel)


# What an 'auto' kernel choice becomes on a GPU, and from how many slots (one device's): where the
# kernel beat XLA on an H200 at every slot count measured from there up. Below it, and on any
# other platform, XLA. The SSM update: 1.50x XLA at 8 slots, 0.63x at 1 (27 launches against one
# fused program; experiments/ssm_step_kernel). The LLM's attention: 2.5-2.8x at 16, 56 and 112
# (experiments/decode_attention). The speech decoder's G = 1 kernel: 1.19-1.20x on the fp32
# cache and 1.8-1.9x on bf16 at 56 and 112, not measured below 56; in the tick at 72 and 80
# (experiments/capacity).
# Measured on an H100 (2026-12-05, ``experiments/ssm_step_kernel/results/h100_fused.jsonl``): the
# fused Mamba step's output (its gated norm, summed across programs) left XLA's by up to 22 % of
# the largest value at 112 slots while the states agreed; the interpreter (the CPU tests) agrees.
_FUSED_ON_GPU = (
    "ssm_kernel='fused' is not served on a GPU: its gated-norm output disagreed with XLA's there "
    "(experiments/ssm_step_kernel, 2026-12-05); use 'pallas', 'xla' or 'auto'"
)

# The most frames one encoder call takes: its attention cache is a ring of the attention context
# plus these rows, so that a call writes its new frames before it reads (``model.conformer``).
ENCODER_CALL_FRAMES = 8

AUTO_KERNELS = {
    "ssm_kernel": ("pallas", 8),
    "attention": ("pallas", 16),
    "tts_attention": ("pallas_mha", 56),
}


def check_codec_placement(
    codec_stream: bool,
    codec_in_attention: bool,
    codec_matmul: str | None = None,
    codec_frame_behind: bool = False,
) -> None:
    """Raises ValueError (one line) for a codec placed twice, placed in the attention launches
    (full-fp32 products) under a policy whose codec products are not full fp32 (``codec_matmul``,
    ``Precision.codec_matmul``; None: not known here), or a frame behind anywhere else."""
    _check(
        not (codec_stream and codec_in_attention),
        "codec_stream and codec_in_attention are two places for one codec: choose one",
    )
    _check(
        not codec_frame_behind or codec_in_attention,
        "codec_frame_behind places the codec in the attention launches: it needs "
        "codec_in_attention",
    )
    _check(
        not codec_in_attention or codec_matmul in (None, "float32"),
        "codec_in_attention runs the codec's products in full fp32: the policy's codec "
        f"matmul is {codec_matmul!r}",
    )


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernels one compiled program runs, every 'auto' choice made (``ServeConfig.kernels``).

    Resolved once where a program is built (``Engine``: per engine, per bucket, per device of a
    mesh) and passed whole to the tick and the frame step, which decide nothing about kernels.
    """

    ssm_kernel: SSMKernel = SSMKernel.XLA  # the LLM's Mamba step update
    attention: AttentionImpl = AttentionImpl.XLA  # the LLM's decode attention
    tts_attention: AttentionImpl = AttentionImpl.XLA  # the speech decoder's
    projection: ProjectionImpl = ProjectionImpl.XLA  # the LLM's MLP and Mamba projections
    # the beat's frames unrolled, each frame's codes decoded on a second GPU stream beside the
    # next frame's LLM and speech decoder (``model.streams``; ``ServeConfig.codec_stream``)
    codec_stream: bool = False
    # the beat's frames unrolled, each frame's codec products in the next frame's speech-decoder
    # attention launches (``model.beside``; ``ServeConfig.codec_in_attention``)
    codec_in_attention: bool = False
    # with codec_in_attention, the codec a frame behind: the beat's last frame's products in the
    # next beat's first attention launches (``ServeConfig.codec_frame_behind``)
    codec_frame_behind: bool = False

    def __post_init__(self):
        for field, cls in (
            ("ssm_kernel", SSMKernel),
            ("attention", AttentionImpl),
            ("tts_attention", AttentionImpl),
            ("projection", ProjectionImpl),
        ):
            value = _choice(cls, getattr(self, field), field)
            _check(value != "auto", f"{field}: 'auto' must be resolved (ServeConfig.kernels)")
            object.__setattr__(self, field, value)
        check_codec_placement(
            self.codec_stream, self.codec_in_attention, None, self.codec_frame_behind
        )

    def row(self) -> dict[str, str]:
        """The choices by name (for rows and logs)."""
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _choice(cls: type[enum.StrEnum], value, field: str):
    """``value`` as a member of ``cls``, or a one-line error naming the choices."""
    try:
        return cls(value)
    except ValueError:
        names = "|".join(m.value for m in cls)
        raise ValueError(f"{field} must be {names}: {value}") from None


XLA_KERNELS = Kernels()  # every choice the jnp path (the default off the GPU)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How a server runs the model: slots, beat, context cap, sampling and kernel choices.

    The tick compiles once per ``ServeConfig`` (with the ``ModelConfig``); everything a live session
    changes at run time (joining, leaving, its audio) is data, never a new shape.
    """

    slots: int = 4  # B: concurrent sessions the state is sized for
    frames_per_tick: int = 2  # model frames advanced per beat (2 = a 160 ms beat)
    context_frames: int = 1500  # per-slot cache cap (120 s at 80 ms)
    at_cap: AtCap = AtCap.END  # strings of the enum are accepted (and converted)
    speech_sampling: SpeechSampling = SpeechSampling.FAITHFUL
    system_prompt: tuple[int, ...] = ()  # token ids prefilled as [BOS] + ids + [EOS], if any
    # Kernel choices; 'auto' is made for the platform and the slots a program runs where the
    # program is built (``kernels``; ``Engine.kernels`` names the choice).
    attention: AttentionImpl = AttentionImpl.AUTO  # LLM decode attention ('cudnn': bf16 KV only)
    tts_attention: AttentionImpl | None = None  # speech decoder's; None: as ``attention``
    ssm_kernel: SSMKernel = SSMKernel.AUTO  # LLM Mamba step update
    projection: ProjectionImpl = ProjectionImpl.XLA  # LLM MLP and Mamba projections
    # Experimental (issue 33's overlap): each frame's codec step on a second GPU stream, the
    # beat's frames unrolled (``Kernels.codec_stream``). The same tokens and codes; the waveform
    # to fp32 rounding (the codec decodes a frame at a time). Overlaps only with
    # ``--xla_gpu_experimental_stream_annotation=true`` in ``XLA_FLAGS``.
    codec_stream: bool = False
    # Experimental (issue 33's overlap): each frame's codec products run inside the next frame's
    # speech-decoder attention launches, one a layer (``Kernels.codec_in_attention``,
    # ``model.beside``; fused where that attention is the G = 1 Pallas kernel, 'pallas_mha').
    # The same tokens and codes; the waveform to fp32 rounding. Full-fp32 codec policies only.
    codec_in_attention: bool = False
    # Experimental, for measuring the tick (``experiments/tick_profile``), not for serving: with
    # ``codec_in_attention``, the codec a frame behind the speech decoder, so that every frame's
    # codec products ride in attention launches, the beat's last frame's in the next beat's first
    # (``Kernels.codec_frame_behind``; the frame's codes wait in ``CodecState.pending``). The same
    # tokens and codes; each session's audio comes out one frame (80 ms) later, led by a frame of
    # silence, and a session's last frame is never decoded (nothing flushes it yet).
    codec_frame_behind: bool = False
    deadline_ms: float | None = None  # default: the beat period
    capsule_tokens: int = 96  # U: room for a roll-over's conversation capsule (token ids)
    # Benchmarks only: every live slot's attention caches held full (``step.hold_full``), so a
    # kernel that skips rows past a slot's length reads the whole cache on every tick, the worst
    # case of a two-minute context for as long as a run lasts. The outputs are meaningless.
    hold_full: bool = False
    # Dtypes and matmul precision (a ``Precision`` or a policy name of ``precision.POLICIES``);
    # the params must be built or restored in the same policy.
    precision: Precision = dataclasses.field(default_factory=Precision.reference)

    def __post_init__(self):
        _check(self.slots >= 1, "slots must be >= 1")
        _check(self.frames_per_tick >= 1, "frames_per_tick must be >= 1")
        _check(
            self.frames_per_tick <= ENCODER_CALL_FRAMES,
            f"frames_per_tick must be <= {ENCODER_CALL_FRAMES} (the encoder's cache ring)",
        )
        _check(self.context_frames >= self.frames_per_tick, "context cap below one beat")
        _check(self.capsule_tokens >= 1, "capsule_tokens must be >= 1")
        if isinstance(self.precision, str):
            object.__setattr__(self, "precision", precision_lib.policy(self.precision))
        _check(isinstance(self.precision, Precision), f"precision: {self.precision!r}")
        check_codec_placement(
            self.codec_stream,
            self.codec_in_attention,
            self.precision.codec_matmul,
            self.codec_frame_behind,
        )
        for field, cls in (
            ("at_cap", AtCap),
            ("speech_sampling", SpeechSampling),
            ("attention", AttentionImpl),
            ("tts_attention", AttentionImpl),
            ("ssm_kernel", SSMKernel),
            ("projection", ProjectionImpl),
        ):
            value = getattr(self, field)
            if value is not None or field != "tts_attention":
                object.__setattr__(self, field, _choice(cls, value, field))

    def check_model(self, cfg: ModelConfig) -> None:
        """Raises ValueError (one line) when this config does not fit ``cfg``: a system prompt
        id outside the LLM's vocabulary [0, V) (the embedding would read past its table)."""
        V = cfg.llm.vocab_size
        bad = [i for i in self.system_prompt if not 0 <= i < V]
        if bad:
            shown = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
            raise ValueError(f"system prompt id(s) {shown} outside the vocabulary [0, {V})")

    def resolved(self, platform: str | None = None, slots: int | None = None) -> ServeConfig:
        """This configuration with every 'auto' kernel choice made (``AUTO_KERNELS``).

        ``tts_attention=None`` follows an 'auto' ``attention`` as 'auto' in its own right (the
        speech decoder has its own kernel and threshold); an explicit choice is kept as it is.

        Args:
          platform: the backend the tick runs on (default: JAX's default backend).
          slots: the slots one device runs (default: ``self.slots``).
        """
        tts = self.tts_attention
        if tts is None and self.attention == AttentionImpl.AUTO:
            tts = AttentionImpl.AUTO
        chosen = {"attention": self.attention, "tts_attention": tts, "ssm_kernel": self.ssm_kernel}
        on_gpu = (platform or jax.default_backend()) == "gpu"
        if on_gpu and self.ssm_kernel == SSMKernel.FUSED:
            raise ValueError(_FUSED_ON_GPU)
        if "auto" not in chosen.values():
            return self
        slots = self.slots if slots is None else slots
        for field, value in chosen.items():
            if value == "auto":
                kernel, from_slots = AUTO_KERNELS[field]
                chosen[field] = kernel if on_gpu and slots >= from_slots else "xla"
        return dataclasses.replace(self, **chosen)

    def kernels(self, platform: str | None = None, slots: int | None = None) -> Kernels:
        """The kernels a program of ``slots`` slots (default ``self.slots``) on ``platform``
        (default: JAX's default backend) runs: every 'auto' made (``resolved``), the speech
        decoder's spelled out."""
        r = self.resolved(platform, slots)
        return Kernels(
            r.ssm_kernel,
            r.attention,
            r.tts_attention or r.attention,
            r.projection,
            r.codec_stream,
            r.codec_in_attention,
            r.codec_frame_behind,
        )

    @property
    def beat_ms(self) -> float:
        return 80.0 * self.frames_per_tick

    @property
    def deterministic(self) -> bool:
        return self.speech_sampling == "deterministic"
