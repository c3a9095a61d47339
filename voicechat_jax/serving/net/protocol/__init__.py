"""The wire protocol of a live call (``docs/protocol.md``): event names, audio, and the translation
of each beat's outputs into events. No network and no JAX here, so all of it is tested directly.

The events follow the OpenAI Realtime API, GA version (``REALTIME_API``: the names and shapes of
the ``openai`` SDK's ``openai.types.realtime``; JSON text messages, each with a ``type``; audio as
base64 PCM16, 24 kHz mono by default), so that its clients connect by base URL. A client that asks
for the beta version (``OpenAI-Beta: realtime=v1``) gets the beta names and shapes (``beta``).
What this server adds is namespaced ``voicechat.*``: extension events and fields, sent only to a
client that asks for them, and a ``voicechat`` field in an acknowledgement that says what the
server did not apply (always sent: a request is never dropped silently).

- ``SessionConfig``: a session's audio formats and options, and ``session.update`` applied to it
  (``apply``: the new config and the fields it could not honour).
- ``parse_client_event``: one text message -> an event dict, or a ``ProtocolError`` that the
  connection answers with an ``error`` event (the session goes on).
- ``InputAudio`` / ``OutputAudio``: PCM16 at the client's rate <-> the model's float32 at 16 kHz
  in, 22.05 kHz out, resampled with ``soxr`` (streaming, so chunk edges leave no seams); input is
  cut into whole 80 ms frames for the server's queues.
- ``CallEvents``: one session's beats (``writer.StreamBeat``) -> the events of each 80 ms frame,
  and the client's conversation events -> their acknowledgements (``control``). Each agent turn
  of the stream (the text channel: BOS or a word opens, EOS closes) is one response, from
  ``response.created`` to ``response.done``, with its message item, content part and audio;
  function calls (the function channel, SOTC ... EOTC) are items of the response they fall in;
  the caller's turns come from the RNNT transcript. Text comes from the tokenizers when the
  server has them; the raw ids are in the ``voicechat`` field with the extensions on (the tiny
  test model has no tokenizer).

This package is the protocol's one public face; its parts live in private modules: ``_events``
(names and codes), ``_session`` (the session's configuration and a message parsed), ``_audio``
(PCM16 in and out) and ``_call`` (``CallEvents``).
"""

from __future__ import annotations

from voicechat_jax.serving.net.protocol._audio import (
    InputAudio,
    OutputAudio,
    b64,
)
from voicechat_jax.serving.net.protocol._call import (
    CallEvents,
    Decoder,
    Limits,
    parse_tool_call,
)
from voicechat_jax.serving.net.protocol._events import (
    BETA_NAMES,
    CONTROL,
    DEFAULT_RATE,
    EOTC_ID,
    EOTR_ID,
    FRAME_MS,
    INPUT_RATES,
    OUTPUT_RATES,
    PROTOCOL_VERSION,
    REALTIME_API,
    SILENCE_ID,
    SOTC_ID,
    TEXT_SKIP,
    TRANSCRIPTION_MODEL,
    TURN_DETECTION,
    ClientEvent,
    CloseCode,
    EndReason,
    ErrorCode,
    ErrorType,
    ProtocolError,
    ServerEvent,
    error_event,
)
from voicechat_jax.serving.net.protocol._session import (
    SessionConfig,
    decode_audio,
    parse_client_event,
)

__all__ = [
    "BETA_NAMES",
    "CONTROL",
    "DEFAULT_RATE",
    "EOTC_ID",
    "EOTR_ID",
    "FRAME_MS",
    "INPUT_RATES",
    "OUTPUT_RATES",
    "PROTOCOL_VERSION",
    "REALTIME_API",
    "SILENCE_ID",
    "SOTC_ID",
    "TEXT_SKIP",
    "TRANSCRIPTION_MODEL",
    "TURN_DETECTION",
    "CallEvents",
    "ClientEvent",
    "CloseCode",
    "Decoder",
    "EndReason",
    "ErrorCode",
    "ErrorType",
    "InputAudio",
    "Limits",
    "OutputAudio",
    "ProtocolError",
    "ServerEvent",
    "SessionConfig",
    "b64",
    "decode_audio",
    "error_event",
    "parse_client_event",
    "parse_tool_call",
]
