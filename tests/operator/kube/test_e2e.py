"""A RolloutJob on the Kubernetes API emulator, end to end: created with the `kubernetes` client, the operator
makes its Secret, Service and pods; the test's kubelet starts each pod's engine and sidecar from the pod
manifest itself; the operator polls the sidecars, plans with a profile in which TP=2 pays in the tail and
switches honestly; the job succeeds with every sample written once, the status and the Events say what
happened, and the database (PostgreSQL, as on a cluster) holds the job and its decisions."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rollout_profiler.store import database, runs
from rollout_profiler.store.testing import fresh_database
from sqlalchemy.orm import Session

from tests.operator.kube.conftest import NS, Cluster
from tests.operator.local.jobs import ALL, job_doc, records, write_prompts
from tests.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.postgres]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[str]:
    with fresh_database("postgres", tmp_path) as url:
        yield url


def e2e_doc(model: Path, prompts: Path, out: Path, name: str, **spec: Any) -> dict[str, Any]:
    doc = job_doc(model, prompts, out, **spec)
    doc["metadata"] = {"name": name, "labels": {"kueue.x-k8s.io/queue-name": "rollouts"}}
    return doc


def test_a_job_runs_to_succeeded_and_the_planner_switches_honestly(
    cluster: Cluster, tiny64: Path, prompts: Path, tmp_path: Path, pg_url: str
) -> None:
    cluster.db_url = pg_url
    op = cluster.start_operator()
    out = tmp_path / "out"
    cluster.create_job(e2e_doc(tiny64, prompts, out, "e2e"))
    st = cluster.wait_phase("e2e", "Succeeded", 240)
    why = cluster.explain("e2e")

    # what the operator made: the token Secret, the headless Service, one pod per index, each started once
    secret = cluster.core.read_namespaced_secret("e2e-token", NS)
    assert set(secret.data) == {"engine-key", "sidecar-token"}
    assert secret.metadata.owner_references[0].name == "e2e"
    svc = cluster.core.read_namespaced_service("e2e", NS)
    assert svc.spec.cluster_ip == "None" and {p.port for p in svc.spec.ports} == {30000, 8080, 8081}
    assert [cluster.kubelet.started(f"e2e-{i}") for i in (0, 1)] == [1, 1], why()
    wait_until(
        lambda: not cluster.pods("e2e"), what="the finished job's pods deleted", timeout=30, explain=why
    )

    # every sample once, with the prompt's fields passed through
    recs = records(out)
    assert sorted((r["prompt_id"], r["sample"]) for r in recs) == sorted(ALL), why()
    assert all(r["data_source"] == "arith" for r in recs)
    switched = [r for r in recs if len(r["layouts"]) > 1]
    assert switched, "no request spanned two layouts"

    # the status
    n = len(ALL)
    assert st["progress"] == f"{n}/{n}" and st["samplesDone"] == n and st["observedGeneration"] == 1, st
    assert st["reconfigurations"] >= 1 and st["startTime"] and st["completionTime"], st
    assert st["generationSeconds"] > 0 and st["output"] == str(out) and st["tokens"] > 0, st
    assert {c["type"]: c["status"] for c in st["conditions"]}["Complete"] == "True", st
    assert len(st["pods"]) == 2 and all(p["samplesDone"] == p["samplesTotal"] > 0 for p in st["pods"]), st
    ran = [d for d in st["lastDecisions"] if d["actualCostMs"] is not None]
    assert ran, st["lastDecisions"]
    for d in ran:  # honest: each switch the planner asked for was predicted to pay, past the margin
        if d["predictedGainMs"] > 0:
            assert d["predictedGainMs"] > d["predictedCostMs"] * 1.1, d
        # mostly 2x1 -> 1x2; requests that reach a pod after it consolidated are a new wave, which may move
        # it back toward 2x1 when that too is predicted to pay
        assert {d["fromLayout"], d["toLayout"]} == {"2x1", "1x2"} and d["step"] is not None, d

    # kubectl shows the operator's status in the CRD's printer columns
    kubectl = Path(sys.executable).parent / "kubectl"
    env = os.environ | {"KUBECACHEDIR": str(tmp_path / "kube-cache")}
    got = subprocess.run(
        [str(kubectl), "get", "rj", "e2e"], capture_output=True, text=True, env=env, timeout=60
    )
    assert got.returncode == 0, got.stderr
    header, row = got.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "PROGRESS", "LAYOUT", "RECONFIGS", "AGE"]
    assert row.split()[:5] == ["e2e", "Succeeded", f"{n}/{n}", st["layout"], str(st["reconfigurations"])], row

    # the Events
    reasons = [r for r, _ in cluster.events("e2e")]
    for want in ("Created", "ReconfigurationPlanned", "Reconfigured", "Completed"):
        assert want in reasons, (want, reasons)

    # the database: the job, its outcome, its decisions with the cost they took, the finished lengths
    db = database.make_engine(pg_url)
    with Session(db) as session:
        job = runs.get_job(session, st["recordId"])
        assert (job.name, job.namespace, job.outcome) == ("e2e", NS, "succeeded")
        decisions = runs.list_decisions(session, st["recordId"])
        assert decisions and all(d.outcome == "committed" for d in decisions), decisions
        assert any(d.to_layout == "1x2" for d in decisions), decisions  # the tail consolidated
        assert all(d.actual_cost_ms is not None and d.step is not None for d in decisions), decisions
    db.dispose()
    assert op.metric("rollout_operator_jobs_created_total") == 1
    assert op.metric('rollout_operator_jobs_finished_total{outcome="succeeded"}') == 1
