"""One bound, one default, one spelling: an engine setting is written once, in ``EngineSettings``.

Every option of every `rolloutctl` command named for an engine setting takes its default from the model (or
from the one record of commands that default it otherwise, ``DEFAULT_OVERRIDES``), and the commands and the
simulator's ``SimConfig`` that check a setting themselves check the model's bounds: the tests narrow a
field's bounds and expect the old edge values refused, so a bound written out again (``1 <= page_size <=
16``) fails here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import typer
from annotated_types import Ge, Le
from rollout_operator.cli.args import as_flags
from rollout_operator.cli.engine_opts import DEFAULT_OVERRIDES, setting_default
from rollout_operator.cli.main import app
from rollout_profiler.sim.config import SimConfig
from rollout_worker.config.engine_settings import DEFAULTS, FIELDS, EngineSettings, bounds
from rollout_worker.errors import UserError
from typer.testing import CliRunner

# Options named for a setting whose help says what the command does with it, not what the setting is.
OWN_HELP = {
    ("bench engine", "cuda_graphs"),
    ("bench engine", "deterministic"),
    ("bench engine", "paged_attention"),
    ("bench lossless", "deterministic"),
}


def commands(cmd: Any = None, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every command of rolloutctl by its words ("bench simulator"), a group too (`profile` measures)."""
    cmd = cmd if cmd is not None else typer.main.get_command(app)
    found = {" ".join(path): cmd}
    for name, sub in getattr(cmd, "commands", {}).items():
        found.update(commands(sub, (*path, name)))
    return found


def setting_options() -> list[tuple[str, Any]]:
    return [(name, p) for name, cmd in commands().items() for p in cmd.params if p.name in FIELDS]


def test_the_walk_finds_the_commands_that_take_settings() -> None:
    found = {(name, p.name) for name, p in setting_options()}
    assert {("serve", f) for f in FIELDS} <= found and {("generate", f) for f in FIELDS} <= found
    assert {
        ("simulate", "max_batch"),
        ("bench simulator", "page_size"),
        ("bench simulator", "max_batch"),
        ("bench memory", "page_size"),
        ("bench engine", "device"),
        ("bench engine", "deterministic"),
        ("bench engine", "paged_attention"),
        ("profile", "device"),
    } <= found


@pytest.mark.parametrize(("command", "option"), setting_options(), ids=lambda x: getattr(x, "name", x))
def test_an_option_named_for_a_setting_takes_the_models_default_and_help(command: str, option: Any) -> None:
    name, info = option.name, EngineSettings.model_fields[option.name]
    expected = setting_default(command, name)
    if info.annotation is bool and option.type_descriptor.annotation is str:  # bench engine's on | off | both
        expected = "on" if expected else "off"
    assert option.default == expected, f"{command} {option.opts}: default {option.default!r}"
    assert option.opts[0] == "--" + name.replace("_", "-")
    if (command, name) not in OWN_HELP:
        assert (info.description or "").rstrip(".") in option.help, (
            f"{command} {option.opts}: {option.help!r}"
        )


def test_every_override_is_a_commands_option_within_the_models_bounds_and_not_the_default() -> None:
    found = {(name, p.name) for name, p in setting_options()}
    for command, values in DEFAULT_OVERRIDES.items():
        for name, value in values.items():
            assert (command, name) in found
            assert value != getattr(DEFAULTS, name)
            lo, hi = bounds(name)
            if (command, name, value) != ("simulate", "max_batch", 0):  # 0: no limit but memory's
                assert (lo is None or value >= lo) and (hi is None or value <= hi)


def narrow(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[int, int]:
    """Move the field's bounds one inward; return the old ones (which must now be refused)."""
    lo, hi = bounds(name)
    info = EngineSettings.model_fields[name]
    kept = [r for r in info.metadata if not isinstance(r, Ge | Le)]
    monkeypatch.setattr(info, "metadata", [*kept, Ge(lo + 1), Le(hi - 1)])
    return lo, hi


# (command line before the option, setting): each checks the setting before it does anything
CHECKERS = [
    (["bench", "simulator", "--work", "{tmp}/work"], "page_size"),
    (["bench", "simulator", "--work", "{tmp}/work"], "max_batch"),
    (["bench", "memory", "--work", "{tmp}/work"], "page_size"),
    (["simulate", "--profile", "{tmp}/none.json"], "max_batch"),
]


@pytest.mark.parametrize(("args", "name"), CHECKERS, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_a_command_checks_the_models_bounds(
    args: list[str], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lo, hi = narrow(monkeypatch, name)
    flag = "--" + name.replace("_", "-")
    for value in (lo, hi):
        r = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args] + [flag, str(value)])
        assert isinstance(r.exception, UserError), (value, r.exception, r.output)
        assert str(as_flags(r.exception)) == f"{flag}: must be {lo + 1}..{hi - 1}, got {value}"
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("name", ["page_size", "max_batch"])
def test_the_simulators_config_takes_the_engines_setting(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert name in {f.name for f in dataclasses.fields(SimConfig)}  # under the engine's name
    if name == "page_size":
        assert SimConfig(1).page_size == DEFAULTS.page_size
    lo, hi = narrow(monkeypatch, name)
    for value in (lo, hi):
        with pytest.raises(UserError) as err:
            SimConfig(1, **{name: value})
        assert err.value.field == name and str(err.value).endswith(f"must be {lo + 1}..{hi - 1}, got {value}")
