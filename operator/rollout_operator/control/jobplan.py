"""What a RolloutJob's pods start as and how they are planned: one pure decision that ``rolloutctl run``
(local processes) and the operator (Kubernetes pods) both call, so the same job starts the same way
whoever runs it. Each caller adds only what it alone knows (the model's config on this machine, the
number of prompts it has read).

- candidates: ``parallelism.candidates`` (each checked against the model's heads and vocabulary), else
  every layout the model can run on ``gpusPerPod`` ranks;
- the planner's policy: the job's margin, cooldown and method over the candidates (a static job: its
  starting layout alone);
- the starting layout: ``initialLayout``, or for ``auto`` the planner's choice (:func:`choose_start`)
  for the pod's expected requests; the smallest TP when there is no profile to predict with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import choose_start
from rollout_profiler.planning.policy import PlannerPolicy, PodSnapshot, ReplicaState
from rollout_profiler.planning.predictor import fit
from rollout_profiler.profile import Profile
from rollout_worker.scheduling.layout import Layout, candidate_layouts, tp_problem

from rollout_operator.api.job import RolloutJobSpec

WAITING_PROMPT_LEN = 128  # the prompt length the start's prediction assumes (prompts are not read here)


@dataclass(frozen=True)
class Refusal:
    """Why a job cannot run, at which field (``spec.parallelism.profile``)."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class ModelDims:
    """What the layouts depend on: attention heads, KV heads and vocabulary."""

    num_heads: int
    num_kv_heads: int
    vocab_size: int

    @classmethod
    def of_profile(cls, profile: Profile) -> ModelDims:
        m = profile.model
        return cls(m.num_heads, m.num_kv_heads, m.vocab_size)


@dataclass(frozen=True)
class JobPlan:
    """How a job's pods start and are planned."""

    layout: Layout
    candidates: tuple[Layout, ...]
    policy: PlannerPolicy
    latency: LatencyModel | None  # None: no profile (a static job)


def candidates_of(spec: RolloutJobSpec, dims: ModelDims | None) -> list[Layout] | Refusal:
    """The job's candidate layouts, smallest TP first. ``dims`` None: the model is unknown (a static job
    without a profile on a cluster): the given candidates, else the starting layout alone."""
    g, given = spec.gpus_per_pod, spec.candidate_layouts()
    if dims is None:
        if given is not None:
            return given
        init = spec.parallelism.initial_layout
        return [Layout(g, 1) if init == "auto" else init]
    if given is None:
        found = candidate_layouts(g, dims.num_heads, dims.vocab_size)
        return found or Refusal("spec.gpusPerPod", "no layout of this many ranks fits the model")
    for i, lay in enumerate(given):
        why = tp_problem(lay.tp, dims.num_heads, dims.vocab_size)
        if why:
            return Refusal(f"spec.parallelism.candidates[{i}]", why)
    return given


def policy_of(
    spec: RolloutJobSpec, candidates: tuple[Layout, ...], layout: Layout, policy: str | None = None
) -> PlannerPolicy:
    """The planner's settings for the job (a static job may only stay where it starts). ``policy``
    overrides ``parallelism.policy`` (``rolloutctl run --policy``). The planner's memory model holds what
    the job's engines will: ``engine.maxBatch`` running requests and a pool of ``engine.pool_tokens`` KV
    tokens per replica, whatever its TP size."""
    par = spec.parallelism
    pool = spec.engine.pool_tokens
    return PlannerPolicy(
        candidates=candidates if (policy or par.policy) == "adaptive" else (layout,),
        margin=par.margin,
        cooldown_s=par.cooldown_seconds,
        method=par.method,
        max_batch_per_replica=spec.engine.max_batch,
        kv_tokens_per_replica=tuple((lay.tp, pool) for lay in sorted(set(candidates), key=lambda c: c.tp)),
    )


def requests_per_pod(spec: RolloutJobSpec, prompts: int | None) -> int | None:
    """Requests a pod expects at the start: its share of ``prompts`` x samples (``prompts`` None: the
    job's ``prompts.limit`` when it sets one, else unknown)."""
    if prompts is None:
        prompts = spec.prompts.limit if spec.prompts is not None else None
    if prompts is None:
        return None
    return max(1, -(-prompts * spec.samples_per_prompt // spec.pods))


def start_layout(
    spec: RolloutJobSpec, candidates: list[Layout], latency: LatencyModel | None, requests: int | None
) -> Layout | Refusal:
    """``initialLayout`` when given, else the planner's choice for ``requests`` waiting requests (None:
    a full pod, ``maxBatch`` per replica of the smallest TP); the smallest TP without a profile."""
    init = spec.parallelism.initial_layout
    if init != "auto":
        lay = init
        if lay not in candidates:
            among = ", ".join(map(str, candidates))
            return Refusal("spec.parallelism.initialLayout", f"{lay} is not among {among}")
        return lay
    if latency is None:
        return candidates[0]
    n = requests if requests is not None else spec.engine.max_batch * candidates[0].replicas
    waiting = ReplicaState(np.zeros(0), np.zeros(0), np.zeros(0), n)
    snap = PodSnapshot(
        candidates[0],
        (waiting,),
        (True,) * spec.gpus_per_pod,
        0,
        0.0,
        WAITING_PROMPT_LEN,
        spec.sampling.max_new_tokens,
    )
    pol = PlannerPolicy(candidates=tuple(candidates), margin=spec.parallelism.margin)
    return choose_start(latency, snap, pol, fit(np.zeros(0), np.zeros(0), np.zeros(0)))


def plan_job(
    spec: RolloutJobSpec,
    profile: Profile | None,
    dims: ModelDims | None,
    requests: int | None,
    policy: str | None = None,
) -> JobPlan | Refusal:
    """The whole decision: candidates, starting layout and policy. ``dims``: the model's (from its config
    when the caller can read it, else from the profile); ``policy`` overrides ``parallelism.policy``."""
    if dims is None and profile is not None:
        dims = ModelDims.of_profile(profile)
    cands = candidates_of(spec, dims)
    if isinstance(cands, Refusal):
        return cands
    cands = sorted(set(cands), key=lambda x: x.tp)
    latency = LatencyModel(profile) if profile is not None else None
    layout = start_layout(spec, cands, latency, requests)
    if isinstance(layout, Refusal):
        return layout
    return JobPlan(layout, tuple(cands), policy_of(spec, tuple(cands), layout, policy), latency)
