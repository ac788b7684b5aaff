"""`rolloutctl run` and the operator start the same job the same way: one plan (layouts, policy, starting
layout) and one profile lookup (issue 14, item 2). `initialLayout: auto` is the planner's choice on a
cluster too (it was the smallest TP there, and the planner's choice locally)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rollout_operator.api.manifest import parse_job
from rollout_operator.cluster.plan import plan_pods
from rollout_operator.control.jobplan import ModelDims, Refusal, candidates_of, requests_per_pod, start_layout
from rollout_operator.control.profiles import find_profile
from rollout_operator.local.local_job import RunOptions, prepare
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.profile import Profile
from rollout_profiler.store import migrate, repo
from rollout_profiler.store.database import make_engine
from rollout_worker.scheduling.layout import Layout
from sqlalchemy.orm import Session

from tests.operator.local.jobs import PROFILE, job_doc, write_prompts

PROF = Profile.from_json(PROFILE)


def _loaded(tmp_path: Path, model: Path, limit: int | None = None, **spec: Any) -> Any:
    doc = job_doc(model, write_prompts(tmp_path / "prompts.jsonl"), tmp_path / "out", **spec)
    doc["spec"]["prompts"]["limit"] = limit
    return parse_job(yaml.safe_dump(doc), str(tmp_path / "job.yaml"))


@pytest.mark.parametrize("limit", [1, 12])
def test_run_and_the_operator_pick_the_same_start_profile_and_policy(
    tmp_path: Path, tiny64: Path, limit: int
) -> None:
    loaded = _loaded(
        tmp_path,
        tiny64,
        limit,
        pods=1,
        parallelism={"initialLayout": "auto", "profile": str(PROFILE)},
    )
    spec = loaded.job.spec
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    local = prepare(loaded, RunOptions(db_url=url), lambda _: None)
    migrate.upgrade(url)
    with Session(make_engine(url)) as session:
        prof = find_profile(spec, session, None)
    assert isinstance(prof, Profile) and prof.name == PROF.name
    got = plan_pods(spec, prof)
    assert isinstance(got, tuple), got
    pods, cluster = got
    assert (local.plan.layout, local.plan.candidates) == (cluster.layout, cluster.candidates)
    assert pods.layout == cluster.layout and local.plan.policy == cluster.policy
    # and it is the planner's choice, not the smallest TP
    want = start_layout(spec, list(cluster.candidates), LatencyModel(PROF), requests_per_pod(spec, limit))
    assert cluster.layout == want
    if limit == 1:  # one request of this profile's shape: TP=2 is the faster start
        assert cluster.layout == Layout(1, 2)


def test_auto_starts_at_the_smallest_tp_without_a_profile(tmp_path: Path, tiny64: Path) -> None:
    spec = _loaded(tmp_path, tiny64, parallelism={"initialLayout": "auto", "profile": None}).job.spec
    cands = candidates_of(spec, ModelDims(8, 2, 512))
    assert not isinstance(cands, Refusal)
    assert start_layout(spec, cands, None, 3) == Layout(2, 1)


def test_a_named_profile_is_found_by_one_query_newest_first(tmp_path: Path, tiny64: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    with Session(engine) as session, session.begin():
        first = repo.save_profile(session, PROF)
        second = repo.save_profile(session, PROF)
    spec = _loaded(tmp_path, tiny64, parallelism={"profile": PROF.name}).job.spec
    with Session(engine) as session:
        found = find_profile(spec, session, None)
        assert isinstance(found, Profile)
        assert repo.find_profile_named(session, PROF.name) is not None
        missing = find_profile(
            _loaded(tmp_path, tiny64, parallelism={"profile": "nope"}).job.spec, session, None
        )
        gone = find_profile(
            _loaded(tmp_path, tiny64, parallelism={"profile": "gone.json"}).job.spec, session, None
        )
    assert second > first
    assert isinstance(missing, Refusal) and missing.field == "spec.parallelism.profile"
    assert isinstance(gone, Refusal) and "profile file not found" in gone.message


def test_the_planner_models_the_memory_the_jobs_engines_hold(tmp_path: Path, tiny64: Path) -> None:
    loaded = _loaded(tmp_path, tiny64, 4, engine={"maxBatch": 8, "kvBudgetTokens": 3000, "pageSize": 16})
    plan = plan_pods(loaded.job.spec, PROF)
    assert isinstance(plan, tuple), plan
    policy = plan[1].policy
    pool = 3008  # the budget, rounded up to whole pages: every replica's pool, whatever its TP size
    assert policy.max_batch_per_replica == 8
    assert policy.kv_tokens_per_replica == tuple((lay.tp, pool) for lay in plan[1].candidates)
    assert policy.cooldown_s is None  # by default: ten times the last switch's duration
