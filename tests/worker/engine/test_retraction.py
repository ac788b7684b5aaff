"""Optimistic admission and retraction on a real (in-process, float64) replica: which request is retracted
and when, computed by hand, and tokens identical to a run with room for everything."""

from __future__ import annotations

from pathlib import Path

from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.admission import RatioPolicy

from tests.worker.engine.replica_util import replica


def _specs() -> list[RequestSpec]:
    greedy = RequestSpec("A", (11, 22, 33, 44), 12, Sampling(), ignore_eos=True)
    sampled = Sampling(temperature=0.9, top_p=0.95, seed=7)
    return [greedy, RequestSpec("B", (5, 6, 7, 8, 9, 10), 12, sampled, ignore_eos=True)]


def _run(model: Path, pages: int) -> tuple[dict[str, list[int]], list[tuple[int, str, list[str]]]]:
    """Outputs, and (step, kind, retracted) for every step that admitted or retracted something."""
    rep = replica(model, pages, 4, RatioPolicy(init=0.0))  # ratio 0: running requests are charged nothing
    seqs = [Sequence(spec=s) for s in _specs()]
    for s in seqs:
        rep.add(s)
    events = []
    for step in range(1, 50):
        if not rep.unfinished:
            break
        out = rep.step()
        if out.admitted or out.retracted:
            events.append((step, out.kind, out.admitted or out.retracted))
    assert rep.pool.shared.held == 0  # every page came back (cached ones stay, held by none)
    return {s.spec.id: s.output for s in seqs}, events


def test_retraction_by_hand_changes_no_token(tiny64: Path) -> None:
    """Pages of 4 tokens, a pool of 8 pages (32 tokens), ratio 0. A (prompt 4) and B (prompt 6), 12 new
    tokens each.

    Step 1: A is admitted (32 free tokens; A costs 1 page + 12 + 1 page of slack = 20 < 32; B then costs
    8 + 12 + 4 = 24 >= the 16 left): A prefills into 1 page. Step 2: B is admitted (A is charged 0; 7 free
    pages = 28 > 24) and prefills into 2 pages: 5 free. Each later step decodes both; A at KV length 3 + g
    and B at 5 + g (g generated before the step) take a page whenever that length reaches a multiple of 4:
    A at steps 3, 7, 11, B at steps 5, 9, leaving 0 free after step 11. Step 13 (g = 11 for both): B's KV
    is 16 tokens in 4 full pages, so it needs a fifth; none is free, so a request is retracted: both have
    decoded 11 tokens, so the longer prompt goes, B (its 4 pages back). A decodes its 12th token and
    finishes in the same step. Step 14: B is re-prefilled from prompt + 10 generated tokens (16 tokens,
    4 pages); step 15: it decodes its 12th token from the same sampling counter."""
    tight, events = _run(tiny64, 8)
    assert events == [
        (1, "prefill", ["A"]),
        (2, "prefill", ["B"]),
        (13, "decode", ["B"]),
        (14, "prefill", ["B"]),
    ]
    roomy, events = _run(tiny64, 64)
    assert events == [(1, "prefill", ["A", "B"])]  # room for both at once, no retraction
    assert tight == roomy and all(len(t) == 12 for t in tight.values())
