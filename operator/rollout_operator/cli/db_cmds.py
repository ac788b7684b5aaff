"""rolloutctl db: create or migrate the profile/decision database, and tell its revision."""

from __future__ import annotations

from typing import Annotated

import typer

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        metavar="URL",
        help="Database URL (default: $ROLLOUT_DB_URL, else sqlite:///$ROLLOUT_HOME/rollout.db, "
        "ROLLOUT_HOME defaulting to ~/.local/share/elastic-rollout).",
        show_default=False,
    ),
]


db_app = typer.Typer(help="The profile/decision database (SQLite or PostgreSQL).", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade(db: DbOption = None) -> None:
    """Create the database tables, or migrate them to this version's schema."""
    from rollout_profiler.store import database, migrate

    url = database.resolve_url(db)
    before = migrate.current(url)
    reached = migrate.upgrade(url)
    typer.echo(f"database: {database.mask_url(url)}")
    if before == reached:
        typer.echo(f"revision: {reached} (head, already)")
    else:
        typer.echo(f"revision: {before or 'none'} -> {reached} (head)")


@db_app.command("current")
def current(db: DbOption = None) -> None:
    """Print the revision the database is at, and whether it is this version's head."""
    from rollout_profiler.store import database, migrate

    url = database.resolve_url(db)
    rev, head = migrate.current(url), migrate.head()
    typer.echo(f"database: {database.mask_url(url)}")
    if rev is None:
        typer.echo("revision: none (empty database: run `rolloutctl db upgrade`)")
    elif rev == head:
        typer.echo(f"revision: {rev} (head)")
    else:
        typer.echo(f"revision: {rev} (head is {head}: run `rolloutctl db upgrade`)")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
