"""Server-side printing: the meta.k8s.io/v1 Table that `kubectl get` asks for."""

from __future__ import annotations

import datetime
from typing import Any

NAME_COLUMN = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "priority": 0,
    "description": "Name must be unique within a namespace.",
}
AGE_COLUMN = {
    "name": "Age",
    "type": "date",
    "format": "",
    "priority": 0,
    "description": "CreationTimestamp of the object.",
    "jsonPath": ".metadata.creationTimestamp",
}


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def age(text: str | None, now: datetime.datetime | None = None) -> str:
    """RFC 3339 timestamp -> `3s`, `2m`, `5h`, `4d` (as kubectl prints ages)."""
    if not text:
        return "<unknown>"
    now = now or datetime.datetime.now(datetime.UTC)
    seconds = max(0, int((now - parse_time(text)).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * (2 if unit != "d" else 1):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def json_path(obj: Any, path: str) -> Any:
    """A simple `.a.b[0].c` JSONPath (what printer columns use)."""
    node = obj
    for raw in path.strip().lstrip("{").rstrip("}").lstrip("$").split("."):
        if not raw:
            continue
        name, _, rest = raw.partition("[")
        node = node.get(name) if isinstance(node, dict) and name else node
        if rest:
            index = rest.rstrip("]")
            if not (
                isinstance(node, list)
                and index.lstrip("-").isdigit()
                and -len(node) <= int(index) < len(node)
            ):
                return None
            node = node[int(index)]
        if node is None:
            return None
    return node


def columns_for(printer_columns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cols = [NAME_COLUMN]
    for col in printer_columns:
        cols.append(
            {
                "name": col["name"],
                "type": col.get("type", "string"),
                "format": col.get("format", ""),
                "description": col.get("description", ""),
                "priority": col.get("priority", 0),
                "jsonPath": col["jsonPath"],
            }
        )
    if not any(c["name"] == "Age" for c in cols):
        cols.append(AGE_COLUMN)
    return cols


def _cell(obj: dict[str, Any], col: dict[str, Any]) -> Any:
    if col is NAME_COLUMN:
        return obj["metadata"]["name"]
    value = json_path(obj, col["jsonPath"])
    if col["type"] == "date":
        return age(value) if isinstance(value, str) else value
    return value


def table(
    objs: list[dict[str, Any]],
    printer_columns: list[dict[str, Any]],
    resource_version: str,
    include_object: str = "Metadata",
) -> dict[str, Any]:
    cols = columns_for(printer_columns)
    rows = []
    for obj in objs:
        if include_object == "Object":
            embedded: Any = obj
        elif include_object == "None":
            embedded = None
        else:
            embedded = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            }
        rows.append({"cells": [_cell(obj, c) for c in cols], "object": embedded})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [{k: v for k, v in c.items() if k != "jsonPath"} for c in cols],
        "rows": rows,
    }
