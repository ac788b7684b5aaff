"""Helpers for the multi-process engine tests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rollout_worker.api.layout import Layout
from rollout_worker.api.plan import Trigger
from rollout_worker.api.requests import RequestSpec, parse_request
from rollout_worker.engine.batch import BatchResult, run_batch
from rollout_worker.engine.config import EngineConfig


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


def config(model: Path, world: int, layout: str, **kw: Any) -> EngineConfig:
    kw.setdefault("dtype", "float64")
    kw.setdefault("collective_timeout_seconds", 60.0)
    return EngineConfig.load(str(model), world, Layout.parse(layout), **kw)


def run(
    model: Path,
    world: int,
    layout: str,
    triggers: list[str] | tuple[str, ...] = (),
    specs: list[RequestSpec] | None = None,
    faults: Any = None,
    **kw: Any,
) -> BatchResult:
    trigs = [Trigger.from_text(t, world) for t in triggers]
    cfg = config(model, world, layout, **kw)
    return run_batch(cfg, specs if specs is not None else requests(), trigs, faults=faults)


def tokens(res: BatchResult) -> dict[str, list[int]]:
    return {o["id"]: o["output_ids"] for o in res.outputs}
