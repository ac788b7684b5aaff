"""The pod sidecar's HTTP bodies, its sample records and a job's sampling (torch-free): the sidecar answers
with these models and writes its samples through :class:`Sample`; the runner, the operator and the tests
parse its answers with the same models and its output files with :func:`read_samples`.

A sample record is one line of ``pod-{index}.jsonl``: the fields of :class:`Sample`, then the prompt's
pass-through fields (VeRL's ``data_source``, ``reward_model``, ``extra_info``, ...) at the top level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from rollout_worker.api.sampling import sample_seed
from rollout_worker.api.sglang import SamplingParams
from rollout_worker.api.state import EngineState
from rollout_worker.errors import UserError

Mode = Literal["job", "service"]


def _nonempty(stops: list[str]) -> list[str]:
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


Stops = Annotated[list[str], AfterValidator(_nonempty), Field(max_length=64)]  # a job's stop strings


class SamplingSettings(BaseModel):
    """How every sample of the job is drawn."""

    # the RolloutJob's ``spec.sampling`` (the operator's ``SamplingSpec`` is this model with the manifest's
    # camelCase names) and the sidecar's settings of the same names

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Keep the most likely tokens up to this mass.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 = off.")
    max_new_tokens: int = Field(
        1024, ge=1, description="Most tokens per sample (a prompt's own max_new_tokens may lower it)."
    )
    seed: int = Field(
        0, ge=0, lt=2**63, description="Each sample's seed is a fixed hash of (seed, prompt id, index)."
    )
    stop: Stops = Field(default_factory=list, description="Stop strings: a sample ends at the first.")
    ignore_eos: bool = Field(False, description="Generate past end-of-sequence (replaying recorded lengths).")

    def sampling_params(
        self, prompt_id: str, sample: int, max_new_tokens: int | None = None
    ) -> SamplingParams:
        """SGLang's ``sampling_params`` of sample ``sample`` of prompt ``prompt_id``: drawn with that
        sample's own seed (:func:`sample_seed`), at most ``max_new_tokens`` (the prompt's, if it has one)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=min(self.max_new_tokens, max_new_tokens or self.max_new_tokens),
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            sampling_seed=sample_seed(self.seed, prompt_id, sample),
        )


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
    reward: float | None = Field(
        None,
        description="1 when the response's answer (after `####`, else its last number) equals the prompt's "
        "ground truth (`reward_model.ground_truth`, else `ground_truth`), else 0; null without one.",
    )

    @property
    def capped(self) -> bool:
        """Stopped at its max_new_tokens (SGLang's finish reason "length")."""
        return (self.finish_reason or {}).get("type") == "length"

    def extra_fields(self) -> dict[str, Any]:
        """The prompt's pass-through fields."""
        return dict(self.model_extra or {})

    def to_line(self) -> bytes:
        """The sample's line in the output file (compact JSON, the fields in order, then the pass-through
        fields; newline included)."""
        return json.dumps(self.model_dump(), separators=(",", ":")).encode() + b"\n"


# Names a prompt's pass-through field must not take (they would overwrite the sample's own fields).
SAMPLE_FIELDS = frozenset(Sample.model_fields)


def output_file(out_dir: str | Path, pod_index: int) -> Path:
    """Pod ``pod_index``'s output file in ``out_dir``."""
    return Path(out_dir) / f"pod-{pod_index}.jsonl"


def output_files(out_dir: str | Path) -> list[Path]:
    """Every pod's output file in ``out_dir``, in name order."""
    return sorted(Path(out_dir).glob("pod-*.jsonl"))


def parse_samples(data: bytes, path: str | Path) -> list[Sample]:
    """The samples of one output file's bytes, in file order. Only whole lines count: bytes after the last
    newline are a write cut short (the sidecar cuts them when it resumes). A line that is not a sample is
    damage, reported with the file and line (UserError), never skipped."""
    samples: list[Sample] = []
    for n, line in enumerate(data[: data.rfind(b"\n") + 1].splitlines(), start=1):
        try:
            samples.append(Sample.model_validate(json.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(
                f"{path}:{n}: not a sample record ({type(exc).__name__}); the file is damaged"
            ) from None
        except ValidationError as exc:
            err = exc.errors()[0]
            why = f"{'.'.join(map(str, err['loc'])) or 'line'}: {err['msg']}"
            raise UserError(f"{path}:{n}: not a sample record ({why}); the file is damaged") from None
    return samples


def read_samples(path: str | Path) -> list[Sample]:
    """Every whole sample of one output file ``pod-{index}.jsonl`` (see :func:`parse_samples`)."""
    return parse_samples(Path(path).read_bytes(), path)


def read_outputs(out_dir: str | Path) -> list[Sample]:
    """Every whole sample of every pod's output file in ``out_dir`` (files in name order)."""
    return [s for f in output_files(out_dir) for s in read_samples(f)]


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
