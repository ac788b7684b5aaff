"""`rolloutctl profile --model DIR|--preset NAME ...`: measure the real engine, store and export a profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rollout_worker.data.files import check_writable, read_text, save
from rollout_worker.errors import UserError

from rollout_operator.cli.args import int_list


def resolve_model(model: Path | None, preset: str | None, work: Path) -> tuple[Path, str]:
    from rollout_worker.engine.model.checkpoint import ensure_model

    if (model is None) == (preset is None):
        raise UserError("give exactly one of --model DIR or --preset NAME")
    if preset is not None:
        return ensure_model(preset, work), preset
    assert model is not None
    if not model.is_dir():
        raise UserError(f"--model: {model} is not a directory")
    return model, model.name


def comm_table(path: Path | None) -> tuple[list[tuple[int, float]], str]:
    """All-reduce latency table: a JSON list of [bytes, microseconds] pairs, or the H100 default."""
    from rollout_profiler.profiling.measure import H100_ALLREDUCE_US

    if path is None:
        return H100_ALLREDUCE_US, "published H100 NVLink all-reduce figures (field notes)"
    text = read_text(path, "--comm-table", "comm table")
    try:
        rows = json.loads(text)
        table = sorted((int(b), float(us)) for b, us in rows)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(
            f"--comm-table {path}: expected a JSON list of [bytes, microseconds] pairs ({exc})"
        ) from exc
    if len(table) < 2:
        raise UserError(f"--comm-table {path}: needs at least two points")
    return table, f"the table in {path.name}"


def check_options(opts: dict[str, Any]) -> None:
    """Every flag that can be wrong, before a model is made or a rank starts."""
    from rollout_worker.config.engine_settings import check_setting
    from rollout_worker.scheduling.layout import MAX_RANKS

    for flag in ("ranks", "steps", "gpus"):
        if opts[flag] < 1:
            raise UserError(f"must be >= 1, got {opts[flag]}", "--" + flag)
    if opts["ranks"] > MAX_RANKS:
        raise UserError(f"must be <= {MAX_RANKS} (the ranks of one engine), got {opts['ranks']}", "--ranks")
    check_setting("device", opts["device"], "--device")
    if opts["device"] == "cuda":
        from rollout_worker.engine.rank.rank_state import require_cuda

        require_cuda("--device")
    if opts["out"] is not None:
        check_writable(opts["out"], "--out")
    if not opts["no_db"]:
        check_database(opts["db"])


def check_database(db: str | None) -> None:
    """The database can be opened (a bad URL is found before the measurement, not after it)."""
    from rollout_profiler.store import database

    url = database.resolve_url(db)
    eng = database.make_engine(url)
    try:
        with database.reachable(url), eng.connect():
            pass
    finally:
        eng.dispose()


def run_profile(opts: dict[str, Any]) -> None:
    from rollout_profiler.profiling.measure import profile_measured, profile_shard_equivalent
    from rollout_worker.scheduling.layout import Layout, parse_candidates

    check_options(opts)
    model_dir, name = resolve_model(opts["model"], opts["preset"], opts["work"])
    batches, contexts = int_list(opts["batch"], "--batch"), int_list(opts["context"], "--context")
    if opts["shard_equivalent"]:
        table, source = comm_table(opts["comm_table"])
        prof = profile_shard_equivalent(
            opts["name"] or f"{name}-{opts['device']}-{opts['gpus']}-shard-equivalent",
            name,
            model_dir,
            opts["gpus"],
            int_list(opts["tp_sizes"], "--tp-sizes"),
            batches,
            contexts,
            opts["dtype"],
            opts["device"],
            opts["steps"],
            table,
            source,
            typer.echo,
        )
    else:
        from rollout_worker.config.model_config import ModelConfig

        mc = ModelConfig.load(model_dir)
        layouts = (
            parse_candidates(opts["layouts"], opts["ranks"], "--layouts")
            if opts["layouts"]
            else mc.candidate_layouts(opts["ranks"])
        )
        prof = profile_measured(
            opts["name"] or f"{name}-{opts['device']}-{opts['ranks']}",
            name,
            model_dir,
            opts["ranks"],
            [Layout(x.replicas, x.tp) for x in layouts],
            batches,
            contexts,
            opts["dtype"],
            opts["device"],
            opts["steps"],
            typer.echo,
            deterministic=opts["deterministic"],
        )
    prof.provenance["command"] = opts["command"]
    if opts["out"] is not None:
        typer.echo(f"wrote {save(opts['out'], prof.dumps(), '--out')}")
    if not opts["no_db"]:
        typer.echo(f"stored profile {store(prof, opts['db'])}")


def store(prof: Any, db: str | None) -> str:
    """Save to the database; the embedded SQLite database is migrated on first use."""
    from rollout_profiler.store import database, migrate, repo
    from sqlalchemy.orm import Session

    url = database.resolve_url(db)
    if url.startswith("sqlite"):
        migrate.upgrade(url)
    eng = database.make_engine(url)
    try:
        migrate.require_head(eng, url)
        with database.reachable(url), Session(eng) as session, session.begin():
            pid = repo.save_profile(session, prof)
    finally:
        eng.dispose()
    return f"id {pid} in {database.mask_url(url)}"
