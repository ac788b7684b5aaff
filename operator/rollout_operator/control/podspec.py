"""What every pod of a job runs, whoever starts it (``rolloutctl run``'s local processes or the operator's
Kubernetes pods): the engine server's arguments and the sidecar's settings that follow from the job spec.
Pure; the caller adds where things listen and where the secrets are."""

from __future__ import annotations

from typing import Any

from rollout_worker.config.engine_settings import settings_args
from rollout_worker.scheduling.costs import COSTS_ENV, CostModel, costs_json
from rollout_worker.scheduling.layout import Layout

from rollout_operator.api.job import RolloutJobSpec


def engine_args(spec: RolloutJobSpec, layout: Layout, candidates: list[Layout]) -> list[str]:
    """``rolloutctl serve``'s arguments for the job's model, ranks, layouts and engine settings (every
    setting, derived from the settings model)."""
    return [
        "--model", spec.model.path, "--ranks", str(spec.gpus_per_pod), "--layout", str(layout),
        "--candidates", ",".join(map(str, candidates)), "--dtype", spec.model.dtype,
        *settings_args(spec.engine),
    ]  # fmt: skip


def engine_env(costs: CostModel | None) -> dict[str, str]:
    """The engine's environment beyond its arguments: the planner's switch-cost model, so the engine
    prices a switch (and picks its KV method) as the planner does."""
    return {} if costs is None else {COSTS_ENV: costs_json(costs)}


def sidecar_fields(spec: RolloutJobSpec, index: int) -> dict[str, Any]:
    """The sidecar settings (``SidecarFields``) the job decides for pod ``index``: its mode, shard and
    sampling. Output and listening addresses are the caller's."""
    prompts = spec.prompts
    return {
        "mode": spec.mode,
        "prompts_path": prompts.path if prompts else None,
        "prompts_limit": prompts.limit if prompts else None,
        "model_dir": spec.model.path,
        "pod_index": index,
        "pods": spec.pods,
        "samples_per_prompt": spec.samples_per_prompt,
        **spec.sampling.model_dump(),  # the sidecar's settings of the same names (SidecarFields.sampling)
        "output_dir": spec.output.path if spec.mode == "job" else None,
    }
