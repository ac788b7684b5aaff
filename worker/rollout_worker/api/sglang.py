"""SGLang's native request bodies, as real clients send them (SGLang 0.4.6 / 0.5 field names and defaults).

Every key of SGLang's ``GenerateReqInput`` and ``SamplingParams`` (``sglang_surface.json``, see
``rollout_worker.api.neutral_keys``) is accepted: a key this engine does not implement (constrained decoding,
penalties, images, LoRA, ...) only when absent or at its neutral value, anything else refused with the key
named. A ``null`` is the key's default, as in SGLang.
Types are strict, as SGLang's msgspec structs are: an integer must be a JSON integer (not ``"5"`` nor
``5.0``), a number a JSON number (an integer will do, ``true`` will not), a flag ``true`` or ``false``.
Every string of a body must be Unicode text (a lone surrogate such as ``"\ud800"`` is refused, naming
where it is).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rollout_worker.api.load_format import DiskFormat, DistributedFormat, TensorFormat
from rollout_worker.api.neutral_keys import drop_nulls, sglang_neutral, strip_neutral
from rollout_worker.api.sampling import Sampling
from rollout_worker.errors import FieldAt, FieldPath


def _not_text(data: Any, path: FieldPath = ()) -> FieldPath | None:
    """Where in a parsed JSON value a string (a value or a key) is not Unicode text, or None."""
    if isinstance(data, str):
        return None if data.isascii() or _encodes(data) else path
    if isinstance(data, dict):
        for key, value in data.items():
            where = (*path, key)
            if isinstance(key, str) and not _encodes(key):
                return where
            if isinstance(value, str | list | dict) and (bad := _not_text(value, where)) is not None:
                return bad
    elif isinstance(data, list) and not (data and isinstance(data[0], int | float)):
        # (a list of numbers, such as input_ids, is not walked: a string among them fails validation anyway)
        for i, value in enumerate(data):
            if isinstance(value, str | list | dict) and (bad := _not_text(value, (*path, i))) is not None:
                return bad
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class Body(BaseModel):
    """A request body: strict types, unknown keys refused, every string Unicode text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        bad = _not_text(data)
        if bad is not None:
            raise FieldAt(bad, "not Unicode text (a lone surrogate escape such as \\ud800)")
        return data


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, also for max_new_tokens: null
# The requests one /generate body may ask for (prompts x n): each is work for the server before the first
# token, so a short body must not ask for an unbounded number; a larger batch is sent as several bodies.
MAX_REQUESTS_PER_BODY = 1024
StartLen = Annotated[int, Field(ge=-1, description="-1 = no prompt logprobs.")]
TopCount = Annotated[int, Field(ge=0)]


def check_stops(v: str | list[str] | None) -> str | list[str] | None:
    if any(s == "" for s in ([v] if isinstance(v, str) else v or [])):
        raise ValueError("stop strings must not be empty")
    return v


def check_lengths(least: int, info: ValidationInfo, most_name: str) -> int:
    """At least ``least`` new tokens cannot be more than at most ``most_name`` (None: SGLang's default);
    a field validator of the least, declared after the most."""
    most = info.data.get(most_name, DEFAULT_MAX_NEW_TOKENS)
    cap = DEFAULT_MAX_NEW_TOKENS if most is None else most
    if least > cap:
        raise ValueError(f"{least} is above {most_name} ({cap})")
    return least


