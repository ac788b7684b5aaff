"""What each pod of a local run is: an engine server and a sidecar, their ports, arguments and environment.
Pure: built from the job and the ports, so it can be tested (and mirrors the operator's pod manifests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rollout_worker.scheduling.costs import CostModel
from rollout_worker.scheduling.layout import Layout
from rollout_worker.sidecar.settings import settings_env

from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.control.podspec import engine_args, engine_env, sidecar_fields


@dataclass(frozen=True)
class PodProcesses:
    index: int
    name: str
    engine_port: int
    api_port: int
    admin_port: int
    engine_args: list[str]
    sidecar_env: dict[str, str] = field(default_factory=dict)
    engine_env: dict[str, str] = field(default_factory=dict)

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
    costs: CostModel | None = None,
) -> list[PodProcesses]:
    """One engine + sidecar per pod; ``ports`` holds 3 free ports per pod (engine, sidecar API, admin);
    ``costs``: the planner's switch-cost model for the engines (as on a cluster: ``engine_env``)."""
    pods = []
    engine_key, token = secrets / "engine-key", secrets / "sidecar-token"
    for i in range(spec.pods):
        ep, api, admin = ports[3 * i : 3 * i + 3]
        args = [*engine_args(spec, layout, candidates), "--port", str(ep), "--api-key-file", str(engine_key)]
        fields = sidecar_fields(spec, i) | {"output_dir": out_dir if spec.mode == "job" else None}
        env = settings_env(
            **fields,
            engine_url=f"http://127.0.0.1:{ep}",
            engine_key_file=engine_key,
            token_file=token,
            host="127.0.0.1",
            port=api,
            admin_port=admin,
        )  # no exit_with_parent: the runner starts every child to die with it (local/processes.py)
        pods.append(PodProcesses(i, f"{job_name}-{i}", ep, api, admin, args, env, engine_env(costs)))
    return pods
