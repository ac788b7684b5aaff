"""`rolloutctl run` refuses every invalid job before any process starts: one `error:` line naming the file,
line and YAML path (or the flag), exit code 2, no traceback, and nothing created (no output directory, no
database, no model)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.operator.local.jobs import PROFILE, rolloutctl

JOB = """apiVersion: elasticrollout.dev/v1alpha1
kind: RolloutJob
metadata:
  name: bad-job
spec:
  model:
    path: {model}
    dtype: float64
  pods: 2
  gpusPerPod: 2
  prompts:
    path: {prompts}
  samplesPerPrompt: 2
  sampling:
    temperature: 0.8
  parallelism:
    candidates: [2x1, 1x2]
    profile: {profile}
  output:
    path: {out}
"""

# (replacements in JOB, the error line expected after "error: ")
CASES: list[tuple[list[tuple[str, str]], str]] = [
    ([("pods: 2", "pods: two")], "job.yaml:9: spec.pods: Input should be a valid integer"),
    ([("samplesPerPrompt: 2", "samplesPerPrompt: 0")], "job.yaml:13: spec.samplesPerPrompt: Input should be"),
    ([("temperature: 0.8", "temperature: -1")], "job.yaml:15: spec.sampling.temperature: Input should be"),
    (
        [("[2x1, 1x2]", "[2x1, 3x1]")],
        "job.yaml:17: spec.parallelism.candidates[1]: 3x1 uses 3 ranks, but gpusPerPod is 2",
    ),
    ([("[2x1, 1x2]", "[2x1, 2y1]")], "job.yaml:17: spec.parallelism.candidates[1]: '2y1' is not of the form"),
    (
        [("    profile:", "    policy: greedy\n    profile:")],
        "job.yaml:18: spec.parallelism.policy: Input should be 'adaptive' or 'static'",
    ),
    (
        [("[2x1, 1x2]", "[2x1]"), ("    profile:", "    initialLayout: 1x2\n    profile:")],
        "job.yaml:18: spec.parallelism.initialLayout: 1x2 is not among the candidates",
    ),
    (
        [("  pods: 2", "  pods: 2\n  maxBatch: 8")],
        "job.yaml:10: spec.maxBatch: Extra inputs are not permitted",
    ),
    ([("name: bad-job", "name: Bad_Job")], "job.yaml:4: metadata.name: String should match pattern"),
    ([("kind: RolloutJob", "kind: RolloutJobs")], "job.yaml:2: kind: Input should be 'RolloutJob'"),
    ([("{prompts}", "{missing}")], "job.yaml:12: spec.prompts.path: file not found"),
    ([("{prompts}", "{badprompts}")], "job.yaml:12: spec.prompts.path: "),
    ([("{model}", "{nomodel}")], "job.yaml:7: spec.model.path: no checkpoint at"),
    ([("{profile}", "{missing}.json")], "job.yaml:18: spec.parallelism.profile: profile file not found"),
    (
        [("gpusPerPod: 2", "gpusPerPod: 3")],
        "job.yaml:17: spec.parallelism.candidates[0]: 2x1 uses 2 ranks, but gpusPerPod is 3",
    ),
    (  # valid for the manifest, not for the model: 8 attention heads over 3 ranks
        [("gpusPerPod: 2", "gpusPerPod: 3"), ("[2x1, 1x2]", "[3x1, 1x3]")],
        "job.yaml:17: spec.parallelism.candidates[1]: ",
    ),
    ([("  prompts:\n    path: {prompts}\n", "")], "job.yaml:5: spec.prompts: job mode needs prompts"),
    (
        [("  pods: 2", "  pods: 2\n  mode: service")],
        "job.yaml:12: spec.prompts: service mode takes no prompts",
    ),
    ([("  pods: 2", "  pods: [2")], "job.yaml:10: not valid YAML"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tiny64: Path) -> dict[str, str]:
    d = tmp_path_factory.mktemp("inputs")
    (d / "prompts.jsonl").write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    (d / "bad.jsonl").write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n{not json\n")
    return {
        "model": str(tiny64),
        "prompts": str(d / "prompts.jsonl"),
        "badprompts": str(d / "bad.jsonl"),
        "missing": str(d / "nowhere"),
        "nomodel": str(d / "no-model"),
        "profile": str(PROFILE),
    }


@pytest.mark.parametrize(("edits", "message"), CASES, ids=[f"{i:02d}" for i in range(len(CASES))])
def test_an_invalid_job_is_refused_before_anything_starts(
    edits: list[tuple[str, str]], message: str, files: dict[str, str], tmp_path: Path
) -> None:
    out, db = tmp_path / "out", tmp_path / "db.sqlite"
    text = JOB
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    text = text.format(**files, out=out)
    job = tmp_path / "job.yaml"
    job.write_text(text)
    got = subprocess.run(
        rolloutctl("run", str(job), "--db", f"sqlite:///{db}"), capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 2, got.stdout + got.stderr
    errors = [line for line in got.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in got.stderr, got.stderr
    assert errors[0].startswith(f"error: {tmp_path}/{message}"), errors[0]
    assert not out.exists() and not db.exists() and not Path(files["nomodel"]).exists()
    assert "starting as" not in got.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "fast"], "error: --policy: must be adaptive or static, got 'fast'"),
        (["--compare", "tp2"], "error: --compare: only `static` can be compared, got 'tp2'"),
    ],
)
def test_invalid_flags_are_refused(
    flags: list[str], message: str, files: dict[str, str], tmp_path: Path
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(**files, out=tmp_path / "out"))
    got = subprocess.run(rolloutctl("run", str(job), *flags), capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and got.stderr.strip() == message, got.stderr
    assert not (tmp_path / "out").exists()
