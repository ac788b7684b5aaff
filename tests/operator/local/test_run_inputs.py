"""`rolloutctl run` (in-process): every input the engine or the sidecar would refuse only once started (a
prompt that cannot fit, an unwritable output, a GPU that is not there), and every output path, is refused
before anything starts, naming the job file's line or the flag; output files are written where they were
asked to be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rollout_operator.api.manifest import load_job
from rollout_operator.cli.main import app
from rollout_operator.local import result as res
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout
from rollout_worker.sidecar.outputs import write_manifest
from typer.testing import CliRunner

from tests.operator.local.jobs import job_doc, write_job


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    return p


def run(job: Path, *flags: str) -> tuple[int, str]:
    """`rolloutctl run JOB FLAGS` in this process: (exit code, the error as the CLI prints it)."""
    r = CliRunner().invoke(app, ["run", str(job), "--db", f"sqlite:///{job.parent / 'db.sqlite'}", *flags])
    if isinstance(r.exception, UserError):
        return 2, str(r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.output


def job(tmp_path: Path, model: Path, prompts: Path, out: Path | None = None, **spec: object) -> Path:
    return write_job(tmp_path / "job.yaml", job_doc(model, prompts, out or tmp_path / "out", **spec))


def line_of(path: Path, text: str) -> int:
    """The last line of the file that holds ``text``."""
    return max(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"sampling": {"temperature": float("inf")}}, "spec.sampling.temperature", "finite number"),
        ({"sampling": {"seed": 2**70}}, "spec.sampling.seed", "less than"),
        ({"sampling": {"stop": [""]}}, "spec.sampling.stop", "must not be empty"),
        ({"sampling": {"maxNewTokens": 10**12}}, "spec.sampling.maxNewTokens", "exceeds the context length"),
        ({"engine": {"kvBudgetTokens": 4}}, "spec.engine.kvBudgetTokens", "exceeds the KV budget"),
        ({"engine": {"contextLength": 10**6}}, "spec.engine.contextLength", "max_position_embeddings"),
    ],
)
def test_values_the_engine_would_refuse_are_refused_with_the_line(
    tmp_path: Path, tiny64: Path, prompts: Path, spec: dict[str, dict[str, object]], field: str, message: str
) -> None:
    path = job(tmp_path, tiny64, prompts, **spec)
    key = field.rsplit(".", 1)[1]
    code, err = run(path)
    assert code == 2 and err.startswith(f"{path}:{line_of(path, key)}: {field}: "), err
    assert message in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "long", "prompt": "x" * 3000}, "prompt 'long': prompt (3000 tokens)"),
        ({"id": "ids", "input_ids": [1, 2, 10**6]}, "prompt 'ids': token id 1000000 out of range"),
    ],
)
def test_prompts_are_checked_as_generate_checks_them(
    tmp_path: Path, tiny64: Path, prompts: Path, row: dict[str, object], message: str
) -> None:
    prompts.write_text(json.dumps(row) + "\n")
    path = job(tmp_path, tiny64, prompts)
    code, err = run(path)
    assert code == 2 and err.startswith(f"{path}:{line_of(path, 'prompts.jsonl')}: spec.prompts.path: "), err
    assert message in err


def test_cuda_without_a_gpu_is_refused_with_the_line(
    tmp_path: Path, tiny64: Path, prompts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    path = job(tmp_path, tiny64, prompts, engine={"device": "cuda"})
    code, err = run(path)
    assert code == 2 and err.startswith(
        f"{path}:{line_of(path, 'device')}: spec.engine.device: cuda: no CUDA"
    )


@pytest.mark.parametrize("where", ["prompts", "under-a-file", "proc"])
def test_an_output_directory_that_cannot_be_written_is_refused(
    tmp_path: Path, tiny64: Path, prompts: Path, where: str
) -> None:
    out = {"prompts": prompts, "under-a-file": prompts / "out", "proc": Path("/proc/rollout-out")}[where]
    path = job(tmp_path, tiny64, prompts, out)
    code, err = run(path)
    assert code == 2 and err.startswith(f"{path}:{line_of(path, str(out))}: spec.output.path: "), err
    assert prompts.read_text() == json.dumps({"id": "a", "prompt": "hello"}) + "\n"
    code, err = run(path, "--output", str(out))
    assert code == 2 and err.startswith("--output: "), err


@pytest.mark.parametrize("flag", ["--report", "--timeline"])
def test_report_and_timeline_paths_are_checked_before_the_job_runs(
    tmp_path: Path, tiny64: Path, prompts: Path, flag: str
) -> None:
    path = job(tmp_path, tiny64, prompts)
    for bad, why in ((prompts / "r.json", "is a file, not a directory"), (tmp_path, "is a directory")):
        code, err = run(path, flag, str(bad))
        assert code == 2 and err.startswith(f"{flag}: ") and why in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.tmp*"))


def test_report_and_timeline_are_written_where_asked(tmp_path: Path, tiny64: Path, prompts: Path) -> None:
    """A finished run reported again (nothing started): `--timeline t` writes t (not t.png)."""
    path = job(tmp_path, tiny64, prompts, parallelism={"policy": "static"})
    out, loaded = tmp_path / "out", load_job(path)
    res.claim(out, loaded.job.spec, loaded.job.metadata.name)
    write_manifest(out, [], {"job": "tiny-e2e", "policy": "static"})
    res.record(res.RunResult("static", Layout(2, 1), out, 1.0, 0, 0, {}, []))
    code, output = run(path, "--timeline", str(tmp_path / "t"), "--report", str(tmp_path / "r" / "r.json"))
    assert code == 0, output
    assert (tmp_path / "t").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "t.png").exists()
    assert json.loads((tmp_path / "r" / "r.json").read_text())["runs"][0]["policy"] == "static"
    assert f"timeline: {tmp_path / 't'}" in output
