"""Input files read within a bound, whatever the path names; output paths checked writable before the work,
and a result that cannot be written at the end is saved beside it, the message saying where."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_worker.data.files import check_writable, read_text, save
from rollout_worker.errors import UserError


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
        ("{dangling}", True, "is a symbolic link to {dir}/gone, which does not exist"),
        ("{dangling}", False, "is a symbolic link to {dir}/gone, which does not exist"),
    ],
)
def test_unwritable_paths_are_refused_naming_the_field(
    tmp_path: Path, path: str, directory: bool, message: str
) -> None:
    f = tmp_path / "in.jsonl"
    f.write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # a volume not mounted, a model not copied yet
    fill = {"file": f, "dir": tmp_path, "dangling": tmp_path / "link"}
    with pytest.raises(UserError) as exc:
        inputs = [f] if "input" in message else []
        check_writable(path.format(**fill), "--out", directory=directory, inputs=inputs)
    assert exc.value.field == "--out" and message.format(**fill) in exc.value.message, exc.value


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


def test_an_input_is_read_no_further_than_its_limit(tmp_path: Path) -> None:
    (tmp_path / "ok").write_text("a\nb\n")
    assert read_text(tmp_path / "ok", "--x", "job file", limit=4) == "a\nb\n"
    (tmp_path / "big").write_text("12345")
    for path in (tmp_path / "big", "/dev/zero"):  # an endless device is read up to the limit, not forever
        with pytest.raises(UserError) as exc:
            read_text(path, "--x", "job file", limit=4)
        assert str(exc.value) == f"--x: {path} is over 4 bytes, the limit of a job file"
    (tmp_path / "wide").write_text("你好")  # 2 characters, 6 bytes: the limit counts bytes
    with pytest.raises(UserError, match="is over 4 bytes"):
        read_text(tmp_path / "wide", "--x", "job file", limit=4)
    (tmp_path / "crlf").write_bytes(b"a\r\nb\r")  # lines read as text mode reads them
    assert read_text(tmp_path / "crlf", "--x", "job file") == "a\nb\n"
