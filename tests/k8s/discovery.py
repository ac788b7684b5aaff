"""API discovery (/api, /apis, ...), /version and a minimal /openapi/v3 (enough for `kubectl apply`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from tests.k8s.resources import ResourceDef
from tests.k8s.store import ApiError

VERSION = {
    "major": "1",
    "minor": "35",
    "gitVersion": "v1.35.0",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.25.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def _groups(resources: Iterable[ResourceDef]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for res in resources:
        if res.group and res.version not in out.setdefault(res.group, []):
            out[res.group].append(res.version)
    return out


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    gvs = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": gvs, "preferredVersion": gvs[0]}


def serve(resources: Iterable[ResourceDef], path: str, host: str) -> dict[str, Any]:
    resources = list(resources)
    parts = path.strip("/").split("/")
    groups = _groups(resources)
    if path == "/api":
        cidr = [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": cidr}
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [_group(g, v) for g, v in groups.items()],
        }
    if parts[0] == "apis" and len(parts) == 2 and parts[1] in groups:
        return {"kind": "APIGroup", "apiVersion": "v1", **_group(parts[1], groups[parts[1]])}
    group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2] if len(parts) > 2 else "")
    served = [r for r in resources if (r.group, r.version) == (group, version)]
    if len(parts) == (2 if parts[0] == "api" else 3) and served:
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": [entry for r in served for entry in r.discovery()],
        }
    raise ApiError(404, "NotFound", "the server could not find the requested resource")


def _gv_path(res: ResourceDef) -> str:
    return f"apis/{res.group}/{res.version}" if res.group else f"api/{res.version}"


def openapi(resources: Iterable[ResourceDef], path: str, origin: Any) -> dict[str, Any]:
    """The v3 index, and per group-version documents whose PATCH operations take `fieldValidation`.

    kubectl then validates on the server (`fieldValidation=Strict`) rather than with the schema."""
    resources = list(resources)
    if path.rstrip("/") == "/openapi/v3":
        index = {}
        for gv in sorted({_gv_path(r) for r in resources}):
            digest = hashlib.sha1(gv.encode()).hexdigest()
            index[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
        return {"paths": index}
    gv = path.removeprefix("/openapi/v3/").strip("/")
    served = [r for r in resources if _gv_path(r) == gv]
    if not served:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    param = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
    paths = {}
    for r in served:
        ns = "/namespaces/{namespace}" if r.namespaced else ""
        gvk = {"group": r.group, "version": r.version, "kind": r.kind}
        op = {"x-kubernetes-group-version-kind": gvk, "parameters": [param], "responses": {}}
        paths[f"/{gv}{ns}/{r.plural}/{{name}}"] = {"patch": op, "put": op}
        paths[f"/{gv}{ns}/{r.plural}"] = {"post": op}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": VERSION["gitVersion"]},
        "paths": paths,
        "components": {"schemas": {}},
    }
