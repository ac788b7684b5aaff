"""The profile/decision database on SQLite and on the real PostgreSQL server (one fresh schema per test)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from rollout_profiler.profile import KVCapacity, Profile
from rollout_profiler.store import database, migrate, repo
from rollout_profiler.store.models import Base, ProfileRow, StepLatencyPointRow
from rollout_profiler.store.testing import (
    sample_profile,
)
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout
from sqlalchemy import Engine, delete, inspect, select
from sqlalchemy.orm import Session

TABLES = {"profiles", "step_latency_points", "reconfig_cost_points", "jobs", "finished_lengths", "decisions"}


@pytest.fixture
def db(empty_url: str) -> Iterator[Engine]:
    """An engine on a database migrated to head."""
    migrate.upgrade(empty_url)
    eng = database.make_engine(empty_url)
    yield eng
    eng.dispose()


def make_profile(name: str = "tiny-cpu-2", method: str = "measured", created: str | None = None) -> Profile:
    prof = sample_profile(name, method)
    if created is not None:
        prof.created = created
    return prof


def test_migrations_apply_on_an_empty_database(empty_url: str) -> None:
    assert migrate.current(empty_url) is None
    assert migrate.upgrade(empty_url) == migrate.head() == "0003"
    assert migrate.current(empty_url) == migrate.head()
    eng = database.make_engine(empty_url)
    try:
        # in the test schema (alone on the search_path) on PostgreSQL
        assert set(inspect(eng).get_table_names()) == {*TABLES, "alembic_version"}
        with eng.connect() as conn:
            # `alembic current`, as the alembic command prints it
            cfg = migrate.alembic_config(empty_url)
            cfg.stdout = io.StringIO()
            cfg.attributes["connection"] = conn
            command.current(cfg)
            assert cfg.stdout.getvalue().split() == ["0003", "(head)"]
            # the migration builds exactly what the models describe
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
    finally:
        eng.dispose()


def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    assert migrate.upgrade(empty_url) == "0003"
    assert migrate.downgrade(empty_url) is None
    eng = database.make_engine(empty_url)
    try:
        assert set(inspect(eng).get_table_names()) <= {"alembic_version"}
    finally:
        eng.dispose()
    assert migrate.upgrade(empty_url) == "0003"
    assert migrate.current(empty_url) == migrate.head()


def test_profile_round_trip(db: Engine) -> None:
    first = make_profile()
    second = make_profile("tiny-offset", method="modelled", created="2026-11-21T22:00:00.123456+02:00")
    second.kv_capacity = KVCapacity({1: 123_456, 2: 2**40}, {"gpu_bytes": 8.5e10, "rule": "test"})
    with Session(db) as session, session.begin():
        id1, id2 = repo.save_profile(session, first), repo.save_profile(session, second)
    with Session(db) as session:
        assert repo.load_profile(session, id1).to_dict() == first.to_dict()
        assert repo.load_profile(session, id2).to_dict() == second.to_dict()
        row = session.get(ProfileRow, id2)
        assert row is not None and row.created == datetime(2026, 11, 21, 20, 0, 0, 123456, tzinfo=UTC)
        assert row.stored_at.tzinfo is UTC
        summaries = repo.list_profiles(session)
    assert [(s.id, s.name, s.step_points, s.reconfig_points) for s in summaries] == [
        (id1, "tiny-cpu-2", 12, 3),
        (id2, "tiny-offset", 12, 3),
    ]


def test_find_profile_prefers_measured_then_newest(db: Engine) -> None:
    shape_hash = make_profile().model.shape_hash
    with Session(db) as session, session.begin():
        assert repo.find_profile(session, shape_hash, "cpu", 2, "float32") is None
        repo.save_profile(session, make_profile("old-measured"))
        newest = repo.save_profile(session, make_profile("new-measured"))
        repo.save_profile(session, make_profile("newer-modelled", method="modelled"))
        assert repo.find_profile_id(session, shape_hash, "cpu", 2, "float32") == newest
        found = repo.find_profile(session, shape_hash, "cpu", 2, "float32")
        assert found is not None and found.name == "new-measured"
        assert repo.find_profile_id(session, shape_hash, "cpu", 4, "float32") is None
        assert repo.find_profile_id(session, shape_hash, "cuda", 2, "float32") is None
        assert repo.find_profile_id(session, "0" * 16, "cpu", 2, "float32") is None


def test_bad_profiles_are_refused_with_clear_errors(db: Engine) -> None:
    dup = make_profile()
    dup.step_latency.append(dup.step_latency[0])
    long_name = make_profile("x" * 201)
    with Session(db) as session, session.begin():
        with pytest.raises(UserError, match="two points for layout 2x1, batch 1, context 128"):
            repo.save_profile(session, dup)
        with pytest.raises(UserError, match="name is longer than 200"):
            repo.save_profile(session, long_name)
        with pytest.raises(UserError, match="no profile with id 12345"):
            repo.load_profile(session, 12345)
        assert repo.list_profiles(session) == []


def test_deleting_a_profile_deletes_its_points(db: Engine) -> None:
    with Session(db) as session, session.begin():
        pid = repo.save_profile(session, make_profile())
    with Session(db) as session, session.begin():
        session.execute(
            delete(ProfileRow).where(ProfileRow.id == pid)
        )  # the database cascades (FK ON DELETE)
    with Session(db) as session:
        assert session.scalars(select(StepLatencyPointRow)).all() == []


def test_jobs_and_finished_lengths_round_trip(db: Engine) -> None:
    shape = make_profile().model.shape_hash
    start = datetime(2026, 11, 21, 20, 0, tzinfo=timezone(timedelta(hours=2)))
    lengths = [(i * 37) % 4096 for i in range(5000)]
    capped = [n >= 4000 for n in lengths]
    with Session(db) as session, session.begin():
        job = repo.record_job(
            session, name="grpo-1", namespace="rl", spec_hash="abc", model_shape_hash=shape, started_at=start
        )
        other = repo.record_job(
            session, name="grpo-2", namespace="rl", spec_hash="def", model_shape_hash="f" * 16
        )
        assert repo.add_finished_lengths(session, job, lengths[:3000], capped[:3000]) == 3000
        assert repo.add_finished_lengths(session, job, lengths[3000:], capped[3000:]) == 2000
        assert repo.add_finished_lengths(session, other, [7, 8]) == 2
        assert repo.add_finished_lengths(session, other, []) == 0
        repo.finish_job(
            session, job, outcome="succeeded", ended_at=start + timedelta(minutes=5), generation_seconds=290.5
        )
    with Session(db) as session:
        got = repo.get_job(session, job)
        assert got.started_at == start and got.started_at.tzinfo is UTC
        assert got.ended_at == start + timedelta(minutes=5)
        assert (got.outcome, got.generation_seconds, got.model_shape_hash) == ("succeeded", 290.5, shape)
        assert repo.get_job(session, other).ended_at is None
        samples = repo.finished_lengths_for_model(session, shape)
        assert [(s.length, s.capped) for s in samples] == list(zip(lengths, capped, strict=True))
        assert repo.finished_lengths_for_model(session, "f" * 16) == [(7, False), (8, False)]
        assert repo.finished_lengths_for_model(session, "0" * 16) == []


def test_bad_job_inputs(db: Engine) -> None:
    with Session(db) as session, session.begin():
        job = repo.record_job(session, name="j", namespace="n", spec_hash="s", model_shape_hash="h")
        with pytest.raises(UserError, match="no job with id 999"):
            repo.add_finished_lengths(session, 999, [1])
        with pytest.raises(UserError, match="3 lengths but 2 capped"):
            repo.add_finished_lengths(session, job, [1, 2, 3], [True, False])
        with pytest.raises(UserError, match=r"finished length \[1\] must be an integer >= 0"):
            repo.add_finished_lengths(session, job, [1, -2])
        with pytest.raises(ValueError, match="timezone-aware"):
            repo.record_job(
                session,
                name="k",
                namespace="n",
                spec_hash="s",
                model_shape_hash="h",
                started_at=datetime(2026, 1, 1),
            )
        with pytest.raises(UserError, match="before its start"):
            repo.finish_job(session, job, outcome="failed", ended_at=datetime(2000, 1, 1, tzinfo=UTC))


def test_decisions_round_trip(db: Engine) -> None:
    t0 = datetime(2026, 11, 21, 20, 0, tzinfo=UTC)
    with Session(db) as session, session.begin():
        job = repo.record_job(session, name="grpo-1", namespace="rl", spec_hash="abc", model_shape_hash="h")
        late = repo.record_decision(
            session,
            job_id=job,
            pod="rollout-0",
            at=t0 + timedelta(seconds=30),
            running_requests=3,
            from_layout=Layout(4, 1),
            to_layout=Layout(1, 4),
            method="migrate",
            predicted_gain_ms=900.0,
            predicted_cost_ms=120.5,
            outcome="started",
            reason="tail: 3 running < 4 ranks",
            inputs={"running": 3, "waiting": 0, "finished": 61, "predictor": "km+lognormal"},
        )
        early = repo.record_decision(
            session,
            job_id=job,
            pod="rollout-0",
            at=t0,
            running_requests=64,
            from_layout="4x1",
            to_layout=" 4X1 ",
            predicted_gain_ms=0.0,
            predicted_cost_ms=0.0,
            outcome="kept",
            reason="batch large enough",
        )
        loose = repo.record_decision(
            session,
            pod="rollout-9",
            running_requests=1,
            from_layout="2x1",
            to_layout="1x2",
            predicted_gain_ms=1.0,
            predicted_cost_ms=2.0,
            outcome="skipped",
        )
        repo.finish_decision(session, late, outcome="applied", actual_cost_ms=133.25, step=4711)
    with Session(db) as session:
        got = repo.list_decisions(session, job)
        everything = repo.list_decisions(session)
    assert [d.id for d in got] == [early, late]  # time order, not insertion order
    assert [d.id for d in everything][:2] == [early, late] and loose in [d.id for d in everything]
    d = got[1]
    assert (d.job_id, d.pod, d.at, d.running_requests) == (job, "rollout-0", t0 + timedelta(seconds=30), 3)
    assert (d.from_layout, d.to_layout, d.method) == ("4x1", "1x4", "migrate")
    assert (d.predicted_gain_ms, d.predicted_cost_ms, d.actual_cost_ms) == (900.0, 120.5, 133.25)
    assert (d.outcome, d.reason, d.step) == ("applied", "tail: 3 running < 4 ranks", 4711)
    assert d.inputs == {"running": 3, "waiting": 0, "finished": 61, "predictor": "km+lognormal"}
    assert d.at.tzinfo is UTC
    assert (got[0].to_layout, got[0].method, got[0].actual_cost_ms) == ("4x1", None, None)
    assert (got[0].inputs, got[0].step) == (None, None)


def test_bad_decisions_are_refused(db: Engine) -> None:
    def decide(session: Session, src: str, **extra: Any) -> int:
        return repo.record_decision(
            session, pod="p", running_requests=1, from_layout=src, to_layout="1x2", predicted_gain_ms=1.0,
            predicted_cost_ms=1.0, outcome="x", **extra,
        )  # fmt: skip

    with Session(db) as session, session.begin():
        with pytest.raises(UserError, match="from_layout: '2by1' is not of the form DxT"):
            decide(session, "2by1")
        with pytest.raises(UserError, match="method must be one of"):
            decide(session, "2x1", method="teleport")
        with pytest.raises(UserError, match="no job with id 77"):
            decide(session, "2x1", job_id=77)
        with pytest.raises(ValueError, match="timezone-aware"):
            decide(session, "2x1", at=datetime(2026, 1, 1))
        assert repo.list_decisions(session) == []
