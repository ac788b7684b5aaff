"""Generation as a library call: validate, run the ranks, check that every request finished exactly once,
and write the output atomically (never a partial file)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_worker.api.errors import EngineError
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.checkpoint import CheckpointReader
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.launcher import OnEvent, run_ranks


@dataclass(slots=True)
class GenerateResult:
    outputs: list[dict[str, Any]]  # in input order
    steps: int
    step_ms: list[float]  # rank 0's wall time per step
    reconfigs: list[dict[str, Any]]
    wall_s: float


def generate(cfg: EngineConfig, specs: list[RequestSpec], on_event: OnEvent | None = None) -> GenerateResult:
    t0 = time.perf_counter()
    CheckpointReader(cfg.model_dir, ModelConfig.load(cfg.model_dir)).verify()  # fail before starting ranks
    results = run_ranks(cfg, specs, on_event)
    by_id: dict[str, dict[str, Any]] = {}
    for res in results:
        for rid, output, finish, history in res["finished"]:
            if rid in by_id:
                raise EngineError(f"request {rid!r} finished twice (ranks disagree)")
            by_id[rid] = {"id": rid, "output_ids": output, "finish_reason": finish, "placements": history}
    missing = [s.id for s in specs if s.id not in by_id]
    if missing:
        raise EngineError(f"{len(missing)} request(s) never finished: {missing[:5]}")
    outputs = []
    for s in specs:
        out = by_id[s.id]
        out["prompt_tokens"] = len(s.prompt_ids)
        out["completion_tokens"] = len(out["output_ids"])
        out["layouts"] = list(dict.fromkeys(h["layout"] for h in out["placements"]))
        outputs.append(out)
    r0 = results[0]
    return GenerateResult(outputs, r0["steps"], r0["step_ms"], r0["reconfigs"], time.perf_counter() - t0)


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write to a temporary file beside ``path`` and rename: readers never see a partial file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