class SamplingParams(BaseModel):
    """``sampling_params`` of ``/generate`` (SGLang's names and defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(128, ge=0, description="None = 128. 0 = prefill only.")
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=64)
    sampling_seed: int | None = Field(None, ge=0, lt=2**63)

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        return strip_neutral(drop_nulls(data), NEUTRAL_SAMPLING)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_stops(v)

    @field_validator("min_new_tokens")
    @classmethod
    def _lengths(cls, v: int, info: ValidationInfo) -> int:
        return check_lengths(v, info, "max_new_tokens")

    @property
    def max_tokens(self) -> int:
        return DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def engine(self, seed: int) -> Sampling:
        """What the engine's ranks draw with, seeded ``seed`` (SGLang's ``top_k`` -1 is the engine's 0: off).
        The other fields shape the request around the draw (lengths, stops, text), see ``server.convert``."""
        return Sampling(self.temperature, self.top_p, max(self.top_k, 0), self.min_p, seed)


class GenerateRequest(Body):
    """``POST /generate``: one request, or a batch when ``text`` / ``input_ids`` is a list of prompts."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: StartLen | list[StartLen] = -1
    top_logprobs_num: TopCount | list[TopCount] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        return strip_neutral(drop_nulls(data), NEUTRAL_GENERATE)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        where = "text" if self.text is not None else "input_ids"
        if self.text == []:  # (``input_ids: []`` is one empty prompt, refused as such)
            raise FieldAt((where,), "an empty batch: give at least one prompt")
        if (count := self.requests) > MAX_REQUESTS_PER_BODY:
            raise FieldAt(
                (where,),
                f"{self.prompt_count} prompt(s) and their samples (n) ask for {count} requests, more than "
                f"the {MAX_REQUESTS_PER_BODY} one body may; send the batch as several bodies",
            )
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    @property
    def prompt_count(self) -> int:
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts) if self.is_batch and prompts is not None else 1

    @property
    def requests(self) -> int:
        """How many requests the body asks for: one per prompt and sample (``n``); a prompt without
        sampling parameters of its own (a list too short, refused later) counts once."""
        sp, count = self.sampling_params, self.prompt_count
        if isinstance(sp, list):
            return sum(p.n for p in sp[:count]) + max(count - len(sp), 0)
        return count * (1 if sp is None else sp.n)

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        ids = self.input_ids or []
        return [list(x) for x in ids] if self.is_batch else [list(ids)]  # type: ignore[arg-type]

    def at(self, value: Any, i: int, default: Any) -> Any:
        """Per-prompt value of a field that may be given once or as a list."""
        if isinstance(value, list):
            if i >= len(value):
                raise ValueError(f"a list field has {len(value)} item(s) for {self.prompt_count} prompt(s)")
            return value[i]
        return default if value is None else value


# what this engine does not implement of SGLang's surface (``sglang_surface.json``), at neutral values only;
# log_metrics false (health checks send it) and no_logs true change nothing here: no request is logged
NEUTRAL_SAMPLING = sglang_neutral("sampling", SamplingParams.model_fields)
NEUTRAL_GENERATE = sglang_neutral(
    "generate", GenerateRequest.model_fields, {"log_metrics": (False,), "no_logs": (True,)}
)


class AbortRequest(Body):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


class AddCorpusRequest(Body):
    """SGLang's ``/add_external_corpus``: documents (text) for speculative decoding to draft from."""

    model_config = ConfigDict(extra="ignore")

    corpus_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    documents: Annotated[list[str], Field(min_length=1)]


class RemoveCorpusRequest(Body):
    model_config = ConfigDict(extra="ignore")

    corpus_id: Annotated[str, Field(min_length=1, max_length=256)]


class PauseRequest(Body):
    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsRequest(Body):
    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(min_length=1)
    load_format: DiskFormat = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True

    @field_validator("model_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError("a path cannot contain a NUL character")
        return v


class UpdateTensorRequest(Body):
    """``POST /update_weights_from_tensor`` (``rollout_worker.server.tensor_update`` reads the tensors)."""

    model_config = ConfigDict(extra="ignore")

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: TensorFormat = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsGroupRequest(Body):
    """``POST /init_weights_update_group``: every engine rank r joins the trainer's group as
    ``rank_offset + r`` (the trainer is rank 0)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "nccl"
    timeout: float = Field(
        300.0,
        gt=0,
        le=3600,
        description="Seconds the ranks wait for the trainer before the join fails (ours; not in SGLang).",
    )


class DistributedUpdateRequest(Body):
    """``POST /update_weights_from_distributed``: the trainer broadcasts these full tensors, in order (one
    broadcast each, or one of them all with ``load_format: "flattened_bucket"``)."""

    model_config = ConfigDict(extra="ignore")

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)
    group_name: str = Field("weight_update_group", min_length=1)
    load_format: DistributedFormat = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsGroupRequest(Body):
    model_config = ConfigDict(extra="ignore")

    group_name: str = Field("weight_update_group", min_length=1)


MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
MEMORY_TAGS: tuple[MemoryTag, ...] = get_args(MemoryTag)


class MemoryRequest(Body):
    """``/release_memory_occupation``, ``/resume_memory_occupation``; no tags: all of them."""

    model_config = ConfigDict(extra="ignore")

    tags: list[MemoryTag] | None = None


class WeightVersionRequest(Body):
    """``POST /update_weight_version``: name the weights being served (SGLang aborts by default)."""

    model_config = ConfigDict(extra="ignore")

    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True
