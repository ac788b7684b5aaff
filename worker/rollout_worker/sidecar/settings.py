"""The sidecar's settings, every one from the environment as ``ROLLOUT_SIDECAR_<NAME>`` (pydantic-settings).

:class:`SidecarFields` holds the fields, their bounds and documentation and the cross-field rules;
:class:`SidecarSettings` reads them from the environment. :func:`settings_env` is the pure way back: plain
values -> the environment a sidecar process needs, validated, for ``rolloutctl run`` and the operator.
Lists (``stop``) are JSON in the environment: ``ROLLOUT_SIDECAR_STOP='["\\n\\n", "</answer>"]'``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_worker.api.sidecar import SamplingSettings, Stops, output_file
from rollout_worker.config.env_settings import describe as describe_settings
from rollout_worker.config.env_settings import env_name as env_var
from rollout_worker.config.env_settings import load
from rollout_worker.data.files import MAX_SECRET_BYTES, read_text
from rollout_worker.errors import FieldAt, UserError, user_error

ENV_PREFIX = "ROLLOUT_SIDECAR_"


class SidecarFields(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # the engine
    engine_url: str = Field(
        "http://127.0.0.1:30000",
        pattern=r"^https?://[^\s/]+(:\d+)?/?$",
        description="Base URL of the pod's engine server (`rolloutctl serve`).",
    )
    engine_key: SecretStr | None = Field(None, description="The engine's API key, if it has one.")
    engine_key_file: Path | None = Field(None, description="File holding the engine's API key.")
    mode: Literal["job", "service"] = Field(
        "job",
        description="job: submit the shard's prompts and write the samples; service: an external client "
        "sends requests straight to the engine, the sidecar only reports and forwards plans.",
    )
    # the job's work (job mode)
    prompts_path: Path | None = Field(None, description="Prompts file: JSONL, or Parquet in VeRL's format.")
    prompts_limit: int | None = Field(None, ge=1, description="Use only the first N prompts of the file.")
    model_dir: Path | None = Field(
        None, description="Checkpoint directory, for its chat template (chat-message prompts need it)."
    )
    pod_index: int = Field(0, ge=0, description="This pod's index; its shard is prompts[pod_index::pods].")
    pods: int = Field(1, ge=1, le=1024, description="Pods in the job.")
    samples_per_prompt: int = Field(1, ge=1, le=1024, description="Samples drawn per prompt.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k cut; -1 = off.")
    max_new_tokens: int = Field(1024, ge=1, description="Most tokens generated per sample.")
    seed: int = Field(
        0, ge=0, lt=2**63, description="Job seed; each sample's seed is a hash of (seed, prompt id, index)."
    )
    stop: Stops = Field(default_factory=list, description="Stop strings (JSON list).")
    ignore_eos: bool = Field(
        False, description="Generate past the end-of-sequence token (replaying recorded lengths, benchmarks)."
    )
    output_dir: Path | None = Field(None, description="Directory of the pod's output file pod-{index}.jsonl.")
    # the sidecar's own API
    token: SecretStr | None = Field(None, description="Bearer token every route but health/metrics needs.")
    token_file: Path | None = Field(None, description="File holding that bearer token.")
    host: str = Field("127.0.0.1", min_length=1, description="Address both ports listen on.")
    port: int = Field(8080, ge=1, le=65535, description="API port: progress, state, samples, health.")
    admin_port: int = Field(
        8081, ge=1, le=65535, description="Admin port: PUT /v1/plan, POST /v1/reconfigure."
    )
    max_in_flight: int = Field(64, ge=1, le=4096, description="Most samples in flight to the engine at once.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Request bodies over this get 413.")
    # timing
    poll_seconds: float = Field(0.5, gt=0.0, le=60.0, description="How often the engine's state is read.")
    engine_wait_seconds: float = Field(
        600.0, gt=0.0, description="At start, how long to wait for the engine to become healthy."
    )
    engine_timeout_seconds: float = Field(
        60.0, gt=0.0, description="Once it served, exit non-zero when the engine is unreachable this long."
    )
    retry_seconds: float = Field(0.5, gt=0.0, le=60.0, description="Pause before a sample is sent again.")
    exit_when_done: bool = Field(False, description="Job mode: exit 0 once every sample is written.")
    exit_with_parent: bool = Field(
        False,
        description="Stop (as on SIGTERM) when the process that started the sidecar ends, SIGKILL included.",
    )
    access_log: bool = Field(False, description="Log one line per HTTP request.")

    @model_validator(mode="after")
    def _rules(self) -> SidecarFields:
        if self.pod_index >= self.pods:
            raise FieldAt(("pod_index",), f"{self.pod_index} must be below pods ({self.pods})")
        if self.mode == "job":
            for name in ("prompts_path", "output_dir"):
                if getattr(self, name) is None:
                    raise FieldAt((name,), "job mode needs it")
        for name in ("token", "engine_key"):  # set but empty: every request would be refused, or unsigned
            secret = getattr(self, name)
            if secret is not None and not secret.get_secret_value().strip():
                raise FieldAt((name,), "is empty: give the secret, or leave the variable unset")
        if (self.token is None) == (self.token_file is None):
            raise FieldAt(("token",), "give exactly one of token or token_file (the sidecar's bearer token)")
        if self.engine_key is not None and self.engine_key_file is not None:
            raise FieldAt(("engine_key",), "give at most one of engine_key or engine_key_file")
        if self.port == self.admin_port:
            raise FieldAt(("admin_port",), f"must differ from port (both {self.port})")
        return self

    @property
    def output_file(self) -> Path | None:
        return None if self.output_dir is None else output_file(self.output_dir, self.pod_index)

    @property
    def sampling(self) -> SamplingSettings:
        """The job's sampling, from the settings of the same names."""
        return SamplingSettings.model_validate(
            {name: getattr(self, name) for name in SamplingSettings.model_fields}
        )

    def bearer_token(self) -> str:
        """The sidecar's own token (read from its file when given so)."""
        return _secret(self.token, self.token_file, "token_file") or ""

    def engine_secret(self) -> str | None:
        """The engine's API key (read from its file when given so), or None."""
        return _secret(self.engine_key, self.engine_key_file, "engine_key_file")


