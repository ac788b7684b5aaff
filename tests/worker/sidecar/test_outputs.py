"""The sample file: durable appends, resume after a crash (a torn line cut), never a sample twice; what the
sidecar writes is what the one reader (``api.sidecar.read_samples``) gives back, in the file's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_worker.api.sampling import sample_seed
from rollout_worker.api.sidecar import Sample, SamplingSettings, read_outputs, read_samples
from rollout_worker.data.prompts import Prompt
from rollout_worker.errors import UserError
from rollout_worker.sidecar.job_mode import Job
from rollout_worker.sidecar.outputs import SampleWriter, sha256_of, write_manifest


def rec(pid: str, i: int) -> Sample:
    return Sample(
        prompt_id=pid,
        sample=i,
        prompt=[5, 6],
        output_text="ab",
        output_ids=[1, 2],
        output_logprobs=[-0.5, -1.25],
        finish_reason={"type": "length", "length": 2},
        prompt_tokens=2,
        completion_tokens=2,
        layouts=["2x1"],
        weight_version="default",
        sampling_seed=sample_seed(0, pid, i),
    )


def test_resume_cuts_a_torn_line_and_keeps_every_whole_sample(tmp_path: Path) -> None:
    path = tmp_path / "pod-0.jsonl"
    w = SampleWriter(path)
    assert [w.write(rec("a", 0)), w.write(rec("a", 1)), w.write(rec("b", 0))] == [0, 1, 2]
    w.close()
    with path.open("ab") as f:
        f.write(b'{"prompt_id": "b", "sample": 1, "outp')  # the process died mid-write
    again = SampleWriter(path)
    assert again.repaired_bytes > 0 and again.done == {("a", 0), ("a", 1), ("b", 0)}
    assert [r.sample for r in again.records] == [0, 1, 0]
    with pytest.raises(ValueError, match="already written"):
        again.write(rec("a", 1))
    assert again.write(rec("b", 1)) == 3
    again.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["prompt_id"], x["sample"]) for x in lines] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_damage_in_the_middle_is_reported_not_skipped(tmp_path: Path) -> None:
    path = tmp_path / "pod-0.jsonl"
    path.write_bytes(rec("a", 0).to_line() + b"{oops\n" + rec("a", 1).to_line())
    with pytest.raises(UserError, match=r"pod-0.jsonl:2: not a sample record \(JSONDecodeError\)"):
        SampleWriter(path)
    with pytest.raises(UserError, match=r"pod-0.jsonl:2: not a sample record \(JSONDecodeError\)"):
        read_samples(path)
    path.write_bytes(rec("a", 0).to_line() + b'{"prompt_id": "a", "sample": 1}\n')
    with pytest.raises(UserError, match=r"pod-0.jsonl:2: not a sample record \(prompt: Field required\)"):
        read_samples(path)
    path.write_bytes(rec("a", 0).to_line() + rec("a", 0).to_line())
    with pytest.raises(UserError, match="written twice"):
        SampleWriter(path)


def test_manifest_counts_and_checksums(tmp_path: Path) -> None:
    files = []
    for pod in range(2):
        w = SampleWriter(tmp_path / f"pod-{pod}.jsonl")
        for i in range(pod + 2):
            w.write(rec(f"p{pod}", i))
        w.close()
        files.append(w.path)
    m = json.loads(write_manifest(tmp_path, files, {"job": "x"}).read_text())
    assert m["samples"] == 5 and m["job"] == "x"
    assert [(e["file"], e["samples"]) for e in m["files"]] == [("pod-0.jsonl", 2), ("pod-1.jsonl", 3)]
    assert m["files"][1]["sha256"] == sha256_of(tmp_path / "pod-1.jsonl")


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "pod-0.jsonl"
    first = SampleWriter(path)
    with pytest.raises(UserError, match="being written by another process"):
        SampleWriter(path)
    first.close()  # released (as when the holder dies)
    SampleWriter(path).close()


ANSWER = {  # the engine's /generate answer (SGLang's shape) to a sample with return_logprob
    "text": "4",
    "output_ids": [19, 2],
    "meta_info": {
        "id": "q1#1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "weight_version": "v2",
        "e2e_latency": 0.5,
        "layouts": ["2x1", "1x2"],
        "output_token_logprobs": [[-0.123456789012, 19, None], [-2.0, 2, None]],
        "input_token_logprobs": [],
    },
}


def test_a_sample_the_sidecar_writes_round_trips_through_the_one_reader_in_the_files_format(
    tmp_path: Path,
) -> None:
    extra = {"data_source": "arith", "reward_model": {"ground_truth": "4"}, "extra_info": {"index": 1}}
    prompt = Prompt("q1", "2 + 2 =", None, extra, max_new_tokens=8)
    params = SamplingSettings(seed=7).sampling_params(prompt.id, 1, prompt.max_new_tokens)
    sample = Job._record(prompt, 1, params, ANSWER)
    w = SampleWriter(tmp_path / "pod-0.jsonl")
    w.write(sample)
    w.close()
    (got,) = read_samples(w.path)
    assert got == sample and read_outputs(tmp_path) == [sample]
    assert got.extra_fields() == extra and got.sampling_seed == sample_seed(7, "q1", 1)
    assert got.reward == 1.0 and Job._record(prompt, 1, params, ANSWER | {"text": "5"}).reward == 0.0
    # the bytes on disk: the record's keys in the order the sidecar always wrote them, compact JSON
    old = {
        "prompt_id": "q1",
        "sample": 1,
        "prompt": "2 + 2 =",
        "output_text": "4",
        "output_ids": [19, 2],
        "output_logprobs": [-0.12345679, -2.0],
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "layouts": ["2x1", "1x2"],
        "weight_version": "v2",
        "sampling_seed": sample_seed(7, "q1", 1),
        "reward": 1.0,  # the answer "4" is the ground truth
        **extra,
    }
    assert w.path.read_bytes() == json.dumps(old, separators=(",", ":")).encode() + b"\n"


def test_the_reader_counts_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "pod-3.jsonl"
    path.write_bytes(rec("a", 0).to_line() + rec("a", 1).to_line()[:-9])  # a write cut short
    assert [s.sample for s in read_samples(path)] == [0]
    assert read_outputs(tmp_path / "none") == []
