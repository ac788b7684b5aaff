"""Error bodies of the HTTP APIs: ``{"error": {"message", "field", "code"}}`` (plus SGLang's top-level
``object``/``message``), the field named as a dotted path (``triggers.0.layout``, ``sampling_params.top_p``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_worker.errors import UserError, field_errors

_SOURCES = {"body", "query", "path", "header"}  # where a value came from: the first part of a location
# tags of union members in a location (``text: str | list[str]``, ``sampling_params: SamplingParams | list``)
UNION_TAGS = {"SamplingParams", "str", "bool", "int", "constrained-int"}
UNION_TAGS |= {f"list[{t}]" for t in UNION_TAGS} | {"list[list[int]]", "list[any]"}


class ErrorDetail(BaseModel):
    message: str
    field: str | None = None
    code: int


class ErrorBody(BaseModel):
    """Every error answer (documented in the OpenAPI of the routes)."""

    error: ErrorDetail


def error_body(message: str, field_name: str | None, code: int) -> dict[str, Any]:
    return {
        "error": {"message": message, "field": field_name, "code": code},
        "object": "error",
        "message": message,
    }


def error_bytes(message: str, field_name: str | None, code: int) -> bytes:
    """An error body as JSON bytes, ASCII only: a message may quote what a client sent, lone surrogates
    included, which UTF-8 cannot encode."""
    return json.dumps(error_body(message, field_name, code)).encode()


class ErrorResponse(Response):
    media_type = "application/json"

    def __init__(self, message: str, field_name: str | None, code: int, **kw: Any) -> None:
        super().__init__(error_bytes(message, field_name, code), status_code=code, **kw)


def _parse_failure(exc: BaseException) -> str:
    """Why FastAPI could not parse a body that was not malformed JSON (its HTTPException's cause)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"body: not UTF-8 (byte {cause.start}): JSON bodies are UTF-8 text"
    if isinstance(cause, RecursionError):
        return "body: JSON nested too deeply"
    return "body: cannot be parsed as JSON"


def validation_message(exc: RequestValidationError) -> tuple[str, str]:
    """(field, message) of a request's first validation error, e.g. ``("triggers.0.layout",
    "triggers.0.layout: '0x2' needs D >= 1 and T >= 1")``; a body that is not JSON is ``("body", "body:
    malformed JSON: ...")``."""
    errors = field_errors(exc, skip=UNION_TAGS)
    # a value that fits no member of a union fails once per member: the deepest failure is the telling one
    # (``sampling_params.0.top_p``, not "sampling_params: Input should be a valid dictionary")
    head = errors[0][0][:2]
    path, msg = max((e for e in errors if e[0][:2] == head), key=lambda e: len(e[0]))
    if path and path[0] in _SOURCES:
        path = path[1:]
    where = ".".join(map(str, path)) or "body"
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        where, msg = "body", f"malformed JSON: {err.get('ctx', {}).get('error', msg)}"
    return where, f"{where}: {msg}"


def install_error_handlers(app: FastAPI, validation_status: int, http_errors: bool = False) -> None:
    """UserError -> its status; a request that fails validation -> ``validation_status`` (SGLang answers
    400, the sidecar 422), the field named; a body FastAPI cannot parse (not UTF-8, nested too deeply) ->
    ``validation_status`` naming ``body``; with ``http_errors`` also 404 / 405 as error bodies (the
    engine keeps FastAPI's ``{"detail": ...}`` there, as SGLang does). Never a traceback."""

    async def user_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, UserError)
        return ErrorResponse(str(exc), exc.field, exc.status)

    async def invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        where, message = validation_message(exc)
        return ErrorResponse(message, where, validation_status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:  # FastAPI's "There was an error parsing the body"
            return ErrorResponse(_parse_failure(exc), "body", validation_status)
        if not http_errors:
            return await http_exception_handler(request, exc)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ErrorResponse(message, None, exc.status_code, headers=exc.headers)

    app.add_exception_handler(UserError, user_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
