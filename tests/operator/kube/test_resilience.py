"""The operator when things go wrong mid-job, on the emulator with real pods: the operator killed and made
again (the job completes, no pod made twice, no sample lost, no decision recorded twice), a sidecar that
stops answering for a while (Degraded, then Recovered), `suspend` (pods deleted, then resumed from the
outputs), and a pod that keeps failing (Failed once backoffLimit is spent)."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest
from rollout_profiler.store import database, runs
from sqlalchemy.orm import Session

from tests.operator.kube.conftest import Cluster
from tests.operator.kube.test_e2e import e2e_doc
from tests.operator.local.jobs import ALL, records, write_prompts
from tests.waiting import wait_until

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def _condition(c: Cluster, job: str, type_: str) -> str | None:
    for cond in c.status(job).get("conditions") or []:
        if cond["type"] == type_:
            return str(cond["status"])
    return None


def _exactly_once(out: Path) -> None:
    keys = [(r["prompt_id"], r["sample"]) for r in records(out)]
    twice = [k for k, n in Counter(keys).items() if n > 1]
    assert not twice and sorted(keys) == sorted(ALL), (twice, len(keys))


def _writing(c: Cluster, job: str) -> bool:
    st = c.status(job)
    return st.get("phase") == "Running" and 0 < st.get("samplesDone", 0) < len(ALL)


@pytest.mark.long
def test_the_operator_killed_mid_job_and_a_sidecar_away_for_a_while(
    cluster: Cluster, tiny64: Path, prompts: Path, tmp_path: Path
) -> None:
    op = cluster.start_operator("first")
    out = tmp_path / "out"
    cluster.create_job(e2e_doc(tiny64, prompts, out, "restart"))
    why = cluster.explain("restart")
    wait_until(lambda: _writing(cluster, "restart"), what="the job half-way", timeout=180, explain=why)
    op.stop(signal.SIGKILL)
    cluster.kubelet.pause("restart-1", "sidecar")  # away while no operator watches, and after
    second = cluster.start_operator("second")
    wait_until(
        lambda: _condition(cluster, "restart", "Degraded") == "True", what="Degraded", timeout=60, explain=why
    )
    cluster.kubelet.resume("restart-1", "sidecar")
    wait_until(
        lambda: _condition(cluster, "restart", "Degraded") == "False",
        what="recovered",
        timeout=60,
        explain=why,
    )
    st = cluster.wait_phase("restart", "Succeeded", 240)
    assert [cluster.kubelet.started(f"restart-{i}") for i in (0, 1)] == [1, 1], why()
    _exactly_once(out)
    reasons = [r for r, _ in cluster.events("restart")]
    assert "Degraded" in reasons and "Recovered" in reasons and "Completed" in reasons, reasons
    with Session(database.make_engine(cluster.db_url)) as session:
        ran = [(d.pod, d.step) for d in runs.list_decisions(session, st["recordId"]) if d.step is not None]
        assert len(ran) == len(set(ran)), ran  # no switch recorded twice across the restart
        assert runs.get_job(session, st["recordId"]).outcome == "succeeded"
    assert second.metric("rollout_operator_jobs_created_total") == 0  # the job was the first operator's


@pytest.mark.long
def test_suspend_mid_job_deletes_the_pods_and_resume_completes_with_nothing_lost(
    cluster: Cluster, tiny64: Path, prompts: Path, tmp_path: Path
) -> None:
    cluster.start_operator()
    out = tmp_path / "out"
    cluster.create_job(e2e_doc(tiny64, prompts, out, "pause"))
    why = cluster.explain("pause")
    wait_until(lambda: _writing(cluster, "pause"), what="the job half-way", timeout=180, explain=why)
    cluster.patch_job("pause", {"spec": {"suspend": True}})
    cluster.wait_phase("pause", "Suspended", 60)
    wait_until(
        lambda: not cluster.pods("pause") and not cluster.kubelet.running(),
        what="pods gone",
        timeout=60,
        explain=why,
    )
    written = len(records(out))
    assert 0 < written < len(ALL)
    assert _condition(cluster, "pause", "Suspended") == "True"
    cluster.patch_job("pause", {"spec": {"suspend": False}})
    cluster.wait_phase("pause", "Succeeded", 240)
    assert [cluster.kubelet.started(f"pause-{i}") for i in (0, 1)] == [2, 2], why()
    _exactly_once(out)
    reasons = [r for r, _ in cluster.events("pause")]
    assert "Suspended" in reasons and "Resumed" in reasons, reasons


@pytest.mark.long
def test_a_pod_failing_repeatedly_fails_the_job_after_the_backoff_limit(
    cluster: Cluster, prompts: Path, tmp_path: Path
) -> None:
    cluster.start_operator()
    missing = tmp_path / "no-such-model"
    doc = e2e_doc(
        missing, prompts, tmp_path / "out", "broken", pods=1, backoffLimit=1, ttlSecondsAfterFinished=4
    )
    doc["spec"]["parallelism"] = {"policy": "static", "initialLayout": "2x1"}
    cluster.create_job(doc)
    st = cluster.wait_phase("broken", "Failed", 120)
    why = cluster.explain("broken")
    assert "backoffLimit 1" in st["message"] and "broken-0" in st["message"], st
    assert cluster.kubelet.started("broken-0") == 2, why()  # the first try and one more
    wait_until(
        lambda: not cluster.pods("broken"), what="the failed job's pods deleted", timeout=30, explain=why
    )
    reasons = [r for r, _ in cluster.events("broken")]
    assert reasons.count("PodFailed") == 1 and "Failed" in reasons, reasons
    with Session(database.make_engine(cluster.db_url)) as session:
        assert runs.get_job(session, st["recordId"]).outcome == "failed"
    gone = lambda: not any(j["metadata"]["name"] == "broken" for j in cluster.jobs())  # noqa: E731
    wait_until(gone, what="the job deleted after ttlSecondsAfterFinished", timeout=30, explain=why)
