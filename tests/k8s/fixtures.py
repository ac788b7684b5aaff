"""pytest fixtures for tests that need a Kubernetes API: import them in a conftest.py:

from tests.k8s.fixtures import emulator, k8s_api, kubelet  # noqa: F401
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest

from tests.k8s.kubelet import LocalKubelet
from tests.k8s.runner import ROOT, EmulatorHandle, serve_emulator


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatorHandle]:
    """An API server emulator serving crds/rolloutjob.yaml; $KUBECONFIG (and $KUBECACHEDIR) point at it."""
    with serve_emulator(crd_paths=[ROOT / "crds" / "rolloutjob.yaml"]) as emu:
        monkeypatch.setenv("KUBECONFIG", str(emu.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setenv("KUBECACHEDIR", str(tmp_path / "kube-cache"))
        yield emu
        errors = emu.errors()
    assert not errors, f"the emulator failed while serving: {errors!r}"


def api_client(url: str) -> kubernetes.client.ApiClient:
    config = kubernetes.client.Configuration(host=url)
    config.api_key = {"BearerToken": "dummy-token"}
    config.api_key_prefix = {"BearerToken": "Bearer"}
    return kubernetes.client.ApiClient(config)


@pytest.fixture
def k8s_api(emulator: EmulatorHandle) -> Iterator[kubernetes.client.ApiClient]:
    """A `kubernetes` client bound to the emulator."""
    with api_client(emulator.url) as client:
        yield client


@pytest.fixture
def kubelet(
    emulator: EmulatorHandle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalKubelet]:
    """Runs the pods of namespace `default` as local processes (the venv's bin first on PATH)."""
    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ.get("PATH", ""))
    with LocalKubelet(emulator.url, "default", tmp_path / "kubelet-logs") as node:
        yield node
    assert not [e for e in node.errors if not isinstance(e, Exception)], node.errors