class SidecarSettings(SidecarFields, BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")


def env_name(field: str) -> str:
    return env_var(ENV_PREFIX, field)


def _secret(value: SecretStr | None, path: Path | None, field: str) -> str | None:
    if value is not None:
        return value.get_secret_value().strip()
    if path is None:
        return None
    text = read_text(path, env_name(field), field.replace("_", " "), MAX_SECRET_BYTES).strip()
    if not text:
        raise UserError(f"{path} is empty", env_name(field))
    return text


def load_settings() -> SidecarSettings:
    """The settings from the environment; errors name the variable (``ROLLOUT_SIDECAR_POD_INDEX``). An
    unknown ``ROLLOUT_SIDECAR_*`` variable (a typo) is refused, not ignored."""
    return load(SidecarSettings, ENV_PREFIX, "rolloutctl sidecar")


def settings_env(**fields: Any) -> dict[str, str]:
    """The environment (``ROLLOUT_SIDECAR_*``) of a sidecar with these settings, validated as the sidecar
    will validate it (errors name the field). Pure: reads neither the environment nor any file. Only the
    fields given are set; the sidecar's defaults fill the rest."""
    try:
        SidecarFields.model_validate(fields)
    except ValidationError as exc:
        raise user_error(exc, lambda path: str(path[0])) from None
    env: dict[str, str] = {}
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | tuple | dict):
            text = json.dumps(list(value) if isinstance(value, tuple) else value)
        else:
            text = str(value)
        env[env_name(name)] = text
    return env


def describe() -> list[tuple[str, str, str]]:
    """(variable, default, description) of every setting, for ``rolloutctl sidecar --help``."""
    return describe_settings(ENV_PREFIX, SidecarFields)
