"""RolloutJob manifests: defaults, and every invalid one refused with its YAML path and line."""

from __future__ import annotations

import pytest
from rollout_operator.api.manifest import parse_job
from rollout_worker.errors import UserError
from rollout_worker.scheduling.layout import Layout

GOOD = """apiVersion: elasticrollout.dev/v1alpha1
kind: RolloutJob
metadata:
  name: quickstart
spec:
  model:
    path: build/models/tiny
  gpusPerPod: 2
  prompts:
    path: examples/prompts.jsonl
  parallelism:
    candidates: [2x1, 1x2]
  output:
    path: build/rollout
"""


def test_defaults() -> None:
    spec = parse_job(GOOD).job.spec
    assert (spec.pods, spec.gpus_per_pod, spec.samples_per_prompt) == (1, 2, 1)
    assert spec.parallelism.initial_layout == "auto" and spec.parallelism.policy == "adaptive"
    assert spec.sampling.temperature == 1.0 and spec.engine.max_batch == 64
    assert spec.candidate_layouts() == [Layout(2, 1), Layout(1, 2)]


def test_layouts_are_layouts_in_python_and_dxt_strings_in_yaml() -> None:
    text = GOOD.replace("candidates: [2x1, 1x2]", "candidates: [2x1, 1x2]\n    initialLayout: 1x2")
    spec = parse_job(text).job.spec
    assert spec.parallelism.candidates == [Layout(2, 1), Layout(1, 2)]
    assert spec.parallelism.initial_layout == Layout(1, 2)
    dumped = spec.model_dump(mode="json", by_alias=True)["parallelism"]
    assert (dumped["candidates"], dumped["initialLayout"]) == (["2x1", "1x2"], "1x2")
    assert type(spec).model_validate(spec.model_dump()) == spec


BAD = [
    ("gpusPerPod: 2", "gpusPerPod: two", "job.yaml:8: spec.gpusPerPod: Input should be a valid integer"),
    (
        "gpusPerPod: 2",
        "gpusPerPod: 0",
        "job.yaml:8: spec.gpusPerPod: Input should be greater than or equal to 1",
    ),
    (
        "[2x1, 1x2]",
        "[2x1, 1x2, 4x1]",
        "job.yaml:12: spec.parallelism.candidates[2]: 4x1 uses 4 ranks, but gpusPerPod is 2",
    ),
    (
        "[2x1, 1x2]",
        "[2x1, 2by1]",
        "job.yaml:12: spec.parallelism.candidates[1]: '2by1' is not of the form DxT",
    ),
    ("[2x1, 1x2]", "[]", "job.yaml:12: spec.parallelism.candidates: give at least one layout"),
    (
        "    candidates: [2x1, 1x2]",
        "    candidates: [2x1]\n    initialLayout: 1x2",
        "job.yaml:13: spec.parallelism.initialLayout: 1x2 is not among the candidates",
    ),
    (
        "    candidates: [2x1, 1x2]",
        "    policy: elastic",
        "job.yaml:12: spec.parallelism.policy: Input should be 'adaptive' or 'static'",
    ),
    (
        "    candidates: [2x1, 1x2]",
        "    method: teleport",
        "spec.parallelism.method: Input should be 'auto', 'migrate' or 'recompute'",
    ),
    (
        "    candidates: [2x1, 1x2]",
        "    margin: -1",
        "spec.parallelism.margin: Input should be greater than or equal to 0",
    ),
    (
        "  prompts:\n    path: examples/prompts.jsonl\n",
        "",
        "job.yaml:5: spec.prompts: job mode needs prompts (or set mode: service)",
    ),
    (
        "gpusPerPod: 2",
        "gpusPerPod: 2\n  samplesPerPrompt: 0",
        "job.yaml:9: spec.samplesPerPrompt: Input should be greater than or equal to 1",
    ),
    (
        "gpusPerPod: 2",
        "gpusPerPod: 2\n  sampling: {topP: 1.5}",
        "job.yaml:9: spec.sampling.topP: Input should be less than or equal to 1",
    ),
    (
        "gpusPerPod: 2",
        "gpusPerPod: 2\n  sampling: {temprature: 0.6}",
        "spec.sampling.temprature: Extra inputs are not permitted",
    ),
    ("kind: RolloutJob", "kind: Job", "job.yaml:2: kind: Input should be 'RolloutJob'"),
    ("  name: quickstart", "  name: Quick_Start", "job.yaml:4: metadata.name: String should match pattern"),
    (
        "    path: build/models/tiny",
        "    path: build/models/tiny\n    dtype: int4",
        "job.yaml:8: spec.model.dtype: Input should be",
    ),
    (  # a preset the engine does not have (the checkpoint existing or not)
        "    path: build/models/tiny",
        "    path: build/models/tiny\n    preset: bogus",
        "job.yaml:8: spec.model.preset: Input should be 'tiny', 'smol-shape', ",
    ),
    (  # YAML's true is not 1, nor "64" 64: the CRD's schema says integer
        "gpusPerPod: 2",
        "gpusPerPod: 2\n  sampling: {topK: true}",
        "job.yaml:9: spec.sampling.topK: Input should be a valid integer",
    ),
    (
        "gpusPerPod: 2",
        "gpusPerPod: 2\n  engine:\n    maxBatch: '64'",
        "job.yaml:10: spec.engine.maxBatch: Input should be a valid integer",
    ),
    (
        "gpusPerPod: 2",
        "gpusPerPod: 2\n  sampling:\n    ignoreEos: 'yes'",
        "job.yaml:10: spec.sampling.ignoreEos: Input should be a valid boolean",
    ),
    (
        "[2x1, 1x2]",
        "[2x1, 1x2, 2x1]",
        "job.yaml:12: spec.parallelism.candidates: 2x1 is listed twice (items 0 and 2)",
    ),
]


@pytest.mark.parametrize(("old", "new", "message"), BAD, ids=[m.split(": ")[1] for _, _, m in BAD])
def test_invalid_manifests_name_path_and_line(old: str, new: str, message: str) -> None:
    assert old in GOOD
    with pytest.raises(UserError) as exc:
        parse_job(GOOD.replace(old, new, 1))
    assert message in str(exc.value), str(exc.value)


def test_not_yaml_or_not_a_mapping() -> None:
    with pytest.raises(UserError, match=r"job.yaml:\d+: not valid YAML"):
        parse_job("a: [1, 2\nb: 3\n")
    with pytest.raises(UserError, match="expected a RolloutJob manifest"):
        parse_job("- just a list")


def test_an_alias_bomb_is_refused_before_it_is_expanded() -> None:
    """Nine levels of nine aliases would expand to 9**9 strings (minutes, gigabytes): refused at once."""
    rows = ['      l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    rows += [f"      l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    text = GOOD + "  pod:\n    resources:\n" + "\n".join(rows) + "\n"
    assert len(text) < 2048
    with pytest.raises(UserError, match=r"^job.yaml:18: alias \*l0: a job file may not use anchors"):
        parse_job(text)


def test_a_duplicate_key_is_refused_with_its_line() -> None:
    with pytest.raises(UserError, match=r"^job.yaml:9: duplicate key 'gpusPerPod'"):
        parse_job(GOOD.replace("gpusPerPod: 2", "gpusPerPod: 2\n  gpusPerPod: 4"))
