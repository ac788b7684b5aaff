"""A container's environment and command line as the kubelet builds them: `$(VAR)` expansion, fieldRef,
secretKeyRef and configMapKeyRef."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable
from typing import Any

ReadObject = Callable[[str, str], "dict[str, Any] | None"]  # (plural, name) -> object or None
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(Exception):
    """CreateContainerConfigError: a referenced Secret/ConfigMap or key is missing (the kubelet retries)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names replaced, `$$` -> `$`, unknown references kept."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, text)


def _field_ref(pod: dict[str, Any], path: str) -> str:
    meta = pod.get("metadata", {})
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": pod.get("spec", {}).get("nodeName"),
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName"),
        "status.podIP": pod.get("status", {}).get("podIP"),
        "status.hostIP": pod.get("status", {}).get("hostIP"),
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef {path!r}")
    return str(simple[path] or "")


def _key_ref(kind: str, ref: dict[str, Any], read: ReadObject) -> str | None:
    plural = "secrets" if kind == "Secret" else "configmaps"
    obj = read(plural, ref.get("name", ""))
    optional = bool(ref.get("optional"))
    if obj is None:
        if optional:
            return None
        raise ConfigError(f'{plural[:-1]} "{ref.get("name")}" not found')
    key = ref.get("key", "")
    if kind == "Secret":
        if key in (obj.get("data") or {}):
            return base64.b64decode(obj["data"][key]).decode()
        if key in (obj.get("stringData") or {}):
            return str(obj["stringData"][key])
    elif key in (obj.get("data") or {}):
        return str(obj["data"][key])
    if optional:
        return None
    raise ConfigError(
        f"couldn't find key {key} in {kind} {obj['metadata'].get('namespace')}/{ref.get('name')}"
    )


def container_env(pod: dict[str, Any], container: dict[str, Any], read: ReadObject) -> dict[str, str]:
    """The process environment: this process's own, OMP_NUM_THREADS=1, PYTHONUNBUFFERED=1, then `env`."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    own: dict[str, str] = {}  # what $(VAR) may refer to: the container's earlier entries
    for source in container.get("envFrom") or []:
        for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
            if field in source:
                ref = source[field]
                obj = read("secrets" if kind == "Secret" else "configmaps", ref.get("name", ""))
                if obj is None and not ref.get("optional"):
                    raise ConfigError(f'{kind.lower()} "{ref.get("name")}" not found')
                for key, raw in ((obj or {}).get("data") or {}).items():
                    decoded = base64.b64decode(raw).decode() if kind == "Secret" else str(raw)
                    own[source.get("prefix", "") + key] = decoded
    for item in container.get("env") or []:
        name, source = item["name"], item.get("valueFrom")
        value: str | None
        if source is None:
            value = expand(str(item.get("value", "")), own)
        elif "fieldRef" in source:
            value = _field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            value = _key_ref("Secret", source["secretKeyRef"], read)
        elif "configMapKeyRef" in source:
            value = _key_ref("ConfigMap", source["configMapKeyRef"], read)
        else:
            raise ConfigError(f"unsupported valueFrom for {name}: {sorted(source)}")
        if value is not None:
            own[name] = value
    env.update(own)
    return env


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded against the container's environment."""
    argv = [expand(str(a), env) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not argv:
        raise ConfigError(f"container {container['name']} has no command (images are not emulated)")
    return argv
