"""The RolloutJob CustomResourceDefinition, built from the pydantic models that ``rolloutctl run`` reads
(``job.RolloutJobSpec``) and the operator writes (``status.RolloutJobStatus``): one source of truth.
``crds/rolloutjob.yaml`` is this function's output (``rolloutctl crd``); a test fails when they drift.

Pydantic's JSON Schema becomes a Kubernetes *structural* schema: references inlined, ``T | None`` as
``nullable``, ``Literal`` as ``enum``, ``gt`` as OpenAPI 3.0's boolean ``exclusiveMinimum``, unique items
as ``x-kubernetes-list-type: set``, free-form
Kubernetes objects (tolerations, affinity, volumes) kept with ``x-kubernetes-preserve-unknown-fields``.
Cross-field rules are CEL (``x-kubernetes-validations``), the same rules the model's validator applies.
Pure: no I/O, no kopf."""

from __future__ import annotations

import copy
from typing import Any

from rollout_operator.api.job import API_VERSION, KIND, RolloutJobSpec
from rollout_operator.api.status import RolloutJobStatus

GROUP, VERSION = API_VERSION.split("/")
PLURAL, SINGULAR, SHORT = "rolloutjobs", "rolloutjob", "rj"
CRD_NAME = f"{PLURAL}.{GROUP}"

_KEEP = ("description", "default", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern")
# "DxT" -> D * T, with Kubernetes' CEL strings library (split).
_RANKS = "int({0}.split('x')[0]) * int({0}.split('x')[1])"
_GPUS = "(has(self.gpusPerPod) ? self.gpusPerPod : 1)"
_CANDS = "has(self.parallelism) && has(self.parallelism.candidates)"
_INITIAL = (
    "has(self.parallelism) && has(self.parallelism.initialLayout) && self.parallelism.initialLayout != 'auto'"
)

SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": f"!({_CANDS}) || self.parallelism.candidates.all(c, {_RANKS.format('c')} == {_GPUS})",
        "message": "every candidate DxT must use gpusPerPod ranks (D x T = gpusPerPod)",
        "fieldPath": ".parallelism.candidates",
    },
    {
        "rule": f"!({_INITIAL}) || {_RANKS.format('self.parallelism.initialLayout')} == {_GPUS}",
        "message": "initialLayout DxT must use gpusPerPod ranks (D x T = gpusPerPod)",
        "fieldPath": ".parallelism.initialLayout",
    },
    {
        "rule": f"!({_INITIAL} && {_CANDS}) || self.parallelism.initialLayout in self.parallelism.candidates",
        "message": "initialLayout must be among the candidates",
        "fieldPath": ".parallelism.initialLayout",
    },
    {
        "rule": "(has(self.mode) && self.mode == 'service') ? !has(self.prompts) : has(self.prompts)",
        "message": "job mode needs prompts; service mode takes none (the client sends the requests)",
        "fieldPath": ".prompts",
    },
]

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress"},
    {"name": "Layout", "type": "string", "jsonPath": ".status.layout"},
    {"name": "Reconfigs", "type": "integer", "jsonPath": ".status.reconfigurations"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON Schema (with ``$defs``) as a structural OpenAPI v3.0 schema."""
    defs = schema.get("$defs", {})

    def conv(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            return conv(
                {**defs[node["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}}
            )
        if "anyOf" in node:  # T | None
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            if len(options) != 1 or len(options) == len(node["anyOf"]):
                raise ValueError(f"only T | None unions map to a structural schema: {node['anyOf']}")
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            one = conv({**options[0], **rest})
            if "enum" in one:  # OpenAPI 3.0.3: nullable widens the type, not the enum
                one["enum"] = [*one["enum"], None]
            return {**one, "nullable": True}
        out: dict[str, Any] = {}
        if "const" in node:
            out["enum"] = [node["const"]]
        kind = node.get("type")
        if kind is None and "enum" in node:
            kind = "string"
        if kind is not None:
            out["type"] = kind
        out.update({k: copy.deepcopy(node[k]) for k in _KEEP if k in node})
        if "exclusiveMinimum" in node:
            out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
        if out.get("default", 0) is None:
            del out["default"]  # null defaults are not allowed; an absent field means the same
        if kind == "object" and isinstance(out.get("default"), dict):
            out["default"] = {}  # the API server then fills in the fields' own defaults
        if kind == "array":
            out["items"] = conv(node.get("items", {}))
            if node.get("uniqueItems"):  # structural schemas forbid uniqueItems; a set says the same
                out["x-kubernetes-list-type"] = "set"
        if kind == "object":
            props = node.get("properties")
            extra = node.get("additionalProperties")
            if props is not None:
                out["properties"] = {name: conv(sub) for name, sub in props.items()}
                if node.get("required"):
                    out["required"] = list(node["required"])
            elif isinstance(extra, dict) and extra:
                out["additionalProperties"] = conv(extra)
            else:  # a free-form Kubernetes object
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif kind is None:  # Any
            out["x-kubernetes-preserve-unknown-fields"] = True
        return out

    return conv(schema)


def spec_schema() -> dict[str, Any]:
    spec = structural(RolloutJobSpec.model_json_schema(by_alias=True, mode="validation"))
    spec["x-kubernetes-validations"] = copy.deepcopy(SPEC_RULES)
    return spec


def status_schema() -> dict[str, Any]:
    return structural(RolloutJobStatus.model_json_schema(by_alias=True, mode="validation"))


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) as a dict, ready for YAML."""
    schema = {
        "type": "object",
        "description": "A rollout (generation) job whose pods change tensor parallelism while they decode.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {f"{GROUP}/component": "crd"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }
