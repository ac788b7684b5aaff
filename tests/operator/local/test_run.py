"""`rolloutctl run` end to end, with real processes and HTTP: 2 pods (engine server + sidecar each) of the
tiny model in float64, the planner loop in the runner with a profile in which TP=2 pays in the tail.

- the planner switches on its own (no manual trigger), honestly (recorded gain > cost x (1 + margin)), and
  the outputs equal a static run's; decisions and finished lengths land in SQLite and in PostgreSQL;
- a sidecar, or one engine rank, killed mid-run: the run stops every process and fails naming the one that
  died; rerunning resumes, and the outputs equal an uninterrupted run's byte for byte (static policy, so
  that the `layouts` field, too, is the same), nothing lost, nothing twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from rollout_profiler.profile import Profile
from rollout_profiler.store import database, runs
from rollout_profiler.store.testing import sqlite_url
from rollout_worker.api.sidecar import read_outputs
from sqlalchemy.orm import Session

from tests.conftest import run_cli
from tests.operator.local.jobs import (
    ALL,
    PROFILE,
    SAMPLES,
    count_lines,
    job_doc,
    records,
    rolloutctl,
    sorted_lines,
    start_run,
    write_job,
    write_prompts,
)
from tests.waiting import wait_until
from tests.worker.server.served import alive, descendants

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def reference(tiny64: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted static run of the job."""
    d = tmp_path_factory.mktemp("reference")
    job = write_job(d / "job.yaml", job_doc(tiny64, prompts, d / "out"))
    got = run_cli("run", str(job), "--policy", "static", "--db", f"sqlite:///{d / 'db.sqlite'}")
    assert got.returncode == 0, got.stdout + got.stderr
    return d / "out"


def _without_layouts(out: Path) -> list[dict[str, object]]:
    recs = [{k: v for k, v in r.items() if k != "layouts"} for r in records(out)]
    return sorted(recs, key=lambda r: (str(r["prompt_id"]), int(str(r["sample"]))))


@pytest.mark.long
def test_the_planner_switches_honestly_and_the_outputs_equal_static(
    tiny64: Path, prompts: Path, reference: Path, tmp_path: Path
) -> None:
    # the embedded SQLite database, in a folder still to create: a whole job on PostgreSQL is the operator's
    # end-to-end test (tests/operator/kube/test_e2e.py), and the store runs on both in tests/profiler/store
    empty_url = sqlite_url(tmp_path)
    job = write_job(tmp_path / "job.yaml", job_doc(tiny64, prompts, tmp_path / "out"))
    got = run_cli("run", str(job), "--db", empty_url, "--report", str(tmp_path / "report.json"))
    assert got.returncode == 0, got.stdout + got.stderr
    out = tmp_path / "out"
    recs = records(out)
    assert sorted((r["prompt_id"], r["sample"]) for r in recs) == sorted(ALL)  # each exactly once
    for r in recs:
        assert r["data_source"] == "arith" and "ground_truth" in r["reward_model"]  # pass-through
    assert _without_layouts(out) == _without_layouts(reference)  # the same tokens, logprobs, texts
    switched = [r for r in recs if len(r["layouts"]) > 1]
    assert switched and all(r["layouts"][:2] == ["2x1", "1x2"] for r in switched)

    report = json.loads((tmp_path / "report.json").read_text())["runs"][0]
    committed = [e for e in report["reconfigurations"] if e["outcome"] == "committed"]
    assert committed and all(e["reason"].startswith("plan: unfinished") for e in committed)
    runner_log = (out / "logs" / "runner.log").read_text()  # the runner's own log: what it started and did
    assert "every pod is ready" in runner_log and "every sample written" in runner_log, runner_log
    assert "plan pushed: 1x2" in runner_log and "2x1 -> 1x2" in runner_log, runner_log
    assert "plan pushed" not in got.stdout + got.stderr  # the terminal shows the progress and the report
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == len(ALL) and [f["file"] for f in manifest["files"]] == [
        "pod-0.jsonl",
        "pod-1.jsonl",
    ]

    with Session(database.make_engine(empty_url)) as session:
        decisions = runs.list_decisions(session)
        lengths = runs.finished_lengths_for_model(session, Profile.from_json(PROFILE).model.shape_hash)
    ran = [d for d in decisions if d.outcome == "committed"]
    assert len(ran) == len(committed)
    honest = [d for d in ran if d.inputs is not None]  # pushed by the planner, with what it saw
    assert honest, decisions
    for d in honest:
        assert d.predicted_gain_ms > d.predicted_cost_ms * 1.1, d
        assert d.to_layout == "1x2" and d.step is not None and d.actual_cost_ms is not None
    # the engines price a switch with the planner's costs (the profile's), not their built-in priors
    planner = sorted(d.predicted_cost_ms for d in honest)
    engine = sorted(e["predicted_ms"] for e in committed)
    assert planner == pytest.approx(engine, rel=0.5), (planner, engine)
    assert sorted(x.length for x in lengths) == sorted(r["completion_tokens"] for r in recs)
    assert len(lengths) == len(ALL)


Killer = Callable[[Path, int], str]  # (output dir, runner pid) -> the child's name it killed


def _kill_sidecar(out: Path, runner: int) -> str:
    for pid in descendants(runner):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        env = Path(f"/proc/{pid}/environ").read_bytes()
        if b"sidecar" in cmd and b"ROLLOUT_SIDECAR_POD_INDEX=0" in env:
            os.kill(pid, signal.SIGKILL)
            return "tiny-e2e-0-sidecar"
    raise AssertionError("no sidecar of pod 0 among the runner's processes")


