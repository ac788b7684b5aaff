"""The server's settings: ``rolloutctl serve`` flags map onto them; each can also come from the
environment as ``ROLLOUT_SERVE_<NAME>`` (e.g. ``ROLLOUT_SERVE_PORT=30000``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROLLOUT_SERVE_", extra="forbid")

    model: Path = Field(description="Checkpoint directory (config.json, safetensors, tokenizer.json).")
    ranks: int = Field(1, ge=1, description="Rank processes G (GPUs on a GPU machine).")
    layout: str | None = Field(None, description="Initial layout DxT, D*T = ranks (default: ranks x 1).")
    candidates: str | None = Field(None, description="Layouts the engine may switch to (default: all).")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(30000, ge=0, le=65535, description="Port (30000, SGLang's default).")
    api_key: str | None = Field(None, description="Bearer token every route but health and metrics needs.")
    weights_root: Path | None = Field(
        None,
        description="update_weights_from_disk loads only below this directory (default: --model's parent).",
    )
    served_model_name: str | None = Field(None, description="Model name in /v1/models (default: --model).")
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = Field(64, ge=1)
    kv_budget: int | None = Field(None, ge=2, description="Reserved KV tokens per replica.")
    context_length: int = Field(0, ge=0, description="0 = the model's max_position_embeddings.")
    timeout: float = Field(120.0, gt=0, description="Timeout of every collective, seconds.")
    cuda_graphs: bool = Field(
        False, description="cuda: replay decode steps from CUDA graphs (TP=1 replicas; experimental)."
    )
    max_body_bytes: int = Field(16 << 20, ge=1024, description="Larger request bodies get 413.")
    drain_seconds: float = Field(
        0.0, ge=0, description="On SIGTERM, let requests finish for this long before aborting the rest."
    )
    access_log: bool = Field(
        False, description="Log every HTTP request (one line each; costs CPU under load)."
    )
    failure_grace_seconds: float = Field(
        2.0, ge=0, description="After a rank dies, answer 503 this long, then exit non-zero."
    )
