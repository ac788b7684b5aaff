"""``rolloutctl run``'s whole course. ``prepare``: every check before anything is made or started (prompts,
model, layouts, profile file, output directories), then set-up on first use (the model from its preset, a
profile measured when none is stored), the database's job row and the initial layout. ``execute``: the
run (and ``--compare static``), and the job's outcome and finished lengths in the database."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import PlannerPolicy
from rollout_profiler.planning.predictor import Prior
from rollout_profiler.profile import ModelShape, Profile
from rollout_worker.api.layout import Layout
from rollout_worker.api.sidecar import Progress, read_outputs

from rollout_operator.api.job import samples_hash
from rollout_operator.api.manifest import LoadedJob
from rollout_operator.local import result as res
from rollout_operator.local.result import RunResult
from rollout_operator.local.runner import Interrupted, Planning, PodRun, run_pods
from rollout_operator.local.setup import (
    candidate_layouts,
    check_model,
    initial_layout,
    load_job_prompts,
    make_model_if_missing,
    measure_profile,
    profile_file,
    stored_profile,
)


@dataclass(frozen=True)
class RunOptions:
    policy: str | None = None  # overrides spec.parallelism.policy
    output: Path | None = None  # overrides spec.output.path
    compare_static: bool = False
    db_url: str | None = None


Echo = Callable[[str], Any]
OnProgress = Callable[[dict[str, Progress]], Any]
Bytes = Callable[[int, int], Any]


@dataclass(frozen=True)
class Prepared:
    loaded: LoadedJob
    policy: str
    prompts: int
    candidates: list[Layout]
    latency: LatencyModel | None
    layout: Layout
    runs: list[tuple[str, Path]]  # (policy, output directory), in order
    db: _Database


def planning(prep: Prepared, policy: str) -> Planning | None:
    """The planner's side of a run of ``policy`` (None for a static run): the job's planner settings."""
    if policy != "adaptive" or prep.latency is None:
        return None
    par = prep.loaded.job.spec.parallelism
    pol = PlannerPolicy(
        candidates=tuple(prep.candidates),
        margin=par.margin,
        cooldown_s=par.cooldown_seconds,
        method=par.method,
    )
    return Planning(prep.latency, pol, prep.db.prior, prep.db.recorder())


def prepare(loaded: LoadedJob, opts: RunOptions, echo: Echo, model_bytes: Bytes | None = None) -> Prepared:
    spec = loaded.job.spec
    if opts.compare_static and spec.mode == "service":
        raise loaded.error(("spec", "mode"), "--compare static needs job mode (the prompts to run twice)")
    policy = opts.policy or spec.parallelism.policy
    prompts = load_job_prompts(loaded)
    model_cfg = check_model(loaded)
    candidates = candidate_layouts(loaded, model_cfg)
    profile = profile_file(loaded, model_cfg)
    out = Path(opts.output or spec.output.path)
    runs = [(policy, out / policy if opts.compare_static else out)]
    if opts.compare_static:
        runs.append(("static", out / "static"))
    for _, d in runs:
        res.check_claim(d, spec, loaded.job.metadata.name)
    # every input is valid: set up what is missing
    if make_model_if_missing(loaded, model_bytes):
        echo(f"made the {spec.model.preset} model at {spec.model.path} (random weights)")
    db = _Database.open(opts.db_url)
    if profile is None:
        profile = db.profile(loaded, model_cfg)
    if profile is None and policy == "adaptive":
        profile = measure_profile(loaded, Path(spec.model.path), candidates, echo)
        echo(f"stored profile {profile.name} ({db.store(profile)})")
    latency = LatencyModel(profile) if profile is not None else None
    layout = initial_layout(loaded, candidates, latency, len(prompts))
    shape = ModelShape.of(Path(spec.model.path).name, model_cfg).shape_hash
    db.start(loaded, shape)
    for _, d in runs:
        res.claim(d, spec, loaded.job.metadata.name)
    return Prepared(loaded, policy, len(prompts), candidates, latency, layout, runs, db)


def execute(prep: Prepared, echo: Echo, on_progress: OnProgress) -> list[RunResult]:
    loaded, spec = prep.loaded, prep.loaded.job.spec
    what = f"{prep.prompts} prompts x {spec.samples_per_prompt}" if spec.mode == "job" else "service mode"
    echo(
        f"{loaded.job.metadata.name}: {spec.pods} pod(s) x {spec.gpus_per_pod} rank(s), {what}, "
        f"{prep.policy}, starting as {prep.layout}"
    )
    results = []
    try:
        for name, out_dir in prep.runs:
            done = res.finished(out_dir, name) if spec.mode == "job" else None
            if done is not None:
                echo(f"{name}: already finished in {out_dir} (remove it to run again)")
                results.append(done)
                continue
            run = PodRun(loaded, name, prep.layout, prep.candidates, out_dir, planning(prep, name))
            results.append(asyncio.run(run_pods(run, on_progress, echo)))
    except BaseException as exc:
        prep.db.finish(None, "interrupted" if isinstance(exc, KeyboardInterrupt | Interrupted) else "failed")
        raise
    prep.db.finish(results[0], "succeeded")
    return results


@dataclass
class _Database:
    """The job's rows: the job, its decisions (through the recorder), its finished lengths; the profiles
    stored; and the prior from earlier jobs of the same model."""

    engine: Any
    job_id: int | None = None
    prior: Prior | None = None

    @classmethod
    def open(cls, url: str | None) -> _Database:
        from rollout_profiler.store import engine as db_engine
        from rollout_profiler.store import migrate

        resolved = db_engine.resolve_url(url)
        migrate.upgrade(resolved)
        return cls(db_engine.make_engine(resolved))

    def profile(self, loaded: LoadedJob, model: Any) -> Profile | None:
        from sqlalchemy.orm import Session

        with Session(self.engine) as session:
            return stored_profile(loaded, model, session)

    def store(self, prof: Profile) -> str:
        from rollout_profiler.store import repo
        from sqlalchemy.orm import Session

        with Session(self.engine) as session, session.begin():
            return f"id {repo.save_profile(session, prof)}"

    def start(self, loaded: LoadedJob, shape: str) -> None:
        from rollout_profiler.store import runs
        from sqlalchemy.orm import Session

        from rollout_operator.control.records import prior_for_model

        with Session(self.engine) as session, session.begin():
            self.prior = prior_for_model(session, shape)
            self.job_id = runs.record_job(
                session,
                name=loaded.job.metadata.name,
                namespace="local",
                spec_hash=samples_hash(loaded.job.spec),
                model_shape_hash=shape,
            )

    def recorder(self) -> Any:
        from rollout_operator.control.records import DbRecorder

        return DbRecorder(self.engine, self.job_id)

    def finish(self, r: RunResult | None, outcome: str) -> None:
        from rollout_profiler.store import runs
        from sqlalchemy.orm import Session

        assert self.job_id is not None
        lengths, capped = [], []
        if r is not None and not r.reused:
            for s in read_outputs(r.out_dir):
                lengths.append(s.completion_tokens)
                capped.append((s.finish_reason or {}).get("type") == "length")
        with Session(self.engine) as session, session.begin():
            if lengths:
                runs.add_finished_lengths(session, self.job_id, lengths, capped)
            seconds = r.seconds if r is not None else None
            runs.finish_job(session, self.job_id, outcome=outcome, generation_seconds=seconds)


def outputs_equal(a: Path, b: Path) -> tuple[bool, str]:
    """Both runs' samples, sorted by (prompt, sample): the same output ids?"""

    def load(d: Path) -> dict[tuple[str, int], list[int]]:
        return {(s.prompt_id, s.sample): s.output_ids for s in read_outputs(d)}

    x, y = load(a), load(b)
    if x.keys() != y.keys():
        return False, f"{len(x)} vs {len(y)} samples"
    diff = [k for k in x if x[k] != y[k]]
    return not diff, f"{len(x)} samples, {len(diff)} differ" if diff else f"{len(x)} samples, identical"