def _kill_rank(out: Path, runner: int) -> str:
    ends = json.loads((out / "endpoints.json").read_text())
    key = Path(ends["engine_key_file"]).read_text().strip()
    url = ends["pods"][1]["engine_url"]
    info = httpx.get(url + "/get_server_info", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    os.kill(info["rank_pids"][1], signal.SIGKILL)
    return "tiny-e2e-1-engine"


@pytest.mark.parametrize(
    "kill", [pytest.param(_kill_sidecar, marks=pytest.mark.long), _kill_rank], ids=["sidecar", "engine-rank"]
)
def test_a_run_killed_mid_way_resumes_to_the_uninterrupted_outputs(
    kill: Killer, tiny64: Path, prompts: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", job_doc(tiny64, prompts, out))
    args = [str(job), "--policy", "static", "--db", f"sqlite:///{tmp_path / 'db.sqlite'}"]
    runner = start_run(*args, log=tmp_path / "first.log")
    try:
        per_pod = len(ALL) // 2
        pods = [out / "pod-0.jsonl", out / "pod-1.jsonl"]
        wait_until(lambda: all(count_lines(f) >= 4 for f in pods), what="4 samples of each pod", timeout=120)
        family = descendants(runner.pid)
        victim = kill(out, runner.pid)
        written = sum(count_lines(f) for f in pods)
        assert written < 2 * per_pod, "the run finished before the kill: nothing was interrupted"
        assert runner.wait(60) == 1
    finally:
        if runner.poll() is None:
            runner.kill()
    log = (tmp_path / "first.log").read_text()
    assert f"error: {victim} exited with code" in log, log
    assert "Traceback" not in log
    wait_until(lambda: not alive(family), what="every process of the failed run to end", timeout=30)
    assert f"{victim} exited with code" in (out / "logs" / "runner.log").read_text()
    written_tokens = sum(s.completion_tokens for s in read_outputs(out))

    report = tmp_path / "report.json"
    again = subprocess.run(
        rolloutctl("run", *args, "--report", str(report)), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed:" in again.stdout
    assert sorted_lines(out) == sorted_lines(reference)  # byte for byte: nothing lost, nothing twice
    assert len(sorted_lines(out)) == len(ALL) == 12 * SAMPLES
    # tokens/s counts the tokens this run generated, not those the killed run had written
    got = json.loads(report.read_text())["runs"][0]
    assert 0 < written_tokens < got["tokens"] and got["generated_tokens"] == got["tokens"] - written_tokens
    rounding = 0.05 + got["tokens_per_s"] * 0.0005 / got["generation_seconds"]  # report: 0.1 tok/s, 1 ms
    rate = got["generated_tokens"] / got["generation_seconds"]
    assert got["tokens_per_s"] == pytest.approx(rate, abs=rounding)


def _decoding(out: Path, since: float) -> bool:
    """This run's pods (endpoints.json written after ``since``) each have requests running."""
    ends_file = out / "endpoints.json"
    if not ends_file.exists() or ends_file.stat().st_mtime < since:
        return False
    ends = json.loads(ends_file.read_text())
    headers = {"Authorization": f"Bearer {Path(ends['sidecar_token_file']).read_text().strip()}"}
    try:
        got = [
            httpx.get(p["sidecar_url"] + "/v1/progress", headers=headers, timeout=2).json()
            for p in ends["pods"]
        ]
    except (httpx.HTTPError, ValueError):
        return False
    return all(g.get("running", 0) > 0 for g in got)


@pytest.mark.long
def test_ctrl_c_then_sigkill_of_the_runner_stop_every_child_and_reruns_resume(
    tiny64: Path, prompts: Path, reference: Path, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT) mid-run: exit 130, every child gone; rerun, then SIGKILL of the runner itself (how a
    container is killed): its children die with it; the last rerun completes, byte-equal to an uninterrupted
    run, nothing lost, nothing twice."""
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.yaml", job_doc(tiny64, prompts, out))
    args = [str(job), "--policy", "static", "--db", f"sqlite:///{tmp_path / 'db.sqlite'}"]
    pods = [out / "pod-0.jsonl", out / "pod-1.jsonl"]
    for sig, code in ((signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)):
        started = time.time()
        runner = start_run(*args, log=tmp_path / f"{sig.name}.log")
        try:
            if sig == signal.SIGINT:  # the first run: some samples written, so the others resume
                wait_until(
                    lambda: all(count_lines(f) >= 2 for f in pods), what="2 samples of each pod", timeout=120
                )
            else:  # the resumed run holds only the long samples: stop it as soon as both pods decode
                wait_until(lambda t=started: _decoding(out, t), what="both pods to decode", timeout=120)
            family = descendants(runner.pid)
            assert family, "the runner has no children"
            runner.send_signal(sig)
            assert runner.wait(60) == code
        finally:
            if runner.poll() is None:
                runner.kill()
        assert sum(count_lines(f) for f in pods) < len(ALL), f"the run finished before {sig.name}"
        wait_until(lambda fam=family: not alive(fam), what=f"every child to end after {sig.name}", timeout=30)
        log = (tmp_path / f"{sig.name}.log").read_text()
        assert "Traceback" not in log, log
    assert "interrupted" in (tmp_path / "SIGINT.log").read_text()

    again = subprocess.run(rolloutctl("run", *args), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed:" in again.stdout
    assert sorted_lines(out) == sorted_lines(reference)
