"""A Kubernetes API server emulator for tests: kmock's KubernetesEmulator, fixed where kopf, the `kubernetes`
client and kubectl need real API-server behaviour (see /work/shared/notes/k8s-testing.md).

Every /api and /apis request is served here from a `Store` (tests/k8s/store.py); anything else goes to kmock
(its DSL reactions still work for other paths). Run standalone: `python -m tests.k8s.emulator --port 8001`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import traceback
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from tests.k8s import discovery, tables
from tests.k8s.resources import ResourceDef, builtin_resources, crd_resources
from tests.k8s.selectors import field_selector, label_selector
from tests.k8s.store import ApiError, Event, Store


@dataclass
class Route:
    res: ResourceDef
    namespace: str | None
    name: str | None
    sub: str | None


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock.KubernetesEmulator with Kubernetes semantics; `crds` are CustomResourceDefinition documents."""

    crds: list[dict[str, Any]] = attrs.field(factory=list)
    store: Store = attrs.field(factory=Store, init=False)
    # every API request as (user agent, verb, group, resource[/subresource]), as RBAC would judge it
    audit: list[tuple[str, str, str, str]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for res in builtin_resources():
            self.register(res)
        for crd in self.crds:
            for res in crd_resources(crd):
                self.register(res)
        self.store.create(self.store.resources["/v1/namespaces"], None, {"metadata": {"name": "default"}})

    def register(self, res: ResourceDef) -> None:
        self.store.resources[res.key] = res
        self.resources[f"{res.group}/{res.version}/{res.plural}"] = kmock.ResourceInfo(
            kind=res.kind, namespaced=res.namespaced, verbs=set(), subresources=res.subresources
        )

    def find(self, plural_or_kind: str) -> ResourceDef:
        """`rolloutjobs`, `RolloutJob`, `rj`, `rolloutjobs.elasticrollout.dev`, `pods` -> its ResourceDef."""
        name = plural_or_kind.split(".")[0]
        group = plural_or_kind.partition(".")[2]
        for res in self.store.resources.values():
            if group and res.group != group:
                continue
            if name in (res.plural, res.kind, res.singular, *res.short_names) or name == res.kind.lower():
                return res
        raise KeyError(plural_or_kind)

    # --- HTTP
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        path = raw.path.rstrip("/") or "/"
        try:
            if path == "/version":
                return _json(discovery.VERSION)
            if path.startswith("/openapi/"):
                return _json(discovery.openapi(self.store.resources.values(), path, raw.url.origin()))
            if path in ("/api", "/apis") or path.startswith(("/api/", "/apis/")):
                route = self._route(path)
                if route is None:
                    return _json(discovery.serve(self.store.resources.values(), path, raw.host))
                self.audit.append(_audited(raw, route))
                if raw.method == "GET" and raw.query.get("watch") in ("true", "1"):
                    return await self._watch(raw, route)
                body = await _body(raw)
                with self.store.lock:
                    return self._serve(raw, route, body)
        except ApiError as exc:
            return _json(exc.status(), exc.code)
        except Exception as exc:  # an emulator bug: say so to the client, keep it for the test
            if self._errors:
                self._errors[-1].append(exc)
            return _json(
                ApiError(500, "InternalError", f"{exc!r}", {"traceback": traceback.format_exc()}).status(),
                500,
            )
        return await super().__call__(raw)

    def _route(self, path: str) -> Route | None:
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 3:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        known = self.store.resources
        ns = None
        if rest[0] == "namespaces" and len(rest) >= 3 and f"{group}/{version}/{rest[2]}" in known:
            ns, rest = rest[1], rest[2:]
        res = known.get(f"{group}/{version}/{rest[0]}")
        if res is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else None
        sub = "/".join(rest[2:]) or None
        return Route(res, ns if res.namespaced else None, name, sub)

    def _serve(self, raw: aiohttp.web.BaseRequest, r: Route, body: Any) -> aiohttp.web.StreamResponse:
        q, store = raw.query, self.store
        dry = q.get("dryRun") == "All"
        if raw.method == "GET" and r.name is None:
            items = [o for o in store.items(r.res, r.namespace) if _matches(q, o)]
            if "as=Table" in raw.headers.get("Accept", ""):
                return _json(
                    tables.table(items, r.res.printer_columns, str(store.rv), q.get("includeObject", ""))
                )
            meta = {"resourceVersion": str(store.rv)}
            return _json(
                {"kind": r.res.list_kind, "apiVersion": r.res.api_version, "metadata": meta, "items": items}
            )
        if r.name is None and raw.method == "POST":
            return _json(store.create(r.res, r.namespace, body, dry), 201)
        if r.name is None and raw.method == "DELETE":
            for obj in [o for o in store.items(r.res, r.namespace) if _matches(q, o)]:
                store.delete(
                    r.res, obj["metadata"].get("namespace"), obj["metadata"]["name"], body or {}, dry
                )
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})
        if r.name is None:
            raise ApiError(405, "MethodNotAllowed", f"{raw.method} is not supported on a collection")
        if raw.method == "GET":
            obj = store.get(r.res, r.namespace, r.name)
            if "as=Table" in raw.headers.get("Accept", ""):
                return _json(
                    tables.table([obj], r.res.printer_columns, str(store.rv), q.get("includeObject", ""))
                )
            return _json(obj)
        if raw.method == "POST" and r.sub == "binding" and r.res.kind == "Pod":
            node = (body.get("target") or {}).get("name", "node") if isinstance(body, dict) else "node"
            pod = store.get(r.res, r.namespace, r.name)
            if pod.get("spec", {}).get("nodeName"):
                raise ApiError(409, "Conflict", f'pod {r.name} is already assigned to node "{node}"')
            store.patch(r.res, r.namespace, r.name, {"spec": {"nodeName": node}}, "merge", None, dry)
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}, 201)
        if raw.method == "PUT":
            return _json(store.write(r.res, r.namespace, r.name, body, r.sub, dry))
        if raw.method == "PATCH":
            ctype = raw.headers.get("Content-Type", "application/merge-patch+json")
            return _json(store.patch(r.res, r.namespace, r.name, body, ctype, r.sub, dry))
        if raw.method == "DELETE":
            opts = dict(body) if isinstance(body, dict) else {}
            if "gracePeriodSeconds" in q:
                opts["gracePeriodSeconds"] = int(q["gracePeriodSeconds"])
            if "propagationPolicy" in q:
                opts["propagationPolicy"] = q["propagationPolicy"]
            return _json(store.delete(r.res, r.namespace, r.name, opts, dry))
        raise ApiError(405, "MethodNotAllowed", f"{raw.method} is not supported here")

    async def _watch(self, raw: aiohttp.web.BaseRequest, r: Route) -> aiohttp.web.StreamResponse:
        q, store = raw.query, self.store
        queue: asyncio.Queue[Event] = asyncio.Queue()
        since = q.get("resourceVersion", "")
        initial: list[Event] = []
        with store.lock:  # the initial state and the first live event, with nothing lost in between
            history = store.history
            if since in ("", "0"):
                objs = copy.deepcopy(store.items(r.res, r.namespace))
                initial = [(store.rv, r.res.key, {"type": "ADDED", "object": o}) for o in objs]
            elif history and int(since) < history[0][0] - 1 and len(history) == history.maxlen:
                gone = ApiError(410, "Expired", f"too old resource version: {since} ({history[0][0]})")
                initial = [(0, r.res.key, {"type": "ERROR", "object": gone.status()})]
            else:
                initial = [e for e in history if e[0] > int(since)]
            if q.get("sendInitialEvents") == "true":  # a watch-list: a bookmark ends the initial state
                end = {"resourceVersion": str(store.rv), "annotations": {"k8s.io/initial-events-end": "true"}}
                mark = {"kind": r.res.kind, "apiVersion": r.res.api_version, "metadata": end}
                initial.append((store.rv, r.res.key, {"type": "BOOKMARK", "object": mark}))
            store.listeners.append(queue.put_nowait)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        timeout = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        try:
            await response.prepare(raw)
            for event in initial:
                await self._send(response, r, q, event)
            async with asyncio.timeout(timeout):
                while True:
                    await self._send(response, r, q, await queue.get())
        except (TimeoutError, ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            with store.lock:
                store.listeners.remove(queue.put_nowait)
        return response

    async def _send(self, response: aiohttp.web.StreamResponse, r: Route, q: Any, event: Event) -> None:
        _, key, payload = event
        obj = payload["object"]
        if payload["type"] not in ("ERROR", "BOOKMARK"):
            if key != r.res.key or (r.namespace and obj["metadata"].get("namespace") != r.namespace):
                return
            if (r.name and obj["metadata"]["name"] != r.name) or not _matches(q, obj):
                return
        await response.write(json.dumps(payload).encode() + b"\n")


def _matches(q: Any, obj: dict[str, Any]) -> bool:
    return label_selector(q.get("labelSelector"))(obj) and field_selector(q.get("fieldSelector"))(obj)


def _audited(raw: aiohttp.web.BaseRequest, r: Route) -> tuple[str, str, str, str]:
    """The request as RBAC sees it: the verb (get, list, watch, create, update, patch, delete,
    deletecollection) on group and resource (``pods``, ``rolloutjobs/status``)."""
    if raw.method == "GET":
        verb = "watch" if raw.query.get("watch") in ("true", "1") else ("get" if r.name else "list")
    else:
        verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
        verb = verbs.get(raw.method, raw.method.lower())
        if verb == "delete" and r.name is None:
            verb = "deletecollection"
    resource = f"{r.res.plural}/{r.sub}" if r.sub else r.res.plural
    return raw.headers.get("User-Agent", ""), verb, r.res.group, resource


def _json(data: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(text=json.dumps(data), status=status, content_type="application/json")


async def _body(raw: aiohttp.web.BaseRequest) -> Any:
    text = await raw.text()
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        try:
            return yaml.safe_load(text)  # application/apply-patch+yaml
        except yaml.YAMLError as exc:
            raise ApiError(400, "BadRequest", f"the body is neither JSON nor YAML: {exc}") from exc


if __name__ == "__main__":
    from tests.k8s.runner import main

    main()
