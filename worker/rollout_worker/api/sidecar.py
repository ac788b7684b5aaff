"""The pod sidecar's HTTP bodies and its sample records (torch-free): the sidecar answers with these models,
and the runner, the operator and the tests parse its answers and its output files with the same ones.

A sample record is one line of ``pod-{index}.jsonl``: the fields of :class:`Sample`, then the prompt's
pass-through fields (VeRL's ``data_source``, ``reward_model``, ``extra_info``, ...) at the top level.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout_worker.api.state import EngineState

Mode = Literal["job", "service"]


class Sample(BaseModel):
    """One finished sample, as written to the pod's output file (one JSON object per line)."""

    model_config = ConfigDict(extra="allow")  # the prompt's pass-through fields

    prompt_id: str
    sample: int = Field(ge=0, description="Sample index of the prompt, 0 .. samplesPerPrompt-1.")
    prompt: str | list[int] = Field(description="The prompt as sent: text (chat template applied) or ids.")
    output_text: str
    output_ids: list[int]
    output_logprobs: list[float | None] = Field(
        description="Log-probability of each output token under the distribution it was drawn from, to 8 "
        "significant digits."
    )
    finish_reason: dict[str, Any] | None = Field(
        description='SGLang\'s: {"type": "stop", "matched": ...} or {"type": "length", "length": N}.'
    )
    prompt_tokens: int
    completion_tokens: int
    layouts: list[str] = Field(description="Every layout DxT the request ran on, in order.")
    weight_version: str
    sampling_seed: int = Field(description="Fixed hash of (sampling.seed, prompt id, sample index).")

    def extra_fields(self) -> dict[str, Any]:
        """The prompt's pass-through fields."""
        return dict(self.model_extra or {})


# Names a prompt's pass-through field must not take (they would overwrite the sample's own fields).
SAMPLE_FIELDS = frozenset(Sample.model_fields)


class SamplesPage(BaseModel):
    """``GET /v1/samples?after=CURSOR&limit=N``: finished samples in the order they were written."""

    samples: list[Sample]
    next: int = Field(description="Pass as `after` to get the samples written after these.")
    total_written: int = Field(description="Samples in the output file so far.")
    done: bool = Field(description="Every sample of the pod's shard is written; nothing more will come.")


class NotSubmitted(BaseModel):
    """Work of the pod's shard the engine has not been given yet (job mode; zeros in service mode)."""

    samples: int = Field(0, description="Samples neither written nor in flight.")
    prompts: int = Field(0, description="Prompts with at least one such sample.")
    max_new_tokens: int = Field(0, description="Each sample's max_new_tokens.")


class SidecarState(BaseModel):
    """``GET /v1/state``: the engine's planner snapshot (``since_step`` passed through) and the work of the
    shard not submitted yet, so a planner counts every request still to come."""

    mode: Mode
    engine: EngineState
    not_submitted: NotSubmitted


class Progress(BaseModel):
    """``GET /v1/progress``: how far the pod is (answered from the sidecar's last engine snapshot)."""

    mode: Mode
    pod_index: int
    pods: int
    samples_done: int = Field(
        description="Job: samples of the shard in the output file. Service: requests the engine finished."
    )
    samples_total: int | None = Field(
        description="Job: prompts of the shard x samplesPerPrompt. Service: null."
    )
    in_flight: int = Field(description="Samples the sidecar has sent to the engine and not had back.")
    not_submitted: int = Field(description="Samples not yet sent (job mode).")
    running: int = Field(description="Requests the engine is decoding (all clients).")
    waiting: int = Field(description="Requests the engine holds but does not run yet (all clients).")
    layout: str | None = Field(description="The engine's layout DxT (null before the first snapshot).")
    tokens_per_s: float = Field(description="Tokens the engine generated per second, last 10 s.")
    reconfigurations: int = Field(description="Layout switches the engine made since it started.")
    weight_version: str | None
    engine_ready: bool = Field(description="The last engine poll succeeded and every rank serves.")
    snapshot_age_s: float | None = Field(description="Age of the engine snapshot behind these figures.")
    elapsed_s: float = Field(description="Seconds since the sidecar started.")
    done: bool = Field(description="Job mode: every sample of the shard is written.")
    output_file: str | None = Field(description="The pod's output file (job mode).")


class Health(BaseModel):
    status: Literal["ok", "ready", "not ready"]
    message: str | None = None
