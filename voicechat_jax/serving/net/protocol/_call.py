"""One call's beats -> its events, and its conversation events -> their acknowledgements
(``CallEvents``). Part of ``serving.net.protocol``."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from voicechat_jax.config import BOS_ID, EOS_ID, PAD_ID
from voicechat_jax.serving.net.protocol._audio import b64
from voicechat_jax.serving.net.protocol._events import (
    _END_BY_REASON,
    BETA_NAMES,
    EOTC_ID,
    EOTR_ID,
    FRAME_MS,
    PROTOCOL_VERSION,
    REALTIME_API,
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
from voicechat_jax.serving.net.protocol._session import _SESSION_FIELDS, SessionConfig, _not_applied
from voicechat_jax.serving.writer import StreamBeat, StreamEnd


@dataclasses.dataclass(frozen=True)
class Limits:
    """How turns are cut and bounded (frames are 80 ms)."""

    user_gap_frames: int = 6  # the caller's turn ends after this many frames with no RNNT token
    agent_gap_frames: int = 50  # an agent turn with no EOS closes after this many quiet frames
    max_turn_ids: int = 512  # ids per turn or call; a longer one is closed and a new one opened
    # The speech decoder lags its text by about two frames (docs/model.md §2): a turn's response
    # ends this many frames after its EOS, so that its last words are in it.
    audio_tail_frames: int = 2
    request_wait_frames: int = 50  # a response.create's response waits this long for a turn
    max_items: int = 256  # conversation items kept (retrieve, truncate, delete): oldest forgotten


class _Turn:
    """One open turn (or tool call): its item id, ids and the text already sent."""

    def __init__(self, item_id: str, start_frame: int):
        self.item_id = item_id
        self.start_frame = start_frame
        self.ids: list[int] = []
        self.text = ""
        self.quiet = 0
        self.output_index = 0  # its place in its response's output
        self.audio_ms = 0  # its audio sent so far


class _Response:
    """One response: an agent turn's message and the tool calls made while it is open; or a
    ``response.create``'s, which waits ``wait`` frames at most for the model's next turn."""

    def __init__(self, response_id: str, *, metadata: Any = None, wait: int | None = None):
        self.id = response_id
        self.metadata = metadata
        self.wait = wait
        self.items: list[dict] = []  # its output items, each as last sent
        self.message: _Turn | None = None  # the message being voiced (or in its audio tail)
        self.tail: int | None = None  # frames of audio left once the message's turn closed
        self.call: _Turn | None = None  # the tool call being made


Decoder = Callable[[Sequence[int]], str]

_NO_COMMIT = (
    "nothing to commit: the model is full duplex and hears the audio as it arrives; each of the "
    "caller's turns is committed when it ends (input_audio_buffer.speech_stopped)"
)
_CLEARED = (
    "the part of a frame not yet queued was dropped; the audio before it is the model's already "
    "(it hears each 80 ms frame at the next beat)"
)
_TRUNCATED = (
    "the model's own context keeps the whole turn (it heard itself say it); audio_end_ms is at "
    "most the audio sent; response.cancel stops a response's audio"
)
_ITEM_NOT_HEARD = "the model hears only the call's audio: an item from the client does not reach it"
_NO_TURN = "the model took no turn in time"
# response.create's fields (besides the session's) -> as ``_SESSION_FIELDS``.
_RESPONSE_FIELDS: dict[str, tuple[str, str]] = {
    "conversation": ("conversation", "every response is in the call's one conversation"),
    "input": ("optional", _ITEM_NOT_HEARD),
    "audio": ("optional", "the response's audio is the session's"),
    "metadata": ("metadata", ""),
}


class CallEvents:
    """One session's events, built from its beats and the client's conversation events; see the
    module docstring.

    Args:
      session_id: the session's id (the ``session.id`` the client sees).
      text_decode: LLM ids -> text (the agent's words and tool calls); None: ids only.
      asr_decode: RNNT ids -> text (the caller's words); None: ids only.
      limits: turn gaps and bounds.
      beta: the client asked for the beta API: its event names and shapes.
      context_frames: the session's context cap, reported in ``rate_limits.updated``; None: not
        reported.

    Not thread-safe: one connection's event loop owns it (its reader and sender take turns).
    """

    def __init__(
        self,
        session_id: str,
        *,
        text_decode: Decoder | None = None,
        asr_decode: Decoder | None = None,
        limits: Limits | None = None,
        beta: bool = False,
        context_frames: int | None = None,
    ):
        self.session_id = session_id
        self.text_decode = text_decode
        self.asr_decode = asr_decode
        self.limits = limits or Limits()
        self.beta = beta
        self.context_frames = context_frames
        self.conversation_id = f"conv_{session_id}"
        self._ids = itertools.count()
        self._events = itertools.count()
        self._responses = itertools.count()
        self._agent: _Turn | None = None  # the text channel's open turn
        self._call: _Turn | None = None  # the function channel's open call
        self._user: _Turn | None = None  # the caller's open turn
        self._response: _Response | None = None  # the active response
        self._last_response_id = ""
        # The conversation, oldest first (bounded), and the audio sent for each agent message.
        self._items: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._audio_ms: dict[str, int] = {}
        self._frame = 0  # the frame being built
        self._context_start = 0  # the frame its context began at (0, or the last rollover)
        self.last_tick: int | None = None

    # ---- helpers -----------------------------------------------------------------------------

    def _item_id(self, kind: str) -> str:
        return f"item_{self.session_id}_{kind}{next(self._ids)}"

    def stamp(self, event: dict) -> dict:
        """Gives the event its ``event_id`` (every server event has one) and, for a beta client,
        its beta name."""
        if self.beta:
            event["type"] = BETA_NAMES.get(event["type"], event["type"])
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

    def _cancelled_turn(self) -> bool:
        """The text channel is in a turn whose response the client cancelled (not sent)."""
        resp = self._response
        return self._agent is not None and (resp is None or resp.message is not self._agent)

    # ---- the conversation --------------------------------------------------------------------

    def _item_added(self, item: dict) -> list[dict]:
        """Keeps a new item (the oldest forgotten past ``max_items``): its
        ``conversation.item.added`` (beta: ``.created``)."""
        previous = next(reversed(self._items), None)
        self._items[item["id"]] = item
        while len(self._items) > self.limits.max_items:
            old, _ = self._items.popitem(last=False)
            self._audio_ms.pop(old, None)
        return [{"type": str(ServerEvent.ITEM_ADDED), "previous_item_id": previous, "item": item}]

    def _item_done(self, item: dict) -> list[dict]:
        """An item complete: kept as it now is; its ``conversation.item.done`` (GA only)."""
        if item["id"] in self._items:
            self._items[item["id"]] = item
        return [] if self.beta else [{"type": str(ServerEvent.ITEM_DONE), "item": item}]

    def _message(self, turn: _Turn, status: str) -> dict:
        content = [{"type": "audio" if self.beta else "output_audio", "transcript": turn.text}]
        return {
            "id": turn.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content if status != "in_progress" else [],
        }

    @staticmethod
    def _function_call(call: _Turn, status: str, name: str = "", arguments: str = "") -> dict:
        return {
            "id": call.item_id,
            "object": "realtime.item",
            "type": "function_call",
            "status": status,
            "call_id": f"call_{call.item_id}",
            "name": name,
            "arguments": arguments,
        }

    # ---- responses ---------------------------------------------------------------------------

    def _response_object(self, resp: _Response, status: str, details: dict | None) -> dict:
        modalities = (
            {"modalities": ["audio", "text"]} if self.beta else {"output_modalities": ["audio"]}
        )
        return {
            "id": resp.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": list(resp.items),
            "conversation_id": self.conversation_id,
            "metadata": resp.metadata,
            **modalities,
        }

    def _open_response(
        self, *, metadata: Any = None, wait: int | None = None, note: dict | None = None
    ) -> list[dict]:
        resp = _Response(
            f"resp_{self.session_id}_{next(self._responses)}", metadata=metadata, wait=wait
        )
        self._response = resp
        event = {
            "type": str(ServerEvent.RESPONSE_CREATED),
            "response": self._response_object(resp, "in_progress", None),
        }
        if note:
            event["voicechat"] = note
        return [event]

    def _close_response(
        self,
        status: str = "completed",
        reason: str | None = None,
        *,
        error: dict | None = None,
        note: str | None = None,
    ) -> list[dict]:
        """``response.done`` for the active response (its open items closed first by the caller),
        then ``rate_limits.updated``."""
        resp, self._response = self._response, None
        if resp is None:
            return []
        self._last_response_id = resp.id
        details = None
        if status != "completed":
            details = {"type": status, "reason": reason, **({"error": error} if error else {})}
        event = {
            "type": str(ServerEvent.RESPONSE_DONE),
            "response": self._response_object(resp, status, details),
        }
        if note:
            event["voicechat"] = {"note": note}
        return [event, *self._rate_limits()]

    def _rate_limits(self) -> list[dict]:
        """The session's context as a token limit: one frame is one step of the model."""
        if self.context_frames is None:
            return []
        remaining = max(0, self.context_frames - (self._frame + 1 - self._context_start))
        limit = {
            "name": "tokens",
            "limit": self.context_frames,
            "remaining": remaining,
            "reset_seconds": remaining * FRAME_MS / 1000,
        }
        return [{"type": str(ServerEvent.RATE_LIMITS_UPDATED), "rate_limits": [limit]}]

    def _finish_message(self, resp: _Response, status: str) -> list[dict]:
        turn, resp.message, resp.tail = resp.message, None, None
        item = self._message(turn, status)
        resp.items[turn.output_index] = item
        common = {
            "response_id": resp.id,
            "item_id": turn.item_id,
            "output_index": turn.output_index,
            "content_index": 0,
        }
        return [
            {"type": str(ServerEvent.AUDIO_DONE), **common},
            {"type": str(ServerEvent.AUDIO_TRANSCRIPT_DONE), **common, "transcript": turn.text},
            {
                "type": str(ServerEvent.CONTENT_PART_DONE),
                **common,
                "part": {"type": "audio", "transcript": turn.text},
            },
            {
                "type": str(ServerEvent.OUTPUT_ITEM_DONE),
                "response_id": resp.id,
                "output_index": turn.output_index,
                "item": item,
            },
            *self._item_done(item),
        ]

    def _finish_call(self, resp: _Response, status: str) -> list[dict]:
        call, resp.call = resp.call, None
        name, arguments = parse_tool_call(call.text)
        item = self._function_call(call, status, name, arguments)
        resp.items[call.output_index] = item
        return [
            {
                "type": str(ServerEvent.FUNCTION_ARGUMENTS_DONE),
                "response_id": resp.id,
                "item_id": call.item_id,
                "output_index": call.output_index,
                "call_id": item["call_id"],
                "name": name,
                "arguments": arguments,
            },
            {
                "type": str(ServerEvent.OUTPUT_ITEM_DONE),
                "response_id": resp.id,
                "output_index": call.output_index,
                "item": item,
            },
            *self._item_done(item),
        ]

    def _cut(self, status: str, reason: str | None, error: dict | None = None) -> list[dict]:
        """Ends the active response before its turn does: its open items ``incomplete``. The rest
        of the turn is not sent."""
        resp = self._response
        events = []
        if resp.message is not None:
            events += self._finish_message(resp, "incomplete")
        if resp.call is not None:
            events += self._finish_call(resp, "incomplete")
        return events + self._close_response(status, reason, error=error)

    # ---- session-level events ----------------------------------------------------------------

    def session_object(self, cfg: SessionConfig, info: dict) -> dict:
        """The ``session`` object of ``session.created`` / ``session.updated``: the session as it
        is (GA or beta shape), with the server's own figures in ``voicechat``."""
        ext = {
            "voicechat": {
                "protocol_version": PROTOCOL_VERSION,
                "realtime_api": "beta" if self.beta else REALTIME_API,
                "events": cfg.extensions,
                "input_sample_rate": cfg.input_rate,
                "output_sample_rate": cfg.output_rate,
                "frame_ms": FRAME_MS,
                **info,
            }
        }
        transcription = {"model": TRANSCRIPTION_MODEL}
        common = {"id": self.session_id, "object": "realtime.session", "instructions": None}
        if self.beta:
            return {
                **common,
                "modalities": ["audio", "text"],
                "voice": cfg.voice,
                "input_audio_format": "pcm16",
                "output_audio_format": "pcm16",
                "input_audio_transcription": transcription,
                "turn_detection": dict(TURN_DETECTION),
                "tools": [],
                "tool_choice": "auto",
                "max_response_output_tokens": "inf",
                "speed": 1.0,
                **ext,
            }
        return {
            "type": "realtime",
            **common,
            "model": cfg.model,
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": cfg.input_rate},
                    "transcription": transcription,
                    "noise_reduction": None,
                    "turn_detection": dict(TURN_DETECTION),
                },
                "output": {
                    "format": {"type": "audio/pcm", "rate": cfg.output_rate},
                    "voice": cfg.voice,
                    "speed": 1.0,
                },
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            **ext,
        }

    def session_created(self, cfg: SessionConfig, info: dict) -> dict:
        return self.stamp(
            {
                "type": str(ServerEvent.SESSION_CREATED),
                "session": self.session_object(cfg, info),
            }
        )

    def session_updated(self, cfg: SessionConfig, info: dict, not_applied: list[dict]) -> dict:
        """``session.updated``: the session as applied, and what of the update was not
        (``voicechat.not_applied``, ``SessionConfig.apply``)."""
        return self.stamp(
            {
                "type": str(ServerEvent.SESSION_UPDATED),
                "session": self.session_object(cfg, info),
                "voicechat": {"not_applied": not_applied},
            }
        )

    # ---- the client's conversation events ----------------------------------------------------

    def control(self, event: dict, cfg: SessionConfig) -> list[dict]:
        """The answer to a client's response, conversation or buffer event (``CONTROL``): its
        acknowledgement, or ``ProtocolError`` with the Realtime API's code for the case."""
        event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        handle = {
            ClientEvent.RESPONSE_CREATE: self._response_create,
            ClientEvent.RESPONSE_CANCEL: self._response_cancel,
            ClientEvent.OUTPUT_AUDIO_CLEAR: self._output_audio_clear,
            ClientEvent.INPUT_AUDIO_COMMIT: self._input_commit,
            ClientEvent.INPUT_AUDIO_CLEAR: self._input_clear,
            ClientEvent.ITEM_CREATE: self._item_create,
            ClientEvent.ITEM_TRUNCATE: self._item_truncate,
            ClientEvent.ITEM_DELETE: self._item_delete,
            ClientEvent.ITEM_RETRIEVE: self._item_retrieve,
        }[ClientEvent(event["type"])]
        return [self.stamp(e) for e in handle(event, event_id, cfg)]

    def _response_create(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        """A response for the model's next turn (the model decides when it speaks): between
        turns, ``response.created`` now; the next turn within ``request_wait_frames`` is its
        output, else it ends ``incomplete`` with none."""
        if self._response is not None:
            raise ProtocolError(
                ErrorCode.ACTIVE_RESPONSE,
                f"Conversation already has an active response in progress: {self._response.id}. "
                "Wait until the response is finished before creating a new one.",
                event_id=event_id,
            )
        params = event.get("response") or {}
        if not isinstance(params, dict):
            raise ProtocolError(
                ErrorCode.INVALID_VALUE,
                "response must be an object",
                event_id=event_id,
                param="response",
            )
        skipped = []
        for key, value in params.items():
            rule = _RESPONSE_FIELDS.get(key, _SESSION_FIELDS.get(key))
            skipped += _not_applied(f"response.{key}", value, rule, cfg)
        return self._open_response(
            metadata=params.get("metadata"),
            wait=self.limits.request_wait_frames,
            note={"not_applied": skipped} if skipped else None,
        )

    def _response_cancel(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        resp, wanted = self._response, event.get("response_id")
        if resp is None or (wanted is not None and wanted != resp.id):
            raise ProtocolError(
                ErrorCode.CANCEL_NOT_ACTIVE,
                "Cancellation failed: no active response found",
                event_id=event_id,
            )
        return self._cut("cancelled", "client_cancelled")

    def _output_audio_clear(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        """The client stops playing: the active response is cut as by ``response.cancel``."""
        resp = self._response
        events = [] if resp is None else self._cut("cancelled", "client_cancelled")
        response_id = self._last_response_id if resp is None else resp.id
        return [
            *events,
            {"type": str(ServerEvent.OUTPUT_AUDIO_CLEARED), "response_id": response_id},
        ]

    def _input_commit(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        item_id = self._item_id("user") if self._user is None else self._user.item_id
        return [
            {
                "type": str(ServerEvent.INPUT_COMMITTED),
                "previous_item_id": next(reversed(self._items), None),
                "item_id": item_id,
                "voicechat": {"note": _NO_COMMIT},
            }
        ]

    def _input_clear(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        return [{"type": str(ServerEvent.INPUT_CLEARED), "voicechat": {"note": _CLEARED}}]

    def _item_create(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type") not in (
            "message",
            "function_call",
            "function_call_output",
        ):
            raise ProtocolError(
                ErrorCode.INVALID_VALUE,
                "item must be an object of type message, function_call or function_call_output",
                event_id=event_id,
                param="item",
            )
        item = {"object": "realtime.item", "status": "completed", **item}
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = self._item_id("client")
        added = self._item_added(item)
        added[0]["voicechat"] = {"not_applied": [{"param": "item", "reason": _ITEM_NOT_HEARD}]}
        return added + self._item_done(item)

    def _known_item(self, event: dict, event_id: str | None, code: ErrorCode, verb: str) -> dict:
        item_id = event.get("item_id")
        item = self._items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            raise ProtocolError(
                code,
                f"Error {verb} item: the item with id {item_id!r} does not exist.",
                event_id=event_id,
                param="item_id",
            )
        return item

    def _item_truncate(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        item = self._known_item(event, event_id, ErrorCode.TRUNCATE_INVALID_ITEM, "truncating")
        if item.get("type") != "message" or item.get("role") != "assistant":
            raise ProtocolError(
                ErrorCode.TRUNCATE_INVALID_ITEM,
                "only the assistant's audio messages can be truncated",
                event_id=event_id,
                param="item_id",
            )
        end_ms = event.get("audio_end_ms")
        if not isinstance(end_ms, int) or isinstance(end_ms, bool) or end_ms < 0:
            raise ProtocolError(
                ErrorCode.INVALID_VALUE,
                "audio_end_ms must be an integer >= 0",
                event_id=event_id,
                param="audio_end_ms",
            )
        if event.get("content_index", 0) != 0:
            raise ProtocolError(
                ErrorCode.INVALID_VALUE,
                "content_index must be 0: an audio message has one content part",
                event_id=event_id,
                param="content_index",
            )
        return [
            {
                "type": str(ServerEvent.ITEM_TRUNCATED),
                "item_id": item["id"],
                "content_index": 0,
                "audio_end_ms": min(end_ms, self._audio_ms.get(item["id"], 0)),
                "voicechat": {"note": _TRUNCATED},
            }
        ]

    def _item_delete(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        item = self._known_item(event, event_id, ErrorCode.DELETE_INVALID_ITEM, "deleting")
        del self._items[item["id"]]
        self._audio_ms.pop(item["id"], None)
        return [{"type": str(ServerEvent.ITEM_DELETED), "item_id": item["id"]}]

    def _item_retrieve(self, event: dict, event_id: str | None, cfg: SessionConfig) -> list:
        item = self._known_item(event, event_id, ErrorCode.RETRIEVE_INVALID_ITEM, "retrieving")
        return [{"type": str(ServerEvent.ITEM_RETRIEVED), "item": item}]

    # ---- one frame ---------------------------------------------------------------------------

    def beat(
        self, beat: StreamBeat, audio: Sequence[bytes], cfg: SessionConfig, *, dropped: int = 0
    ) -> list[list[dict]]:
        """The events of each of the beat's frames (``frame``, for all of them at once)."""
        return [
            self.frame(beat, t, audio[t], cfg, dropped=dropped) for t in range(beat.text.shape[0])
        ]

    def frame(
        self, beat: StreamBeat, t: int, pcm: bytes, cfg: SessionConfig, *, dropped: int = 0
    ) -> list[dict]:
        """The events of the beat's frame ``t`` (``pcm``: its audio, PCM16 at the client's rate),
        built as it is sent, after the client's events before it. ``dropped``: output beats the
        stream dropped before this beat. The frame's audio delta comes last."""
        events: list[dict] = []
        frame = self._frame = beat.frame + t
        if t == 0:
            if cfg.extensions:
                stamp = beat.stamp
                skipped = 0 if self.last_tick is None else stamp.tick - self.last_tick - 1
                events.append(
                    {
                        "type": str(ServerEvent.BEAT),
                        "tick": stamp.tick,
                        "frame": beat.frame,
                        "frames": beat.text.shape[0],
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
            if beat.rollover is not None:
                self._context_start = frame
            self.last_tick = beat.stamp.tick
        ext = cfg.extensions
        events += self._agent_frame(int(beat.text[t]), frame, ext)
        events += self._call_frame(int(beat.function[t]), frame, ext)
        events += self._user_frame(beat.transcript[t], frame, ext)
        events += self._audio_frame(pcm, frame, ext)
        return [self.stamp(e) for e in events]

    def _audio_frame(self, pcm: bytes, frame: int, ext: bool) -> list[dict]:
        """The frame's audio: the active response's while its message is voiced; else, with the
        extensions on, the stream's (``voicechat.output_audio.delta``); a cancelled turn's,
        never."""
        events: list[dict] = []
        resp = self._response
        if resp is not None and resp.message is not None:
            turn = resp.message
            events.append(
                {
                    "type": str(ServerEvent.AUDIO_DELTA),
                    "response_id": resp.id,
                    "item_id": turn.item_id,
                    "output_index": turn.output_index,
                    "content_index": 0,
                    "delta": b64(pcm),
                }
            )
            turn.audio_ms += FRAME_MS
            self._audio_ms[turn.item_id] = turn.audio_ms
            if resp.tail is not None and resp.tail > 0:
                resp.tail -= 1
            elif resp.tail is not None:  # the turn's audio is out: its response ends
                events += self._finish_message(resp, "completed")
                if resp.call is None:
                    events += self._close_response()
        elif ext and not self._cancelled_turn():
            events.append(
                {"type": str(ServerEvent.EXT_AUDIO_DELTA), "frame": frame, "delta": b64(pcm)}
            )
        if resp is not None and resp.wait is not None:
            resp.wait -= 1
            if resp.wait <= 0:
                events += self._close_response("incomplete", note=_NO_TURN)
        return events

    def _agent_frame(self, x: int, frame: int, ext: bool) -> list[dict]:
        events: list[dict] = []
        turn = self._agent
        if x == BOS_ID or (x not in TEXT_SKIP and turn is None):
            self._close_agent()
            turn = self._agent = _Turn(self._item_id("agent"), frame)
            events += self._open_message(turn)
        if turn is None:
            return events
        if x == EOS_ID:
            self._close_agent()
            return events
        if x in TEXT_SKIP:
            turn.quiet += 1
            if turn.quiet >= self.limits.agent_gap_frames:
                self._close_agent()
            return events
        turn.quiet = 0
        turn.ids.append(x)
        delta = self._decode(self.text_decode, turn)
        resp = self._response
        if resp is not None and resp.message is turn:
            events.append(
                {
                    "type": str(ServerEvent.AUDIO_TRANSCRIPT_DELTA),
                    "response_id": resp.id,
                    "item_id": turn.item_id,
                    "output_index": turn.output_index,
                    "content_index": 0,
                    "delta": delta,
                    **self._ext(ext, ids=[x], frame=frame),
                }
            )
        if len(turn.ids) >= self.limits.max_turn_ids:
            self._close_agent()
        return events

    def _open_message(self, turn: _Turn) -> list[dict]:
        """A new agent turn: its message in the active response (a ``response.create``'s that
        waits for it), else in a new one; the last turn's response ends here if its audio tail
        has not."""
        events: list[dict] = []
        resp = self._response
        if resp is not None and resp.message is not None:
            events += self._finish_message(resp, "completed")
            if resp.call is None:
                events += self._close_response()
        if self._response is None:
            events += self._open_response()
        resp = self._response
        resp.message = turn
        return [
            *events,
            *self._add_output(resp, turn, self._message(turn, "in_progress")),
            {
                "type": str(ServerEvent.CONTENT_PART_ADDED),
                "response_id": resp.id,
                "item_id": turn.item_id,
                "output_index": turn.output_index,
                "content_index": 0,
                "part": {"type": "audio", "transcript": ""},
            },
        ]

    def _close_agent(self) -> None:
        """The text channel's turn ends; its response ends once its audio tail is out."""
        turn, self._agent = self._agent, None
        resp = self._response
        if turn is not None and resp is not None and resp.message is turn:
            resp.tail = self.limits.audio_tail_frames

    def _call_frame(self, x: int, frame: int, ext: bool) -> list[dict]:
        """The function channel: ids between SOTC and EOTC are a tool call's text."""
        events: list[dict] = []
        call = self._call
        if x == SOTC_ID:
            if call is not None:
                events += self._close_call("incomplete")
            call = self._call = _Turn(self._item_id("call"), frame)
            return events + self._open_call(call)
        if call is None or x in (PAD_ID, EOTR_ID):
            return events
        if x == EOTC_ID:
            return self._close_call("completed")
        call.ids.append(x)
        delta = self._decode(self.text_decode, call)
        resp = self._response
        if resp is not None and resp.call is call:
            events.append(
                {
                    "type": str(ServerEvent.FUNCTION_ARGUMENTS_DELTA),
                    "response_id": resp.id,
                    "item_id": call.item_id,
                    "output_index": call.output_index,
                    "call_id": f"call_{call.item_id}",
                    "delta": delta,
                    **self._ext(ext, ids=[x], frame=frame),
                }
            )
        if len(call.ids) >= self.limits.max_turn_ids:
            events += self._close_call("incomplete")
        return events

    def _open_call(self, call: _Turn) -> list[dict]:
        events = self._open_response() if self._response is None else []
        resp = self._response
        resp.call = call
        return [*events, *self._add_output(resp, call, self._function_call(call, "in_progress"))]

    def _add_output(self, resp: _Response, turn: _Turn, item: dict) -> list[dict]:
        """``item`` (``turn``'s) the response's next output, the response no longer waiting:
        its ``response.output_item.added`` and ``conversation.item.added``."""
        resp.wait = None
        turn.output_index = len(resp.items)
        resp.items.append(item)
        added = {
            "type": str(ServerEvent.OUTPUT_ITEM_ADDED),
            "response_id": resp.id,
            "output_index": turn.output_index,
            "item": item,
        }
        return [added, *self._item_added(item)]

    def _close_call(self, status: str) -> list[dict]:
        call, self._call = self._call, None
        resp = self._response
        if call is None or resp is None or resp.call is not call:  # none, or cancelled
            return []
        events = self._finish_call(resp, status)
        if resp.message is None:
            events += self._close_response()
        return events

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
        """The caller's turn ends: speech stopped, the turn committed as a user item, and its
        transcript."""
        turn, self._user = self._user, None
        if turn is None:
            return []
        end_ms = (frame - turn.quiet + 1) * FRAME_MS
        item = {
            "id": turn.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": turn.text}],
        }
        added = self._item_added(item)
        return [
            {
                "type": str(ServerEvent.SPEECH_STOPPED),
                "audio_end_ms": end_ms,
                "item_id": item["id"],
            },
            {
                "type": str(ServerEvent.INPUT_COMMITTED),
                "previous_item_id": added[0]["previous_item_id"],
                "item_id": item["id"],
            },
            *added,
            *self._item_done(item),
            {
                "type": str(ServerEvent.TRANSCRIPTION_COMPLETED),
                "item_id": item["id"],
                "content_index": 0,
                "transcript": turn.text,
                "usage": {
                    "type": "duration",
                    "seconds": (end_ms - turn.start_frame * FRAME_MS) / 1e3,
                },
            },
        ]

    # ---- the end -----------------------------------------------------------------------------

    def end(self, end: StreamEnd, frame: int, cfg: SessionConfig) -> tuple[list[dict], CloseCode]:
        """The events that end the session (the caller's open turn and the active response
        closed first) and the close code."""
        reason, close, code = _END_BY_REASON.get(
            end.reason, (EndReason.FAILED, CloseCode.INTERNAL_ERROR, ErrorCode.SESSION_FAILED)
        )
        events = self._close_user(frame)
        if self._response is not None:
            if reason is EndReason.CLIENT_CLOSED:
                events += self._cut("cancelled", "client_cancelled")
            elif reason is EndReason.FAILED:
                events += self._cut("failed", None, {"type": "server_error", "code": str(code)})
            else:
                events += self._cut("incomplete", None)
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
