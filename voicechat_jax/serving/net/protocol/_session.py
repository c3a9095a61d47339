"""A session's configuration, ``session.update`` applied to it, and one client message parsed.
Part of ``serving.net.protocol``."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any

from voicechat_jax.serving.net.protocol._events import (
    DEFAULT_RATE,
    INPUT_RATES,
    OUTPUT_RATES,
    TRANSCRIPTION_MODEL,
    TURN_DETECTION,
    ErrorCode,
    ProtocolError,
)


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """A session's settings: what the client chose (``session.update``) and what the server is
    (``voice``, ``model``: reported, not changeable)."""

    input_rate: int = DEFAULT_RATE
    output_rate: int = DEFAULT_RATE
    extensions: bool = False  # send the ``voicechat.*`` events and fields
    voice: str = "Aria"  # the model's one voice (``ModelConfig.tts.speaker_name``)
    model: str = "voicechat"

    def update(self, session: Any) -> SessionConfig:
        """This config with a ``session.update``'s ``session`` object applied (``apply``)."""
        return self.apply(session)[0]

    def apply(self, session: Any) -> tuple[SessionConfig, list[dict]]:
        """This config with a ``session.update``'s ``session`` object applied, and the fields it
        could not honour: ``[{"param": "session.<field>", "reason": ...}]``.

        Applied: the audio formats (PCM16; ``audio.{input,output}.format`` ``{"type":
        "audio/pcm", "rate": R}`` or the beta ``input_audio_format`` / ``output_audio_format``
        ``"pcm16"``) and ``voicechat.{events, input_sample_rate, output_sample_rate}``. A field
        that asks for what the session already is (the model's voice, audio out, its turn
        detection, ``tool_choice`` ``"auto"``, ...) is honoured as it is. Any other value is
        listed, not applied: the system prompt is prefilled at start-up, the model has one voice,
        takes turns by itself and always transcribes the caller. A bad audio format or rate
        raises ``ProtocolError`` and nothing is applied.
        """
        if not isinstance(session, dict):
            raise ProtocolError(
                ErrorCode.INVALID_SESSION_CONFIG, "session must be an object", param="session"
            )
        cfg = self
        skipped: list[dict] = []
        for key, value in session.items():
            if key in ("input_audio_format", "output_audio_format"):
                if value is not None and value != "pcm16":
                    raise ProtocolError(
                        ErrorCode.INVALID_SESSION_CONFIG,
                        f"{key} {value!r} is not supported; only 'pcm16'",
                        param=f"session.{key}",
                    )
            elif key == "audio":
                cfg = cfg._audio(value, skipped)
            elif key == "voicechat":
                cfg = cfg._extensions(value)
            else:
                skipped += _not_applied(f"session.{key}", value, _SESSION_FIELDS.get(key), cfg)
        for rate, rates, side in (
            (cfg.input_rate, INPUT_RATES, "input"),
            (cfg.output_rate, OUTPUT_RATES, "output"),
        ):
            if rate not in rates or isinstance(rate, bool):
                raise ProtocolError(
                    ErrorCode.INVALID_SESSION_CONFIG,
                    f"{side} sample rate {rate!r} is not supported; one of {rates}",
                    param=f"session.voicechat.{side}_sample_rate",
                )
        return cfg, skipped

    def _audio(self, audio: Any, skipped: list[dict]) -> SessionConfig:
        if audio is None:
            return self
        if not isinstance(audio, dict):
            raise ProtocolError(
                ErrorCode.INVALID_SESSION_CONFIG, "audio must be an object", param="session.audio"
            )
        cfg = self
        for side, field in (("input", "input_rate"), ("output", "output_rate")):
            config = audio.get(side) or {}
            if not isinstance(config, dict):
                raise ProtocolError(
                    ErrorCode.INVALID_SESSION_CONFIG,
                    f"audio.{side} must be an object",
                    param=f"session.audio.{side}",
                )
            for key, value in config.items():
                param = f"session.audio.{side}.{key}"
                if key != "format":
                    skipped += _not_applied(param, value, _AUDIO_FIELDS.get(key), cfg)
                    continue
                if value is None:
                    continue
                if not isinstance(value, dict) or value.get("type", "audio/pcm") != "audio/pcm":
                    raise ProtocolError(
                        ErrorCode.INVALID_SESSION_CONFIG,
                        f"audio.{side}.format {value!r} is not supported; only audio/pcm",
                        param=param,
                    )
                if "rate" in value:
                    cfg = dataclasses.replace(cfg, **{field: value["rate"]})
        for key in audio.keys() - {"input", "output"}:
            skipped += _not_applied(f"session.audio.{key}", audio[key], None, cfg)
        return cfg

    def _extensions(self, ext: Any) -> SessionConfig:
        if ext is None:
            return self
        if not isinstance(ext, dict):
            raise ProtocolError(
                ErrorCode.INVALID_SESSION_CONFIG,
                "voicechat must be an object",
                param="session.voicechat",
            )
        cfg = self
        if "events" in ext:
            cfg = dataclasses.replace(cfg, extensions=bool(ext["events"]))
        if "input_sample_rate" in ext:
            cfg = dataclasses.replace(cfg, input_rate=ext["input_sample_rate"])
        if "output_sample_rate" in ext:
            cfg = dataclasses.replace(cfg, output_rate=ext["output_sample_rate"])
        return cfg


