"""The wire protocol of a live call (``docs/protocol.md``): event names, audio, and the translation
of each beat's outputs into events. No network and no JAX here, so all of it is tested directly.

The events follow the OpenAI Realtime API's names and shapes wherever they fit (JSON text
messages, each with a ``type``; audio as base64 PCM16, 24 kHz mono by default), so that its clients
connect by base URL. What this server adds is namespaced ``voicechat.*`` (event types, and a
``voicechat`` field inside a standard event) and sent only to a client that asks for it.

- ``SessionConfig``: a session's audio formats and options, and ``session.update`` applied to it.
- ``parse_client_event``: one text message -> an event dict, or a ``ProtocolError`` that the
  connection answers with an ``error`` event (the session goes on).
- ``InputAudio`` / ``OutputAudio``: PCM16 at the client's rate <-> the model's float32 at 16 kHz
  in, 22.05 kHz out, resampled with ``soxr`` (streaming, so chunk edges leave no seams); input is
  cut into whole 80 ms frames for the server's queues.
- ``CallEvents``: one session's beats (``writer.StreamBeat``) -> the events of each 80 ms frame:
  audio deltas, the agent's turns from the text channel (BOS opens, EOS closes), function calls
  from the function channel (SOTC ... EOTC), the caller's turns from the RNNT transcript, and the
  session's end. Text comes from the tokenizers when the server has them; the raw ids are always
  in the ``voicechat`` field (the tiny test model has no tokenizer).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import soxr

from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID
from voicechat_jax.serving.audio import FRAME_LEN, INPUT_RATE, OUTPUT_RATE
from voicechat_jax.serving.writer import PCM16_MAX, StreamBeat, StreamEnd

PROTOCOL_VERSION = 1
FRAME_MS = 80
DEFAULT_RATE = 24000  # the Realtime API's PCM16 rate, in and out
INPUT_RATES = (16000, 24000)
OUTPUT_RATES = (16000, 22050, 24000)
SILENCE_ID = 11  # the text channel's "silence" token (docs/model.md §2)
SOTC_ID, EOTC_ID, EOTR_ID = 20, 21, 22  # function channel: start / end of a tool call, tool result
# Ids that are not words on the text channel.
TEXT_SKIP = frozenset({PAD_ID, SILENCE_ID, BOS_ID, EOS_ID})


class ClientEvent(enum.StrEnum):
    SESSION_UPDATE = "session.update"
    INPUT_AUDIO_APPEND = "input_audio_buffer.append"
    INPUT_AUDIO_COMMIT = "input_audio_buffer.commit"
    INPUT_AUDIO_CLEAR = "input_audio_buffer.clear"
    RESPONSE_CREATE = "response.create"
    RESPONSE_CANCEL = "response.cancel"
    ITEM_CREATE = "conversation.item.create"
    ITEM_TRUNCATE = "conversation.item.truncate"
    ITEM_DELETE = "conversation.item.delete"
    SESSION_CLOSE = "voicechat.session.close"  # extension: end the call gracefully


# Realtime client events that a full-duplex model has no use for: answered with an error.
UNSUPPORTED = frozenset(
    {
        ClientEvent.INPUT_AUDIO_COMMIT,
        ClientEvent.INPUT_AUDIO_CLEAR,
        ClientEvent.RESPONSE_CREATE,
        ClientEvent.RESPONSE_CANCEL,
        ClientEvent.ITEM_CREATE,
        ClientEvent.ITEM_TRUNCATE,
        ClientEvent.ITEM_DELETE,
    }
)


class ServerEvent(enum.StrEnum):
    ERROR = "error"
    SESSION_CREATED = "session.created"
    SESSION_UPDATED = "session.updated"
    RESPONSE_CREATED = "response.created"
    RESPONSE_DONE = "response.done"
    OUTPUT_ITEM_ADDED = "response.output_item.added"
    OUTPUT_ITEM_DONE = "response.output_item.done"
    AUDIO_DELTA = "response.audio.delta"
    AUDIO_TRANSCRIPT_DELTA = "response.audio_transcript.delta"
    AUDIO_TRANSCRIPT_DONE = "response.audio_transcript.done"
    FUNCTION_ARGUMENTS_DELTA = "response.function_call_arguments.delta"
    FUNCTION_ARGUMENTS_DONE = "response.function_call_arguments.done"
    SPEECH_STARTED = "input_audio_buffer.speech_started"
    SPEECH_STOPPED = "input_audio_buffer.speech_stopped"
    TRANSCRIPTION_DELTA = "conversation.item.input_audio_transcription.delta"
    TRANSCRIPTION_COMPLETED = "conversation.item.input_audio_transcription.completed"
    # Extensions (sent when the client asked for them).
    BEAT = "voicechat.beat"
    ROLLED_OVER = "voicechat.session.rolled_over"
    SESSION_ENDED = "voicechat.session.ended"


class ErrorType(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"
    SERVER = "server_error"


class ErrorCode(enum.StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_EVENT = "invalid_event"
    UNKNOWN_EVENT = "unknown_event"
    UNSUPPORTED_EVENT = "unsupported_event"
    BINARY_NOT_SUPPORTED = "binary_message_not_supported"
    INVALID_AUDIO = "invalid_audio"
    INVALID_SESSION_CONFIG = "invalid_session_config"
    INPUT_OVERFLOW = "input_audio_buffer_overflow"
    OUTPUT_OVERFLOW = "output_audio_dropped"
    SERVER_AT_CAPACITY = "server_at_capacity"
    SERVER_NOT_READY = "server_not_ready"
    SERVER_SHUTTING_DOWN = "server_shutting_down"
    SESSION_EXPIRED = "session_expired"  # the Realtime API's code for a session past its limit
    IDLE_TIMEOUT = "idle_timeout"
    SESSION_FAILED = "session_failed"


class CloseCode(enum.IntEnum):
    """WebSocket close codes (RFC 6455 §7.4.1)."""

    NORMAL = 1000
    GOING_AWAY = 1001  # the server is shutting down
    POLICY_VIOLATION = 1008  # too many protocol errors
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011  # the session failed
    TRY_AGAIN_LATER = 1013  # no free slot


class EndReason(enum.StrEnum):
    """Why a session ended, as the client sees it (``voicechat.session.ended``)."""

    CONTEXT_CAP = "context_cap"
    SHUTDOWN = "shutdown"
    IDLE_TIMEOUT = "idle_timeout"
    CLIENT_CLOSED = "client_closed"
    FAILED = "failed"


# The server's release reasons (``Server`` metrics) -> what the client is told.
_END_BY_REASON = {
    "context cap": (EndReason.CONTEXT_CAP, CloseCode.NORMAL, ErrorCode.SESSION_EXPIRED),
    "shutdown": (EndReason.SHUTDOWN, CloseCode.GOING_AWAY, ErrorCode.SERVER_SHUTTING_DOWN),
    "idle timeout": (EndReason.IDLE_TIMEOUT, CloseCode.NORMAL, ErrorCode.IDLE_TIMEOUT),
    "left": (EndReason.CLIENT_CLOSED, CloseCode.NORMAL, None),
    "failed": (EndReason.FAILED, CloseCode.INTERNAL_ERROR, ErrorCode.SESSION_FAILED),
}


class ProtocolError(ValueError):
    """A client message the server cannot take; answered with an ``error`` event."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        event_id: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id
        self.param = param


