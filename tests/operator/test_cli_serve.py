"""`rolloutctl serve --costs`: a bad cost model is refused with the flag named, before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli


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
    assert got.returncode == 2 and "--costs" in got.stderr and "cannot read" in got.stderr, got.stderr
