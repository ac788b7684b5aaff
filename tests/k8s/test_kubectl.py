"""kubectl against the emulator: apply, get with the CRD's printer columns, -o json, delete --wait."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes.client

from tests.k8s.runner import ROOT, EmulatorHandle
from tests.k8s.test_emulator import GROUP, PLURAL, VERSION

KUBECTL = Path(sys.executable).parent / "kubectl"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def kubectl(*args: str) -> str:
    done = subprocess.run([str(KUBECTL), *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, (
        f"kubectl {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
    assert "ambiguous" not in done.stderr and "Warning" not in done.stderr, done.stderr
    return done.stdout


def test_apply_get_and_delete(k8s_api: kubernetes.client.ApiClient) -> None:
    assert "rolloutjob.elasticrollout.dev/quickstart created" in kubectl("apply", "-f", str(QUICKSTART))
    assert "unchanged" in kubectl("apply", "-f", str(QUICKSTART))
    status = {"phase": "Running", "progress": "3/32", "layout": "1x2", "reconfigurations": 1}
    jobs = kubernetes.client.CustomObjectsApi(k8s_api)
    jobs.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "quickstart", {"status": status}
    )
    assert "condition met" in kubectl(
        "wait", "rj/quickstart", "--for=jsonpath={.status.phase}=Running", "--timeout=10s"
    )
    header, row = kubectl("get", "rj").splitlines()
    assert header.split() == ["NAME", "PHASE", "PROGRESS", "LAYOUT", "RECONFIGS", "AGE"]
    assert row.split()[:5] == ["quickstart", "Running", "3/32", "1x2", "1"], row
    assert row.split()[5][-1] in "smh"
    got = json.loads(kubectl("get", "rolloutjobs.elasticrollout.dev", "quickstart", "-o", "json"))
    assert got["status"]["progress"] == "3/32" and got["spec"]["gpusPerPod"] == 2
    assert "quickstart" in kubectl("describe", "rj", "quickstart")
    assert "deleted" in kubectl("delete", "-f", str(QUICKSTART), "--wait=true", "--timeout=15s")
    assert kubectl("get", "rj", "-o", "name") == ""


def test_kubectl_refuses_an_invalid_job(emulator: EmulatorHandle, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(QUICKSTART.read_text().replace("gpusPerPod: 2", "gpusPerPod: 0"))
    done = subprocess.run([str(KUBECTL), "apply", "-f", str(bad)], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "spec.gpusPerPod" in done.stderr, done.stderr
    assert emulator.objects("rj") == []
