"""Helpers for the multi-process engine tests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rollout_worker.api.layout import Layout
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.api.requests import RequestSpec, parse_request
from rollout_worker.engine.config import EngineConfig, Trigger
from rollout_worker.engine.generate import GenerateResult, generate


def requests(n: int = 16, seed: int = 0, vocab: int = 512) -> list[RequestSpec]:
    """Mixed workload: even ids greedy, odd ids sampled (temperature, top-p, top-k, seed); varied lengths."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        obj: dict[str, Any] = {
            "id": f"q{i}",
            "input_ids": [rng.randrange(vocab) for _ in range(rng.randint(3, 14))],
            "max_new_tokens": rng.randint(6, 44),
            "ignore_eos": i % 4 != 3,
        }
        if i % 2:
            obj.update(temperature=0.9, top_p=0.95, top_k=50 if i % 3 else 0, seed=1000 + i)
        specs.append(parse_request(obj, f"req {i}", None, vocab))
    return specs


def config(model: Path, world: int, layout: str, triggers: list[str] = (), **kw: Any) -> EngineConfig:  # type: ignore[assignment]
    mc = ModelConfig.load(model)
    cfg = EngineConfig(
        model_dir=str(model),
        world=world,
        layout=Layout.parse(layout),
        candidates=tuple(mc.candidate_layouts(world)),
        dtype=kw.pop("dtype", "float64"),
        triggers=tuple(Trigger.parse(t) for t in triggers),
        collective_timeout_s=kw.pop("collective_timeout_s", 60.0),
        **kw,
    )
    cfg.validate(mc)
    return cfg


def run(
    model: Path,
    world: int,
    layout: str,
    triggers: list[str] = (),
    specs: list[RequestSpec] | None = None,  # type: ignore[assignment]
    **kw: Any,
) -> GenerateResult:
    return generate(config(model, world, layout, triggers, **kw), specs if specs is not None else requests())


def tokens(res: GenerateResult) -> dict[str, list[int]]:
    return {o["id"]: o["output_ids"] for o in res.outputs}
