"""Fixtures: one shared tiny server (2 ranks, float64) for the API tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.server.served import Served, start


@pytest.fixture(scope="module")
def server(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Tiny model, 2 ranks as 2x1 (candidates 2x1, 1x2), float64, weights root = the model directory."""
    s = start(tiny64, tmp_path_factory.mktemp("srv"), "--ranks", "2", "--dtype", "float64")
    yield s
    s.stop()
