"""A job's sampling, walked field by field from the manifest to the engine: ``spec.sampling`` -> the pod's
``ROLLOUT_SIDECAR_*`` settings -> the sidecar's ``SamplingSettings`` -> SGLang's ``sampling_params`` of each
sample (the one mapping) -> the engine's ``Sampling``. A sampling field the manifest gains fails here until
every step carries it."""

from __future__ import annotations

from typing import Any

import pytest
from rollout_operator.api.job import SamplingSpec
from rollout_operator.api.manifest import parse_job
from rollout_operator.control.podspec import sidecar_fields
from rollout_worker.api.sampling import sample_seed
from rollout_worker.api.sidecar import SamplingSettings
from rollout_worker.sidecar.settings import load_settings, settings_env

from tests.operator.api.test_manifest import GOOD

# a value other than the default for every field of the manifest's `spec.sampling` (snake_case names)
CHANGED: dict[str, Any] = {
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 7,
    "max_new_tokens": 33,
    "seed": 11,
    "stop": ["\n\n", "</answer>"],
    "ignore_eos": True,
}
WIRE = {"seed": "sampling_seed"}  # SGLang's name where it differs (the value: each sample's own seed)
ENGINE = ("temperature", "top_p", "top_k")  # what the engine's ranks draw with (besides the seed)


def wire_value(name: str, value: Any, prompt_id: str, sample: int) -> Any:
    return sample_seed(value, prompt_id, sample) if name == "seed" else value


def test_every_manifest_sampling_field_is_walked() -> None:
    assert set(CHANGED) == set(SamplingSpec.model_fields) == set(SamplingSettings.model_fields)
    assert all(
        CHANGED[k] != f.get_default(call_default_factory=True) for k, f in SamplingSpec.model_fields.items()
    )


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_a_sampling_field_reaches_sglang_and_the_engine(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    camel = "".join(w.capitalize() if i else w for i, w in enumerate(name.split("_")))
    value = CHANGED[name]
    yaml = GOOD + f"  sampling:\n    {camel}: {value!r}\n".replace("'", '"')
    spec = parse_job(yaml).job.spec
    assert getattr(spec.sampling, name) == value
    # the pod's sidecar reads it back from its environment
    for var, text in settings_env(**sidecar_fields(spec, 0), token="t").items():
        monkeypatch.setenv(var, text)
    sampling = load_settings().sampling
    assert sampling.model_dump() == spec.sampling.model_dump()
    # one sample's SGLang sampling_params: every field there, under SGLang's name
    params = sampling.sampling_params("q3", 1)
    assert getattr(params, WIRE.get(name, name)) == wire_value(name, value, "q3", 1)
    assert params == spec.sampling.sampling_params("q3", 1)
    body = params.model_dump(exclude_unset=True)
    assert set(body) == {WIRE.get(k, k) for k in CHANGED}  # nothing else is sent
    engine = params.engine(params.sampling_seed or 0)
    assert engine.seed == sample_seed(spec.sampling.seed, "q3", 1)
    for k in ENGINE:
        want = getattr(spec.sampling, k)
        assert getattr(engine, k) == (max(want, 0) if k == "top_k" else want)


def test_a_prompts_own_cap_applies_under_the_jobs() -> None:
    s = SamplingSettings(max_new_tokens=20)
    assert [s.sampling_params("p", 0, cap).max_new_tokens for cap in (None, 5, 50)] == [20, 5, 20]