_FIXED_PROMPT = "the system prompt is prefilled once at start-up (voicechat-serve --system_prompt)"
_ONE_VOICE = "the model speaks in its one voice"
_OWN_TURNS = "the model takes turns by itself; the session's turn_detection is what it does"
_ALWAYS_TRANSCRIBED = f"the caller is always transcribed, by the model's own {TRANSCRIPTION_MODEL}"
_FIXED_TOOLS = "the model's tools come with the model; it cannot take others here"
_AUDIO_OUT = "the model always answers in audio, with its text as the transcript"


def _honoured(kind: str, value: Any, cfg: SessionConfig) -> bool:
    """Whether ``value`` asks for what the session already is (``kind``: which field)."""
    if value is None:  # the default; but no turn detection or no transcription cannot be
        return kind not in ("turn_detection", "transcription")
    if kind == "instructions":
        return value == ""
    if kind == "voice":
        return value == cfg.voice
    if kind == "modalities":
        return isinstance(value, list) and "audio" in value
    if kind == "turn_detection":
        return isinstance(value, dict) and all(
            TURN_DETECTION.get(k, object()) == v for k, v in value.items()
        )
    if kind == "transcription":
        return isinstance(value, dict) and all(
            v is None or (k == "model" and v == TRANSCRIPTION_MODEL) for k, v in value.items()
        )
    if kind == "tools":
        return value == []
    if kind == "tool_choice":
        return value == "auto"
    if kind == "max_tokens":
        return value == "inf"
    if kind == "speed":
        return value == 1.0
    if kind == "model":
        return value == cfg.model
    if kind == "type":
        return value == "realtime"
    if kind == "conversation":
        return value == "auto"
    # "metadata": echoed in the response; "optional": no value but null.
    return kind == "metadata"


# session.update fields (GA and beta names) -> how they are checked (``_honoured``) and why a
# value that asks for anything else cannot be applied.
_SESSION_FIELDS: dict[str, tuple[str, str]] = {
    "type": ("type", "only realtime (speech-to-speech) sessions"),
    "model": ("model", "the server serves one model"),
    "instructions": ("instructions", _FIXED_PROMPT),
    "prompt": ("optional", _FIXED_PROMPT),
    "voice": ("voice", _ONE_VOICE),
    "speed": ("speed", "the model speaks at its own pace"),
    "modalities": ("modalities", _AUDIO_OUT),
    "output_modalities": ("modalities", _AUDIO_OUT),
    "turn_detection": ("turn_detection", _OWN_TURNS),
    "input_audio_transcription": ("transcription", _ALWAYS_TRANSCRIBED),
    "input_audio_noise_reduction": ("optional", "no noise reduction: the model hears the input"),
    "tools": ("tools", _FIXED_TOOLS),
    "tool_choice": ("tool_choice", _FIXED_TOOLS),
    "max_output_tokens": ("max_tokens", "a turn is as long as the model makes it"),
    "max_response_output_tokens": ("max_tokens", "a turn is as long as the model makes it"),
    "temperature": ("optional", "sampling is set at start-up (voicechat-serve --speech_sampling)"),
    "tracing": ("optional", "no tracing"),
    "truncation": ("optional", "the context cap's policy is set at start-up (--at_cap)"),
    "include": ("optional", "no logprobs"),
    "reasoning": ("optional", "not a reasoning model"),
    "parallel_tool_calls": ("optional", _FIXED_TOOLS),
}
_AUDIO_FIELDS: dict[str, tuple[str, str]] = {
    "voice": ("voice", _ONE_VOICE),
    "speed": ("speed", "the model speaks at its own pace"),
    "turn_detection": ("turn_detection", _OWN_TURNS),
    "transcription": ("transcription", _ALWAYS_TRANSCRIBED),
    "noise_reduction": ("optional", "no noise reduction: the model hears the input"),
}


def _not_applied(
    param: str, value: Any, rule: tuple[str, str] | None, cfg: SessionConfig
) -> list[dict]:
    """``[]`` when ``value`` is honoured, else the one entry that says why not."""
    if rule is None:
        return [{"param": param, "reason": "not a field this server knows"}]
    kind, reason = rule
    return [] if _honoured(kind, value, cfg) else [{"param": param, "reason": reason}]


def parse_client_event(text: str | bytes) -> dict:
    """One client message -> its event (a dict with a string ``type``), or ``ProtocolError``."""
    try:
        event = json.loads(text)
    except RecursionError:
        raise ProtocolError(ErrorCode.INVALID_JSON, "the message nests too deep") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer of more digits than Python reads
        raise ProtocolError(ErrorCode.INVALID_JSON, f"the message is not JSON: {e}") from None
    if not isinstance(event, dict):
        raise ProtocolError(ErrorCode.INVALID_EVENT, "an event must be a JSON object")
    event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
    kind = event.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(
            ErrorCode.INVALID_EVENT, "the event has no string 'type'", event_id=event_id
        )
    return event


def decode_audio(event: dict) -> bytes:
    """The PCM16 bytes of an ``input_audio_buffer.append``, or ``ProtocolError``."""
    data = event.get("audio")
    event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
    if not isinstance(data, str):
        raise ProtocolError(
            ErrorCode.INVALID_AUDIO, "audio must be a base64 string", event_id=event_id
        )
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(
            ErrorCode.INVALID_AUDIO, "audio is not valid base64", event_id=event_id, param="audio"
        ) from None
    if len(pcm) % 2:
        raise ProtocolError(
            ErrorCode.INVALID_AUDIO,
            f"audio is not PCM16: {len(pcm)} bytes, an odd number",
            event_id=event_id,
            param="audio",
        )
    return pcm
