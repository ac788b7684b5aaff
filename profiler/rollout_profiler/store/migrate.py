"""Run the Alembic migrations programmatically: the config is built in code and points at the
``migrations`` folder shipped inside the package, so no ``alembic.ini`` is needed anywhere.

After a change to ``models.py``, autogenerate the next revision against a database at head, then review it::

    python -c "from rollout_profiler.store import migrate; migrate.revision('sqlite:///dev.db', 'add foo')"
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from rollout_worker.errors import UserError
from sqlalchemy import Engine

from rollout_profiler.store.database import make_engine, mask_url, reachable

MIGRATIONS = Path(str(files("rollout_profiler.store").joinpath("migrations")))


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ConfigParser interpolation
    return cfg


def head() -> str:
    """The newest revision shipped with this package."""
    rev = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if rev is None:
        raise RuntimeError(f"no migrations found under {MIGRATIONS}")
    return rev


def _current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _run(url: str, revision: str, upgrade: bool) -> str | None:
    engine = make_engine(url)
    try:
        with reachable(url):
            with engine.begin() as conn:
                cfg = alembic_config(url)
                cfg.attributes["connection"] = conn
                if upgrade:
                    command.upgrade(cfg, revision)
                else:
                    command.downgrade(cfg, revision)
            return _current(engine)
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> str | None:
    """Migrate the database at ``url`` up to ``revision``; returns the revision reached."""
    return _run(url, revision, upgrade=True)


def downgrade(url: str, revision: str = "base") -> str | None:
    """Migrate the database at ``url`` down to ``revision`` (``base``: drop every table)."""
    return _run(url, revision, upgrade=False)


def current(url: str) -> str | None:
    """The revision the database at ``url`` is at (None: never migrated)."""
    engine = make_engine(url)
    try:
        with reachable(url):
            return _current(engine)
    finally:
        engine.dispose()


def revision(url: str, message: str) -> None:
    """Autogenerate a new revision file (a developer tool) by comparing ``models`` with the database."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.revision(cfg, message=message, autogenerate=True)
    finally:
        engine.dispose()


def require_head(engine: Engine, url: str) -> None:
    """Refuse to use a database that is not migrated to this package's head revision."""
    with reachable(url):
        rev = _current(engine)
    want = head()
    if rev != want:
        at = "is empty" if rev is None else f"is at revision {rev}"
        raise UserError(
            f"database {mask_url(url)} {at}, this version needs {want}: "
            f"run `rolloutctl db upgrade --db '{mask_url(url)}'`"
        )
