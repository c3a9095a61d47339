"""Live calls over the network: the wire protocol (``protocol``), the aiohttp front beside a
running ``Server`` (``app.NetFront``: WebSocket calls, health, readiness, Prometheus metrics, the
browser page in ``web/``) and a load client (``load``)."""

from voicechat_jax.serving.net.app import (
    REALTIME_PATH,
    NetConfig,
    NetFront,
    check_listen,
    parse_listen,
)
from voicechat_jax.serving.net.protocol import PROTOCOL_VERSION, CallEvents, SessionConfig

__all__ = [
    "PROTOCOL_VERSION",
    "REALTIME_PATH",
    "CallEvents",
    "NetConfig",
    "NetFront",
    "SessionConfig",
    "check_listen",
    "parse_listen",
]
