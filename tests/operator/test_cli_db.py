"""`rolloutctl db ...` and `rolloutctl profile ...` through the real entry point (`main`, which turns a
UserError into `error: ...` and exit status 2), on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_operator.cli.main import main
from rollout_profiler.store import database
from rollout_profiler.store.testing import (
    sample_profile,
)
from rollout_worker.errors import UserError
from sqlalchemy.engine import make_url

LAYOUTS = ((4, 1), (2, 2), (1, 4))


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test touches ~/.local/share/elastic-rollout or a database named by the environment."""
    monkeypatch.delenv("ROLLOUT_DB_URL", raising=False)
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    sample_profile(name="tiny-cpu-4", layouts=LAYOUTS).to_json(path)
    return path


def run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """Run `rolloutctl ARGS` in this process; returns (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["rolloutctl", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def step_rows(out: str) -> list[list[str]]:
    """The rows of the step-latency table of `profile show` (between its dashes and the next blank line)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step latency")) + 3
    end = lines.index("", start)
    return [line.split() for line in lines[start:end]]


def assert_user_error(result: tuple[int, str, str], fragment: str) -> None:
    code, _, err = result
    assert code == 2, result
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one clear line, no traceback
    assert fragment in err, err


def test_db_upgrade_and_current(
    empty_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = make_url(empty_url)
    if url.get_backend_name() == "postgresql":  # trust auth ignores the password: only its masking is tested
        url = url.set(password="s3cret-pw")
    db = url.render_as_string(hide_password=False)
    code, out, _ = run(monkeypatch, capsys, "db", "current", "--db", db)
    assert code == 0 and "revision: none (empty database" in out
    code, out, _ = run(monkeypatch, capsys, "db", "upgrade", "--db", db)
    assert code == 0, out
    assert out.splitlines() == [
        f"database: {url.render_as_string(hide_password=True)}",
        "revision: none -> 0003 (head)",
    ]
    code, out, _ = run(monkeypatch, capsys, "db", "upgrade", "--db", db)
    assert code == 0 and "revision: 0003 (head, already)" in out
    code, out, _ = run(monkeypatch, capsys, "db", "current", "--db", db)
    assert code == 0 and out.splitlines()[1] == "revision: 0003 (head)"
    assert "s3cret-pw" not in out


def test_profile_import_list_show_export(
    empty_url: str,
    profile_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = ("--db", empty_url)
    assert run(monkeypatch, capsys, "db", "upgrade", *db)[0] == 0
    code, out, _ = run(monkeypatch, capsys, "profile", "list", *db)
    assert code == 0 and out.startswith("no profiles in ")
    code, out, err = run(monkeypatch, capsys, "profile", "import", str(profile_file), *db)
    assert (code, out) == (0, "1\n"), err
    assert run(monkeypatch, capsys, "profile", "import", str(profile_file), *db)[1] == "2\n"
    code, out, _ = run(monkeypatch, capsys, "profile", "list", *db)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["id", "name", "model"]
    assert [line.split()[:2] for line in lines[1:]] == [["1", "tiny-cpu-4"], ["2", "tiny-cpu-4"]]
    code, out, _ = run(monkeypatch, capsys, "profile", "show", "2", *db, "--plot", str(tmp_path))
    assert code == 0
    assert {row[0] for row in step_rows(out)} == {"4x1", "2x2", "1x4"}
    assert (tmp_path / "tiny-cpu-4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out_file = tmp_path / "exported.json"
    code, out, _ = run(monkeypatch, capsys, "profile", "export", "1", "--out", str(out_file), *db)
    assert code == 0 and "wrote profile 1" in out
    assert json.loads(out_file.read_text()) == json.loads(profile_file.read_text())
    assert_user_error(run(monkeypatch, capsys, "profile", "show", "99", *db), "no profile with id 99")
    assert_user_error(
        run(monkeypatch, capsys, "profile", "export", "99", "--out", str(out_file), *db),
        "no profile with id 99",
    )


def test_show_file_with_plot(
    profile_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "out.png"
    code, out, err = run(monkeypatch, capsys, "profile", "show", str(profile_file), "--plot", str(png))
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    rows = step_rows(out)
    assert len(rows) == 9
    for d, t in LAYOUTS:
        assert [r[1] for r in rows if r[0] == f"{d}x{t}"] == ["1", "4", "16"], f"layout {d}x{t} missing"
    assert f"plot written to {png}" in err
    code, out, _ = run(monkeypatch, capsys, "profile", "show", str(profile_file))
    assert code == 0 and "step latency" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "tiny.json"]  # no plot unless asked


def test_bad_inputs_give_one_line_errors(
    profile_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"schema": "elastic-rollout/profile/v1", ')
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps({**json.loads(profile_file.read_text()), "step_latency": []}))
    db = ("--db", f"sqlite:///{tmp_path / 'r.db'}")
    assert_user_error(
        run(monkeypatch, capsys, "profile", "show", str(tmp_path / "missing.json")), "profile file not found"
    )
    assert_user_error(run(monkeypatch, capsys, "profile", "show", str(malformed)), "not valid JSON (line 1")
    assert_user_error(
        run(monkeypatch, capsys, "profile", "import", str(invalid), *db), "step_latency is empty"
    )
    assert_user_error(run(monkeypatch, capsys, "profile", "show", "7", *db), "run `rolloutctl db upgrade")
    assert run(monkeypatch, capsys, "db", "upgrade", *db)[0] == 0
    assert_user_error(run(monkeypatch, capsys, "profile", "show", "7", *db), "no profile with id 7")
    assert_user_error(
        run(
            monkeypatch,
            capsys,
            "profile",
            "show",
            str(profile_file),
            "--plot",
            str(tmp_path / "no" / "p.png"),
        ),
        "cannot write plot",
    )
    assert_user_error(
        run(monkeypatch, capsys, "db", "current", "--db", "no such url"), "database URL is not valid"
    )
    refused = "postgresql://me:pw@127.0.0.1:1/x"
    assert_user_error(
        run(monkeypatch, capsys, "db", "upgrade", "--db", refused),
        "database postgresql://me:***@127.0.0.1:1/x: ",
    )


def test_default_url_comes_from_the_environment(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(monkeypatch, capsys, "db", "upgrade")
    assert code == 0 and out.splitlines()[0] == f"database: sqlite:///{isolated_home / 'rollout.db'}"
    assert (isolated_home / "rollout.db").is_file()
    monkeypatch.setenv("ROLLOUT_DB_URL", f"sqlite:///{tmp_path / 'env.db'}")
    code, out, _ = run(monkeypatch, capsys, "db", "current")
    assert code == 0 and out.splitlines() == [
        f"database: sqlite:///{tmp_path / 'env.db'}",
        "revision: none (empty database: run `rolloutctl db upgrade`)",
    ]


def test_profile_alone_prints_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(monkeypatch, capsys, "profile")
    assert code == 0
    for sub in ("show", "import", "export", "list"):
        assert sub in out


def test_console_script_prints_error_and_exits_2(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("rolloutctl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollout_operator.cli.main"]
    proc = subprocess.run(
        [*cmd, "profile", "show", str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr == f"error: profile file not found: {tmp_path / 'nope.json'}\n"
    assert proc.stdout == ""


# --- URL resolution and engines (no server needed) ---------------------------------------------------------


def test_url_precedence(tmp_path: Path) -> None:
    env = {"ROLLOUT_DB_URL": "postgresql+psycopg://u@h/d", "ROLLOUT_HOME": str(tmp_path)}
    assert database.resolve_url("sqlite:///x.db", env) == "sqlite:///x.db"
    assert database.resolve_url(None, env) == "postgresql+psycopg://u@h/d"
    assert database.resolve_url(None, {"ROLLOUT_HOME": str(tmp_path)}) == f"sqlite:///{tmp_path}/rollout.db"
    default = database.resolve_url(None, {})
    assert default == f"sqlite:///{Path('~/.local/share/elastic-rollout').expanduser()}/rollout.db"


def test_make_engine_creates_the_sqlite_folder_and_masks_passwords(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a' / 'b' / 'r.db'}"
    database.make_engine(url).dispose()
    assert (tmp_path / "a" / "b").is_dir()
    assert (
        database.mask_url("postgresql+psycopg://me:s3cret@h:5432/d") == "postgresql+psycopg://me:***@h:5432/d"
    )
    assert database.parse_url("postgresql://me@h/d").drivername == "postgresql+psycopg"
    with pytest.raises(UserError, match="not valid"):
        database.make_engine("not a url")
    with pytest.raises(UserError, match="unknown dialect"):
        database.make_engine("nosuchdb://h/d")
