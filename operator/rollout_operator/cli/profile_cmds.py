"""rolloutctl profile: show, import, export and list profiles (see ``rollout_profiler.profile``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rollout_worker.config.engine_settings import Dtype
from rollout_worker.errors import UserError

from rollout_operator.cli.db_cmds import DbOption
from rollout_operator.cli.engine_opts import setting_default, setting_option

if TYPE_CHECKING:
    from rollout_profiler.profile import Profile
    from sqlalchemy.orm import Session

profile_app = typer.Typer(help="Profiles of a model on a device: step latency and reconfiguration costs.")


def _given(ctx: typer.Context, name: str | None) -> bool:
    """Whether the user gave option ``name`` (on the command line or in its variable)."""
    source = ctx.get_parameter_source(name) if name else None
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


@profile_app.callback(invoke_without_command=True)
def profile(
    ctx: typer.Context,
    model: Annotated[Path | None, typer.Option(help="Checkpoint directory to profile.")] = None,
    preset: Annotated[
        str | None, typer.Option(help="Or a preset (its checkpoint is made under --work).")
    ] = None,
    ranks: Annotated[int, typer.Option(help="Ranks G (measured mode).")] = 2,
    layouts: Annotated[
        str | None, typer.Option(help="Layouts, e.g. 2x1,1x2 (default: all candidates).")
    ] = None,
    batch: Annotated[str, typer.Option(help="Batch sizes per replica.")] = "1,2,4,8,16",
    context: Annotated[str, typer.Option(help="Context lengths.")] = "32,64,128,256",
    steps: Annotated[int, typer.Option(help="Timed decode steps per grid point (trimmed mean).")] = 40,
    dtype: Annotated[Dtype, typer.Option(help="The weights' dtype.")] = "float32",
    device: Annotated[str, setting_option("device")] = setting_default("profile", "device"),
    deterministic: Annotated[
        bool, setting_option("deterministic", note="the profile times the engine with them")
    ] = setting_default("profile", "deterministic"),
    shard_equivalent: Annotated[
        bool,
        typer.Option("--shard-equivalent", help="One device: 1/T-width shards + modelled communication."),
    ] = False,
    gpus: Annotated[int, typer.Option(help="Pod size G for --shard-equivalent.")] = 8,
    tp_sizes: Annotated[str, typer.Option(help="TP sizes for --shard-equivalent.")] = "1,2,4,8",
    comm_table: Annotated[
        Path | None, typer.Option(help="All-reduce latency JSON [[bytes, us], ...] (default: H100 figures).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Profile name (default from model, device, size).")] = None,
    out: Annotated[Path | None, typer.Option(help="Also export the profile as JSON here.")] = None,
    db: DbOption = None,
    no_db: Annotated[bool, typer.Option("--no-db", help="Do not store the profile in the database.")] = False,
    work: Annotated[Path, typer.Option(help="Where preset checkpoints are cached.")] = Path("build/models"),
) -> None:
    """Measure the real engine (step latency grid, reconfiguration costs) into a stored profile;
    or show, import, export and list profiles (subcommands)."""
    if ctx.invoked_subcommand is not None:
        return
    if model is None and preset is None:
        given = [p.opts[0] for p in ctx.command.params if _given(ctx, p.name)]
        if given:  # options of a measurement, but nothing to measure
            raise UserError(
                f"give --model or --preset to measure a profile (got {', '.join(given)})", "--model"
            )
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    import shlex
    import sys

    from rollout_operator.cli.args import require_engine
    from rollout_operator.cli.profile_measure import run_profile

    require_engine()

    run_profile(
        {
            "model": model,
            "preset": preset,
            "ranks": ranks,
            "layouts": layouts,
            "batch": batch,
            "context": context,
            "steps": steps,
            "dtype": dtype,
            "device": device,
            "deterministic": deterministic,
            "shard_equivalent": shard_equivalent,
            "gpus": gpus,
            "tp_sizes": tp_sizes,
            "comm_table": comm_table,
            "name": name,
            "out": out,
            "db": db,
            "no_db": no_db,
            "work": work,
            "command": "rolloutctl " + shlex.join(sys.argv[1:]),
        }
    )


@contextmanager
def _session(db: str | None) -> Iterator[tuple[Session, str]]:
    """A session (in one transaction) on a database migrated to head, and its masked URL."""
    from rollout_profiler.store import database, migrate
    from sqlalchemy.orm import Session

    url = database.resolve_url(db)
    eng = database.make_engine(url)
    try:
        migrate.require_head(eng, url)
        with database.reachable(url), Session(eng) as session, session.begin():
            yield session, database.mask_url(url)
    finally:
        eng.dispose()


def _parse_id(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


def _load(source: str, db: str | None) -> Profile:
    from rollout_profiler.show import read_profile_file
    from rollout_profiler.store import repo

    profile_id = _parse_id(source)
    if profile_id is None:
        return read_profile_file(Path(source))
    with _session(db) as (session, _):
        return repo.load_profile(session, profile_id)


@profile_app.command("show")
def show(
    source: Annotated[str, typer.Argument(metavar="ID|FILE", help="Database id (an integer) or JSON file.")],
    db: DbOption = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE.png",
            help="Also write a PNG plot here (a folder, e.g. `.`, writes <name>.png in it).",
        ),
    ] = None,
) -> None:
    """Print a profile as tables; optionally plot step latency against batch."""
    from rollout_profiler.show import plot_path, render_table, write_plot

    prof = _load(source, db)
    typer.echo(render_table(prof), nl=False)
    if plot is not None:
        written = write_plot(prof, plot_path(plot, prof))
        typer.echo(f"plot written to {written}", err=True)


@profile_app.command("import")
def import_(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Profile JSON file.")],
    db: DbOption = None,
) -> None:
    """Validate a profile JSON file and store it; prints its new id."""
    from rollout_profiler.show import read_profile_file
    from rollout_profiler.store import repo

    prof = read_profile_file(file)
    with _session(db) as (session, where):
        new_id = repo.save_profile(session, prof)
    typer.echo(f"stored profile {prof.name!r} in {where}", err=True)
    typer.echo(str(new_id))


@profile_app.command("export")
def export(
    profile_id: Annotated[int, typer.Argument(metavar="ID", help="Database id.")],
    out: Annotated[Path, typer.Option("--out", metavar="FILE", help="JSON file to write.")],
    db: DbOption = None,
) -> None:
    """Write a stored profile as a JSON file."""
    from rollout_profiler.store import repo

    with _session(db) as (session, _):
        prof = repo.load_profile(session, profile_id)
    try:
        prof.to_json(out)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from exc
    typer.echo(f"wrote profile {profile_id} ({prof.name!r}) to {out}")


@profile_app.command("list")
def list_(db: DbOption = None) -> None:
    """List the stored profiles."""
    from rollout_profiler.store import repo

    with _session(db) as (session, where):
        rows = repo.list_profiles(session)
    if not rows:
        typer.echo(f"no profiles in {where}")
        return
    table = [["id", "name", "model", "shape", "device", "dtype", "method", "steps", "reconfigs", "created"]]
    for r in rows:
        table.append(
            [
                str(r.id),
                r.name,
                r.model_name,
                r.shape_hash,
                f"{r.device_count}x{r.device_kind}",
                r.dtype,
                r.method,
                str(r.step_points),
                str(r.reconfig_points),
                r.created or "-",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def register(app: typer.Typer) -> None:
    app.add_typer(profile_app, name="profile")
