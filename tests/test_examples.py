"""The shipped examples: every job file is a valid RolloutJob whose files exist, the prompt files are the
ones their scripts write (the math problems: distinct, with their answers), and the VeRL Parquet job runs end
to end with VeRL's fields passed through, a reward on every sample and the report's rollout lines."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rollout_operator.api.manifest import load_job
from rollout_worker.data.prompts import RANDOM_MODEL_TOKENIZER_CONFIG, ChatTemplate
from rollout_worker.data.reward import reward_of, score

ROOT = Path(__file__).parents[1]
JOBS = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", JOBS, ids=[p.name for p in JOBS])
def test_every_example_job_is_valid_and_its_files_exist(path: Path) -> None:
    spec = load_job(path).job.spec
    assert spec.prompts is not None and (ROOT / spec.prompts.path).is_file()
    profile = spec.parallelism.profile
    assert profile is None or (ROOT / profile).is_file()
    assert spec.model.preset is not None  # a fresh clone makes the model on first use


@pytest.mark.parametrize(
    ("script", "made"),
    [
        ("make_longtail.py", "longtail.jsonl"),
        ("make_math.py", "math.jsonl"),
        ("make_math.py", "math.parquet"),
    ],
)
def test_the_prompt_files_are_what_their_scripts_write(script: str, made: str, tmp_path: Path) -> None:
    shutil.copy(ROOT / "examples" / script, tmp_path / script)
    subprocess.run([sys.executable, str(tmp_path / script)], check=True, capture_output=True, timeout=60)
    if made.endswith(".parquet"):
        assert (
            pq.read_table(tmp_path / made).to_pylist() == pq.read_table(ROOT / "examples" / made).to_pylist()
        )
    else:
        assert (tmp_path / made).read_text() == (ROOT / "examples" / made).read_text()


def test_the_math_problems_are_distinct_and_carry_their_answers() -> None:
    jsonl = [json.loads(x) for x in (ROOT / "examples/math.jsonl").read_text().splitlines()]
    rows = pq.read_table(ROOT / "examples/math.parquet").to_pylist()
    assert len(jsonl) == len(rows) >= 64
    assert len({r["prompt"][0]["content"] for r in jsonl}) == len(jsonl)  # distinct problems
    for line, row in zip(jsonl, rows, strict=True):
        assert line["prompt"] == row["prompt"] and line["id"] == str(row["extra_info"]["index"])
        assert line["ground_truth"] == row["reward_model"]["ground_truth"] == row["extra_info"]["answer"]
        assert score(f"#### {line['ground_truth']}", line["ground_truth"]) == 1.0


@pytest.mark.multiproc
def test_the_verl_parquet_job_runs_with_its_fields_passed_through(tmp_path: Path) -> None:
    for d in ("examples", "profiles"):
        shutil.copytree(ROOT / d, tmp_path / d)
    argv = [sys.executable, "-m", "rollout_operator.cli.main", "run", "examples/verl-job.yaml"]
    got = subprocess.run(
        [*argv, "--db", f"sqlite:///{tmp_path / 'db.sqlite'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    rows = pq.read_table(ROOT / "examples/math.parquet").to_pylist()
    recs = [json.loads(x) for x in (tmp_path / "build/verl-job/pod-0.jsonl").read_text().splitlines()]
    assert sorted((r["prompt_id"], r["sample"]) for r in recs) == sorted(
        (str(i), s) for i in range(8) for s in range(4)
    )
    assert re.search(r"lengths: p50 \d+, p90 \d+, p99 \d+, max \d+ tokens; \d+ of 32 samples", got.stdout)
    assert re.search(r"rewards: mean [\d.]+ over 32 samples .*; pass@4 [\d.]+ \(\d+ of 8 prompts", got.stdout)
    template = ChatTemplate.of_config(RANDOM_MODEL_TOKENIZER_CONFIG)
    assert template is not None
    for r in recs:
        row = rows[int(r["prompt_id"])]
        assert r["prompt"] == template.render(row["prompt"])
        for key in ("data_source", "ability", "reward_model", "extra_info"):
            assert r[key] == row[key]
        assert 0 < r["completion_tokens"] <= 64
        assert r["reward"] == reward_of(row, r["output_text"])  # from reward_model.ground_truth
