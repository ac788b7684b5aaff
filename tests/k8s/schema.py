"""A CRD's openAPIV3Schema as the API server applies it: defaults, then validation (schema and CEL rules)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import jsonschema

try:  # CEL rules (x-kubernetes-validations) are checked when cel-python is installed
    import celpy
    from celpy import celtypes
except ImportError:  # pragma: no cover
    celpy = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Cause:
    """One reason of a 422: `field` is a dotted path like `spec.parallelism.candidates[0]`."""

    field: str
    message: str
    reason: str = "FieldValueInvalid"


def draft7(node: Any) -> Any:
    """OpenAPI 3.0 (Kubernetes flavour) -> JSON Schema draft 7: nullable, int-or-string, x-kubernetes-*."""
    if isinstance(node, list):
        return [draft7(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: draft7(v) for k, v in node.items() if not k.startswith("x-kubernetes") and k != "nullable"}
    if out.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if out.get("exclusiveMaximum") is True:
        out["exclusiveMaximum"] = out.pop("maximum")
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = [*out["type"], "null"] if isinstance(out["type"], list) else [out["type"], "null"]
    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # unknown fields are refused (fieldValidation=Strict)
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill missing object properties with their schema `default:` (recursively, as the API server does)."""
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in list(value):
                if name not in schema.get("properties", {}):
                    value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def field_path(parts: Any) -> str:
    """['spec', 'parallelism', 'candidates', 0] -> 'spec.parallelism.candidates[0]'."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _split(s: Any, sep: Any) -> Any:  # Kubernetes' CEL strings library
    return celtypes.ListType([celtypes.StringType(x) for x in str(s).split(str(sep))])


class Validator:
    """Validates whole custom resources against one CRD version's openAPIV3Schema."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._validator = jsonschema.Draft7Validator(draft7(schema))
        self._rules: list[tuple[list[str], dict[str, Any], Any]] = []
        if celpy is not None:
            self._compile_rules(schema, [])

    def _compile_rules(self, node: dict[str, Any], path: list[str]) -> None:
        env = celpy.Environment()
        for rule in node.get("x-kubernetes-validations", []):
            try:
                program = env.program(env.compile(rule["rule"]), functions={"split": _split})
            except Exception:  # a rule cel-python cannot compile is not checked
                continue
            self._rules.append((path, rule, program))
        for name, sub in node.get("properties", {}).items():
            if isinstance(sub, dict):
                self._compile_rules(sub, [*path, name])

    def defaults(self, obj: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = apply_defaults(self.schema, obj)
        return out

    def causes(self, obj: dict[str, Any]) -> list[Cause]:
        causes: list[Cause] = []
        for error in sorted(self._validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
            where = field_path(error.absolute_path)
            if error.validator == "additionalProperties":
                for extra in sorted(set(error.instance) - set(error.schema.get("properties", {}))):
                    name = f"{where}.{extra}" if where else extra
                    causes.append(Cause(name, f'unknown field "{name}"', "FieldValueInvalid"))
                continue
            if error.validator == "required":
                missing = error.message.split("'")[1] if "'" in error.message else ""
                name = f"{where}.{missing}" if where else missing
                causes.append(Cause(name, f"{name}: Required value", "FieldValueRequired"))
                continue
            value = error.instance if not isinstance(error.instance, (dict, list)) else "..."
            causes.append(Cause(where, f"{where}: Invalid value: {value!r}: {where} in body {error.message}"))
        if not causes:
            causes += self._cel_causes(obj)
        return causes

    def _cel_causes(self, obj: dict[str, Any]) -> list[Cause]:
        out: list[Cause] = []
        for path, rule, program in self._rules:
            node: Any = obj
            for part in path:
                node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                continue
            try:
                verdict = program.evaluate({"self": celpy.json_to_cel(node)})
            except Exception:
                continue
            if isinstance(verdict, celtypes.BoolType) and not verdict:
                where = ".".join(path) + rule.get("fieldPath", "")
                message = rule.get("message") or f"failed rule: {rule['rule']}"
                out.append(Cause(where, f'{where}: Invalid value: "object": {message}'))
        return out
