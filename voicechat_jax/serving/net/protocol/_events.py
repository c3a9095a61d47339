"""The wire protocol's names: client and server events, error types and codes, close codes, end
reasons; the error event. Part of ``serving.net.protocol``."""

from __future__ import annotations

import enum
from typing import Any

from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID

PROTOCOL_VERSION = 2
# The OpenAI Realtime API version followed: GA, as the ``openai`` Python SDK types it
# (``openai.types.realtime``, checked against openai 3.60 in tests/test_realtime_ga.py).
REALTIME_API = "GA"
FRAME_MS = 80
DEFAULT_RATE = 24000  # the Realtime API's PCM16 rate, in and out
INPUT_RATES = (16000, 24000)
OUTPUT_RATES = (16000, 22050, 24000)
SILENCE_ID = 11  # the text channel's "silence" token (docs/model.md §2)
SOTC_ID, EOTC_ID, EOTR_ID = 20, 21, 22  # function channel: start / end of a tool call, tool result
# Ids that are not words on the text channel.
TEXT_SKIP = frozenset({PAD_ID, SILENCE_ID, BOS_ID, EOS_ID})
# How the model takes turns, in the GA session's terms: a model decides (semantic, not volume),
# it starts answering by itself, and the server never cuts a response short when the caller
# speaks (the model may stop, or talk on: full duplex).
TURN_DETECTION = {
    "type": "semantic_vad",
    "eagerness": "auto",
    "create_response": True,
    "interrupt_response": False,
}
TRANSCRIPTION_MODEL = "rnnt"  # the caller is always transcribed, by the model's own RNNT head


class ClientEvent(enum.StrEnum):
    SESSION_UPDATE = "session.update"
    INPUT_AUDIO_APPEND = "input_audio_buffer.append"
    INPUT_AUDIO_COMMIT = "input_audio_buffer.commit"
    INPUT_AUDIO_CLEAR = "input_audio_buffer.clear"
    RESPONSE_CREATE = "response.create"
    RESPONSE_CANCEL = "response.cancel"
    OUTPUT_AUDIO_CLEAR = "output_audio_buffer.clear"
    ITEM_CREATE = "conversation.item.create"
    ITEM_TRUNCATE = "conversation.item.truncate"
    ITEM_DELETE = "conversation.item.delete"
    ITEM_RETRIEVE = "conversation.item.retrieve"
    SESSION_CLOSE = "voicechat.session.close"  # extension: end the call gracefully


# The client events ``CallEvents.control`` answers (the conversation, responses, buffers).
CONTROL = frozenset(
    {
        ClientEvent.INPUT_AUDIO_COMMIT,
        ClientEvent.INPUT_AUDIO_CLEAR,
        ClientEvent.RESPONSE_CREATE,
        ClientEvent.RESPONSE_CANCEL,
        ClientEvent.OUTPUT_AUDIO_CLEAR,
        ClientEvent.ITEM_CREATE,
        ClientEvent.ITEM_TRUNCATE,
        ClientEvent.ITEM_DELETE,
        ClientEvent.ITEM_RETRIEVE,
    }
)


class ServerEvent(enum.StrEnum):
    """Server events by their GA names (``BETA_NAMES``: the beta names of those renamed)."""

    ERROR = "error"
    SESSION_CREATED = "session.created"
    SESSION_UPDATED = "session.updated"
    RESPONSE_CREATED = "response.created"
    RESPONSE_DONE = "response.done"
    OUTPUT_ITEM_ADDED = "response.output_item.added"
    OUTPUT_ITEM_DONE = "response.output_item.done"
    CONTENT_PART_ADDED = "response.content_part.added"
    CONTENT_PART_DONE = "response.content_part.done"
    AUDIO_DELTA = "response.output_audio.delta"
    AUDIO_DONE = "response.output_audio.done"
    AUDIO_TRANSCRIPT_DELTA = "response.output_audio_transcript.delta"
    AUDIO_TRANSCRIPT_DONE = "response.output_audio_transcript.done"
    FUNCTION_ARGUMENTS_DELTA = "response.function_call_arguments.delta"
    FUNCTION_ARGUMENTS_DONE = "response.function_call_arguments.done"
    ITEM_ADDED = "conversation.item.added"
    ITEM_DONE = "conversation.item.done"  # GA only
    ITEM_TRUNCATED = "conversation.item.truncated"
    ITEM_DELETED = "conversation.item.deleted"
    ITEM_RETRIEVED = "conversation.item.retrieved"
    INPUT_COMMITTED = "input_audio_buffer.committed"
    INPUT_CLEARED = "input_audio_buffer.cleared"
    SPEECH_STARTED = "input_audio_buffer.speech_started"
    SPEECH_STOPPED = "input_audio_buffer.speech_stopped"
    OUTPUT_AUDIO_CLEARED = "output_audio_buffer.cleared"
    TRANSCRIPTION_DELTA = "conversation.item.input_audio_transcription.delta"
    TRANSCRIPTION_COMPLETED = "conversation.item.input_audio_transcription.completed"
    RATE_LIMITS_UPDATED = "rate_limits.updated"
    # Extensions (sent when the client asked for them).
    BEAT = "voicechat.beat"
    EXT_AUDIO_DELTA = "voicechat.output_audio.delta"  # the stream's audio outside any response
    ROLLED_OVER = "voicechat.session.rolled_over"
    SESSION_ENDED = "voicechat.session.ended"


# The beta names of the events GA renamed (``conversation.item.done`` has none: not sent).
BETA_NAMES = {
    ServerEvent.AUDIO_DELTA: "response.audio.delta",
    ServerEvent.AUDIO_DONE: "response.audio.done",
    ServerEvent.AUDIO_TRANSCRIPT_DELTA: "response.audio_transcript.delta",
    ServerEvent.AUDIO_TRANSCRIPT_DONE: "response.audio_transcript.done",
    ServerEvent.ITEM_ADDED: "conversation.item.created",
}


class ErrorType(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"
    SERVER = "server_error"


class ErrorCode(enum.StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_EVENT = "invalid_event"
    UNKNOWN_EVENT = "unknown_event"
    INVALID_VALUE = "invalid_value"  # a field of a known event with a value it cannot take
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
    # The Realtime API's own codes for these cases.
    ACTIVE_RESPONSE = "conversation_already_has_active_response"
    CANCEL_NOT_ACTIVE = "response_cancel_not_active"
    TRUNCATE_INVALID_ITEM = "item_truncate_invalid_item_id"
    DELETE_INVALID_ITEM = "item_delete_invalid_item_id"
    RETRIEVE_INVALID_ITEM = "item_retrieve_invalid_item_id"
    INVALID_API_KEY = "invalid_api_key"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"


class CloseCode(enum.IntEnum):
    """WebSocket close codes (RFC 6455 §7.4.1)."""

    NORMAL = 1000
    GOING_AWAY = 1001  # the server is shutting down
    POLICY_VIOLATION = 1008  # too many protocol errors, or no valid API key
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
