"""Running a RolloutJob on this machine: checks before any process starts, set-up (model, profile), the pods
as local processes, the planner loop, then the manifest, the database records and a report."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import PlannerPolicy
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.profile import ModelShape, Profile
from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.api.plan import Plan, ReconfigEvent
from rollout_worker.api.sidecar import SidecarState
from rollout_worker.api.state import EngineState
from rollout_worker.server.process import free_port
from rollout_worker.sidecar.outputs import write_manifest

from rollout_operator.api.manifest import LoadedJob
from rollout_operator.control.loop import Outcome, PlannerLoop
from rollout_operator.local.pods import PodProcesses, build_pods
from rollout_operator.local.processes import LocalPods


@dataclass
class Sample:
    """One moment of one pod, for the timeline."""

    t: float
    pod: str
    running: int
    tp: int


@dataclass
class RunResult:
    policy: str
    layout: Layout
    out_dir: Path
    seconds: float
    samples: int
    tokens: int
    events: dict[str, list[ReconfigEvent]]
    decisions: list[dict[str, Any]]
    timeline: list[Sample] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class SidecarLink:
    """A pod reached through its sidecar: state on the API port, plans on the admin port."""

    name: str
    api: str
    admin: str
    token: str
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.AsyncClient(headers={"Authorization": f"Bearer {self.token}"}, timeout=10.0)

    async def state(self, since_step: int) -> tuple[EngineState, int]:
        r = await self.client.get(self.api + "/v1/state", params={"since_step": since_step})
        r.raise_for_status()
        got = SidecarState.model_validate(r.json())
        return got.engine, got.not_submitted.samples

    async def push(self, plan: Plan) -> bool:
        r = await self.client.put(self.admin + "/v1/plan", json=plan.model_dump(mode="json"))
        if r.status_code == 409:
            return False
        r.raise_for_status()
        return True

    async def events(self) -> list[ReconfigEvent]:
        r = await self.client.get(self.api + "/v1/reconfigurations")
        r.raise_for_status()
        return [ReconfigEvent.model_validate(e) for e in r.json()]

    async def progress(self) -> dict[str, Any]:
        r = await self.client.get(self.api + "/v1/progress")
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    async def aclose(self) -> None:
        await self.client.aclose()


def spec_hash(loaded: LoadedJob) -> str:
    return hashlib.sha256(loaded.job.spec.model_dump_json(by_alias=True).encode()).hexdigest()[:16]


def _secrets(dir_: Path) -> tuple[Path, str]:
    """Fresh API key and sidecar token, readable by this user only."""
    dir_.mkdir(parents=True, exist_ok=True)
    dir_.chmod(0o700)
    token = secrets.token_urlsafe(24)
    for name, value in (("engine-key", secrets.token_urlsafe(24)), ("sidecar-token", token)):
        f = dir_ / name
        f.write_text(value + "\n")
        f.chmod(0o600)
    return dir_, token


async def run_pods(
    loaded: LoadedJob,
    policy_name: str,
    layout: Layout,
    candidates: list[Layout],
    out_dir: Path,
    model: LatencyModel | None,
    planner: PlannerPolicy | None,
    prior: Prior | None,
    recorder: Any,
    on_progress: Any,
) -> RunResult:
    """Start the pods, run the planner loop (adaptive) until every sample is written, stop the pods."""
    spec = loaded.job.spec
    secrets_dir, token = _secrets(out_dir / ".secrets")
    ports = [free_port() for _ in range(3 * spec.pods)]
    pods: list[PodProcesses] = build_pods(
        loaded.job.metadata.name, spec, layout, candidates, ports, out_dir, secrets_dir
    )
    local = LocalPods(pods, out_dir / "logs")
    links = [SidecarLink(p.name, p.api_url, p.admin_url, token) for p in pods]
    timeline: list[Sample] = []
    local.start()
    try:
        await local.wait_ready()
        t_gen = time.monotonic()
        progress: dict[str, dict[str, Any]] = {}

        def finished() -> bool:
            if local.dead():
                c = local.dead()[0]
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}:\n{c.tail()}")
            return len(progress) == len(links) and all(p.get("done") for p in progress.values())

        async def poll() -> None:
            for link in links:
                try:
                    progress[link.name] = await link.progress()
                except httpx.HTTPError:
                    continue
                p = progress[link.name]
                timeline.append(
                    Sample(
                        time.monotonic() - t_gen,
                        link.name,
                        int(p.get("running", 0)),
                        Layout.parse(str(p.get("layout", layout))).tp,
                    )
                )
            on_progress(progress)

        loop = PlannerLoop(list(links), model, planner, prior, recorder, 0.25) if model and planner else None
        decisions: list[dict[str, Any]] = []

        def on_tick(outcomes: list[Outcome]) -> None:
            for o in outcomes:
                if o.pushed:
                    d = o.result.decision
                    decisions.append(
                        {
                            "pod": o.pod,
                            "to": str(d.target),
                            "method": d.method,
                            "gain_ms": d.predicted_gain_ms,
                            "cost_ms": d.predicted_cost_ms,
                            "reason": d.reason,
                        }
                    )

        while not finished():
            await poll()
            if loop is not None:
                on_tick(await loop.run_once())
            await asyncio.sleep(0.25)
        await poll()
        seconds = time.monotonic() - t_gen
        events = {link.name: await link.events() for link in links}
        if loop is not None:
            await loop.run_once()  # records the outcome of the last switches
    finally:
        for link in links:
            await link.aclose()
        local.stop()
    files = sorted(out_dir.glob("pod-*.jsonl"))
    samples = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    write_manifest(
        out_dir, files, {"job": loaded.job.metadata.name, "policy": policy_name, "layout": str(layout)}
    )
    tokens = sum(int(s.get("completion_tokens", 0)) for s in samples)
    return RunResult(policy_name, layout, out_dir, seconds, len(samples), tokens, events, decisions, timeline)


def candidate_layouts(loaded: LoadedJob, model: ModelConfig) -> list[Layout]:
    """The job's candidates (each checked against the model), or every layout the model can run."""
    spec = loaded.job.spec
    given = spec.parallelism.candidates
    if given is None:
        return model.candidate_layouts(spec.gpus_per_pod)
    out = []
    for i, c in enumerate(given):
        lay = Layout.parse(c)
        why = model.tp_problem(lay.tp)
        if why:
            raise loaded.error(("spec", "parallelism", "candidates", i), why)
        out.append(lay)
    return sorted(set(out), key=lambda x: x.tp)


