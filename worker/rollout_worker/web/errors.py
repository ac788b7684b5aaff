"""Error bodies of the HTTP APIs: ``{"error": {"message", "field", "code"}}`` (plus SGLang's top-level
``object``/``message``), the field named as a dotted path (``triggers.0.layout``, ``sampling_params.top_p``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_worker.api.errors import UserError, field_errors

_SOURCES = {"body", "query", "path", "header"}  # where a value came from: the first part of a location
# tags of union members in a location (``text: str | list[str]``, ``sampling_params: SamplingParams | list``)
_UNION_TAGS = {"list[SamplingParams]", "SamplingParams", "str", "list[str]"}


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


def validation_message(exc: RequestValidationError) -> tuple[str, str]:
    """(field, message) of a request's first validation error, e.g. ``("triggers.0.layout",
    "triggers.0.layout: '0x2' needs D >= 1 and T >= 1")``; a body that is not JSON is ``("body", "body:
    malformed JSON: ...")``."""
    ((path, msg),) = field_errors(exc, 1, skip=_UNION_TAGS)
    if path and path[0] in _SOURCES:
        path = path[1:]
    where = ".".join(map(str, path)) or "body"
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        where, msg = "body", f"malformed JSON: {err.get('ctx', {}).get('error', msg)}"
    return where, f"{where}: {msg}"


def install_error_handlers(app: FastAPI, validation_status: int, http_errors: bool = False) -> None:
    """UserError -> its status; a request that fails validation -> ``validation_status`` (SGLang answers
    400, the sidecar 422), the field named; with ``http_errors`` also 404 / 405 as error bodies (the
    engine keeps FastAPI's ``{"detail": ...}`` there, as SGLang does). Never a traceback."""

    async def user_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, UserError)
        return JSONResponse(error_body(str(exc), exc.field, exc.status), status_code=exc.status)

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        where, message = validation_message(exc)
        return JSONResponse(error_body(message, where, validation_status), status_code=validation_status)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        body = error_body(f"{request.method} {request.url.path}: {exc.detail}", None, exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(UserError, user_error)
    app.add_exception_handler(RequestValidationError, invalid)
    if http_errors:
        app.add_exception_handler(StarletteHTTPException, http_error)
