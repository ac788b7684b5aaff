"""Output paths: checked writable before the work, and a result that cannot be written at the end is saved
beside it, the message saying where."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_worker.api.errors import UserError
from rollout_worker.api.files import check_writable, save


def test_writable_paths_pass_and_create_nothing(tmp_path: Path) -> None:
    check_writable(tmp_path / "new" / "deeper" / "f.json", "out")
    check_writable(tmp_path / "d", "out", directory=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("path", "directory", "message"),
    [
        ("{file}", False, "is the input file"),
        ("{file}/x", False, "is a file, not a directory"),
        ("{file}/x/y", True, "is a file, not a directory"),
        ("{file}", True, "is a file, not a directory"),
        ("{dir}", False, "is a directory, not a file"),
        ("/proc/rollout-x/y.json", False, "cannot create files in /proc"),
        ("{dir}/a\0b", False, "is not a usable path"),
    ],
)
def test_unwritable_paths_are_refused_naming_the_field(
    tmp_path: Path, path: str, directory: bool, message: str
) -> None:
    f = tmp_path / "in.jsonl"
    f.write_text("x")
    with pytest.raises(UserError) as exc:
        inputs = [f] if "input" in message else []
        check_writable(path.format(file=f, dir=tmp_path), "--out", directory=directory, inputs=inputs)
    assert exc.value.field == "--out" and message in exc.value.message, exc.value


def test_save_writes_or_saves_beside_and_says_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert save(tmp_path / "a" / "r.json", "{}", "--report").read_text() == "{}"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["r.json"]  # no temporary file left
    (tmp_path / "gone").write_text("a file where the directory was")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as exc:
        save(tmp_path / "gone" / "r.json", b"result", "--report")
    saved = [p for p in tmp_path.iterdir() if p.name.startswith("r.json.")]
    assert len(saved) == 1 and saved[0].read_bytes() == b"result"
    assert exc.value.field == "--report" and f"saved it as {saved[0]} instead" in exc.value.message
