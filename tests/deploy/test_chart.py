"""The Helm chart (charts/elastic-rollout), offline: lint, render with each values variant, validate the
built-in kinds with kubernetes-validate --strict, and check what the chart promises: the CRD is the
repository's, RBAC is exactly tests/deploy/rbac_rules.py, values.schema.json refuses bad values, the
NetworkPolicy admits the admin port only from the operator, the operator runs non-root and read-only, and
values.yaml is documented and typed key by key."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from rollout_operator.api import cluster as k
from rollout_operator.cluster import settings as operator_settings

from tests.deploy import rbac_rules
from tests.deploy.conftest import CHART, NAMESPACE, ROOT, Docs, Helm, of_kind, one

Render = Callable[..., Docs]
POSTGRES = {"postgres": {"existingSecret": "rollout-db", "key": "url"}}

# values variant -> {kind: how many objects of it}
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, int]]] = {
    "defaults": (
        {},
        {
            "Deployment": 1,
            "ServiceAccount": 1,
            "Service": 1,
            "PersistentVolumeClaim": 1,
            "CustomResourceDefinition": 3,
            "ClusterRole": 1,
            "ClusterRoleBinding": 1,
            "Role": 0,
            "RoleBinding": 0,
            "NetworkPolicy": 1,
            "ServiceMonitor": 0,
            "KopfPeering": 0,
            "ClusterKopfPeering": 0,
        },
    ),
    "replicas-2-postgres": (
        {"replicas": 2, "database": POSTGRES},
        {"PersistentVolumeClaim": 0, "ClusterKopfPeering": 1, "KopfPeering": 0},
    ),
    "watch-namespaces": (
        {"watchNamespaces": ["a", "b"]},
        {"Role": 2, "RoleBinding": 2, "ClusterRole": 1, "NetworkPolicy": 3, "KopfPeering": 0},
    ),
    "watch-namespaces-replicas-2": (
        {"watchNamespaces": ["a", "b"], "replicas": 2, "database": POSTGRES},
        {"Role": 2, "KopfPeering": 2, "ClusterKopfPeering": 0, "PersistentVolumeClaim": 0},
    ),
    "crds-disabled": ({"crds": {"enabled": False}}, {"CustomResourceDefinition": 0}),
    "network-policy-disabled": ({"networkPolicy": {"enabled": False}}, {"NetworkPolicy": 0}),
    "service-monitor": ({"metrics": {"serviceMonitor": {"enabled": True}}}, {"ServiceMonitor": 1}),
}
CUSTOM_API_GROUPS = ("elasticrollout.dev/", "kopf.dev/", "monitoring.coreos.com/")


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def deployment_container(docs: Docs) -> dict[str, Any]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def env_of(docs: Docs) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in deployment_container(docs)["env"]}


# ---------------------------------------------------------------- lint and render


def test_helm_lint_strict(helm: Helm) -> None:
    proc = helm.run("lint", "--strict", str(CHART))
    assert proc.returncode == 0, f"helm lint --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_renders(render: Render, variant: str) -> None:
    values, expected = VARIANTS[variant]
    docs = render(values)
    counts = {kind: len(of_kind(docs, kind)) for kind in expected}
    assert counts == expected
    for doc in docs:
        assert doc["metadata"]["name"], doc
        if doc["kind"] not in {
            "CustomResourceDefinition",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterKopfPeering",
        }:
            assert doc["metadata"].get("namespace"), (
                f"{doc['kind']} {doc['metadata']['name']} has no namespace"
            )
    # the peering objects are post-install hooks: their CRD (templates/crds.yaml) must exist first
    for doc in of_kind(docs, "KopfPeering") + of_kind(docs, "ClusterKopfPeering"):
        assert "post-install" in doc["metadata"]["annotations"]["helm.sh/hook"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_database_and_strategy(render: Render, variant: str) -> None:
    docs = render(VARIANTS[variant][0])
    deploy = one(docs, "Deployment")
    env = env_of(docs)
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    if of_kind(docs, "PersistentVolumeClaim"):  # SQLite: one writer on a ReadWriteOnce volume
        pvc = one(docs, "PersistentVolumeClaim")
        assert deploy["spec"]["strategy"]["type"] == "Recreate"
        assert env["ROLLOUT_OPERATOR_DATABASE_URL"] == "sqlite:////var/lib/elastic-rollout/rollout.db"
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    else:
        assert env["ROLLOUT_OPERATOR_DATABASE_URL"] == {"secretKeyRef": {"name": "rollout-db", "key": "url"}}
        assert "emptyDir" in volumes["data"]
    peering = deploy["spec"]["replicas"] > 1
    assert ("ROLLOUT_OPERATOR_PEERING" in env) == peering
    assert env["ROLLOUT_HOME"] == "/var/lib/elastic-rollout"


def test_watch_namespaces_become_flags(render: Render) -> None:
    assert deployment_container(render())["args"] == ["operator"]
    container = deployment_container(render({"watchNamespaces": ["a", "b"]}))
    assert container["command"] == ["rolloutctl"]
    assert container["args"] == ["operator", "--namespace", "a", "--namespace", "b"]


def test_deployment_env_is_valid_operator_settings(render: Render, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ROLLOUT_OPERATOR_* variable the chart sets is one the operator knows (it refuses unknown ones)
    and its value parses; the probe and the metrics port are the settings' ports."""
    for values in ({}, {"replicas": 2, "database": POSTGRES}):
        docs = render(values)
        for var in [v for v in os.environ if v.startswith(operator_settings.ENV_PREFIX)]:
            monkeypatch.delenv(var)
        for name, value in env_of(docs).items():
            if name.startswith(operator_settings.ENV_PREFIX):
                monkeypatch.setenv(name, value if isinstance(value, str) else "postgresql+psycopg://x@y/z")
        got = operator_settings.load_settings()
        container = deployment_container(docs)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert (
            ports
            == {"metrics": got.metrics_port, "health": got.health_port}
            == {"metrics": 9090, "health": 8080}
        )
        probe = container["livenessProbe"]["httpGet"]
        assert probe["path"] == "/healthz" and ports[probe["port"]] == got.health_port
        assert got.profiles_dir == Path("/opt/elastic-rollout/profiles")
        assert (got.peering == "elastic-rollout") == (values.get("replicas", 1) > 1)


