"""Every engine setting reaches the ranks through every surface, under one name (issue 14, item 1).

The names are spelled here by their rule, independently of the code that derives them: a field whose flag,
variable or CRD field is missing or named otherwise fails, and so does a field without a sample below (add
one when you add a setting). Each surface is exercised for real: `rolloutctl serve` parses its flags and
variables (the server itself is replaced by a recorder), the shipped CRD is read from crds/, and the pod
arguments the operator and `rolloutctl run` give an engine are parsed by the same command.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from rollout_operator.api.manifest import parse_job
from rollout_operator.cli.main import app
from rollout_operator.control.podspec import engine_args
from rollout_worker.config.engine_settings import DEFAULTS, EngineSettings
from rollout_worker.scheduling.layout import Layout
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]

# A value other than the default for every setting (the test fails for a setting missing here).
SAMPLES: dict[str, Any] = {
    "device": "cpu",  # the only device this machine has; its flag and variable are still parsed
    "max_batch": 7,
    "kv_budget_tokens": 4000,
    "page_size": 8,
    "prefix_cache": False,
    "max_prefill_tokens": 300,
    "context_length": 1500,
    "collective_timeout_seconds": 33.5,
    "cuda_graphs": False,
    "deterministic": True,
    "packed_weights": "off",
    "paged_attention": False,
    "speculative_algorithm": "ngram",
    "speculative_num_draft_tokens": 6,
    "speculative_policy": "always",
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def variable(name: str) -> str:
    return "ROLLOUT_SERVE_" + name.upper()


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def as_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def test_every_setting_has_a_sample_and_the_samples_are_valid() -> None:
    assert set(SAMPLES) == set(EngineSettings.model_fields)
    EngineSettings(**SAMPLES)
    assert all(SAMPLES[n] != getattr(DEFAULTS, n) for n in SAMPLES if n != "device")


def serve(served: list[Any], args: list[str], env: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(app, ["serve", *args], env=env)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return served.pop()[1].engine


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_flag_sets_the_engine_setting(name: str, served: list[Any], tiny64: Path) -> None:
    value = SAMPLES[name]
    if isinstance(value, bool):  # --cuda-graphs / --no-cuda-graphs
        args = [flag(name) if value else "--no-" + flag(name)[2:]]
    else:
        args = [flag(name), as_text(value)]
    assert getattr(serve(served, ["--model", str(tiny64), *args]), name) == value


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_variable_sets_the_engine_setting(name: str, served: list[Any], tiny64: Path) -> None:
    value = SAMPLES[name]
    engine = serve(served, ["--model", str(tiny64)], {variable(name): as_text(value)})
    assert getattr(engine, name) == value


def test_a_flag_beats_its_variable(served: list[Any], tiny64: Path) -> None:
    engine = serve(served, ["--model", str(tiny64), "--max-batch", "5"], {"ROLLOUT_SERVE_MAX_BATCH": "9"})
    assert engine.max_batch == 5
    # a server setting's variable too (it was documented but never took effect)
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny64)], env={"ROLLOUT_SERVE_PORT": "31234"})
    assert result.exit_code == 0 and served.pop()[0].port == 31234


def test_generate_has_every_setting_as_a_flag() -> None:
    text = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).output
    for name in SAMPLES:
        assert re.search(rf"{flag(name)}\b", text), name


def test_crd_has_every_setting_under_spec_engine() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "rolloutjob.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["properties"]["engine"]["properties"]) == {camel(n) for n in SAMPLES}


def _job(engine: dict[str, Any]) -> Any:
    doc = {
        "apiVersion": "elasticrollout.dev/v1alpha1",
        "kind": "RolloutJob",
        "metadata": {"name": "walk"},
        "spec": {
            "model": {"path": "/models/m"},
            "gpusPerPod": 2,
            "prompts": {"path": "/p.jsonl"},
            "output": {"path": "/out"},
            "engine": engine,
        },
    }
    return parse_job(yaml.safe_dump(doc)).job.spec


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_job_field_reaches_the_engine_through_the_pod_arguments(
    name: str, served: list[Any], tiny64: Path
) -> None:
    """spec.engine.<camelCase> -> the pod's engine arguments -> `rolloutctl serve` -> EngineConfig."""
    spec = _job({camel(name): SAMPLES[name]})
    assert getattr(spec.engine, name) == SAMPLES[name]
    args = engine_args(spec, Layout(2, 1), [Layout(2, 1), Layout(1, 2)])
    assert flag(name) in args or (SAMPLES[name] is False and f"--no-{flag(name)[2:]}" in args)
    args[args.index("--model") + 1] = str(tiny64)
    assert getattr(serve(served, args), name) == SAMPLES[name]


def test_max_prefill_tokens_reaches_the_replicas(tiny64: Path) -> None:
    """The setting no surface could set before: the ranks' admission limit is the configured one."""
    import torch
    from rollout_worker.drafting.corpus import corpus_index
    from rollout_worker.engine.config import EngineConfig
    from rollout_worker.engine.model.weights import random_shard
    from rollout_worker.engine.rank.rank_state import make_replica

    cfg = EngineConfig.load(str(tiny64), 1, max_prefill_tokens=300)
    assert cfg.engine.max_prefill_tokens == 300
    weights = random_shard(cfg.model, 1, 0, torch.float64, torch.device("cpu"))
    rep = make_replica(
        cfg, 0, Layout(1, 1), weights, {Layout(1, 1): [None]}, torch.device("cpu"), False, corpus_index()
    )
    assert rep.limits.max_prefill_tokens == 300
