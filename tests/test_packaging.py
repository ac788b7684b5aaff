"""torch lives in the `engine` extra: a plain `pip install elastic-rollout` (what the operator's and the
sidecar's image hold) installs and imports without it, its migrations are packaged, and a command that needs
the engine says which extra to install instead of failing in a rank process."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

TORCH_FREE = """
import importlib.util, sys
assert importlib.util.find_spec("torch") is None, "torch is installed"
import rollout_operator.cli.main, rollout_operator.local.runner, rollout_operator.control.planner_loop
import rollout_worker.sidecar.app, rollout_worker.server.app
import rollout_profiler.planning.planner, rollout_profiler.sim.simulator, rollout_profiler.store.migrate
import rollout_bench.planner  # `rolloutctl bench planner` ships in the wheel, torch-free
assert "torch" not in sys.modules
print("imports ok")
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the project installed from a wheel, no extras. The wheel is built from a copy of
    the sources, so the build leaves nothing in the checkout (setuptools' build/ would otherwise keep stale
    modules for later builds)."""
    tmp = tmp_path_factory.mktemp("bare")
    src, where = tmp / "src", tmp / "venv"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("worker", "profiler", "operator", "bench/rollout_bench"):  # not bench/'s results
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    venv.EnvBuilder(with_pip=True).create(where)
    env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    got = subprocess.run(
        [str(where / "bin" / "pip"), "install", "-q", str(src)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr
    return where / "bin"


def _run(bin_: Path, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROLLOUT_DB_URL")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd or bin_)


def test_the_package_imports_and_runs_without_torch(bare: Path, tmp_path: Path) -> None:
    got = _run(bare, str(bare / "python"), "-c", TORCH_FREE)
    assert got.returncode == 0 and "imports ok" in got.stdout, got.stdout + got.stderr
    for argv in (["--help"], ["sidecar", "--help"], ["simulate", "--help"]):
        got = _run(bare, str(bare / "rolloutctl"), *argv)
        assert got.returncode == 0, (argv, got.stderr)
    url = f"sqlite:///{tmp_path / 'r.db'}"  # the migrations ship in the wheel
    got = _run(bare, str(bare / "rolloutctl"), "db", "upgrade", "--db", url)
    assert got.returncode == 0, got.stdout + got.stderr
    got = _run(bare, str(bare / "rolloutctl"), "db", "current", "--db", url)
    assert got.returncode == 0 and "(head)" in got.stdout, got.stdout + got.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "m"],
        ["run", "examples/quickstart.yaml"],
        ["bench", "engine", "--preset", "tiny"],
        ["profile", "--preset", "tiny"],
        ["make-model", "--preset", "tiny", "--out", "m"],
    ],
    ids=["serve", "run", "bench-engine", "profile", "make-model"],
)
def test_engine_commands_name_the_extra(bare: Path, argv: list[str]) -> None:
    got = _run(bare, str(bare / "rolloutctl"), *argv, cwd=ROOT)
    assert "Traceback" not in got.stderr, got.stderr
    assert got.returncode == 2, got.stdout + got.stderr
    assert "pip install 'elastic-rollout[engine]'" in got.stderr, got.stderr


def test_no_worker_module_names_the_profiler_or_the_operator() -> None:
    """Not even in a string (``python -m rollout_operator...``): import-linter cannot see those."""
    named = [
        str(f.relative_to(ROOT))
        for f in (ROOT / "worker").rglob("*.py")
        if "rollout_operator" in f.read_text() or "rollout_profiler" in f.read_text()
    ]
    assert named == []
