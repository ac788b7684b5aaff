"""The operator's settings, each from the environment as ``ROLLOUT_OPERATOR_<NAME>`` (pydantic-settings). The
chart's Deployment sets them from values.yaml; ``rolloutctl operator --help`` lists them with their defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from rollout_worker.config.env_settings import describe as describe_settings
from rollout_worker.config.env_settings import load

ENV_PREFIX = "ROLLOUT_OPERATOR_"


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    namespaces: list[str] = Field(
        default_factory=list,
        description="Namespaces to watch, a JSON list (`--namespace` adds to it); empty: the whole cluster.",
    )
    database_url: SecretStr | None = Field(
        None,
        description="SQL database of profiles, jobs and decisions (default: $ROLLOUT_DB_URL, else SQLite "
        "under $ROLLOUT_HOME). PostgreSQL when the operator runs more than one replica.",
    )
    profiles_dir: Path | None = Field(
        None,
        description="Directory of profile JSON files a job may name by file name in "
        "spec.parallelism.profile (the image ships the project's under /opt/elastic-rollout/profiles).",
    )
    tick_seconds: float = Field(
        1.0, gt=0.0, le=60.0, description="How often each job's pods are polled and the planner runs."
    )
    sidecar_timeout_seconds: float = Field(
        5.0, gt=0.0, le=120.0, description="Timeout of each request to a sidecar."
    )
    degraded_after_seconds: float = Field(
        10.0, gt=0.0, description="A pod's sidecar unreachable this long marks the job Degraded."
    )
    pod_listen: Literal["all", "pod-ip"] = Field(
        "all",
        description="Where the pods' servers bind: all (0.0.0.0; kubectl port-forward works) or pod-ip "
        "(only the pod's own address, as the tests' local kubelet needs).",
    )
    peering: str | None = Field(
        None,
        description="kopf peering object: with several operator replicas, only the one with the highest "
        "priority acts (the chart sets it when replicas > 1). Unset: standalone.",
    )
    priority: int | None = Field(
        None,
        description="This replica's peering priority (kopf pauses every operator below the highest). "
        "Unset: a random one per process, so that of a Deployment's replicas exactly one acts; another "
        "takes over about a minute after it stops.",
    )
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics (0: off).")
    health_port: int = Field(8080, ge=0, le=65535, description="kopf's liveness endpoint /healthz (0: off).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


def load_settings() -> OperatorSettings:
    """The settings from the environment; errors name the variable. An unknown ``ROLLOUT_OPERATOR_*``
    variable (a typo) is refused, not ignored."""
    return load(OperatorSettings, ENV_PREFIX, "rolloutctl operator")


def describe() -> list[tuple[str, str, str]]:
    """(variable, default, description) of every setting, for ``--list-settings`` and the docs."""
    return describe_settings(ENV_PREFIX, OperatorSettings)
