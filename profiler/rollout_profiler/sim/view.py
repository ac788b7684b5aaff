"""What a simulated pod's engine would report (``GET /v1/state``), built from the simulator's request arrays:
the one view the adaptive controller has of a run, in the schema the operator's planner loop reads from a
real pod (:class:`~rollout_worker.api.state.EngineState`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from rollout_worker.api.plan import Plan
from rollout_worker.api.state import EngineState
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.sim.memory import DONE, RUNNING, WAITING, Requests


def _rows(req: Requests, gen: np.ndarray, idx: np.ndarray) -> list[dict[str, Any]]:
    """Requests ``idx`` with ``gen`` tokens generated (per request), as the body would carry them (built
    column by column: a tick of a long run reads ~1,000 requests, and a run ticks tens of thousands of
    times)."""
    cols = (x.astype(np.int64).tolist() for x in (idx, req.prompt[idx], req.cap[idx], gen[idx]))
    return [
        {"rid": f"r{i}", "prompt_len": p, "max_new_tokens": c, "generated": g}
        for i, p, c, g in zip(*cols, strict=True)
    ]


def engine_state(
    req: Requests,
    gen: np.ndarray,
    layout: Layout,
    *,
    step: int,
    time_s: float,
    step_ms: float | None,
    finished_at: np.ndarray,
    since_step: int,
    plan: Plan | None,
    switches: int,
) -> EngineState:
    """The state of requests ``req`` with ``gen`` tokens generated (per request), in ``layout``, at engine
    step ``step``: the lengths of requests finished at a step after ``since_step`` (``finished_at``: the step
    each finished at, -1 while unfinished), in the order they finished; ``switches`` committed so far."""
    recent = np.nonzero(finished_at > since_step)[0]
    recent = recent[np.argsort(finished_at[recent], kind="stable")]
    return EngineState.model_validate(  # one validation of the whole body: a tick reads ~1,000 requests
        {
            "layout": layout,
            "step": step,
            "time_s": time_s,
            "ranks_ready": [True] * layout.world,
            "paused": False,
            "reconfiguring": False,  # a simulated switch is atomic: no state is read during one
            "step_ms": step_ms,
            "replicas": [
                {
                    "running": _rows(req, gen, req.on(r, RUNNING)),
                    "waiting": _rows(req, gen, req.on(r, WAITING)),
                }
                for r in range(layout.replicas)
            ],
            "finished": {
                "since_step": since_step,
                "lengths": req.lengths[recent].astype(np.int64).tolist(),
                "capped": (req.lengths[recent] >= req.cap[recent]).tolist(),
                "total": int((req.status == DONE).sum()),
            },
            "plan": plan,
            "weight_version": "sim",
            "reconfigurations": switches,
        }
    )
