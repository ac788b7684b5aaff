"""One memory model: the simulator's ``paged`` admission makes the engine's decisions (the same functions,
scheduling/admission) on the engine's counts. On long-tailed workloads run on a real replica (in process,
float64, pages of 4), the simulator retracts as many requests as the engine did, within 10% (measured:
exactly as many, 2, 5 and 3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.profile import CostModel, KVCapacity, ModelShape, Profile, StepPoint
from rollout_profiler.sim.config import SimConfig
from rollout_profiler.sim.simulator import Simulator
from rollout_profiler.sim.workloads import Workload
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.layout import Layout

from tests.worker.engine.replica_util import replica

SHAPE = ModelShape("toy", "LlamaForCausalLM", 64, 2, 8, 8, 8, 128, 100)
PAGE = 4


def _lengths(seed: int, n: int) -> list[int]:
    """Long-tailed (lognormal, median about 60), at least 2 and at most 200 tokens."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.round(rng.lognormal(np.log(60), 0.9, n)), 2, 200)]


def _engine_retractions(model: Path, lengths: list[int], prompt: int, pages: int, batch: int) -> int:
    rep = replica(model, pages, PAGE, max_batch=batch, prefix_cache=False)
    for i, n in enumerate(lengths):
        ids = tuple(10 + (i * 7 + j) % 90 for j in range(prompt))
        rep.add(Sequence(spec=RequestSpec(f"r{i}", ids, n, Sampling(), ignore_eos=True)))
    while rep.unfinished:
        rep.step()
    return rep.retractions


def _sim_retractions(lengths: list[int], prompt: int, pages: int, batch: int) -> int:
    pts = [StepPoint(1, 1, b, c, 1.0 + b) for b in (1, 2, 4, 8, 16) for c in (0, 1000)]
    costs = CostModel(1e30, 0.0, 100.0, 50.0, 1.0, 30.0, 5.0)
    cap = KVCapacity({1: pages * PAGE}, {"rule": "the engine's pool"})
    prof = Profile(
        "pool", SHAPE, "test", "cpu", 1, "", "float64", "modelled", pts, [], costs, kv_capacity=cap
    )
    n = len(lengths)
    wl = Workload("tail", np.array(lengths), np.full(n, prompt), np.array(lengths))
    cfg = SimConfig(1, admission="paged", max_batch=batch, page_size=PAGE)
    return Simulator(LatencyModel(prof), wl, cfg).run(Layout(1, 1), name="paged").preemptions


@pytest.mark.parametrize(("seed", "n", "prompt"), [(1, 32, 8), (2, 48, 5), (3, 40, 12)])
def test_the_simulator_retracts_as_the_engine_does(tiny64: Path, seed: int, n: int, prompt: int) -> None:
    """A pool one page larger than the longest request (so every request fits alone), 16 running at most."""
    lengths = _lengths(seed, n)
    pages = -(-(prompt + max(lengths)) // PAGE) + 1
    engine = _engine_retractions(tiny64, lengths, prompt, pages, 16)
    sim = _sim_retractions(lengths, prompt, pages, 16)
    assert engine > 0, "the pool was not tight enough to retract anything"
    assert abs(sim - engine) <= 0.1 * engine, (engine, sim)
