"""Where the database is (URL resolution) and how to open it.

Precedence: an explicit URL (``--db``) > ``$ROLLOUT_DB_URL`` > ``sqlite:///$ROLLOUT_HOME/rollout.db``, with
``$ROLLOUT_HOME`` defaulting to ``~/.local/share/elastic-rollout``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollout_worker.errors import UserError
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

ENV_URL = "ROLLOUT_DB_URL"
ENV_HOME = "ROLLOUT_HOME"
DEFAULT_HOME = "~/.local/share/elastic-rollout"
URL_EXAMPLES = "e.g. sqlite:///path/to/rollout.db or postgresql+psycopg://user@host:5432/dbname"


def rollout_home(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get(ENV_HOME) or DEFAULT_HOME).expanduser()


def resolve_url(explicit: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The database URL: ``explicit`` if given, else ``$ROLLOUT_DB_URL``, else the default SQLite file."""
    env = os.environ if environ is None else environ
    if explicit:
        return explicit
    if env.get(ENV_URL):
        return env[ENV_URL]
    return f"sqlite:///{rollout_home(env) / 'rollout.db'}"


def parse_url(url: str) -> URL:
    """Parse ``url``; a bare ``postgresql://`` gets the psycopg 3 driver (the one elastic-rollout ships)."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        # Not echoed: an unparseable URL may still hold a password.
        raise UserError(f"database URL is not valid ({URL_EXAMPLES})") from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<invalid database URL>"


def sqlite_file(url: URL) -> Path | None:
    """The file of a file-backed SQLite URL, None for any other URL (or an in-memory database)."""
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    if url.database.startswith("file:"):
        return None
    return Path(url.database).expanduser()


def _enable_sqlite_foreign_keys(dbapi_connection: Any, connection_record: Any) -> None:
    del connection_record
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``; creates the parent folder of a SQLite file and turns on its foreign keys."""
    parsed = parse_url(url)
    path = sqlite_file(parsed)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the folder of database {path}: {exc.strerror}") from exc
    try:
        engine = create_engine(parsed, **kwargs)
    except NoSuchModuleError as exc:
        raise UserError(f"database URL {mask_url(url)}: unknown dialect or driver ({URL_EXAMPLES})") from exc
    except ImportError as exc:
        raise UserError(
            f"database URL {mask_url(url)}: driver not installed ({exc.name}); "
            "for PostgreSQL install elastic-rollout[postgres]"
        ) from exc
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _enable_sqlite_foreign_keys)
    return engine


@contextmanager
def reachable(url: str) -> Iterator[None]:
    """Turn a failure to reach or open the database into a one-line ``UserError``."""
    try:
        yield
    except OperationalError as exc:
        detail = str(exc.orig or exc).strip().splitlines()
        raise UserError(f"database {mask_url(url)}: {detail[0] if detail else type(exc).__name__}") from exc
