"""The RolloutJob CRD is generated from the job spec's pydantic model and stays in step with it:
- crds/rolloutjob.yaml is exactly `rolloutctl crd`'s output (regenerate with `make crds`);
- the schema is structural (what the API server demands of a CRD);
- every example job is valid under it, and a table of invalid jobs is refused naming the field;
- the CEL rules (evaluated with cel-python, plus Kubernetes' `split` from its strings library) accept and
  refuse exactly what the model's own cross-field validator does."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from celpy import celtypes
from pydantic import ValidationError
from rollout_operator.api.crd import PLURAL, SHORT, SPEC_RULES, build_crd
from rollout_operator.api.crd_yaml import crd_yaml
from rollout_operator.api.job import RolloutJob

from tests.k8s.schema import draft7

ROOT = Path(__file__).parents[3]
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_the_shipped_crd_is_the_generated_one() -> None:
    assert (ROOT / "crds" / "rolloutjob.yaml").read_text() == crd_yaml(), "run `make crds`"
    crd = build_crd()
    names = crd["spec"]["names"]
    assert (names["plural"], names["shortNames"], crd["metadata"]["name"]) == (
        PLURAL,
        [SHORT],
        "rolloutjobs.elasticrollout.dev",
    )
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols == ["Phase", "Progress", "Layout", "Reconfigs", "Age"]


def _nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        out += _nodes(sub, f"{path}.{name}")
    if "items" in node:
        out += _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _nodes(node["additionalProperties"], f"{path}{{}}")
    return out


def test_the_schema_is_structural() -> None:
    for path, node in _nodes(SCHEMA):
        assert not {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "const", "title"} & node.keys(), path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if "default" in node:
            assert node["default"] is not None, path
            if node.get("type") == "object":
                assert node["default"] == {}, path  # nested fields' own defaults apply
    spec = SCHEMA["properties"]["spec"]
    assert spec["required"] == ["model", "output"]
    assert spec["properties"]["pod"]["properties"]["gpuResourceName"]["default"] == "nvidia.com/gpu"
    assert spec["properties"]["pod"]["properties"]["tolerations"]["items"] == {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }


VALIDATOR = jsonschema.Draft7Validator(draft7(SCHEMA))


def _errors(doc: dict[str, Any]) -> list[str]:
    return [".".join(map(str, e.absolute_path)) + ": " + e.message for e in VALIDATOR.iter_errors(doc)]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_valid_under_the_crd(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert _errors(doc) == []
    assert _cel_failures(doc["spec"]) == []


def _job(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"path": "/models/m"},
        "gpusPerPod": 2,
        "prompts": {"path": "/data/p.jsonl"},
        "output": {"path": "/out"},
    }
    for key, value in spec.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    return {
        "apiVersion": "elasticrollout.dev/v1alpha1",
        "kind": "RolloutJob",
        "metadata": {"name": "j"},
        "spec": base,
    }


INVALID = [
    ("pods-zero", {"pods": 0}, "spec.pods"),
    ("gpus-type", {"gpusPerPod": "two"}, "spec.gpusPerPod"),
    ("top-p-zero", {"sampling": {"topP": 0}}, "spec.sampling.topP"),
    ("temperature-negative", {"sampling": {"temperature": -0.5}}, "spec.sampling.temperature"),
    ("policy-unknown", {"parallelism": {"policy": "greedy"}}, "spec.parallelism.policy"),
    ("candidate-shape", {"parallelism": {"candidates": ["2y1"]}}, "spec.parallelism.candidates.0"),
    ("initial-shape", {"parallelism": {"initialLayout": "two"}}, "spec.parallelism.initialLayout"),
    ("model-missing", {"model": None}, "spec"),
    ("mode-unknown", {"mode": "batch"}, "spec.mode"),
    ("device-unknown", {"engine": {"device": "tpu"}}, "spec.engine.device"),
    ("backoff-negative", {"backoffLimit": -1}, "spec.backoffLimit"),
    ("pull-policy", {"pod": {"imagePullPolicy": "Sometimes"}}, "spec.pod.imagePullPolicy"),
    ("unknown-field", {"replicas": 3}, "spec"),
    ("node-selector-type", {"pod": {"nodeSelector": {"gpu": 1}}}, "spec.pod.nodeSelector.gpu"),
    ("top-k-bool", {"sampling": {"topK": True}}, "spec.sampling.topK"),
    ("max-batch-string", {"engine": {"maxBatch": "64"}}, "spec.engine.maxBatch"),
    ("candidates-repeated", {"parallelism": {"candidates": ["2x1", "2x1"]}}, "spec.parallelism.candidates"),
    ("preset-unknown", {"model": {"path": "/models/m", "preset": "bogus"}}, "spec.model.preset"),
]


@pytest.mark.parametrize(("spec", "where"), [(s, w) for _, s, w in INVALID], ids=[i for i, _, _ in INVALID])
def test_an_invalid_job_is_refused_by_the_schema_naming_the_field(spec: dict[str, Any], where: str) -> None:
    doc = _job(**spec)
    errors = _errors(doc)
    assert any(e.split(": ")[0] == where for e in errors), errors
    with pytest.raises(ValidationError):  # the model refuses it too
        RolloutJob.model_validate(doc)


def test_a_null_preset_is_valid_under_the_schema_and_the_model() -> None:
    doc = _job(model={"path": "/models/m", "preset": None})
    assert _errors(doc) == []  # nullable: the enum lists null too (OpenAPI 3.0.3)
    assert RolloutJob.model_validate(doc).spec.model.preset is None


def _split(s: Any, sep: Any) -> celtypes.ListType:  # Kubernetes' CEL strings library
    return celtypes.ListType([celtypes.StringType(x) for x in str(s).split(str(sep))])


_CEL = celpy.Environment()
_RULES = [(r, _CEL.program(_CEL.compile(r["rule"]), functions={"split": _split})) for r in SPEC_RULES]


def _cel_failures(spec: dict[str, Any]) -> list[str]:
    me, failed = celpy.json_to_cel(spec), []
    for rule, prog in _RULES:
        got = prog.evaluate({"self": me})
        assert isinstance(got, celtypes.BoolType), f"{rule['rule']} -> {got!r}"  # an error, not a verdict
        if not got:
            failed.append(rule["message"])
    return failed


CROSS = [
    ("valid", {"parallelism": {"initialLayout": "2x1", "candidates": ["2x1", "1x2"]}}, None),
    ("valid-auto", {"parallelism": {"candidates": ["1x2"]}}, None),
    ("valid-no-candidates", {"parallelism": {"initialLayout": "1x2"}}, None),
    ("valid-service", {"mode": "service", "prompts": None}, None),
    ("candidate-ranks", {"parallelism": {"candidates": ["2x1", "3x1"]}}, "every candidate"),
    (
        "candidate-ranks-default-gpus",
        {"gpusPerPod": None, "parallelism": {"candidates": ["2x1"]}},
        "every candidate",
    ),
    ("initial-ranks", {"parallelism": {"initialLayout": "4x1"}}, "initialLayout DxT must use"),
    (
        "initial-not-candidate",
        {"parallelism": {"initialLayout": "2x1", "candidates": ["1x2"]}},
        "among the candidates",
    ),
    ("job-without-prompts", {"prompts": None}, "job mode needs prompts"),
    ("service-with-prompts", {"mode": "service"}, "job mode needs prompts"),
]


@pytest.mark.parametrize(("spec", "message"), [(s, m) for _, s, m in CROSS], ids=[i for i, _, _ in CROSS])
def test_cel_rules_agree_with_the_model(spec: dict[str, Any], message: str | None) -> None:
    doc = _job(**copy.deepcopy(spec))
    assert _errors(doc) == []  # each rule is beyond what the schema's types can say
    failures = _cel_failures(doc["spec"])
    if message is None:
        assert failures == []
        RolloutJob.model_validate(doc)
    else:
        assert len(failures) == 1 and message in failures[0], failures
        with pytest.raises(ValidationError):
            RolloutJob.model_validate(doc)