def error_event(
    code: ErrorCode,
    message: str,
    *,
    error_type: ErrorType = ErrorType.INVALID_REQUEST,
    event_id: str | None = None,
    param: str | None = None,
    extra: dict | None = None,
) -> dict:
    """An ``error`` event; ``event_id`` names the client event it answers, ``extra`` goes into
    the error's ``voicechat`` field (e.g. ``retry_after_s``)."""
    error: dict[str, Any] = {
        "type": str(error_type),
        "code": str(code),
        "message": message,
        "param": param,
        "event_id": event_id,
    }
    if extra:
        error["voicechat"] = extra
    return {"type": str(ServerEvent.ERROR), "error": error}


# ---------------------------------------------------------------------------------------------
# Session configuration


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """What a client chose for its session (``session.update``)."""

    input_rate: int = DEFAULT_RATE
    output_rate: int = DEFAULT_RATE
    extensions: bool = False  # send the ``voicechat.*`` events and fields

    def update(self, session: Any) -> SessionConfig:
        """This config with a ``session.update``'s ``session`` object applied.

        Understood: ``input_audio_format`` / ``output_audio_format`` (``"pcm16"`` only), the
        newer ``audio.input.format`` / ``audio.output.format`` (``{"type": "audio/pcm", "rate":
        ...}``), and ``voicechat.{events, input_sample_rate, output_sample_rate}``. Every other
        field (instructions, voice, tools, turn detection, ...) is accepted and ignored: the
        system prompt is prefilled at start-up and the model takes turns by itself.
        """
        if not isinstance(session, dict):
            raise ProtocolError(
                ErrorCode.INVALID_SESSION_CONFIG, "session must be an object", param="session"
            )
        cfg = self
        for key in ("input_audio_format", "output_audio_format"):
            value = session.get(key)
            if value is not None and value != "pcm16":
                raise ProtocolError(
                    ErrorCode.INVALID_SESSION_CONFIG,
                    f"{key} {value!r} is not supported; only 'pcm16'",
                    param=f"session.{key}",
                )
        audio = session.get("audio")
        if isinstance(audio, dict):
            for side, field in (("input", "input_rate"), ("output", "output_rate")):
                fmt = (audio.get(side) or {}).get("format")
                if fmt is None:
                    continue
                if not isinstance(fmt, dict) or fmt.get("type", "audio/pcm") != "audio/pcm":
                    raise ProtocolError(
                        ErrorCode.INVALID_SESSION_CONFIG,
                        f"audio.{side}.format {fmt!r} is not supported; only audio/pcm",
                        param=f"session.audio.{side}.format",
                    )
                if "rate" in fmt:
                    cfg = dataclasses.replace(cfg, **{field: fmt["rate"]})
        ext = session.get("voicechat")
        if ext is not None:
            if not isinstance(ext, dict):
                raise ProtocolError(
                    ErrorCode.INVALID_SESSION_CONFIG,
                    "voicechat must be an object",
                    param="session.voicechat",
                )
            if "events" in ext:
                cfg = dataclasses.replace(cfg, extensions=bool(ext["events"]))
            if "input_sample_rate" in ext:
                cfg = dataclasses.replace(cfg, input_rate=ext["input_sample_rate"])
            if "output_sample_rate" in ext:
                cfg = dataclasses.replace(cfg, output_rate=ext["output_sample_rate"])
        if cfg.input_rate not in INPUT_RATES or isinstance(cfg.input_rate, bool):
            raise ProtocolError(
                ErrorCode.INVALID_SESSION_CONFIG,
                f"input sample rate {cfg.input_rate!r} is not supported; one of {INPUT_RATES}",
                param="session.voicechat.input_sample_rate",
            )
        if cfg.output_rate not in OUTPUT_RATES or isinstance(cfg.output_rate, bool):
            raise ProtocolError(
                ErrorCode.INVALID_SESSION_CONFIG,
                f"output sample rate {cfg.output_rate!r} is not supported; one of {OUTPUT_RATES}",
                param="session.voicechat.output_sample_rate",
            )
        return cfg


