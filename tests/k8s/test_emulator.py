"""The emulator keeps the API server's contract: metadata, generation, status subresource, finalizers,
garbage collection, label selectors and optimistic concurrency."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes.client
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from tests.k8s.runner import ROOT, EmulatorHandle

GROUP, VERSION, PLURAL = "elasticrollout.dev", "v1alpha1", "rolloutjobs"
QUICKSTART: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def job(name: str = "quickstart", **labels: str) -> dict[str, Any]:
    body = copy.deepcopy(QUICKSTART)
    body["metadata"] = {"name": name, "labels": labels}
    return body


@pytest.fixture
def jobs(k8s_api: kubernetes.client.ApiClient) -> Any:
    return kubernetes.client.CustomObjectsApi(k8s_api)


def create(jobs: Any, body: dict[str, Any]) -> Any:
    return jobs.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)


def test_create_get_list_by_label(jobs: Any) -> None:
    made = create(jobs, job("a", team="x"))
    meta = made["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["generation"] == 1 and meta["namespace"] == "default"
    assert made["spec"]["sampling"]["topP"] == 1.0  # schema defaults applied
    create(jobs, job("b", team="y"))
    got = jobs.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "a")
    assert got["metadata"]["uid"] == meta["uid"]
    listed = jobs.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)
    assert listed["kind"] == "RolloutJobList" and listed["metadata"]["resourceVersion"]
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a", "b"]
    for selector, names in [
        ("team=x", ["a"]),
        ("team!=x", ["b"]),
        ("team in (x,y)", ["a", "b"]),
        ("!team", []),
    ]:
        items = jobs.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, label_selector=selector)
        assert [i["metadata"]["name"] for i in items["items"]] == names, selector
    with pytest.raises(ApiException) as err:
        create(jobs, job("a"))
    assert err.value.status == 409 and json.loads(err.value.body or "{}")["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as err:
        jobs.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "nope")
    assert err.value.status == 404 and json.loads(err.value.body or "{}")["reason"] == "NotFound"


def test_generation_and_the_status_subresource(jobs: Any) -> None:
    made = create(jobs, job())
    rv0 = made["metadata"]["resourceVersion"]
    patched = jobs.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "quickstart", {"spec": {"sampling": {"seed": 7}}}
    )
    assert patched["metadata"]["generation"] == 2 and patched["metadata"]["resourceVersion"] != rv0
    kept = QUICKSTART["spec"]["sampling"]["maxNewTokens"]
    assert patched["spec"]["sampling"]["maxNewTokens"] == kept  # a merge patch, not a replacement
    status = jobs.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "quickstart", {"status": {"phase": "Running"}, "spec": {"pods": 5}}
    )
    assert status["status"]["phase"] == "Running"
    assert status["spec"]["pods"] == 1 and status["metadata"]["generation"] == 2
    main = jobs.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "quickstart", {"status": {"phase": "Failed"}}
    )
    assert main["status"]["phase"] == "Running" and main["metadata"]["generation"] == 2
    labelled = jobs.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "quickstart", {"metadata": {"labels": {"a": "b"}}}
    )
    assert labelled["metadata"]["generation"] == 2 and labelled["metadata"]["labels"] == {"a": "b"}


def test_replace_and_a_stale_resource_version(jobs: Any) -> None:
    made = create(jobs, job())
    fresh = copy.deepcopy(made)
    fresh["spec"]["pods"] = 2
    replaced = jobs.replace_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "quickstart", fresh)
    assert replaced["spec"]["pods"] == 2 and replaced["metadata"]["generation"] == 2
    made["spec"]["pods"] = 3  # still carries the first resourceVersion
    with pytest.raises(ApiException) as err:
        jobs.replace_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "quickstart", made)
    assert err.value.status == 409 and json.loads(err.value.body or "{}")["reason"] == "Conflict"
    stale = {"metadata": {"resourceVersion": made["metadata"]["resourceVersion"]}, "spec": {"pods": 4}}
    with pytest.raises(ApiException) as err:
        jobs.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "quickstart", stale)
    assert err.value.status == 409
    replaced["status"] = {"phase": "Running"}
    done = jobs.replace_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "quickstart", replaced
    )
    assert (
        done["status"]["phase"] == "Running"
        and done["status"]["tokens"] == 0
        and done["metadata"]["generation"] == 2
    )


def test_finalizers_hold_the_deletion(jobs: Any, emulator: EmulatorHandle) -> None:
    body = job()
    body["metadata"]["finalizers"] = ["elasticrollout.dev/cleanup"]
    create(jobs, body)
    jobs.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "quickstart")
    held = jobs.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "quickstart")
    assert held["metadata"]["deletionTimestamp"]
    jobs.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "quickstart", {"metadata": {"finalizers": None}}
    )
    assert emulator.objects("rj") == []


def test_deleting_the_owner_collects_its_pods(
    jobs: Any, k8s_api: kubernetes.client.ApiClient, emulator: EmulatorHandle
) -> None:
    owner = create(jobs, job())
    uid = owner["metadata"]["uid"]
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RolloutJob", "name": "quickstart", "uid": uid}
    core: Any = kubernetes.client.CoreV1Api(k8s_api)
    gpus = {"limits": {"nvidia.com/gpu": "2"}}  # quantities are strings for the `kubernetes` client
    pod: Any = {
        "metadata": {"name": "quickstart-0", "ownerReferences": [{**ref, "controller": True}]},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": gpus}]},
    }
    core.create_namespaced_pod("default", pod)
    core.create_namespaced_pod("default", {"metadata": {"name": "other"}, "spec": pod["spec"]})
    assert [p["metadata"]["name"] for p in emulator.objects("pods")] == ["other", "quickstart-0"]
    jobs.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "quickstart")
    assert [p["metadata"]["name"] for p in emulator.objects("pods")] == ["other"]
    assert emulator.objects("RolloutJob") == []
