"""The emulated API server's object store: Kubernetes write semantics, without HTTP.

Everything runs in the server's event loop thread; a lock makes `snapshot()` safe from other threads.
"""

from __future__ import annotations

import collections
import copy
import datetime
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

import jsonpatch

from tests.k8s.resources import ResourceDef
from tests.k8s.schema import Cause

Key = tuple[str, str | None, str]  # (resource key, namespace, name)
Event = tuple[int, str, dict[str, Any]]  # (resourceVersion, resource key, {"type", "object"})
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SYSTEM_META = ("uid", "creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds")


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "reason": self.reason,
            "message": self.message,
            "code": self.code,
            "details": self.details,
        }


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386; `$`-directives of strategic merge patches are dropped (strategic merge = merge here)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _details(res: ResourceDef, name: str, causes: list[Cause] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "group": res.group, "kind": res.plural}
    if causes:
        out["kind"] = res.kind
        out["causes"] = [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes]
    return out


class Store:
    def __init__(self, history: int = 5000) -> None:
        self.lock = threading.RLock()
        self.objects: dict[Key, dict[str, Any]] = {}
        self.rv = 1
        self.history: collections.deque[Event] = collections.deque(maxlen=history)
        self.listeners: list[Callable[[Event], None]] = []
        self.resources: dict[str, ResourceDef] = {}

    # --- reading
    def get(self, res: ResourceDef, ns: str | None, name: str) -> dict[str, Any]:
        obj = self.objects.get((res.key, ns if res.namespaced else None, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{res.qualified} "{name}" not found', _details(res, name))
        return obj

    def items(self, res: ResourceDef, ns: str | None) -> list[dict[str, Any]]:
        items = [o for (k, n, _), o in self.objects.items() if k == res.key and (ns is None or n == ns)]
        return sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def snapshot(self, res: ResourceDef, ns: str | None) -> list[dict[str, Any]]:
        with self.lock:
            return copy.deepcopy(self.items(res, ns))

    # --- writing
    def _emit(self, res: ResourceDef, kind: str, obj: dict[str, Any]) -> None:
        event: Event = (self.rv, res.key, {"type": kind, "object": copy.deepcopy(obj)})
        self.history.append(event)
        for listener in list(self.listeners):
            listener(event)

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def _validate(self, res: ResourceDef, obj: dict[str, Any]) -> None:
        causes = res.validator.causes(obj) if res.validator else []
        name = obj["metadata"].get("name", "")
        if causes:
            text = ", ".join(c.message for c in causes)
            message = f'{res.kind}.{res.group or "core"} "{name}" is invalid: {text}'
            if len(causes) > 1:
                message = f'{res.kind}.{res.group or "core"} "{name}" is invalid: [{text}]'
            raise ApiError(422, "Invalid", message, _details(res, name, causes))

    def create(self, res: ResourceDef, ns: str | None, body: Any, dry_run: bool = False) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request is not a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name") or ""
        if res.namespaced:
            ns = ns or meta.get("namespace") or "default"
            if meta.get("namespace", ns) != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = ns
            if ("/v1/namespaces", None, ns) not in self.objects:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{ns}" not found',
                    {"name": ns, "group": "", "kind": "namespaces"},
                )
        else:
            meta.pop("namespace", None)
        if not name:
            cause = Cause("metadata.name", "name or generateName is required", "FieldValueRequired")
            raise ApiError(
                422,
                "Invalid",
                f'{res.kind} "" is invalid: metadata.name: Required value: name or generateName is required',
                _details(res, "", [cause]),
            )
        if not NAME.match(name) or len(name) > 253:
            msg = (
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-', '.'"
            )
            cause = Cause("metadata.name", f"Invalid value: {name!r}: {msg}")
            raise ApiError(
                422,
                "Invalid",
                f'{res.kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": {msg}',
                _details(res, name, [cause]),
            )
        key = (res.key, ns if res.namespaced else None, name)
        if key in self.objects:
            raise ApiError(
                409, "AlreadyExists", f'{res.qualified} "{name}" already exists', _details(res, name)
            )
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        for system in (*SYSTEM_META, "resourceVersion"):
            meta.pop(system, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        if "status" in res.subresources:
            obj.pop("status", None)
        self._server_defaults(res, obj)
        if res.validator:
            res.validator.defaults(obj)
        self._validate(res, obj)
        if dry_run:
            return obj
        self._bump(obj)
        self.objects[key] = obj
        self._emit(res, "ADDED", obj)
        return obj

    def _server_defaults(self, res: ResourceDef, obj: dict[str, Any]) -> None:
        if res.key == "/v1/pods":
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("dnsPolicy", "ClusterFirst")
            spec.setdefault("schedulerName", "default-scheduler")
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif res.key == "/v1/namespaces":
            obj["status"] = {"phase": "Active"}
        elif res.key == "/v1/secrets":
            obj.setdefault("type", "Opaque")

    def write(
        self,
        res: ResourceDef,
        ns: str | None,
        name: str,
        new: dict[str, Any],
        sub: str | None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Store `new` (a whole object: a replaced or patched one) as `name`, with Kubernetes' rules."""
        old = self.get(res, ns, name)
        if not isinstance(new, dict):
            raise ApiError(400, "BadRequest", "the body of the request is not a JSON object")
        new = copy.deepcopy(new)
        meta = new.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        given_rv = meta.get("resourceVersion")
        if given_rv and given_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {res.qualified} "{name}": the '
                "object has been modified; please apply your changes to the latest version and "
                "try again",
                _details(res, name),
            )
        if meta.get("name", name) != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        if sub == "status":  # only .status changes through /status
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
        elif sub is None and "status" in res.subresources:  # the main resource ignores .status
            new.pop("status", None)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
        elif sub is not None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({sub})")
        meta = new["metadata"]
        for system in SYSTEM_META:
            meta.pop(system, None)
            if system in old["metadata"]:
                meta[system] = old["metadata"][system]
        meta.update(name=name, resourceVersion=old["metadata"]["resourceVersion"])
        if res.namespaced:
            meta["namespace"] = old["metadata"]["namespace"]
        new["apiVersion"], new["kind"] = res.api_version, res.kind
        if res.validator:
            res.validator.defaults(new)
        if _content(new) != _content(old):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        self._validate(res, new)
        if old["metadata"].get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old["metadata"].get("finalizers") or [])
            if added:
                raise ApiError(
                    422,
                    "Forbidden",
                    f"no new finalizers can be added if the object is being "
                    f"deleted, found new finalizers {sorted(added)}",
                )
        if new == old or dry_run:
            return new
        self._bump(new)
        self.objects[(res.key, ns if res.namespaced else None, name)] = new
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not self._graceful(res, new):
            return self._remove(res, new)
        self._emit(res, "MODIFIED", new)
        return new

    def patch(
        self,
        res: ResourceDef,
        ns: str | None,
        name: str,
        patch: Any,
        content_type: str,
        sub: str | None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        old = self.get(res, ns, name)
        if "json-patch" in content_type and isinstance(patch, list):
            try:
                new = jsonpatch.apply_patch(old, patch)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiError(422, "Invalid", f"the server rejected our request: {exc}") from exc
        elif isinstance(patch, dict):
            new = merge_patch(old, patch)
        else:
            raise ApiError(400, "BadRequest", f"cannot apply a {content_type} patch of this shape")
        return self.write(res, ns, name, new, sub, dry_run)

    def _graceful(self, res: ResourceDef, obj: dict[str, Any]) -> bool:
        """A pod bound to a node waits for its kubelet until its grace period is 0."""
        return (
            res.key == "/v1/pods"
            and bool(obj.get("spec", {}).get("nodeName"))
            and (obj["metadata"].get("deletionGracePeriodSeconds", 0) > 0)
        )

    def delete(
        self, res: ResourceDef, ns: str | None, name: str, options: dict[str, Any], dry_run: bool = False
    ) -> dict[str, Any]:
        obj = self.get(res, ns, name)
        pre = (options.get("preconditions") or {}).get("resourceVersion")
        if pre and pre != obj["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f"Precondition failed: ResourceVersion in precondition: {pre}, "
                f"ResourceVersion in object meta: {obj['metadata']['resourceVersion']}",
            )
        if dry_run:
            return obj
        meta = obj["metadata"]
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = (
                obj.get("spec", {}).get("terminationGracePeriodSeconds", 30) if res.key == "/v1/pods" else 0
            )
        orphan = options.get("propagationPolicy") == "Orphan" or options.get("orphanDependents") is True
        changed = False
        if not meta.get("deletionTimestamp"):
            meta["deletionTimestamp"] = now()
            changed = True
        if res.key == "/v1/pods" and meta.get("deletionGracePeriodSeconds") != grace:
            meta["deletionGracePeriodSeconds"] = min(grace, meta.get("deletionGracePeriodSeconds", grace))
            changed = True
        if orphan:
            meta["finalizers"] = [*(meta.get("finalizers") or []), "orphan"]
        if not meta.get("finalizers") and not self._graceful(res, obj):
            return self._remove(res, obj)
        if changed:
            self._bump(obj)
            self._emit(res, "MODIFIED", obj)
        return obj

    def _remove(self, res: ResourceDef, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        key = (res.key, meta.get("namespace") if res.namespaced else None, meta["name"])
        self.objects.pop(key, None)
        self._bump(obj)
        self._emit(res, "DELETED", obj)
        self._collect(res, obj)
        return obj

    def _collect(self, res: ResourceDef, owner: dict[str, Any]) -> None:
        """Background cascade: remove dependents whose owners are all gone (and theirs, recursively)."""
        uid, ns = owner["metadata"]["uid"], owner["metadata"].get("namespace")
        uids = {o["metadata"]["uid"] for o in self.objects.values()}
        if res.key == "/v1/namespaces":
            doomed = [k for k in self.objects if k[1] == owner["metadata"]["name"]]
        else:
            doomed = [
                k
                for k, o in self.objects.items()
                if (not res.namespaced or k[1] == ns)
                and any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
                and not any(r.get("uid") in uids for r in o["metadata"].get("ownerReferences") or [])
            ]
        for key in doomed:
            dep = self.objects.get(key)
            if dep is not None and not dep["metadata"].get("deletionTimestamp"):
                self.delete(self.resources[key[0]], key[1], key[2], {"propagationPolicy": "Background"})


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    """What bumps metadata.generation: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}
