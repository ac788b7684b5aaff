"""The README and the docs site stay readable and true: a short README; no commit hash, CPU model name or
machine load figure in the README or in any docstring (figures live in the benchmark page, rendered from
result files); the site builds in strict mode; the tables the docs copy from the code (the operator's
settings, `rolloutctl serve`'s flags) are the code's."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README_MAX_LINES = 260

# a commit hash: 7 to 40 hex digits with at least one digit and one letter
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
CPU = re.compile(
    r"\b(EPYC|Xeon|Ryzen|Threadripper|Opteron|Sapphire Rapids|Ice Lake|Cascade Lake|Skylake|Graviton|"
    r"Neoverse|Core i[3579]|Apple M[1-4])\b",
    re.I,
)
LOAD = re.compile(r"\bload (average|avg)\b", re.I)


def _offences(text: str) -> list[str]:
    found = [f"commit hash {m[0]}" for m in HASH.finditer(text)]
    found += [f"CPU model {m[0]}" for m in CPU.finditer(text)]
    return found + [f"load average ({m[0]})" for m in LOAD.finditer(text)]


def _docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_no_hash_cpu_model_or_load_average_in_the_readme_or_a_docstring() -> None:
    bad = [f"README.md: {o}" for o in _offences((ROOT / "README.md").read_text())]
    files = [
        p for d in ("worker", "operator", "profiler", "bench", "tests") for p in (ROOT / d).rglob("*.py")
    ]
    assert len(files) > 300
    for path in files:
        for line, doc in _docstrings(path):
            bad += [f"{path.relative_to(ROOT)}:{line}: {o}" for o in _offences(doc)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text",
    [
        "measured at 5904b9b",
        "on an AMD EPYC",
        "a Sapphire Rapids VM",
        "at a load average of 3",
    ],
)
def test_the_check_finds_each_kind(text: str) -> None:
    assert _offences(text)


@pytest.mark.parametrize(
    "text", ["sha256 of the file", "float16 and bfloat16", "the deadbeef pattern", "1234567"]
)
def test_the_check_passes_ordinary_words(text: str) -> None:
    assert not _offences(text)


def _strict_build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the project's mkdocs.yml, as ``make docs`` runs it."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("mkdocs")), "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    got = _strict_build(ROOT, tmp_path / "site")
    assert got.returncode == 0, got.stdout + got.stderr
    assert (tmp_path / "site/reference/job-spec/index.html").is_file()


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    """The strict build is strict: the same configuration over a page with a dead link fails."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](missing.md)\n")
    config = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[0] + "\nnav:\n  - Home: index.md\n"
    (tmp_path / "mkdocs.yml").write_text(config)
    got = _strict_build(tmp_path, tmp_path / "site")
    assert got.returncode != 0 and "missing.md" in got.stdout + got.stderr


def test_the_operations_page_lists_every_operator_setting_with_its_default() -> None:
    from rollout_operator.cluster.settings import describe

    text = (ROOT / "docs/operations.md").read_text()
    settings = describe()
    for name, default, _ in settings:
        row = f"| `{name}` | {('`' + default + '`') if default else '-'} |"
        assert row in text, f"docs/operations.md: no row for {name} (default {default!r})"
    written = set(re.findall(r"^\| `(ROLLOUT_OPERATOR_[A-Z_]+)` \|", text, re.M))
    assert written == {name for name, _, _ in settings}


def test_the_http_api_page_lists_every_flag_of_serve_and_no_other() -> None:
    import typer
    from rollout_operator.cli.main import app

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    text = (ROOT / "docs/http-api.md").read_text()
    rows = set(re.findall(r"^\| `(--[a-z][a-z0-9-]*)`", text, re.M))
    flags = {p.opts[0] for p in serve.params if p.opts[0] != "--help"}
    every = {o for p in serve.params for o in (*p.opts, *p.secondary_opts)}
    assert flags <= rows, f"docs/http-api.md's flag table lacks {sorted(flags - rows)}"
    assert rows <= every, f"docs/http-api.md names flags serve lacks: {sorted(rows - every)}"
