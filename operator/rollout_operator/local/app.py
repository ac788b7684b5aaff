"""``rolloutctl run``'s whole course: checks before any process starts, set-up on first use (model from a
preset, profile), the initial layout, the run (and ``--compare static``), database records, the report."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.planner import PlannerPolicy, PodSnapshot, ReplicaState, choose_start
from rollout_profiler.planning.predictor import Prior, fit
from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig

from rollout_operator.api.manifest import LoadedJob
from rollout_operator.local.runner import RunResult, candidate_layouts, load_profile_for, run_pods


@dataclass(frozen=True)
class RunOptions:
    policy: str | None = None  # overrides spec.parallelism.policy
    output: Path | None = None  # overrides spec.output.path
    compare_static: bool = False
    db_url: str | None = None


def prepare_model(loaded: LoadedJob, echo: Callable[[str], Any]) -> ModelConfig:
    spec = loaded.job.spec.model
    path = Path(spec.path)
    if not (path / "config.json").exists():
        if spec.preset is None:
            raise loaded.error(
                ("spec", "model", "path"), f"no checkpoint at {path} (and no preset to make one)"
            )
        from rollout_worker.engine.checkpoint import make_model

        echo(f"first use: making the {spec.preset} model at {path} (random weights) ...")
        make_model(spec.preset, 0, path, spec.dtype)
    return ModelConfig.load(path)


def check_inputs(loaded: LoadedJob) -> None:
    spec = loaded.job.spec
    if not Path(spec.prompts.path).is_file():
        raise loaded.error(("spec", "prompts", "path"), f"file not found: {spec.prompts.path}")


def initial_layout(
    loaded: LoadedJob, candidates: list[Layout], model: LatencyModel | None, prompts: int
) -> Layout:
    init = loaded.job.spec.parallelism.initial_layout
    if init != "auto":
        lay = Layout.parse(init)
        if lay not in candidates:
            raise loaded.error(("spec", "parallelism", "initialLayout"), f"{lay} is not among {candidates}")
        return lay
    if model is None:
        return candidates[0]
    sp = loaded.job.spec
    n = prompts * sp.samples_per_prompt // sp.pods
    waiting = ReplicaState(np.zeros(0), np.zeros(0), np.zeros(0), n)
    snap = PodSnapshot(
        candidates[0], (waiting,), (True,) * sp.gpus_per_pod, 0, 0.0, 128, sp.sampling.max_new_tokens
    )
    pol = PlannerPolicy(candidates=tuple(candidates), margin=sp.parallelism.margin)
    pred = fit(np.zeros(0), np.zeros(0), np.zeros(0))
    return choose_start(model, snap, pol, pred)


def run_job(
    loaded: LoadedJob, opts: RunOptions, echo: Callable[[str], Any], on_progress: Any
) -> list[RunResult]:
    spec = loaded.job.spec
    check_inputs(loaded)
    model_cfg = prepare_model(loaded, echo)
    candidates = candidate_layouts(loaded, model_cfg)
    policy = opts.policy or spec.parallelism.policy
    profile = load_profile_for(loaded, model_cfg, opts.db_url)
    if policy == "adaptive" and profile is None:
        raise loaded.error(
            ("spec", "parallelism", "profile"), "adaptive needs a profile (a JSON file or a name)"
        )
    latency = LatencyModel(profile) if profile is not None else None
    from rollout_worker.api.prompts import ChatTemplate, load_prompts

    prompts = load_prompts(spec.prompts.path, spec.prompts.limit, ChatTemplate.of_model(spec.model.path))
    layout = initial_layout(loaded, candidates, latency, len(prompts))
    out = Path(opts.output or spec.output.path)
    planner = PlannerPolicy(
        candidates=tuple(candidates),
        margin=spec.parallelism.margin,
        cooldown_s=spec.parallelism.cooldown_seconds,
        method=spec.parallelism.method,
    )
    recorder, prior, job_id, db = _database(loaded, opts, profile)
    results = []
    echo(
        f"{loaded.job.metadata.name}: {spec.pods} pod(s) x {spec.gpus_per_pod} rank(s), "
        f"{len(prompts)} prompts x {spec.samples_per_prompt}, {policy}, starting as {layout}"
    )
    adaptive = policy == "adaptive"
    first_out = out / policy if opts.compare_static else out
    if adaptive:
        first = run_pods(
            loaded, policy, layout, candidates, first_out, latency, planner, prior, recorder, on_progress
        )
    else:
        first = run_pods(loaded, policy, layout, candidates, first_out, None, None, None, None, on_progress)
    results.append(asyncio.run(first))
    if opts.compare_static:
        static = run_pods(
            loaded, "static", layout, candidates, out / "static", None, None, None, None, on_progress
        )
        results.append(asyncio.run(static))
    if db is not None and job_id is not None:
        _finish(db, job_id, results[0])
    return results


def _database(loaded: LoadedJob, opts: RunOptions, profile: Any) -> tuple[Any, Prior | None, int | None, Any]:
    from rollout_profiler.store import engine as db_engine
    from rollout_profiler.store import migrate, runs
    from sqlalchemy.orm import Session

    from rollout_operator.control.records import DbRecorder
    from rollout_operator.local.runner import spec_hash

    url = db_engine.resolve_url(opts.db_url)
    migrate.upgrade(url)
    db = db_engine.make_engine(url)
    shape = profile.model.shape_hash if profile is not None else "unknown"
    with Session(db) as session, session.begin():
        prior_samples = runs.finished_lengths_for_model(session, shape)
        job_id = runs.record_job(session, name=loaded.job.metadata.name, namespace="local",
                                 spec_hash=spec_hash(loaded), model_shape_hash=shape)  # fmt: skip
    prior = None
    if len(prior_samples) >= 20:
        lengths = np.array([s.length for s in prior_samples], dtype=float)
        caps = np.array([s.length if s.capped else np.inf for s in prior_samples])
        prior = Prior.from_samples(lengths, caps)
    return DbRecorder(db, job_id), prior, job_id, db


def _finish(db: Any, job_id: int, r: RunResult) -> None:
    from rollout_profiler.store import runs
    from sqlalchemy.orm import Session

    lengths, capped = [], []
    for f in sorted(r.out_dir.glob("pod-*.jsonl")):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            lengths.append(int(s["completion_tokens"]))
            capped.append((s.get("finish_reason") or {}).get("type") == "length")
    with Session(db) as session, session.begin():
        runs.add_finished_lengths(session, job_id, lengths, capped)
        runs.finish_job(session, job_id, outcome="succeeded", generation_seconds=r.seconds)


def outputs_equal(a: Path, b: Path) -> tuple[bool, str]:
    """Both runs' samples, sorted by (prompt, sample): the same output ids?"""

    def load(d: Path) -> dict[tuple[str, int], list[int]]:
        out = {}
        for f in sorted(d.glob("pod-*.jsonl")):
            for line in f.read_text().splitlines():
                s = json.loads(line)
                out[(s["prompt_id"], s["sample"])] = s["output_ids"]
        return out

    x, y = load(a), load(b)
    if x.keys() != y.keys():
        return False, f"{len(x)} vs {len(y)} samples"
    diff = [k for k in x if x[k] != y[k]]
    return not diff, f"{len(x)} samples, {len(diff)} differ" if diff else f"{len(x)} samples, identical"
