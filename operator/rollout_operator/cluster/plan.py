"""What the operator checks before it makes anything for a RolloutJob, beyond the CRD's schema, and what it
decides for the pods: pure functions of the object and the profile. A refusal names the field.

On a cluster the operator never reads the model or the prompts (they are on the pods' volumes), so the
job's plan (:func:`rollout_operator.control.jobplan.plan_job`, the one ``rolloutctl run`` makes too) takes
the model's heads and vocabulary from the profile, and the expected requests from ``prompts.limit``; an
adaptive job needs a profile (``parallelism.profile``), found by ``control.profiles``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from rollout_profiler.profile import Profile
from rollout_worker.errors import field_errors

from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.api.manifest import dotted
from rollout_operator.cluster.manifests import PodPlan
from rollout_operator.control.jobplan import JobPlan, Refusal, plan_job, requests_per_pod

__all__ = ["Refusal", "check_cluster_fields", "parse_spec", "plan_pods"]

MAX_NAME = 63  # a pod's hostname is a DNS label
RESERVED_ENV_PREFIXES = ("ROLLOUT_",)


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


def plan_pods(
    spec: RolloutJobSpec, profile: Profile | None, listen: Any = "all"
) -> tuple[PodPlan, JobPlan] | Refusal:
    """The pods' starting layout, candidates and cost model, and the job's plan. ``profile``: the job's
    (None when it names none, allowed only for a static job)."""
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
    plan = plan_job(spec, profile, None, requests_per_pod(spec, None))
    if isinstance(plan, Refusal):
        return plan
    costs = None if profile is None else profile.costs
    return PodPlan(plan.layout, plan.candidates, costs, listen), plan
