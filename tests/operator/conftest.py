"""Fixtures of the CLI tests."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What `rolloutctl serve` would start: (ServerSettings, EngineConfig) per invocation."""
    import rollout_worker.server.run

    calls: list[Any] = []

    def record(settings: Any, cfg: Any, corpus: list[str] | None = None) -> int:
        calls.append((settings, cfg))
        return 0

    monkeypatch.setattr(rollout_worker.server.run, "serve", record)
    for key in [k for k in os.environ if k.startswith("ROLLOUT_SERVE_")]:
        monkeypatch.delenv(key)
    return calls
