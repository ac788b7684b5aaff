"""The sample file: durable appends, resume after a crash (a torn line cut), never a sample twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_worker.api.errors import UserError
from rollout_worker.sidecar.outputs import SampleWriter, sha256_of, write_manifest


def rec(pid: str, i: int) -> dict[str, object]:
    return {"prompt_id": pid, "sample": i, "output_ids": [1, 2]}


def test_resume_cuts_a_torn_line_and_keeps_every_whole_sample(tmp_path: Path) -> None:
    path = tmp_path / "pod-0.jsonl"
    w = SampleWriter(path)
    assert [w.write(rec("a", 0)), w.write(rec("a", 1)), w.write(rec("b", 0))] == [0, 1, 2]
    w.close()
    with path.open("ab") as f:
        f.write(b'{"prompt_id": "b", "sample": 1, "outp')  # the process died mid-write
    again = SampleWriter(path)
    assert again.repaired_bytes > 0 and again.done == {("a", 0), ("a", 1), ("b", 0)}
    assert [r["sample"] for r in again.records] == [0, 1, 0]
    with pytest.raises(ValueError, match="already written"):
        again.write(rec("a", 1))
    assert again.write(rec("b", 1)) == 3
    again.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["prompt_id"], x["sample"]) for x in lines] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_damage_in_the_middle_is_reported_not_skipped(tmp_path: Path) -> None:
    path = tmp_path / "pod-0.jsonl"
    path.write_text(json.dumps(rec("a", 0)) + "\n{oops\n" + json.dumps(rec("a", 1)) + "\n")
    with pytest.raises(UserError, match=r"pod-0.jsonl:2: not a sample record"):
        SampleWriter(path)
    path.write_text(json.dumps(rec("a", 0)) + "\n" + json.dumps(rec("a", 0)) + "\n")
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
