"""The order a job's sidecar sends its samples in (the job's queue as built, no engine): prompt by prompt, a
prompt's samples together (a GRPO group, sharing the prompt's pages while they run); and a sample already
in the output file is not sent again."""

from __future__ import annotations

from pathlib import Path

from rollout_worker.api.sampling import sample_seed
from rollout_worker.api.sidecar import Sample
from rollout_worker.data.prompts import Prompt
from rollout_worker.sidecar.engine_client import EngineClient
from rollout_worker.sidecar.job_mode import Job
from rollout_worker.sidecar.metrics import SidecarMetrics
from rollout_worker.sidecar.outputs import SampleWriter
from rollout_worker.sidecar.settings import SidecarFields
from rollout_worker.sidecar.watch import EngineWatch


def test_samples_go_out_prompt_by_prompt_and_written_ones_not_again(tmp_path: Path) -> None:
    settings = SidecarFields(
        token="t", prompts_path=tmp_path / "p.jsonl", output_dir=tmp_path, samples_per_prompt=3, seed=5
    )
    prompts = [Prompt(pid, f"what is {pid}?", None) for pid in ("a", "b", "c")]
    writer = SampleWriter(tmp_path / "pod-0.jsonl")
    writer.write(
        Sample(
            prompt_id="b",
            sample=0,
            prompt="what is b?",
            output_text="x",
            output_ids=[1],
            output_logprobs=[-1.0],
            finish_reason={"type": "length", "length": 1},
            prompt_tokens=3,
            completion_tokens=1,
            layouts=["1x1"],
            weight_version="default",
            sampling_seed=sample_seed(5, "b", 0),
        )
    )
    client = EngineClient("http://127.0.0.1:9", None, 4)  # never called: nothing is sent here
    watch = EngineWatch(client, 1.0, 1.0, 1.0)
    job = Job(settings, prompts, writer, client, watch, SidecarMetrics())
    try:
        order = [(p.id, i) for p, i in job.queue]
    finally:
        job.close()
    assert order == [("a", 0), ("a", 1), ("a", 2), ("b", 1), ("b", 2), ("c", 0), ("c", 1), ("c", 2)]
