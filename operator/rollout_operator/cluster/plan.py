"""What the operator checks before it makes anything for a RolloutJob, beyond the CRD's schema, and what it
decides for the pods: pure functions of the object and the profile. A refusal names the field.

On a cluster the operator never reads the model or the prompts (they are on the pods' volumes), so:
- the layouts come from ``parallelism.candidates``, else from the profile's model shape (heads and
  vocabulary), else (a static job with no profile) only the starting layout;
- ``initialLayout: auto`` starts at the smallest TP among the candidates (throughput first: the planner
  consolidates the long tail later);
- an adaptive job needs a profile (``parallelism.profile``), found by the operator (``profiles``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError
from rollout_profiler.profile import Profile
from rollout_worker.api.errors import field_errors
from rollout_worker.api.layout import Layout, candidate_layouts, tp_problem

from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.api.manifest import dotted
from rollout_operator.cluster.manifests import PodPlan

MAX_NAME = 63  # a pod's hostname is a DNS label
RESERVED_ENV_PREFIXES = ("ROLLOUT_",)


@dataclass(frozen=True)
class Refusal:
    """Why a job cannot run, at which field (``spec.parallelism.profile``)."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def parse_spec(raw: dict[str, Any]) -> RolloutJobSpec | Refusal:
    """The spec as the model reads it (the CRD's CEL rules, checked again: an API server without CEL, or
    a job stored before the rules existed)."""
    try:
        return RolloutJobSpec.model_validate(raw)
    except ValidationError as exc:
        path, msg = field_errors(exc, 1)[0]
        return Refusal(dotted(("spec", *path)), msg)


def check_cluster_fields(name: str, spec: RolloutJobSpec) -> Refusal | None:
    """What only a cluster run needs: pod names, volumes, resources."""
    longest = f"{name}-{spec.pods - 1}"
    if len(longest) > MAX_NAME:
        return Refusal("metadata.name", f"pod name {longest!r} would exceed {MAX_NAME} characters")
    volumes = {v.get("name") for v in spec.pod.volumes}
    for i, mount in enumerate(spec.pod.volume_mounts):
        if mount.get("name") not in volumes:
            return Refusal(f"spec.pod.volumeMounts[{i}].name", f"no volume named {mount.get('name')!r}")
        if not mount.get("mountPath"):
            return Refusal(f"spec.pod.volumeMounts[{i}].mountPath", "required")
    for kind, values in spec.pod.resources.items():
        if kind not in ("requests", "limits") or not isinstance(values, dict):
            return Refusal(f"spec.pod.resources.{kind}", "only requests and limits (a map each)")
        if spec.pod.gpu_resource_name in values:
            return Refusal(
                f"spec.pod.resources.{kind}",
                f"{spec.pod.gpu_resource_name} is set by the operator from gpusPerPod",
            )
    return None


def _candidates(spec: RolloutJobSpec, profile: Profile | None) -> list[Layout] | Refusal:
    g = spec.gpus_per_pod
    given = spec.candidate_layouts()
    if profile is None:
        if given is not None:
            return given
        init = spec.parallelism.initial_layout
        return [Layout(g, 1) if init == "auto" else init]
    m = profile.model
    if given is None:
        return candidate_layouts(g, m.num_heads, m.num_kv_heads, m.vocab_size)
    for i, lay in enumerate(given):
        why = tp_problem(lay.tp, m.num_heads, m.num_kv_heads, m.vocab_size)
        if why:
            return Refusal(f"spec.parallelism.candidates[{i}]", why)
    return given


def plan_pods(spec: RolloutJobSpec, profile: Profile | None, listen: Any = "all") -> PodPlan | Refusal:
    """The pods' starting layout, candidates and cost model. ``profile``: the job's (None when it names
    none, allowed only for a static job)."""
    par = spec.parallelism
    if profile is None and par.policy == "adaptive":
        return Refusal(
            "spec.parallelism.profile",
            "an adaptive job needs a profile on a cluster (a name in the operator's database or a JSON file "
            "in its profiles directory); or set parallelism.policy: static",
        )
    if profile is not None and profile.device_count != spec.gpus_per_pod:
        return Refusal(
            "spec.parallelism.profile",
            f"profile {profile.name} was measured on {profile.device_count} devices, the job has "
            f"gpusPerPod {spec.gpus_per_pod}",
        )
    cands = _candidates(spec, profile)
    if isinstance(cands, Refusal):
        return cands
    if not cands:
        return Refusal("spec.gpusPerPod", "no layout of this many ranks fits the profile's model")
    cands = sorted(set(cands), key=lambda x: x.tp)
    init = par.initial_layout
    layout = cands[0] if init == "auto" else init
    if layout not in cands:
        among = ", ".join(map(str, cands))
        return Refusal("spec.parallelism.initialLayout", f"{layout} is not among {among}")
    costs = None if profile is None else {key: float(v) for key, v in asdict(profile.costs).items()}
    return PodPlan(layout, tuple(cands), costs, listen)
