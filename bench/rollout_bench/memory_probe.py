"""One engine run of ``rolloutctl bench memory`` (and of its prefix-sharing part), in a fresh process:
``python -m rollout_bench.memory_probe SPEC OUT``. SPEC: the model, the engine's settings and the requests
(a request may name its sampling); OUT: every step's report (kind, time, running, waiting, finished, KV
tokens held, capacity and pages in use, retractions, prompt tokens prefilled), the tokens generated per
request and the generation time (first submit to last finish).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    from rollout_worker.api.requests import RequestSpec
    from rollout_worker.api.sampling import Sampling
    from rollout_worker.engine.config import EngineConfig
    from rollout_worker.engine.driver.engine import Engine, Observer
    from rollout_worker.engine.driver.fixed_batch import Collector
    from rollout_worker.engine.driver.lifecycle import Health
    from rollout_worker.engine.messages import StepReport

    cfg = EngineConfig.load(spec["model"], 1, dtype=spec["dtype"], **spec["settings"])
    reqs = [
        RequestSpec(
            r["id"],
            tuple(r["input_ids"]),
            r["max_new_tokens"],
            Sampling(**r.get("sampling", {})),
            ignore_eos=True,
        )
        for r in spec["requests"]
    ]
    steps: list[dict[str, Any]] = []

    def on_report(r: StepReport) -> None:
        steps.append(
            {
                "kind": r.kind,
                "ms": r.ms,
                "running": r.running,
                "waiting": r.waiting,
                "finished": len(r.finished),
                "kv_tokens": r.kv_tokens,
                "kv_capacity": r.kv_capacity,
                "kv_paged": r.kv_paged,
                "retractions": r.retractions,
                "prefill_tokens": r.prefill_tokens,
            }
        )

    col = Collector([r.id for r in reqs])
    engine = Engine(cfg, listener=col, observer=Observer(on_report=on_report))
    try:
        engine.start()
        t0 = time.perf_counter()
        for r in reqs:
            engine.submit(r)
        while not col.done.wait(0.05):
            if engine.status.health is Health.FAILED:
                raise RuntimeError(engine.status.failure or "engine failed")
        gen_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = {rid: len(out.output_ids) for rid, out in col.outs.items()}
    return {"gen_s": gen_s, "tokens": tokens, "steps": steps}


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    result = probe(json.loads(spec_path.read_text()))
    out_path.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
