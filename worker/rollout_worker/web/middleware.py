"""ASGI middleware: a bearer token (as SGLang's ``--api-key``) and a request body size and time limit,
shared by the engine's server and the pod sidecar; and whether a server may listen without a token.

Written as plain ASGI so that every route is covered, streaming ones included, and no route can forget it.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from typing import Any

from rollout_worker.web.errors import error_bytes

Scope = dict[str, Any]
# the engine's open routes (SGLang's, less /health_generate: it runs a generation)
OPEN_PATHS = frozenset({"/health", "/metrics"})
BODY_TIMEOUT_S = 30.0  # the most time a client may take to send a request's body


def is_loopback(host: str) -> bool:
    """Whether a server listening on ``host`` is reachable from this machine only (a name other than
    ``localhost`` counts as reachable from elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _send_error(
    send: Any, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    raw = error_bytes(message, None, status)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": raw})


class ApiKey:
    """401 without ``Authorization: Bearer <key>``, 403 with a wrong key (constant-time compare); the
    ``open_paths`` (health and metrics) stay open."""

    def __init__(self, app: Any, key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return await _send_error(
                send,
                401,
                "missing bearer token (Authorization: Bearer <key>)",
                ((b"www-authenticate", b"Bearer"),),
            )
        if not hmac.compare_digest(token.strip(), self.key):
            return await _send_error(send, 403, "invalid API key")
        return await self.app(scope, receive, send)


class BodyLimit:
    """413 for bodies over ``limit`` bytes, whether announced by Content-Length or streamed (chunked); 408
    (and the connection closed) for a body not received whole within ``timeout`` seconds, e.g. shorter
    than its Content-Length.

    The body is read here, up to the limit, before the application sees the request, then handed to it
    whole: an application reading a body cut off midway would answer 400, not 413. Later ``receive`` calls
    (waiting for the client to disconnect) go to the server as before."""

    def __init__(self, app: Any, limit: int, timeout: float = BODY_TIMEOUT_S) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(send)
        try:
            async with asyncio.timeout(self.timeout):
                first = await self._read(receive)
        except TimeoutError:
            message = f"request body not received within {self.timeout:g} s"
            return await _send_error(send, 408, message, ((b"connection", b"close"),))
        if first is None:
            return await self._too_large(send)
        pending: list[dict[str, Any]] = [first]

        async def replay() -> Any:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Any) -> dict[str, Any] | None:
        """The whole body as one message (or the disconnect that cut it short); None past the limit."""
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away while sending
                return dict(msg)
            body += msg.get("body", b"")
            if len(body) > self.limit:
                return None
            if not msg.get("more_body", False):
                return {"type": "http.request", "body": bytes(body), "more_body": False}

    async def _too_large(self, send: Any) -> None:
        await _send_error(send, 413, f"request body over {self.limit} bytes")
