"""ASGI middleware: the API key (as SGLang's ``--api-key``) and a request body size limit.

Written as plain ASGI so that every route is covered, streaming ones included, and no route can forget it.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

Scope = dict[str, Any]
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


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
    """401 without ``Authorization: Bearer <key>``, 403 with a wrong key; health and metrics stay open."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
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
    """413 for bodies over ``limit`` bytes, whether announced by Content-Length or streamed."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(send)
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._too_large(send)

    async def _too_large(self, send: Any) -> None:
        await _send_json(
            send, 413, {"error": {"message": f"request body over {self.limit} bytes", "code": 413}}
        )


class _TooLarge(Exception):
    pass
