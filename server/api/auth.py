"""Bearer-token authentication for /v1 routes, /metrics and /openapi.json; /health stays open.

The OpenAPI schema is guarded too: it lists this deployment's routes and extension fields,
which a server that requires a key should not tell strangers.

Keys come from `--api-key` (repeatable) and `LOCKSTEP_API_KEYS` (comma-separated). With no
keys configured, auth is off (the default bind is loopback-only for that reason).
The presented token is compared with every key in constant time, so response timing
reveals neither whether nor which key matched.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from typing import Iterable, Sequence

from lockstep.server.api.errors import APIError

log = logging.getLogger("lockstep.auth")

KEYS_ENV = "LOCKSTEP_API_KEYS"
PROTECTED_PREFIXES = ("/v1", "/metrics", "/openapi.json")

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."


def api_keys(flag_keys: Iterable[str] | None, environ=os.environ) -> list[str]:
    """The configured keys: flags first, then the environment; blanks dropped."""
    keys = [k.strip() for k in (flag_keys or [])]
    keys += [k.strip() for k in environ.get(KEYS_ENV, "").split(",")]
    return [k for k in keys if k]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or wildcard: assume reachable from elsewhere


def warn_if_exposed(host: str, keys: Sequence[str]) -> bool:
    """Log a warning when binding beyond loopback without keys. True if it warned."""
    if keys or is_loopback(host):
        return False
    log.warning("listening on %s without an API key: anyone who can reach this address can use "
                "the server; pass --api-key KEY (or set %s)", host, KEYS_ENV)
    return True


def _unauthorized(message: str, code: str | None):
    response = APIError(401, message, code=code).response()
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _presented_key(scope) -> bytes | None:
    """The key a request presents: OpenAI clients send `Authorization: Bearer KEY`, Anthropic's
    send `x-api-key: KEY`; a Bearer header wins when both are there."""
    headers = dict(scope["headers"])
    if b"authorization" in headers:
        scheme, _, token = headers[b"authorization"].partition(b" ")
        return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    key = headers.get(b"x-api-key", b"").strip()
    return key or None


class APIKeyAuth:
    """ASGI middleware: 401 (OpenAI shape) unless a protected path carries a valid key."""

    def __init__(self, app, keys: Sequence[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    def _valid(self, token: bytes) -> bool:
        matched = False
        for key in self.keys:  # no early exit: every key is compared
            matched |= hmac.compare_digest(token, key)
        return matched

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or not scope["path"].startswith(PROTECTED_PREFIXES):
            return await self.app(scope, receive, send)
        token = _presented_key(scope)
        if token is None:
            return await _unauthorized(MISSING_KEY, None)(scope, receive, send)
        if not self._valid(token):
            return await _unauthorized(WRONG_KEY, "invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)
