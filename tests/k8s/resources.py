"""What the emulated API server serves: built-in kinds, kopf's peering kinds, and CRDs given to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.schema import Validator

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass
class ResourceDef:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    subresources: set[str] = field(default_factory=set)
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    validator: Validator | None = None

    @property
    def key(self) -> str:
        return f"{self.group}/{self.version}/{self.plural}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def qualified(self) -> str:
        """`rolloutjobs.elasticrollout.dev`, or `pods`: how Status messages name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def discovery(self) -> list[dict[str, Any]]:
        main = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(ALL_VERBS),
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        subs = [
            {
                "name": f"{self.plural}/{sub}",
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": "Binding" if sub == "binding" else self.kind,
                "verbs": ["create"] if sub == "binding" else ["get", "patch", "update"],
            }
            for sub in sorted(self.subresources)
        ]
        return [main, *subs]


POD_COLUMNS = [
    {"name": "Status", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.containerStatuses[0].restartCount"},
    {"name": "IP", "type": "string", "jsonPath": ".status.podIP"},
]


def _core(
    plural: str, kind: str, namespaced: bool = True, short: tuple[str, ...] = (), **kw: Any
) -> ResourceDef:
    return ResourceDef("", "v1", plural, kind, namespaced, short_names=list(short), **kw)


def builtin_resources() -> list[ResourceDef]:
    return [
        _core("namespaces", "Namespace", False, ("ns",), subresources={"status"}),
        _core(
            "pods",
            "Pod",
            True,
            ("po",),
            subresources={"status", "binding"},
            categories=["all"],
            printer_columns=POD_COLUMNS,
        ),
        _core("services", "Service", True, ("svc",), subresources={"status"}, categories=["all"]),
        _core("secrets", "Secret"),
        _core("configmaps", "ConfigMap", True, ("cm",)),
        _core("events", "Event", True, ("ev",)),
        _core("serviceaccounts", "ServiceAccount", True, ("sa",)),
        _core("persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), subresources={"status"}),
        _core("nodes", "Node", False, ("no",), subresources={"status"}),
        ResourceDef("events.k8s.io", "v1", "events", "Event", True, short_names=["ev"]),
        ResourceDef(
            "apps",
            "v1",
            "deployments",
            "Deployment",
            True,
            short_names=["deploy"],
            subresources={"status", "scale"},
            categories=["all"],
        ),
        ResourceDef("batch", "v1", "jobs", "Job", True, subresources={"status"}, categories=["all"]),
        ResourceDef("coordination.k8s.io", "v1", "leases", "Lease", True),
        ResourceDef(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            False,
            short_names=["crd", "crds"],
            subresources={"status"},
        ),
        ResourceDef("kopf.dev", "v1", "kopfpeerings", "KopfPeering", True),
        ResourceDef("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", False),
    ]


def crd_resources(crd: dict[str, Any]) -> list[ResourceDef]:
    """One ResourceDef per served version of a CustomResourceDefinition document."""
    spec, names = crd["spec"], crd["spec"]["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        out.append(
            ResourceDef(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular", ""),
                short_names=list(names.get("shortNames", [])),
                categories=list(names.get("categories", [])),
                subresources=set((version.get("subresources") or {}).keys()),
                printer_columns=list(version.get("additionalPrinterColumns", [])),
                validator=Validator(schema) if schema else None,
            )
        )
    return out


def load_crds(paths: list[Path] | list[str]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                docs.append(doc)
    return docs