def test_metrics_service_and_service_monitor(render: Render) -> None:
    docs = render({"metrics": {"serviceMonitor": {"enabled": True, "interval": "15s"}}})
    svc = one(docs, "Service")
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"


# ---------------------------------------------------------------- kubernetes-validate


def validate(docs: Docs, path: Path) -> subprocess.CompletedProcess[str]:
    path.write_text(yaml.safe_dump_all(docs))
    return run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", str(path)])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_builtin_kinds_pass_kubernetes_validate(render: Render, variant: str, tmp_path: Path) -> None:
    builtin = [d for d in render(VARIANTS[variant][0]) if not d["apiVersion"].startswith(CUSTOM_API_GROUPS)]
    proc = validate(builtin, tmp_path / "rendered.yaml")
    assert proc.returncode == 0, f"kubernetes-validate --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for doc in builtin:  # each was validated, not skipped
        what = f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}"
        assert what in proc.stdout + proc.stderr, f"{what!r} not in:\n{proc.stdout}\n{proc.stderr}"


def test_kubernetes_validate_catches_a_broken_deployment(render: Render, tmp_path: Path) -> None:
    deploy = one(render(), "Deployment")
    deploy["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"  # unknown field
    proc = validate([deploy], tmp_path / "broken.yaml")
    assert proc.returncode != 0, f"a broken Deployment passed:\n{proc.stdout}\n{proc.stderr}"
    assert "imagePullPolicyy" in proc.stdout + proc.stderr


# ---------------------------------------------------------------- CRDs


def test_chart_crd_is_the_repositorys(render: Render) -> None:
    repo = ROOT / "crds" / "rolloutjob.yaml"
    copy = CHART / "files" / "crds" / "rolloutjob.yaml"
    assert copy.read_text() == repo.read_text(), "the chart's CRD is stale: run `make crds`"
    expected = yaml.safe_load(repo.read_text())
    expected["metadata"].setdefault("annotations", {})["helm.sh/resource-policy"] = "keep"
    crds = {d["metadata"]["name"]: d for d in of_kind(render(), "CustomResourceDefinition")}
    assert set(crds) == {f"{k.PLURAL}.{k.GROUP}", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    assert crds[f"{k.PLURAL}.{k.GROUP}"] == expected
    for name in ("kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        assert crds[name]["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert crds[name]["spec"]["group"] == "kopf.dev"


def test_crds_keep_and_kopf_peering_switches(render: Render) -> None:
    crds = of_kind(render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert len(crds) == 3 and all("annotations" not in d["metadata"] for d in crds)
    crds = of_kind(render({"crds": {"kopfPeering": False}}), "CustomResourceDefinition")
    assert [d["metadata"]["name"] for d in crds] == [f"{k.PLURAL}.{k.GROUP}"]


# ---------------------------------------------------------------- RBAC


def grants(docs: Docs) -> tuple[set[tuple[str, str, str]], dict[str, set[tuple[str, str, str]]]]:
    """(cluster-wide grants, {namespace: grants}) the chart gives the operator's ServiceAccount, as
    (apiGroup, resource, verb); only through bindings whose subject is that ServiceAccount."""
    sa = one(docs, "ServiceAccount")["metadata"]
    subject = {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}

    def expand(role: dict[str, Any]) -> set[tuple[str, str, str]]:
        out = set()
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, f"unexpected rule keys: {rule}"
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    out |= {(g, r, v) for v in rule["verbs"]}
        assert not any("*" in x for x in out), f"wildcards in {role['metadata']['name']}"
        return out

    cluster_roles = {r["metadata"]["name"]: r for r in of_kind(docs, "ClusterRole")}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in of_kind(docs, "Role")}
    cluster: set[tuple[str, str, str]] = set()
    for b in of_kind(docs, "ClusterRoleBinding"):
        assert b["subjects"] == [subject] and b["roleRef"]["kind"] == "ClusterRole"
        cluster |= expand(cluster_roles[b["roleRef"]["name"]])
    namespaced: dict[str, set[tuple[str, str, str]]] = {}
    for b in of_kind(docs, "RoleBinding"):
        assert b["subjects"] == [subject] and b["roleRef"]["kind"] == "Role"
        ns = b["metadata"]["namespace"]
        namespaced.setdefault(ns, set()).update(expand(roles[(ns, b["roleRef"]["name"])]))
    assert len(cluster_roles) == len(of_kind(docs, "ClusterRoleBinding")), "an unbound ClusterRole"
    assert len(roles) == len(of_kind(docs, "RoleBinding")), "an unbound Role"
    return cluster, namespaced


def triples(*rule_sets: tuple[rbac_rules.Rule, ...]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rules in rule_sets for g, r, verbs in rules for v in verbs}


R = rbac_rules
RBAC_CASES = {  # values -> (cluster-wide grants, {namespace: grants})
    "whole-cluster": ({}, (triples(R.NAMESPACED, R.CLUSTER), {})),
    "whole-cluster-peering": (
        {"replicas": 2, "database": POSTGRES},
        (triples(R.NAMESPACED, R.CLUSTER, R.CLUSTER_PEERING), {}),
    ),
    "namespaces": (
        {"watchNamespaces": ["a", "b"]},
        (triples(R.CLUSTER), {"a": triples(R.NAMESPACED), "b": triples(R.NAMESPACED)}),
    ),
    "namespaces-peering": (
        {"watchNamespaces": ["a", "b"], "peering": {"enabled": True}},
        (triples(R.CLUSTER), {ns: triples(R.NAMESPACED, R.PEERING) for ns in ("a", "b")}),
    ),
}


@pytest.mark.parametrize("case", list(RBAC_CASES))
def test_rbac_is_exactly_the_rules(render: Render, case: str) -> None:
    values, (cluster, namespaced) = RBAC_CASES[case]
    got_cluster, got_namespaced = grants(render(values))
    assert sorted(got_cluster - cluster) == [], "granted cluster-wide beyond rbac_rules"
    assert sorted(cluster - got_cluster) == [], "missing cluster-wide grants"
    assert got_namespaced == namespaced


def test_rbac_rules_are_sorted_and_unique() -> None:
    for rules in (R.NAMESPACED, R.CLUSTER, R.PEERING, R.CLUSTER_PEERING):
        assert all(list(verbs) == sorted(set(verbs)) for _, _, verbs in rules)
        assert len({(g, r) for g, r, _ in rules}) == len(rules)


def test_rbac_off(render: Render) -> None:
    docs = render({"rbac": {"create": False}})
    assert not [d for d in docs if d["kind"] in {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}]


# ---------------------------------------------------------------- values.schema.json


BAD_VALUES = {
    "replicas-not-integer": ({"replicas": "two"}, "replicas: Invalid type"),
    "unknown-top-level-key": ({"replicaz": 1}, "Additional property replicaz is not allowed"),
    "bad-pull-policy": ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
    "unknown-nested-key": ({"database": {"sqlite": {"sizee": "1Gi"}}}, "Additional property sizee"),
    "bad-pod-listen": ({"operator": {"podListen": "everywhere"}}, "operator.podListen"),
    "tick-too-long": ({"operator": {"tickSeconds": 600}}, "operator.tickSeconds"),
    "replicas-2-on-sqlite": ({"replicas": 2}, "database.postgres.existingSecret"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_schema_rejects(helm: Helm, case: str) -> None:
    values, message = BAD_VALUES[case]
    proc = helm.template(values)
    assert proc.returncode != 0, f"accepted {values}"
    assert "schema" in proc.stderr and message in proc.stderr, proc.stderr


def test_schema_rejects_replicas_2_without_postgres_on_the_command_line(helm: Helm) -> None:
    proc = helm.template(None, "--set", "replicas=2")
    assert proc.returncode != 0 and "database.postgres.existingSecret" in proc.stderr, proc.stderr
    proc = helm.template(None, "--set", "replicas=2", "--set", "database.postgres.existingSecret=pg")
    assert proc.returncode == 0, proc.stderr


def values_tree() -> dict[str, Any]:
    tree: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return tree


def test_every_values_key_has_a_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^\s*([A-Za-z_][\w.-]*):")
    undocumented = []
    for i, line in enumerate(lines):
        m = key.match(line)
        if not m:
            continue
        before = [x.strip() for x in lines[:i] if x.strip()]
        if not before or not before[-1].startswith("#"):
            undocumented.append(f"line {i + 1}: {m.group(1)}")
    assert not undocumented, f"values.yaml keys without a comment above them: {undocumented}"
    assert sum(1 for line in lines if key.match(line)) > 50  # the parser saw the keys


def test_every_values_key_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    missing: list[str] = []

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        assert node.get("type") == "object", f"{path or '(root)'} is not an object in the schema"
        props = node.get("properties", {})
        for name, value in values.items():
            where = f"{path}.{name}" if path else name
            if name not in props:
                missing.append(where)
            elif isinstance(value, dict) and value:
                walk(value, props[name], where)

    walk(values_tree(), schema, "")
    assert not missing, f"values.yaml keys missing from values.schema.json: {missing}"
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(values_tree()), "schema keys that values.yaml lacks"


# ---------------------------------------------------------------- NetworkPolicy and security


def test_network_policy_admits_admin_port_only_from_the_operator(render: Render) -> None:
    api_from = [{"namespaceSelector": {"matchLabels": {"team": "rl"}}}]
    for values in ({"watchNamespaces": ["a", NAMESPACE]}, {"networkPolicy": {"apiFrom": api_from}}):
        docs = render(values)
        operator_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        job_pod_labels = k.job_labels("some-job") | {k.LABEL_COMPONENT: k.COMPONENT_POD}
        policies = of_kind(docs, "NetworkPolicy")
        assert {p["metadata"]["namespace"] for p in policies} == {
            NAMESPACE,
            *values.get("watchNamespaces", []),
        }
        assert len(policies) == len({p["metadata"]["namespace"] for p in policies})
        for policy in policies:
            spec = policy["spec"]
            assert spec["policyTypes"] == ["Ingress"]
            assert spec["podSelector"] == {
                "matchLabels": {k.LABEL_MANAGED_BY: k.MANAGER, k.LABEL_COMPONENT: k.COMPONENT_POD}
            }
            assert spec["podSelector"]["matchLabels"].items() <= job_pod_labels.items()
            reach: dict[int, list[Any]] = {}  # port -> peers allowed (None: anyone)
            for rule in spec["ingress"]:
                for port in rule["ports"]:
                    reach.setdefault(port["port"], []).extend(rule.get("from") or [None])
            assert set(reach) == {k.ADMIN_PORT, k.SIDECAR_PORT, k.ENGINE_PORT}
            for peer in reach[k.ADMIN_PORT]:
                assert peer is not None, "the admin port is open to anyone"
                selector = peer["podSelector"]["matchLabels"]
                assert selector.items() <= operator_labels.items(), "admin peer is not the operator"
                assert not selector.items() <= job_pod_labels.items(), "admin peer selects job pods"
                assert peer["namespaceSelector"] == {
                    "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}
                }
                assert set(peer) == {"podSelector", "namespaceSelector"}
            open_to_anyone = {p for p, peers in reach.items() if None in peers}
            expected_open = set() if "networkPolicy" in values else {k.SIDECAR_PORT, k.ENGINE_PORT}
            assert open_to_anyone == expected_open
            if "networkPolicy" in values:
                assert all(api_from[0] in reach[p] for p in (k.SIDECAR_PORT, k.ENGINE_PORT))


def test_operator_runs_non_root_and_read_only(render: Render) -> None:
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = deployment_container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    assert "/var/lib/elastic-rollout" in mounts  # ROLLOUT_HOME is writable
    assert container["image"] == "ghcr.io/elastic-rollout/elastic-rollout-operator:0.1.0"
    assert container["resources"]["limits"]["memory"]


def test_notes_render(helm: Helm, tmp_path: Path) -> None:
    """NOTES.txt (which `helm template` does not print) rendered through `tpl` in a copy of the chart."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "files" / "notes.tpl").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "notes.yaml").write_text(
        'notes: {{ tpl (.Files.Get "files/notes.tpl") . | toJson }}\n'
    )
    for sets, expected in [
        ([], ["watching the whole cluster", "kubectl -n <namespace> get rj -w", "SQLite"]),
        (
            [
                "--set",
                "watchNamespaces={a,b}",
                "--set",
                "replicas=2",
                "--set",
                "database.postgres.existingSecret=pg",
            ],
            ["watching: a, b", "kubectl -n a get rj -w", "PostgreSQL (Secret pg"],
        ),
    ]:
        proc = helm.run(
            "template", "er", str(chart), "-n", NAMESPACE, "--show-only", "templates/notes.yaml", *sets
        )
        assert proc.returncode == 0, proc.stderr
        notes = yaml.safe_load(proc.stdout)["notes"]
        for text in [*expected, "port-forward pod/", "Authorization: Bearer", "apply -f"]:
            assert text in notes, f"{text!r} not in NOTES:\n{notes}"
