"""Fuzzing what a user types (hypothesis): RolloutJob manifests built from a valid job with random mutations
(fields deleted or replaced by values of the wrong type or out of range, YAML aliases, duplicate keys), and
random values of every flag of `run`, `serve`, `generate`, `simulate` and `profile`, read from the commands
themselves. Each input is either accepted or refused with a message that names a field, a line or a flag;
never an internal error or a traceback, each within a bounded time. The work itself never starts: the first
step of each command's work is replaced by one that raises :class:`Reached`."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import typer
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_operator.api.manifest import parse_job
from rollout_operator.cli.args import as_flags
from rollout_operator.cli.main import app
from rollout_worker.errors import UserError
from typer.testing import CliRunner

from tests.operator.local.jobs import job_doc

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "profiles" / "llama-3.1-8b-h100x8-modelled.json"
FAST = settings(
    max_examples=40,
    deadline=5000,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
    derandomize=True,
)
NAMED = re.compile(r"--[a-z]|\.yaml:\d+|ROLLOUT_[A-Z]")  # a flag, a file:line, a variable


class Reached(Exception):
    """The command got past its checks to its work (the inputs were valid)."""


# ---- manifests ----

BASE = job_doc(Path("build/models/tiny"), Path("examples/prompts.jsonl"), Path("build/out"))
WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from(["0x0", "auto", "1x2", "-1", ".inf", "", "2**70"]),
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value in ``doc``."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


PATHS = sorted(_paths(BASE), key=str)


@st.composite
def manifests(draw: st.DrawFn) -> str:
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            if draw(st.booleans()):
                del parent[path[-1]]
            else:
                parent[path[-1]] = draw(WRONG)
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed or replaced it
            continue
    how = draw(st.sampled_from(["plain", "alias", "duplicate"]))
    if how == "alias":  # one object twice: safe_dump writes an anchor and an alias
        shared = draw(st.lists(st.integers(), min_size=1, max_size=3))
        doc.setdefault("spec", {})
        if isinstance(doc["spec"], dict):
            doc["spec"]["pod"] = {"tolerations": [shared, shared]}
    text = yaml.safe_dump(doc, sort_keys=False)
    if how == "duplicate":
        lines = text.splitlines()
        i = draw(st.integers(0, len(lines) - 1))
        lines.insert(i + 1, lines[i])
        text = "\n".join(lines) + "\n"
    return text


@FAST
@given(text=manifests())
def test_fuzzed_manifests_are_accepted_or_refused_naming_field_and_line(text: str) -> None:
    try:
        parse_job(text)
    except UserError as exc:
        for line in str(exc).splitlines():
            assert re.match(r"job\.yaml(:\d+)?: ", line), str(exc)


# ---- flags ----


def _flags(name: str) -> list[Any]:
    """The options of a command (`profile`'s callback included), from the command itself (click's)."""
    cmd = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return [p for p in cmd.params if p.param_type_name == "option" and p.name != "help"]


def _value(draw: st.DrawFn, opt: Any, tmp: Path) -> list[str]:
    """``[flag, value]`` (``[flag]`` for a boolean flag): values that often must be refused."""
    flag = max(opt.opts, key=len)
    if opt.is_flag:
        return [draw(st.sampled_from([*opt.opts, *opt.secondary_opts]))]
    kind = _base(opt.type_descriptor.annotation)
    if kind is int:
        v: object = draw(st.one_of(st.sampled_from([0, -1, -5, 70000, 2**63]), st.integers(-(10**6), 10**6)))
    elif kind is float:
        v = draw(st.one_of(st.sampled_from(["nan", "inf", "-3", "0"]), st.floats(-1e6, 1e6)))
    elif get_origin(kind) is Literal:
        v = draw(st.one_of(st.sampled_from(get_args(kind)), st.text(max_size=6)))
    else:  # a path or a string: an unwritable path, a file where a directory is meant, junk, a URL
        bad = [f"{tmp}/file/x", "/proc/rollout-x", str(tmp), f"{tmp}/file", "bogus://", "9x9", "0", ""]
        v = draw(
            st.one_of(st.sampled_from(bad), st.text(st.characters(codec="utf-8", exclude_characters="\0")))
        )
    return [flag, str(v)]


def _base(annotation: Any) -> Any:
    """``int | None`` -> ``int``; a list's item type; the annotation itself otherwise."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is list or (len(args) == 1 and get_origin(annotation) is not Literal):
        return _base(args[0])
    return annotation


def _check(args: list[str]) -> None:
    r = CliRunner().invoke(app, args)
    assert "Traceback" not in r.output, r.output
    exc = r.exception
    if isinstance(exc, Reached):
        return
    if isinstance(exc, UserError):
        message = str(as_flags(exc))
        assert NAMED.search(message), (args, message)
        return
    assert isinstance(exc, SystemExit) and r.exit_code == 2, (args, r.exit_code, exc, r.output)
    assert "'--" in r.output or "Missing" in r.output or "No such option" in r.output, r.output


@pytest.fixture()
def world(tmp_path: Path, tiny64: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The commands' valid arguments, the work of each replaced by Reached, the working directory a fresh
    one (a flag that names a relative path creates nothing elsewhere)."""
    import rollout_operator.local.local_job as local_app
    import rollout_profiler.profiling.measure as measure
    import rollout_profiler.sim.simulate as sim_run
    import rollout_worker.engine.driver.fixed_batch as batch
    import rollout_worker.server.run as server_run

    def reached(*args: Any, **kwargs: Any) -> Any:
        raise Reached

    for module, name in (
        (local_app._Database, "open"),
        (batch, "run_batch"),
        (sim_run, "simulate"),
        (measure, "profile_measured"),
        (measure, "profile_shard_equivalent"),
        (server_run, "serve"),
    ):
        monkeypatch.setattr(module, name, reached)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 4}) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_doc(tiny64, prompts, tmp_path / "out", parallelism={"profile": None})))
    model = ["--model", str(tiny64)]
    return {
        "run": ["run", str(job)],
        "serve": ["serve", *model],
        "generate": ["generate", *model, "--prompts", str(prompts), "--out", "o.jsonl"],
        "simulate": ["simulate", "--profile", str(PROFILE), "--policies", "static:8"],
        "profile": ["profile", *model, "--no-db"],
    }


@pytest.mark.parametrize("command", ["run", "serve", "generate", "simulate", "profile"])
def test_fuzzed_flags_are_refused_naming_the_flag(
    command: str, world: dict[str, list[str]], tmp_path: Path
) -> None:
    options = _flags(command)
    _check(world[command])  # imports what the command needs, outside the timed examples

    @settings(FAST, max_examples=12)
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(options), min_size=1, max_size=3, unique_by=lambda o: o.name)
        )
        args = [x for opt in chosen for x in _value(data.draw, opt, tmp_path)]
        _check([*world[command], *args])

    one()
