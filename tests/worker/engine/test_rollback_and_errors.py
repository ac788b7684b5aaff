"""Failures: a rank failing mid-migration rolls every rank back; a crashing rank stops the run with a
clear error and leaves no process behind; float32 logits agree across TP sizes."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_worker.engine.driver.launcher import run_task
from rollout_worker.engine.rank.measure import probe_logits
from rollout_worker.engine.rank.rank_state import Faults
from rollout_worker.errors import EngineError

from tests.worker.engine.engine_util import config, run, tokens

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(("src", "fault"), [("4x1", "migrate:2"), ("2x2", "migrate:0"), ("4x1", "commit:3")])
def test_injected_failure_rolls_back_and_loses_nothing(tiny64: Path, src: str, fault: str) -> None:
    static = tokens(run(tiny64, 4, src))
    phase, rank = fault.split(":")
    res = run(tiny64, 4, src, ["10:4:migrate", "5:4:recompute"], faults=Faults(phase, int(rank)))
    first = res.reconfigs[0]
    assert first.outcome == "rolled_back"
    assert first.error is not None
    assert "injected fault" in first.error or first.error == "another rank failed"
    assert tokens(res) == static  # nothing lost, duplicated or altered
    if fault.startswith("migrate"):
        # the later recompute switch still works after the rollback
        assert res.reconfigs[1].outcome == "committed" and str(res.reconfigs[1].dst) == "1x4"
    for out in res.outputs:  # the history records the rolled-back switch nowhere
        assert out["placements"][0]["layout"] == src


def _crash(st: Any, args: dict[str, Any]) -> dict[str, Any]:
    if st.rank == args["rank"]:
        raise RuntimeError("boom on purpose")
    import torch.distributed as dist

    dist.barrier()  # the others wait for the dead rank until the parent kills them
    return {}


def test_rank_crash_is_reported_and_no_orphans(tiny64: Path) -> None:
    cfg = config(tiny64, 4, "4x1", collective_timeout_seconds=30.0)
    with pytest.raises(EngineError, match="rank 2 failed: RuntimeError: boom on purpose"):
        run_task(cfg, _crash, {"rank": 2})
    assert [p for p in mp.active_children() if p.name.startswith("rank")] == []


def test_float32_logits_agree_across_tp(tiny32: Path) -> None:
    prompts = [[1, 2, 3, 4, 5], [200, 100, 7], [9] * 11]
    cfg = config(tiny32, 4, "4x1", dtype="float32")
    out = run_task(cfg, probe_logits, {"prompts": prompts, "layouts": ["4x1", "2x2", "1x4"]})
    ref = torch.tensor(out[0]["4x1"])
    assert ref.shape == (3, 512) and ref.abs().max() > 0.1
    for lay in ("2x2", "1x4"):
        diff = (torch.tensor(out[0][lay]) - ref).abs().max().item()
        assert diff < 1e-4, (lay, diff)
