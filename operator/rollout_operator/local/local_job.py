"""``rolloutctl run``'s whole course. ``prepare``: every check before anything is made or started (prompts,
model, layouts, profile file, output directories), then set-up on first use (the model from its preset, a
profile measured when none is stored), the database's job row and the initial layout. ``execute``: the
run (and ``--compare static``, both sides from the same warm state), and the job's outcome and finished
lengths in the database."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_profiler.planning.predictor import Prior
from rollout_profiler.profile import ModelShape, Profile
from rollout_worker.api.sidecar import Progress, read_outputs
from rollout_worker.scheduling.layout import Layout

from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.api.manifest import LoadedJob
from rollout_operator.control.jobplan import (
    JobPlan,
    ModelDims,
    Refusal,
    candidates_of,
    plan_job,
    requests_per_pod,
)
from rollout_operator.control.profiles import find_profile
from rollout_operator.local import result as res
from rollout_operator.local.result import RunResult
from rollout_operator.local.runner import Interrupted, Planning, PodRun, run_pods
from rollout_operator.local.setup import (
    check_engine,
    check_model,
    check_output,
    check_prompts_fit,
    checked,
    load_job_prompts,
    make_model_if_missing,
    measure_profile,
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
    plan: JobPlan
    runs: list[tuple[str, Path]]  # (policy, output directory), in order
    db: _Database

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def candidates(self) -> list[Layout]:
        return list(self.plan.candidates)


def planning(prep: Prepared, policy: str) -> Planning | None:
    """The planner's side of a run of ``policy`` (None for a static run): the job's planner settings."""
    if policy != "adaptive" or prep.plan.latency is None:
        return None
    return Planning(prep.plan.latency, prep.plan.policy, prep.db.prior, prep.db.recorder())


def prepare(loaded: LoadedJob, opts: RunOptions, echo: Echo, model_bytes: Bytes | None = None) -> Prepared:
    spec = loaded.job.spec
    if opts.compare_static and spec.mode == "service":
        raise loaded.error(("spec", "mode"), "--compare static needs job mode (the prompts to run twice)")
    policy = opts.policy or spec.parallelism.policy
    prompts = load_job_prompts(loaded)
    model_cfg = check_model(loaded)
    dims = ModelDims(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.vocab_size)
    candidates = checked(loaded, candidates_of(spec, dims))
    check_engine(loaded, model_cfg, candidates)
    check_prompts_fit(loaded, prompts, model_cfg)
    shape = ModelShape.of(Path(spec.model.path).name, model_cfg).shape_hash
    profile = checked(loaded, find_profile(spec, None, shape_hash=shape))  # a file: checked before set-up
    out = Path(opts.output or spec.output.path)
    runs = [(policy, out / policy if opts.compare_static else out)]
    if opts.compare_static:
        runs.append(("static", out / "static"))
    for _, d in runs:
        check_output(loaded, d, opts.output is not None)
        res.check_claim(d, spec, loaded.job.metadata.name)
    # every input is valid: set up what is missing
    made = make_model_if_missing(loaded, model_bytes)
    if made is not None:
        echo(f"made the {spec.model.preset} model at {spec.model.path} ({made})")
    db = _Database.open(opts.db_url)
    if profile is None:
        profile = checked(loaded, db.profile(spec, shape))
    if profile is None and policy == "adaptive":
        profile = measure_profile(loaded, Path(spec.model.path), sorted(candidates, key=lambda x: x.tp), echo)
        echo(f"stored profile {profile.name} ({db.store(profile)})")
    plan = checked(loaded, plan_job(spec, profile, dims, requests_per_pod(spec, len(prompts)), policy))
    db.start(loaded, shape)
    for _, d in runs:
        res.claim(d, spec, loaded.job.metadata.name)
    return Prepared(loaded, policy, len(prompts), plan, runs, db)


def execute(prep: Prepared, echo: Echo, on_progress: OnProgress) -> list[RunResult]:
    loaded, spec = prep.loaded, prep.loaded.job.spec
    what = f"{prep.prompts} prompts x {spec.samples_per_prompt}" if spec.mode == "job" else "service mode"
    echo(
        f"{loaded.job.metadata.name}: {spec.pods} pod(s) x {spec.gpus_per_pod} rank(s), {what}, "
        f"{prep.policy}, starting as {prep.layout}"
    )
    if len(prep.runs) > 1:
        warm_model(Path(spec.model.path))
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


def warm_model(path: Path) -> None:
    """Read the model's files once before the first side of a comparison, so that both sides start from the
    same page cache: neither pays for reads the other finds cached (loading the weights before a side's clock
    starts, and re-reading a shard on a switch, inside it)."""
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        with f.open("rb") as fh:
            while fh.read(1 << 24):
                pass


@dataclass
class _Database:
    """The job's rows: the job, its decisions (through the recorder), its finished lengths; the profiles
    stored; and the prior from earlier jobs of the same model."""

    engine: Any
    job_id: int | None = None
    prior: Prior | None = None

    @classmethod
    def open(cls, url: str | None) -> _Database:
        from rollout_profiler.store import database, migrate

        resolved = database.resolve_url(url)
        migrate.upgrade(resolved)
        return cls(database.make_engine(resolved))

    def profile(self, spec: RolloutJobSpec, shape: str) -> Profile | Refusal | None:
        from sqlalchemy.orm import Session

        with Session(self.engine) as session:
            return find_profile(spec, session, shape_hash=shape)

    def store(self, prof: Profile) -> str:
        from rollout_profiler.store import repo
        from sqlalchemy.orm import Session

        with Session(self.engine) as session, session.begin():
            return f"id {repo.save_profile(session, prof)}"

    def start(self, loaded: LoadedJob, shape: str) -> None:
        from sqlalchemy.orm import Session

        from rollout_operator.control.records import prior_for_model, start_job

        with Session(self.engine) as session:
            self.prior = prior_for_model(session, shape)
        self.job_id = start_job(self.engine, loaded.job.metadata.name, "local", loaded.job.spec, shape)

    def recorder(self) -> Any:
        from rollout_operator.control.records import DbRecorder

        return DbRecorder(self.engine, self.job_id)

    def finish(self, r: RunResult | None, outcome: str) -> None:
        from rollout_operator.control.records import end_job

        assert self.job_id is not None
        lengths, capped = [], []
        if r is not None and not r.reused:
            for s in read_outputs(r.out_dir):
                lengths.append(s.completion_tokens)
                capped.append(s.capped)
        end_job(self.engine, self.job_id, outcome, r.seconds if r is not None else None, lengths, capped)


def outputs_equal(a: Path, b: Path) -> tuple[bool, str]:
    """Both runs' samples, sorted by (prompt, sample): the same output ids? The detail names the differing
    samples and the token position where each first differs."""

    def load(d: Path) -> dict[tuple[str, int], list[int]]:
        return {(s.prompt_id, s.sample): s.output_ids for s in read_outputs(d)}

    x, y = load(a), load(b)
    if x.keys() != y.keys():
        return False, f"{len(x)} vs {len(y)} samples"
    diff = sorted(k for k in x if x[k] != y[k])
    if not diff:
        return True, f"{len(x)} samples, identical"
    where = [f"{p}/{i} at token {first_difference(x[(p, i)], y[(p, i)])}" for p, i in diff]
    shown = ", ".join(where[:8]) + (f", and {len(where) - 8} more" if len(where) > 8 else "")
    return False, f"{len(x)} samples, {len(diff)} differ: {shown}"


def first_difference(x: list[int], y: list[int]) -> int:
    """The first position where two token lists differ (the shorter one's length when one extends the
    other)."""
    return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