def parse_client_event(text: str | bytes) -> dict:
    """One client message -> its event (a dict with a string ``type``), or ``ProtocolError``."""
    try:
        event = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
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


# ---------------------------------------------------------------------------------------------
# Audio


class InputAudio:
    """The client's PCM16 at ``rate`` -> whole 80 ms frames of float32 at 16 kHz (streaming)."""

    def __init__(self, rate: int = DEFAULT_RATE):
        self.rate = rate
        self._resampler = (
            None if rate == INPUT_RATE else soxr.ResampleStream(rate, INPUT_RATE, 1, "float32")
        )
        self._rest = np.zeros((0,), np.float32)
        self.samples_in = 0  # client samples taken

    def feed(self, pcm: bytes) -> np.ndarray:
        """Returns the whole frames now available, float32 [n * 1280] (n may be 0)."""
        x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        self.samples_in += x.shape[0]
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x)
            np.clip(x, -1.0, 1.0, out=x)  # the filter can ring just past full scale
        x = np.concatenate([self._rest, x]) if self._rest.size else x
        n = (x.shape[0] // FRAME_LEN) * FRAME_LEN
        self._rest = x[n:].copy()
        return x[:n]


class OutputAudio:
    """The model's 22.05 kHz float32 -> PCM16 bytes at ``rate``, one 80 ms frame in, exactly one
    80 ms frame out (streaming).

    A streaming resampler hands out its output in uneven blocks; a FIFO primed with ``lead_ms``
    of silence evens them out, so that every frame the client gets holds exactly 80 ms (a frame
    the FIFO cannot fill is padded with silence and counted in ``shortfalls``; with the default
    lead it does not happen at the supported rates).
    """

    def __init__(self, rate: int = DEFAULT_RATE, *, lead_ms: float = 30.0):
        self.rate = rate
        self._resampler = (
            None
            if rate == OUTPUT_RATE
            else soxr.ResampleStream(OUTPUT_RATE, rate, 1, "float32", quality="LQ")
        )
        self._fifo = np.zeros((0 if self._resampler is None else int(rate * lead_ms / 1000),))
        self.shortfalls = 0

    def convert(self, wav: np.ndarray) -> bytes:
        """One frame (or whole frames) of model audio -> the same duration at ``rate``."""
        x = np.asarray(wav, np.float32)
        n = x.shape[0] * self.rate // OUTPUT_RATE
        if self._resampler is not None:
            x = np.concatenate([self._fifo, self._resampler.resample_chunk(x)])
            if x.shape[0] < n:
                self.shortfalls += 1
                x = np.pad(x, (0, n - x.shape[0]))
            x, self._fifo = x[:n], x[n:]
        x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
        return np.rint(np.clip(x, -1.0, 1.0) * PCM16_MAX).astype("<i2").tobytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------------------------------------
# Beats -> events


@dataclasses.dataclass(frozen=True)
class Limits:
    """How turns are cut and bounded (frames are 80 ms)."""

    user_gap_frames: int = 6  # the caller's turn ends after this many frames with no RNNT token
    agent_gap_frames: int = 50  # an agent turn with no EOS closes after this many quiet frames
    max_turn_ids: int = 512  # ids per turn or call; a longer one is closed and a new one opened


class _Turn:
    """One open turn (or tool call): its item id, ids and the text already sent."""

    def __init__(self, item_id: str, start_frame: int):
        self.item_id = item_id
        self.start_frame = start_frame
        self.ids: list[int] = []
        self.text = ""
        self.quiet = 0


Decoder = Callable[[Sequence[int]], str]


class CallEvents:
    """One session's events, built from its beats; see the module docstring.

    Args:
      session_id: the session's id (the ``session.id`` the client sees).
      text_decode: LLM ids -> text (the agent's words and tool calls); None: ids only.
      asr_decode: RNNT ids -> text (the caller's words); None: ids only.
      limits: turn gaps and bounds.

    Not thread-safe: one connection's sender owns it.
    """

    def __init__(
        self,
        session_id: str,
        *,
        text_decode: Decoder | None = None,
        asr_decode: Decoder | None = None,
        limits: Limits | None = None,
    ):
        self.session_id = session_id
        self.text_decode = text_decode
        self.asr_decode = asr_decode
        self.limits = limits or Limits()
        self.response_id = f"resp_{session_id}"
        self.audio_item_id = f"item_{session_id}_audio"  # audio between the agent's turns
        self._ids = itertools.count()
        self._events = itertools.count()
        self._agent: _Turn | None = None
        self._call: _Turn | None = None
        self._user: _Turn | None = None
        self.last_tick: int | None = None

    # ---- helpers -----------------------------------------------------------------------------

    def _item_id(self, kind: str) -> str:
        return f"item_{self.session_id}_{kind}{next(self._ids)}"

    def stamp(self, event: dict) -> dict:
        """Gives the event its ``event_id`` (every server event has one)."""
        event.setdefault("event_id", f"event_{self.session_id}_{next(self._events)}")
        return event

    @staticmethod
    def _decode(decode: Decoder | None, turn: _Turn) -> str:
        """The new text of ``turn`` since the last call (decoding the whole turn keeps word
        boundaries that a token-by-token decode would lose)."""
        if decode is None:
            return ""
        text = decode(turn.ids)
        delta = text[len(turn.text) :] if text.startswith(turn.text) else text
        turn.text = text
        return delta

    def _ext(self, extensions: bool, **fields) -> dict:
        return {"voicechat": fields} if extensions else {}

    # ---- session-level events ----------------------------------------------------------------

    def session_object(self, cfg: SessionConfig, info: dict) -> dict:
        """The ``session`` object of ``session.created`` / ``session.updated``."""
        return {
            "id": self.session_id,
            "object": "realtime.session",
            "modalities": ["audio", "text"],
            "input_audio_format": "pcm16",
            "output_audio_format": "pcm16",
            "turn_detection": None,  # full duplex: the model takes turns by itself
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": cfg.input_rate}},
                "output": {"format": {"type": "audio/pcm", "rate": cfg.output_rate}},
            },
            "voicechat": {
                "protocol_version": PROTOCOL_VERSION,
                "events": cfg.extensions,
                "input_sample_rate": cfg.input_rate,
                "output_sample_rate": cfg.output_rate,
                "frame_ms": FRAME_MS,
                **info,
            },
        }

    def response_created(self) -> dict:
        return self.stamp(
            {
                "type": str(ServerEvent.RESPONSE_CREATED),
                "response": {
                    "id": self.response_id,
                    "object": "realtime.response",
                    "status": "in_progress",
                    "output": [],
                },
            }
        )

    # ---- one frame ---------------------------------------------------------------------------

    def beat(
        self, beat: StreamBeat, audio: Sequence[bytes], cfg: SessionConfig, *, dropped: int = 0
    ) -> list[list[dict]]:
        """The events of each of the beat's frames (``audio``: each frame's PCM16 at the
        client's rate). ``dropped``: output beats the stream dropped before this one."""
        T = beat.text.shape[0]
        frames: list[list[dict]] = []
        for t in range(T):
            events: list[dict] = []
            frame = beat.frame + t
            if t == 0 and cfg.extensions:
                stamp = beat.stamp
                skipped = 0 if self.last_tick is None else stamp.tick - self.last_tick - 1
                events.append(
                    {
                        "type": str(ServerEvent.BEAT),
                        "tick": stamp.tick,
                        "frame": beat.frame,
                        "frames": T,
                        "latency_ms": round(1e3 * stamp.latency, 3),
                        "missed": stamp.missed,
                        "ticks_skipped": max(0, skipped),
                        "input_underrun": beat.underrun,
                        "output_dropped_beats": dropped,
                    }
                )
                if beat.rollover is not None:
                    events.append(
                        {"type": str(ServerEvent.ROLLED_OVER), "frame": frame, **beat.rollover}
                    )
            if t == 0:
                self.last_tick = beat.stamp.tick
            events += self._agent_frame(int(beat.text[t]), frame, cfg.extensions)
            events += self._call_frame(int(beat.function[t]), frame, cfg.extensions)
            events += self._user_frame(beat.transcript[t], frame, cfg.extensions)
            item = self._agent.item_id if self._agent is not None else self.audio_item_id
            events.append(
                {
                    "type": str(ServerEvent.AUDIO_DELTA),
                    "response_id": self.response_id,
                    "item_id": item,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": b64(audio[t]),
                }
            )
            frames.append([self.stamp(e) for e in events])
        return frames

    def _agent_frame(self, x: int, frame: int, ext: bool) -> list[dict]:
        events: list[dict] = []
        turn = self._agent
        if x == BOS_ID or (x not in TEXT_SKIP and turn is None):
            if turn is not None:
                events += self._close_agent()
            turn = self._agent = _Turn(self._item_id("agent"), frame)
            events.append(
                {
                    "type": str(ServerEvent.OUTPUT_ITEM_ADDED),
                    "response_id": self.response_id,
                    "output_index": 0,
                    "item": {
                        "id": turn.item_id,
                        "object": "realtime.item",
                        "type": "message",
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [],
                    },
                }
            )
        if turn is None:
            return events
        if x == EOS_ID:
            return events + self._close_agent()
        if x in TEXT_SKIP:
            turn.quiet += 1
            if turn.quiet >= self.limits.agent_gap_frames:
                events += self._close_agent()
            return events
        turn.quiet = 0
        turn.ids.append(x)
        events.append(
            {
                "type": str(ServerEvent.AUDIO_TRANSCRIPT_DELTA),
                "response_id": self.response_id,
                "item_id": turn.item_id,
                "output_index": 0,
                "content_index": 0,
                "delta": self._decode(self.text_decode, turn),
                **self._ext(ext, ids=[x], frame=frame),
            }
        )
        if len(turn.ids) >= self.limits.max_turn_ids:
            events += self._close_agent()
        return events

    def _close_agent(self) -> list[dict]:
        turn, self._agent = self._agent, None
        if turn is None:
            return []
        common = {"response_id": self.response_id, "output_index": 0}
        return [
            {
                "type": str(ServerEvent.AUDIO_TRANSCRIPT_DONE),
                **common,
                "item_id": turn.item_id,
                "content_index": 0,
                "transcript": turn.text,
            },
            {
                "type": str(ServerEvent.OUTPUT_ITEM_DONE),
                **common,
                "item": {
                    "id": turn.item_id,
                    "object": "realtime.item",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "audio", "transcript": turn.text}],
                },
            },
        ]

    def _call_frame(self, x: int, frame: int, ext: bool) -> list[dict]:
        """The function channel: ids between SOTC and EOTC are a tool call's text."""
        events: list[dict] = []
        call = self._call
        if x == SOTC_ID:
            if call is not None:
                events += self._close_call("incomplete")
            call = self._call = _Turn(self._item_id("call"), frame)
            events.append(
                {
                    "type": str(ServerEvent.OUTPUT_ITEM_ADDED),
                    "response_id": self.response_id,
                    "output_index": 0,
                    "item": {
                        "id": call.item_id,
                        "object": "realtime.item",
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": f"call_{call.item_id}",
                        "name": "",
                        "arguments": "",
                    },
                }
            )
            return events
        if call is None or x in (PAD_ID, EOTR_ID):
            return events
        if x == EOTC_ID:
            return self._close_call("completed")
        call.ids.append(x)
        events.append(
            {
                "type": str(ServerEvent.FUNCTION_ARGUMENTS_DELTA),
                "response_id": self.response_id,
                "item_id": call.item_id,
                "output_index": 0,
                "call_id": f"call_{call.item_id}",
                "delta": self._decode(self.text_decode, call),
                **self._ext(ext, ids=[x], frame=frame),
            }
        )
        if len(call.ids) >= self.limits.max_turn_ids:
            events += self._close_call("incomplete")
        return events

    def _close_call(self, status: str) -> list[dict]:
        call, self._call = self._call, None
        if call is None:
            return []
        name, arguments = parse_tool_call(call.text)
        call_id = f"call_{call.item_id}"
        common = {"response_id": self.response_id, "output_index": 0, "item_id": call.item_id}
        return [
            {
                "type": str(ServerEvent.FUNCTION_ARGUMENTS_DONE),
                **common,
                "call_id": call_id,
                "name": name,
                "arguments": arguments,
            },
            {
                "type": str(ServerEvent.OUTPUT_ITEM_DONE),
                "response_id": self.response_id,
                "output_index": 0,
                "item": {
                    "id": call.item_id,
                    "object": "realtime.item",
                    "type": "function_call",
                    "status": status,
                    "call_id": call_id,
                    "name": name,
                    "arguments": arguments,
                },
            },
        ]

    def _user_frame(self, ids: Sequence[int], frame: int, ext: bool) -> list[dict]:
        """The caller's words (RNNT): a turn opens at its first token, ends after a gap."""
        events: list[dict] = []
        turn = self._user
        if not ids:
            if turn is not None:
                turn.quiet += 1
                if turn.quiet >= self.limits.user_gap_frames:
                    events += self._close_user(frame)
            return events
        if turn is None:
            turn = self._user = _Turn(self._item_id("user"), frame)
            events.append(
                {
                    "type": str(ServerEvent.SPEECH_STARTED),
                    "audio_start_ms": frame * FRAME_MS,
                    "item_id": turn.item_id,
                }
            )
        turn.quiet = 0
        turn.ids.extend(int(i) for i in ids)
        events.append(
            {
                "type": str(ServerEvent.TRANSCRIPTION_DELTA),
                "item_id": turn.item_id,
                "content_index": 0,
                "delta": self._decode(self.asr_decode, turn),
                **self._ext(ext, ids=[int(i) for i in ids], frame=frame),
            }
        )
        if len(turn.ids) >= self.limits.max_turn_ids:
            events += self._close_user(frame + 1)
        return events

    def _close_user(self, frame: int) -> list[dict]:
        turn, self._user = self._user, None
        if turn is None:
            return []
        return [
            {
                "type": str(ServerEvent.SPEECH_STOPPED),
                "audio_end_ms": (frame - turn.quiet + 1) * FRAME_MS,
                "item_id": turn.item_id,
            },
            {
                "type": str(ServerEvent.TRANSCRIPTION_COMPLETED),
                "item_id": turn.item_id,
                "content_index": 0,
                "transcript": turn.text,
            },
        ]

    # ---- the end -----------------------------------------------------------------------------

    def end(self, end: StreamEnd, frame: int, cfg: SessionConfig) -> tuple[list[dict], CloseCode]:
        """The events that end the session (open turns closed first) and the close code."""
        reason, close, code = _END_BY_REASON.get(
            end.reason, (EndReason.FAILED, CloseCode.INTERNAL_ERROR, ErrorCode.SESSION_FAILED)
        )
        events = self._close_user(frame) + self._close_call("incomplete") + self._close_agent()
        message = _end_message(reason, end.detail)
        if code is not None:
            events.append(
                error_event(
                    code,
                    message,
                    error_type=(
                        ErrorType.SERVER
                        if reason is EndReason.FAILED
                        else ErrorType.INVALID_REQUEST
                    ),
                )
            )
        if cfg.extensions:
            events.append(
                {
                    "type": str(ServerEvent.SESSION_ENDED),
                    "reason": str(reason),
                    "detail": end.detail,
                    "frames": frame,
                }
            )
        status = "completed" if reason is EndReason.CLIENT_CLOSED else "incomplete"
        if reason is EndReason.FAILED:
            status = "failed"
        events.append(
            {
                "type": str(ServerEvent.RESPONSE_DONE),
                "response": {
                    "id": self.response_id,
                    "object": "realtime.response",
                    "status": status,
                    "status_details": {"type": status, "reason": str(reason)},
                    "output": [],
                },
            }
        )
        return [self.stamp(e) for e in events], close


def _end_message(reason: EndReason, detail: str) -> str:
    if reason is EndReason.CONTEXT_CAP:
        return f"the session reached its context cap and ended ({detail})"
    if reason is EndReason.SHUTDOWN:
        return "the server is shutting down; the session ended"
    if reason is EndReason.IDLE_TIMEOUT:
        return f"no audio from the client: {detail}"
    return detail


def parse_tool_call(text: str) -> tuple[str, str]:
    """(name, arguments JSON) of a decoded tool call ``<TOOLCALL>[{"name":..,"arguments":..}]
    </TOOLCALL>``; ("", the text as it is) when it does not parse."""
    body = text.strip()
    for tag in ("<TOOLCALL>", "</TOOLCALL>"):
        body = body.replace(tag, "")
    try:
        calls = json.loads(body)
    except json.JSONDecodeError:
        return "", text
    call = calls[0] if isinstance(calls, list) and calls else calls
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "", text
    args = call.get("arguments", {})
    return call["name"], args if isinstance(args, str) else json.dumps(args)
