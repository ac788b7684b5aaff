"""Parsing of list-valued CLI flags, shared by the commands."""

from __future__ import annotations

import typer
from rollout_worker.api.errors import UserError


def int_list(text: str, flag: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, unique); errors name the flag."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise UserError(f"{flag}: {text!r} is not a comma-separated list of integers") from exc
    if not vals or min(vals) < 1:
        raise UserError(f"{flag}: values must be integers >= 1")
    return sorted(set(vals))


# Engine fields -> the flags that set them, so library errors (which name fields) read as flags here.
FLAG_OF_FIELD = {
    "ranks": "--ranks",
    "layout": "--layout",
    "candidates": "--candidates",
    "dtype": "--dtype",
    "device": "--device",
    "max_batch": "--max-batch",
    "kv_budget_tokens": "--kv-budget",
    "max_prefill_tokens": "--max-prefill-tokens",
    "context_length": "--context-length",
    "collective_timeout_s": "--timeout",
    "model": "--model",
    "prompts": "--prompts",
    "reconfigure": "--reconfigure",
}


def as_flags(exc: UserError) -> UserError:
    """The error with its field named as this CLI's flag (``candidates[2]`` -> ``--candidates[2]``)."""
    if exc.field is None:
        return exc
    base, sep, rest = exc.field.partition("[")
    flag = FLAG_OF_FIELD.get(base)
    return exc.with_field(flag + sep + rest) if flag else exc


def bench_group(app: typer.Typer) -> typer.Typer:
    """The `bench` group: the one another command module registered already, else a new one."""
    for info in app.registered_groups:
        if info.name == "bench" and info.typer_instance is not None:
            return info.typer_instance
    bench = typer.Typer(help="Benchmarks (JSON output + printed tables).", no_args_is_help=True)
    app.add_typer(bench, name="bench")
    return bench
