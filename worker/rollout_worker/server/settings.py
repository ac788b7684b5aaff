"""The server's own settings (where it listens, its key, its limits). ``rolloutctl serve``'s flags are derived
from these fields and from the engine's (:mod:`rollout_worker.config.engine_settings`), and each flag can also
come from the environment as ``ROLLOUT_SERVE_<NAME>`` (e.g. ``ROLLOUT_SERVE_PORT=30000``); a flag beats
its variable."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_worker.errors import FieldAt
from rollout_worker.web.middleware import BODY_TIMEOUT_S, is_loopback


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path = Field(description="Checkpoint directory (config.json, safetensors, tokenizer.json).")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(30000, ge=0, le=65535, description="Port (30000, SGLang's default).")
    api_key: str | None = Field(None, description="Bearer token every route but health and metrics needs.")
    allow_unauthenticated: bool = Field(
        False, description="Listen on an address other than loopback without an API key (warned)."
    )
    weights_root: Path | None = Field(
        None,
        description="update_weights_from_disk loads only below this directory (default: --model itself).",
    )
    trust_pickled_tensors: bool = Field(
        False,
        description="update_weights_from_tensor reads SGLang's pickled tensor handles (VeRL's adapter; same "
        "host only) from anyone with the API key: a restricted unpickler, still a trusted surface.",
    )
    enable_memory_saver: bool = Field(
        False,
        description="What /server_info reports as SGLang's enable_memory_saver (slime checks that it equals "
        "its --offload-rollout). release_memory_occupation and resume_memory_occupation work either way.",
    )
    served_model_name: str | None = Field(
        None, min_length=1, description="Model name in /v1/models (default: --model)."
    )
    max_body_bytes: int = Field(16 << 20, ge=1024, description="Larger request bodies get 413.")
    body_timeout_seconds: float = Field(
        BODY_TIMEOUT_S, gt=0, description="A request body not received whole within this gets 408."
    )
    drain_seconds: float = Field(
        0.0, ge=0, description="On SIGTERM, let requests finish for this long before aborting the rest."
    )
    access_log: bool = Field(
        False, description="Log every HTTP request (one line each; costs CPU under load)."
    )
    speculative_ngram_external_corpus_path: Path | None = Field(
        None,
        description="JSON Lines of strings (SGLang's): documents speculative decoding drafts from from the "
        "start, as /add_external_corpus adds them (needs --speculative-algorithm ngram).",
    )
    failure_grace_seconds: float = Field(
        2.0, ge=0, description="After a rank dies, answer 503 this long, then exit non-zero."
    )

    @model_validator(mode="after")
    def _key_beyond_loopback(self) -> ServerSettings:
        if self.open_to_network and not self.allow_unauthenticated:
            raise FieldAt(
                ("host",),
                f"{self.host} is not a loopback address: give an API key (--api-key-file or "
                "$ROLLOUT_API_KEY), or --allow-unauthenticated to serve every route to the network",
            )
        return self

    @property
    def open_to_network(self) -> bool:
        """Whether every route, mutating ones included, is open to other machines (no key, not loopback)."""
        return not self.api_key and not is_loopback(self.host)
