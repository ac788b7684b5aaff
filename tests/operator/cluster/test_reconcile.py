"""The reconciler as a pure state machine: each case is what the API and the sidecars showed, and what the
operator must do (pods made and deleted, phase, conditions, Events) and must not do (count a failure twice,
make a pod while its namesake is still going)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rollout_operator.api.job import RolloutJobSpec
from rollout_operator.api.status import RolloutJobStatus
from rollout_operator.cluster.reconcile import Actions, Observed, PodView, condition, pod_view, reconcile
from rollout_worker.api.sidecar import Progress

T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
SPEC: dict[str, Any] = {
    "model": {"path": "/m"},
    "gpusPerPod": 2,
    "pods": 2,
    "prompts": {"path": "/p.jsonl"},
    "output": {"path": "/out"},
    "backoffLimit": 1,
}


def _spec(**over: Any) -> RolloutJobSpec:
    return RolloutJobSpec.model_validate(SPEC | over)


def _pod(i: int, phase: str = "Running", uid: str | None = None, deleting: bool = False) -> PodView:
    return PodView(i, f"rl-{i}", uid or f"u{i}", phase, f"127.0.0.{i + 2}", phase == "Running", deleting)


def _progress(i: int, done: int, total: int = 4, layout: str = "2x1") -> Progress:
    return Progress(
        mode="job", pod_index=i, pods=2, samples_done=done, samples_total=total, in_flight=0,
        not_submitted=0, running=1, waiting=0, layout=layout, tokens_per_s=1.0, reconfigurations=0,
        weight_version=None, engine_ready=True, snapshot_age_s=0.1, elapsed_s=1.0, done=done == total,
        output_file=None,
    )  # fmt: skip


def _obs(
    status: RolloutJobStatus,
    pods: list[PodView],
    progress: list[Progress] = (),  # type: ignore[assignment]
    now: datetime = T0,
    away: dict[int, float] | None = None,
    **spec: Any,
) -> Observed:
    return Observed(
        "rl", _spec(**spec), status, 1, now, {p.index: p for p in pods}, {p.pod_index: p for p in progress},
        away or {}, 10.0,
    )  # fmt: skip


def _started() -> RolloutJobStatus:
    return RolloutJobStatus(phase="Pending", start_time="2026-11-23T12:00:00Z", layout_plan="2x1 (2x1,1x2)")


def _run(*steps: Observed) -> Actions:
    acts = None
    for obs in steps:
        acts = reconcile(obs)
    assert acts is not None
    return acts


def test_a_new_job_makes_every_pod_then_runs_and_reports_progress() -> None:
    first = reconcile(_obs(_started(), []))
    assert first.create == [0, 1] and first.status.phase == "Pending" and not first.delete
    acts = reconcile(_obs(first.status, [_pod(0), _pod(1)], [_progress(0, 1), _progress(1, 2, layout="1x2")]))
    st = acts.status
    assert acts.create == [] and st.phase == "Running" and st.progress == "3/8"
    assert st.layout == "1x2,2x1" and condition(st, "Ready") and condition(st, "Progressing")
    assert [p.samples_done for p in st.pods] == [1, 2] and st.pods[1].ip == "127.0.0.3"


def test_every_shard_written_succeeds_and_deletes_the_pods() -> None:
    acts = reconcile(_obs(_started(), [_pod(0), _pod(1)], [_progress(0, 4), _progress(1, 4)]))
    assert acts.finished == "succeeded" and acts.status.phase == "Succeeded"
    assert acts.delete == ["rl-0", "rl-1"] and acts.create == []
    assert condition(acts.status, "Complete") and [e.reason for e in acts.events] == ["Completed"]
    assert acts.status.generation_seconds == 0.0 and acts.status.completion_time is not None
    again = reconcile(_obs(acts.status, [_pod(1)]))  # a straggler is deleted, nothing made
    assert again.delete == ["rl-1"] and again.create == [] and again.finished is None


def test_a_failed_pod_is_counted_once_made_again_and_fails_the_job_past_the_backoff_limit() -> None:
    st = reconcile(_obs(_started(), [_pod(0), _pod(1)])).status
    acts = reconcile(_obs(st, [_pod(0, "Failed", "a"), _pod(1)]))
    assert acts.delete == ["rl-0"] and acts.create == [0] and acts.status.pods[0].restarts == 1
    assert [e.reason for e in acts.events] == ["PodFailed"]
    seen_again = reconcile(_obs(acts.status, [_pod(0, "Failed", "a"), _pod(1)]))  # the delete failed
    assert seen_again.status.pods[0].restarts == 1 and seen_again.events == []
    going = reconcile(_obs(acts.status, [_pod(0, "Failed", "a", deleting=True), _pod(1)]))
    assert going.create == [] and going.delete == []  # its namesake is still being deleted
    second = reconcile(_obs(acts.status, [_pod(0, "Running", "b"), _pod(1, "Failed", "c")]))
    assert second.finished == "failed" and second.status.phase == "Failed"
    assert "backoffLimit 1" in (second.status.message or "") and condition(second.status, "Failed")
    assert second.delete == ["rl-0", "rl-1"] and second.create == []


def test_suspend_deletes_the_pods_and_resume_makes_them_again() -> None:
    st = reconcile(_obs(_started(), [_pod(0), _pod(1)])).status
    sus = reconcile(_obs(st, [_pod(0), _pod(1)], suspend=True))
    assert sus.status.phase == "Suspended" and sus.delete == ["rl-0", "rl-1"] and sus.create == []
    assert condition(sus.status, "Suspended") and [e.reason for e in sus.events] == ["Suspended"]
    quiet = reconcile(_obs(sus.status, [], suspend=True))
    assert quiet.events == [] and quiet.create == []
    res = reconcile(_obs(quiet.status, [], now=T0 + timedelta(hours=1)))
    assert res.status.phase == "Pending" and res.create == [0, 1] and not condition(res.status, "Suspended")
    assert res.status.start_time == "2026-11-23T13:00:00Z" and [e.reason for e in res.events] == ["Resumed"]


def test_the_deadline_fails_the_job() -> None:
    st = reconcile(_obs(_started(), [_pod(0), _pod(1)])).status
    ok = reconcile(_obs(st, [_pod(0), _pod(1)], now=T0 + timedelta(seconds=59), activeDeadlineSeconds=60))
    assert ok.finished is None
    late = reconcile(_obs(st, [_pod(0), _pod(1)], now=T0 + timedelta(seconds=61), activeDeadlineSeconds=60))
    assert late.finished == "failed" and condition(late.status, "Failed")
    assert {c.reason for c in late.status.conditions if c.type == "Failed"} == {"DeadlineExceeded"}
    assert late.delete == ["rl-0", "rl-1"]


def test_an_unreachable_sidecar_degrades_the_job_until_it_answers_again() -> None:
    st = reconcile(_obs(_started(), [_pod(0), _pod(1)], [_progress(0, 1), _progress(1, 1)])).status
    brief = reconcile(_obs(st, [_pod(0), _pod(1)], [_progress(0, 1)], away={1: 3.0}))
    assert not condition(brief.status, "Degraded") and brief.events == []
    assert brief.status.pods[1].reachable is False and brief.status.pods[1].samples_done == 1  # last known
    long = reconcile(_obs(brief.status, [_pod(0), _pod(1)], [_progress(0, 1)], away={1: 12.0}))
    assert condition(long.status, "Degraded") and [e.reason for e in long.events] == ["Degraded"]
    assert [c.message for c in long.status.conditions if c.type == "Degraded"] == [
        "sidecar unreachable: rl-1"
    ]
    still = reconcile(_obs(long.status, [_pod(0), _pod(1)], [_progress(0, 1)], away={1: 20.0}))
    assert still.events == []  # one Event per episode
    back = reconcile(_obs(still.status, [_pod(0), _pod(1)], [_progress(0, 2), _progress(1, 2)]))
    assert not condition(back.status, "Degraded") and [e.reason for e in back.events] == ["Recovered"]


def test_pod_view_reads_phase_address_readiness_and_why_a_container_failed() -> None:
    obj = {
        "metadata": {"name": "rl-3", "uid": "x", "labels": {"elasticrollout.dev/pod-index": "3"}},
        "status": {
            "phase": "Failed",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"name": "sidecar", "state": {"terminated": {"exitCode": 1}}}],
        },
    }
    v = pod_view(obj)
    assert v is not None and (v.index, v.phase, v.ip, v.ready) == (3, "Failed", "10.0.0.7", False)
    assert "container sidecar exited with code 1" in v.message
    assert pod_view({"metadata": {"name": "other"}}) is None


def test_a_sidecar_back_in_the_last_tick_is_a_recovery_even_as_the_job_succeeds() -> None:
    st = reconcile(_obs(_started(), [_pod(0), _pod(1)], [_progress(0, 1)], away={1: 12.0})).status
    assert condition(st, "Degraded")
    end = reconcile(_obs(st, [_pod(0), _pod(1)], [_progress(0, 4), _progress(1, 4)]))
    assert end.finished == "succeeded" and not condition(end.status, "Degraded")
    assert [e.reason for e in end.events] == ["Recovered", "Completed"]
