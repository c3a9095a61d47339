"""Who may call: the API key, the browser origins, and the Realtime API's dialect and subprotocol
as a client asks for them (``docs/protocol.md``, "Access"). Plain functions of a request's
headers, so that they are tested without a server.

- The key comes from a file (``voicechat-serve --api_key_file``) or ``VOICECHAT_API_KEY``
  (``read_api_key``). With one set, a client shows it as ``Authorization: Bearer KEY``, or, from
  a browser (which cannot set headers on a WebSocket), as the subprotocol
  ``openai-insecure-api-key.KEY`` (``authorized``); keys are compared in constant time.
- ``origin_allowed``: with ``--allowed_origins``, a browser's WebSocket upgrade from any other
  site is refused (cross-site WebSocket hijacking: a page elsewhere calling this server with the
  visitor's network position).
- ``wants_beta``: the beta API, as ``OpenAI-Beta: realtime=v1``, a ``?beta`` query or the
  browser SDK's ``openai-beta.realtime-v1`` subprotocol ask for it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import urllib.parse
from collections.abc import Mapping, Sequence

API_KEY_ENV = "VOICECHAT_API_KEY"
SUBPROTOCOL = "realtime"  # the one the server selects when offered
KEY_SUBPROTOCOL = "openai-insecure-api-key."  # + the key: how a browser shows it
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


def read_api_key(path: str | None) -> str | None:
    """The key in ``path`` (surrounding whitespace stripped), else ``$VOICECHAT_API_KEY``, else
    None (no key: anyone who can reach the port may call). An empty key is an error."""
    if path:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"the API key file {path} is empty")
        return key
    key = os.environ.get(API_KEY_ENV, "").strip()
    return key or None


def offered_protocols(headers: Mapping[str, str]) -> list[str]:
    """The WebSocket subprotocols the client offers, in its order."""
    value = headers.get("Sec-WebSocket-Protocol", "")
    return [p.strip() for p in value.split(",") if p.strip()]


def authorized(headers: Mapping[str, str], key: str | None) -> bool:
    """Whether the request shows ``key`` (always, with no key set)."""
    if key is None:
        return True
    shown = []
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        shown.append(token.strip())
    shown += [
        p.removeprefix(KEY_SUBPROTOCOL)
        for p in offered_protocols(headers)
        if p.startswith(KEY_SUBPROTOCOL)
    ]
    expected = key.encode()
    # Every shown key is compared, the whole of each, whatever matched before.
    return sum(hmac.compare_digest(s.encode(), expected) for s in shown) > 0


def origin_allowed(headers: Mapping[str, str], host: str, allowed: Sequence[str]) -> bool:
    """Whether a request may be served for its ``Origin``: always with no ``allowed`` list, and
    with no ``Origin`` (not a browser); else when it is this server itself (``host``, the
    request's ``Host``) or in ``allowed`` (``scheme://host[:port]``, as browsers send it)."""
    origin = headers.get("Origin")
    if not allowed or origin is None:
        return True
    if origin.rstrip("/") in {a.rstrip("/") for a in allowed}:
        return True
    return urllib.parse.urlsplit(origin).netloc.lower() == host.lower()


def wants_beta(headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
    """Whether the client asks for the beta Realtime API's names and shapes."""
    if "realtime=v1" in headers.get("OpenAI-Beta", "").replace(" ", "").split(","):
        return True
    if "beta" in query and query["beta"].lower() not in ("0", "false"):
        return True
    return BETA_SUBPROTOCOL in offered_protocols(headers)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a ``--listen`` host) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything
