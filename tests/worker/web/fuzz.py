"""schemathesis over a running server's OpenAPI, shared by the engine's and the sidecar's tests: every
operation with valid and invalid cases (a bounded number each), never a 5xx, every answer as documented,
every 4xx in the project's error schema (rollout_worker.web.errors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from rollout_worker.web.errors import ErrorBody
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

BOUNDED = settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def error_schema(ctx: Any, response: Any, case: Any) -> None:
    """A 4xx answer is ``{"error": {"message", "field", "code"}}`` with its own status as the code."""
    if 400 <= response.status_code < 500:
        body = ErrorBody.model_validate(response.json())
        assert body.error.code == response.status_code, (case.operation.label, response.text)


CHECKS = [not_a_server_error, content_type_conformance, response_schema_conformance, error_schema]


def fuzz(
    base: str,
    headers: dict[str, str],
    after: Callable[[str], None] = lambda path: None,
    max_examples: int = 15,
) -> int:
    """Every operation of the server's OpenAPI; ``after(path)`` runs after each case (to undo what a case
    may have changed, e.g. a pause). Returns the operations tested."""
    schema = schemathesis.openapi.from_url(base + "/openapi.json", headers=headers)
    n = 0
    for result in schema.get_all_operations():
        op = result.ok()
        raw = op.definition.raw
        takes_input = bool(raw.get("parameters") or raw.get("requestBody"))
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if takes_input else [])
        for mode in modes:

            @settings(BOUNDED, max_examples=max_examples)
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                try:
                    case.call_and_validate(headers=headers, checks=CHECKS, timeout=60)
                finally:
                    after(case.path)

            check()
        n += 1
    return n
