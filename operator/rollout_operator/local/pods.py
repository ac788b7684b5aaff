"""What each pod of a local run is: an engine server and a sidecar, their ports, arguments and environment.
Pure: built from the job and the ports, so it can be tested (and mirrors the operator's pod manifests)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rollout_worker.api.layout import Layout

from rollout_operator.api.job import RolloutJobSpec


@dataclass(frozen=True)
class PodProcesses:
    index: int
    name: str
    engine_port: int
    api_port: int
    admin_port: int
    engine_args: list[str]
    sidecar_env: dict[str, str] = field(default_factory=dict)

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


def build_pods(
    job_name: str,
    spec: RolloutJobSpec,
    layout: Layout,
    candidates: list[Layout],
    ports: list[int],
    out_dir: Path,
    secrets: Path,
) -> list[PodProcesses]:
    """One engine + sidecar per pod; ``ports`` holds 3 free ports per pod (engine, sidecar API, admin)."""
    pods = []
    engine_key, token = secrets / "engine-key", secrets / "sidecar-token"
    for i in range(spec.pods):
        ep, api, admin = ports[3 * i : 3 * i + 3]
        eng = spec.engine
        args = [
            "--model", spec.model.path, "--ranks", str(spec.gpus_per_pod), "--layout", str(layout),
            "--candidates", ",".join(map(str, candidates)), "--port", str(ep), "--dtype", spec.model.dtype,
            "--device", eng.device, "--max-batch", str(eng.max_batch), "--api-key-file", str(engine_key),
        ]  # fmt: skip
        if eng.kv_budget_tokens is not None:
            args += ["--kv-budget", str(eng.kv_budget_tokens)]
        s = spec.sampling
        env = {
            "ROLLOUT_SIDECAR_ENGINE_URL": f"http://127.0.0.1:{ep}",
            "ROLLOUT_SIDECAR_ENGINE_KEY_FILE": str(engine_key),
            "ROLLOUT_SIDECAR_TOKEN_FILE": str(token),
            "ROLLOUT_SIDECAR_MODE": "job",
            "ROLLOUT_SIDECAR_PROMPTS_PATH": spec.prompts.path,
            "ROLLOUT_SIDECAR_MODEL_DIR": spec.model.path,
            "ROLLOUT_SIDECAR_POD_INDEX": str(i),
            "ROLLOUT_SIDECAR_PODS": str(spec.pods),
            "ROLLOUT_SIDECAR_SAMPLES_PER_PROMPT": str(spec.samples_per_prompt),
            "ROLLOUT_SIDECAR_TEMPERATURE": str(s.temperature),
            "ROLLOUT_SIDECAR_TOP_P": str(s.top_p),
            "ROLLOUT_SIDECAR_TOP_K": str(s.top_k),
            "ROLLOUT_SIDECAR_MAX_NEW_TOKENS": str(s.max_new_tokens),
            "ROLLOUT_SIDECAR_SEED": str(s.seed),
            "ROLLOUT_SIDECAR_STOP": json.dumps(s.stop),
            "ROLLOUT_SIDECAR_OUTPUT_DIR": str(out_dir),
            "ROLLOUT_SIDECAR_HOST": "127.0.0.1",
            "ROLLOUT_SIDECAR_PORT": str(api),
            "ROLLOUT_SIDECAR_ADMIN_PORT": str(admin),
        }
        if spec.prompts.limit is not None:
            env["ROLLOUT_SIDECAR_PROMPTS_LIMIT"] = str(spec.prompts.limit)
        pods.append(PodProcesses(i, f"{job_name}-{i}", ep, api, admin, args, env))
    return pods
