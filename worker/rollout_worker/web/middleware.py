"""ASGI middleware: a bearer token (as SGLang's ``--api-key``) and a request body size limit, shared by the
engine's server and the pod sidecar.

Written as plain ASGI so that every route is covered, streaming ones included, and no route can forget it.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

Scope = dict[str, Any]
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})  # the engine's (SGLang's) open routes


async def _send_json(
    send: Any, status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    raw = json.dumps(body).encode()
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
            return await _send_json(
                send,
                401,
                {"error": {"message": "missing bearer token (Authorization: Bearer <key>)", "code": 401}},
                ((b"www-authenticate", b"Bearer"),),
            )
        if not hmac.compare_digest(token.strip(), self.key):
            return await _send_json(send, 403, {"error": {"message": "invalid API key", "code": 403}})
        return await self.app(scope, receive, send)


class BodyLimit:
    """413 for bodies over ``limit`` bytes, whether announced by Content-Length or streamed (chunked).

    The body is read here, up to the limit, before the application sees the request, then handed to it
    whole: an application reading a body cut off midway would answer 400, not 413. Later ``receive`` calls
    (waiting for the client to disconnect) go to the server as before."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(send)
        body = bytearray()
        first: dict[str, Any] | None = None
        while first is None:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away while sending
                first = msg
                break
            body += msg.get("body", b"")
            if len(body) > self.limit:
                return await self._too_large(send)
            if not msg.get("more_body", False):
                first = {"type": "http.request", "body": bytes(body), "more_body": False}
        pending: list[dict[str, Any]] = [first]

        async def replay() -> Any:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any) -> None:
        await _send_json(
            send, 413, {"error": {"message": f"request body over {self.limit} bytes", "code": 413}}
        )