def shape_of(model: ModelConfig, name: str) -> ModelShape:
    return ModelShape(
        name,
        model.architecture,
        model.hidden_size,
        model.num_layers,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.intermediate_size,
        model.vocab_size,
    )


def load_profile_for(loaded: LoadedJob, model: ModelConfig, db_url: str | None) -> Profile | None:
    """The profile the job names (a JSON file, or a name in the database), else the best stored one for this
    model shape, device, rank count and dtype; None when there is none."""
    from rollout_profiler.store import engine as db_engine
    from rollout_profiler.store import repo
    from sqlalchemy.orm import Session

    spec, where = loaded.job.spec, ("spec", "parallelism", "profile")
    name = spec.parallelism.profile
    shape = shape_of(model, Path(spec.model.path).name)
    if name is not None and (name.endswith(".json") or Path(name).exists()):
        if not Path(name).is_file():
            raise loaded.error(where, f"profile file not found: {name}")
        prof: Profile | None = Profile.from_json(name)
    else:
        with Session(db_engine.make_engine(db_engine.resolve_url(db_url))) as session:
            if name is None:
                prof = repo.find_profile(
                    session, shape.shape_hash, spec.engine.device, spec.gpus_per_pod, spec.model.dtype
                )
            else:
                ids = [p.id for p in repo.list_profiles(session) if p.name == name]
                if not ids:
                    raise loaded.error(where, f"no profile named {name!r} in the database")
                prof = repo.load_profile(session, max(ids))
    if prof is not None and prof.model.shape_hash != shape.shape_hash:
        raise loaded.error(where, f"profile {prof.name} is of another model shape than {spec.model.path}")
    return prof
