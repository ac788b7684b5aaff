"""Every `rolloutctl` command's `--help` shows whole flag names at 80 columns and when not a terminal.

The command tree is walked from the typer app (groups such as ``bench``, ``db`` and ``profile`` included);
each command's help is rendered through CliRunner (never a terminal) with COLUMNS=80 and with COLUMNS
unset, and every flag name of its parameters (``opts`` and ``secondary_opts``) must appear whole, on lines
of at most 80 characters. One case runs the installed entry point with its output piped, COLUMNS unset.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from rollout_operator.cli.main import app
from typer.testing import CliRunner


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(argv prefix, click command) of a command and, for a group, of every visible command under it."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        if not sub.hidden:
            yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _flags(command: Any) -> list[str]:
    return [
        name
        for param in command.params
        if param.param_type_name == "option" and not param.hidden
        for name in (*param.opts, *param.secondary_opts)
    ]


def _cut(text: str, command: Any) -> list[str]:
    """The flags of ``command`` that ``text`` does not show whole."""
    return [
        flag
        for flag in ["--help", *_flags(command)]
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    ]


def test_the_walk_reaches_the_groups_and_their_commands() -> None:
    names = {" ".join(path) for path in COMMANDS}
    assert {"", "serve", "bench", "db", "profile"} <= names
    assert any(name.startswith("bench ") for name in names) and any(name.startswith("db ") for name in names)


@pytest.mark.parametrize("columns", ["80", None], ids=["columns-80", "columns-unset"])
@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda path: " ".join(path) or "rolloutctl")
def test_help_shows_every_flag_whole(path: tuple[str, ...], columns: str | None) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": columns, "TERMINAL_WIDTH": None})
    assert result.exit_code == 0, result.output
    cut = _cut(result.output, COMMANDS[path])
    assert not cut, f"rolloutctl {' '.join(path)} --help lacks {cut} whole:\n{result.output}"
    wide = [line for line in result.output.splitlines() if len(line) > 80]
    assert not wide, f"rolloutctl {' '.join(path)} --help has lines over 80 characters: {wide}"


def test_serve_help_piped_shows_every_flag_whole() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    got = subprocess.run(
        [sys.executable, "-m", "rollout_operator.cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert got.returncode == 0, got.stderr
    cut = _cut(got.stdout, COMMANDS[("serve",)])
    assert not cut, f"rolloutctl serve --help | cat lacks {cut} whole:\n{got.stdout}"
