"""`rolloutctl serve`'s flags: a bad cost model, a bad port or duration, an empty model name, a network
address without an API key: each refused in one line naming the flag (exit 2), before any rank starts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from rollout_operator.cli.main import app
from typer.testing import CliRunner

from tests.conftest import run_cli
from tests.operator.test_cli_db import run


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ('["a"]', "expected an object of cost rates"),
        ('{"costs": {"migrate_bytes_per_ms": "fast"}}', "costs.migrate_bytes_per_ms must be a number >= 0"),
        ('{"costs": {"sync_ms": -1}}', "costs.sync_ms must be a number >= 0"),
        ('{"costs": {"sync_ms": 1}}', "not a cost model"),
    ],
    ids=["not-json", "not-object", "wrong-type", "negative", "missing-rates"],
)
def test_a_bad_cost_model_is_refused(tiny64: Path, tmp_path: Path, content: str, message: str) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text(content)
    got = run_cli("serve", "--model", str(tiny64), "--port", "0", "--costs", str(costs), timeout=60)
    assert got.returncode == 2, got.stdout + got.stderr
    assert "--costs" in got.stderr and message in got.stderr and "Traceback" not in got.stderr


def test_a_missing_cost_file_is_refused(tiny64: Path, tmp_path: Path) -> None:
    got = run_cli("serve", "--model", str(tiny64), "--costs", str(tmp_path / "nope.json"), timeout=60)
    assert got.returncode == 2 and "--costs: costs file not found" in got.stderr, got.stderr


@pytest.mark.parametrize(
    ("args", "flag", "message"),
    [
        (["--port", "70000"], "--port", "less than or equal to 65535"),
        (["--port", "-1"], "--port", "greater than or equal to 0"),
        (["--drain-seconds", "-3"], "--drain-seconds", "greater than or equal to 0"),
        (["--served-model-name", ""], "--served-model-name", "at least 1 character"),
        (["--body-timeout-seconds", "0"], "--body-timeout-seconds", "greater than 0"),
        (["--host", "0.0.0.0"], "--host", "0.0.0.0 is not a loopback address: give an API key"),
        (["--host", "::"], "--host", "--allow-unauthenticated"),
    ],
)  # fmt: skip
def test_bad_server_flags_are_one_line_naming_the_flag_before_anything_starts(
    served: list[Any],
    tiny64: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    flag: str,
    message: str,
) -> None:
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    code, _, err = run(monkeypatch, capsys, "serve", "--model", str(tiny64), *args)
    assert code == 2 and err.startswith(f"error: {flag}: ") and message in err, err
    assert err.count("\n") == 1 and served == []


def test_a_bad_corpus_file_is_refused_naming_the_flag_and_line(
    served: list[Any],
    tiny64: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--speculative-ngram-external-corpus-path`` (SGLang's): without speculation, with a line that is not
    a JSON string, or with a model that has no tokenizer, one line naming the flag, and nothing starts; a
    good file starts the server."""
    flag = "--speculative-ngram-external-corpus-path"
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('"one document"\n"another"\n')
    bad.write_text('"one document"\n42\n')
    base = ("serve", "--model", str(tiny64))
    ngram = ("--speculative-algorithm", "ngram")
    cases = [
        ((flag, str(good)), "needs speculative decoding"),
        ((flag, str(bad), *ngram), f"{bad}:2: expected a JSON string, got int"),
        ((flag, str(tmp_path / "none.jsonl"), *ngram), "not found"),
    ]
    bare = tmp_path / "bare"  # the model without its tokenizer
    shutil.copytree(tiny64, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    for args, message in cases:
        code, _, err = run(monkeypatch, capsys, *base, *args)
        assert code == 2 and err.startswith(f"error: {flag}: ") and message in err, err
    code, _, err = run(monkeypatch, capsys, "serve", "--model", str(bare), flag, str(good), *ngram)
    assert code == 2 and err.startswith(f"error: {flag}: ") and "has no tokenizer.json" in err, err
    assert served == []
    code, _, err = run(monkeypatch, capsys, *base, flag, str(good), *ngram)
    assert code == 0 and len(served) == 1, err


@pytest.mark.parametrize("how", ["--allow-unauthenticated", "--api-key-file", "ROLLOUT_API_KEY"])
def test_a_key_or_the_explicit_flag_lets_the_server_listen_beyond_loopback(
    served: list[Any], tiny64: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    key = tmp_path / "key"
    key.write_text("k\n")
    extra = {"--allow-unauthenticated": [how], "--api-key-file": [how, str(key)], "ROLLOUT_API_KEY": []}[how]
    env = {"ROLLOUT_API_KEY": "k"} if how == "ROLLOUT_API_KEY" else {}
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny64), "--host", "0.0.0.0", *extra], env=env)
    assert result.exit_code == 0, result.output
    ((settings, _),) = served
    assert settings.host == "0.0.0.0" and settings.open_to_network == (how == "--allow-unauthenticated")
