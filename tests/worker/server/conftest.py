"""Fixtures: a tiny server (2 ranks, float64) per test module for the API tests; one with a weights root of
two checkpoints and an API key for the control tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_worker.engine.model.checkpoint import make_model

from tests.worker.server.served import Served, start


@pytest.fixture(scope="module")
def server(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Tiny model, 2 ranks as 2x1 (candidates 2x1, 1x2), float64, weights root = the model directory."""
    s = start(tiny64, tmp_path_factory.mktemp("srv"), "--ranks", "2", "--dtype", "float64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two checkpoints of the same shape (different seeds) under one weights root."""
    root = tmp_path_factory.mktemp("weights")
    make_model("tiny", 0, root / "a", "float64")
    make_model("tiny", 5, root / "b", "float64")
    return root


@pytest.fixture(scope="module")
def ctl(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(
        root / "a",
        tmp_path_factory.mktemp("ctl"),
        "--ranks",
        "2",
        "--dtype",
        "float64",
        "--weights-root",
        str(root),
        "--trust-pickled-tensors",
        key="s3cret-key",
    )
    yield s
    s.stop()
