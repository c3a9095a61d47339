"""The host side of the serving engine: the beat clock, audio I/O, sessions and admission, metrics.
Live calls over the network are in ``serving.net`` (imported on its own: it needs aiohttp).

Pure Python and NumPy, independent of the model: the device side (``SessionState``, the jitted
``tick``, the on-device loop) reaches the host only through these objects, and the host callback
of the loop returns NumPy only.
"""

from voicechat_jax.serving.audio import (
    FRAME_LEN,
    INPUT_RATE,
    OUTPUT_RATE,
    AudioInputError,
    decode_pcm16,
    frames,
    read_wav,
    validate_frame,
    validate_samples,
    write_wav,
)
from voicechat_jax.serving.clock import OFFLINE, REALTIME, BeatClock, TickTiming
from voicechat_jax.serving.gc_policy import GcMonitor, GcPause, GcPolicy
from voicechat_jax.serving.hub import Join, Leave, ScriptedSessions, SessionHub, SessionSource
from voicechat_jax.serving.metrics import (
    STEADY,
    WARMUP,
    Cause,
    HostTimeline,
    MetricsRecorder,
    TickRecord,
)
from voicechat_jax.serving.report import format_table, prometheus_text
from voicechat_jax.serving.sessions import (
    CapacityError,
    EndedRecords,
    InputQueues,
    Session,
    SlotTable,
)
from voicechat_jax.serving.writer import (
    BeatPool,
    BeatStamp,
    HostBeat,
    OutputStream,
    SessionFiles,
    SessionOutput,
    StreamBeat,
    StreamEnd,
    WavStream,
)

__all__ = [
    "FRAME_LEN",
    "INPUT_RATE",
    "OFFLINE",
    "OUTPUT_RATE",
    "REALTIME",
    "STEADY",
    "WARMUP",
    "AudioInputError",
    "BeatClock",
    "BeatPool",
    "BeatStamp",
    "CapacityError",
    "Cause",
    "EndedRecords",
    "GcMonitor",
    "GcPause",
    "GcPolicy",
    "HostBeat",
    "HostTimeline",
    "InputQueues",
    "Join",
    "Leave",
    "MetricsRecorder",
    "OutputStream",
    "ScriptedSessions",
    "Session",
    "SessionFiles",
    "SessionHub",
    "SessionOutput",
    "SessionSource",
    "SlotTable",
    "StreamBeat",
    "StreamEnd",
    "TickRecord",
    "TickTiming",
    "WavStream",
    "decode_pcm16",
    "format_table",
    "frames",
    "prometheus_text",
    "read_wav",
    "validate_frame",
    "validate_samples",
    "write_wav",
]
