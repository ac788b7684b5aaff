"""Invalid RolloutJobs are refused by the emulated API server with a 422 naming the field, like a real one."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException

from tests.k8s.runner import EmulatorHandle
from tests.k8s.test_emulator import GROUP, PLURAL, QUICKSTART, VERSION

INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("gpus-zero", {"gpusPerPod": 0}, "spec.gpusPerPod"),
    ("gpus-type", {"gpusPerPod": "two"}, "spec.gpusPerPod"),
    ("pods-too-many", {"pods": 5000}, "spec.pods"),
    ("top-p-zero", {"sampling": {"topP": 0}}, "spec.sampling.topP"),
    ("temperature-negative", {"sampling": {"temperature": -0.5}}, "spec.sampling.temperature"),
    ("stop-type", {"sampling": {"stop": "\n"}}, "spec.sampling.stop"),
    ("policy-unknown", {"parallelism": {"policy": "greedy"}}, "spec.parallelism.policy"),
    ("candidate-shape", {"parallelism": {"candidates": ["2x1", "2y1"]}}, "spec.parallelism.candidates[1]"),
    ("initial-shape", {"parallelism": {"initialLayout": "two"}}, "spec.parallelism.initialLayout"),
    ("dtype-unknown", {"model": {"path": "/m", "dtype": "int4"}}, "spec.model.dtype"),
    ("model-missing", {"model": None}, "spec.model"),
    ("output-missing", {"output": None}, "spec.output"),
    ("output-path-empty", {"output": {"path": ""}}, "spec.output.path"),
    ("unknown-field", {"replicas": 3}, "spec.replicas"),
    ("pull-policy", {"pod": {"imagePullPolicy": "Sometimes"}}, "spec.pod.imagePullPolicy"),
    ("node-selector-type", {"pod": {"nodeSelector": {"gpu": 1}}}, "spec.pod.nodeSelector.gpu"),
    ("ranks-mismatch", {"parallelism": {"candidates": ["2x1", "3x1"]}}, "spec.parallelism.candidates"),
    ("bad-name", {"@name": "Quick_Start"}, "metadata.name"),
]


def invalid_job(change: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(QUICKSTART)
    body["metadata"] = {"name": change.pop("@name", "bad")}
    body["spec"]["parallelism"].pop("initialLayout")  # keep the CEL rules out of the schema cases
    for key, value in change.items():
        if value is None:
            body["spec"].pop(key)
        elif isinstance(value, dict) and key in body["spec"]:
            body["spec"][key] = {**body["spec"][key], **value}
        else:
            body["spec"][key] = value
    return body


def refusal(err: ApiException) -> dict[str, Any]:
    assert err.status == 422, err.body
    status: dict[str, Any] = json.loads(err.body or "{}")
    assert status["kind"] == "Status" and status["reason"] == "Invalid" and status["code"] == 422
    return status


@pytest.mark.parametrize(("change", "where"), [(c, w) for _, c, w in INVALID], ids=[i for i, _, _ in INVALID])
def test_an_invalid_job_is_refused_naming_the_field(
    k8s_api: kubernetes.client.ApiClient, emulator: EmulatorHandle, change: dict[str, Any], where: str
) -> None:
    jobs = kubernetes.client.CustomObjectsApi(k8s_api)
    with pytest.raises(ApiException) as err:
        jobs.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, invalid_job(dict(change)))
    status = refusal(err.value)
    assert f"{where}:" in status["message"] or f'"{where}"' in status["message"], status["message"]
    assert where in [c["field"] for c in status["details"]["causes"]], status["details"]
    assert emulator.objects("rolloutjobs") == []


def test_a_patch_that_makes_a_job_invalid_is_refused(
    k8s_api: kubernetes.client.ApiClient, emulator: EmulatorHandle
) -> None:
    jobs: Any = kubernetes.client.CustomObjectsApi(k8s_api)
    jobs.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, copy.deepcopy(QUICKSTART))
    before = emulator.objects("rolloutjobs")
    for patch, where in [
        ({"spec": {"gpusPerPod": 0}}, "spec.gpusPerPod"),
        ({"spec": {"parallelism": {"candidates": ["2x1", "1x"]}}}, "spec.parallelism.candidates[1]"),
        ({"spec": {"output": None}}, "spec.output"),
    ]:
        with pytest.raises(ApiException) as err:
            jobs.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "quickstart", patch)
        assert where in [c["field"] for c in refusal(err.value)["details"]["causes"]]
    with pytest.raises(ApiException) as err:
        jobs.patch_namespaced_custom_object_status(
            GROUP, VERSION, "default", PLURAL, "quickstart", {"status": {"phase": "Exploded"}}
        )
    assert "status.phase" in refusal(err.value)["message"]
    assert emulator.objects("rolloutjobs") == before
