"""The gathered K/V kept between decode steps (``kvcache.GatheredKV``, eager decode on CPU) is bitwise what
gathering every step reads, wherever attention looks: two in-process replicas, one keeping it and one
gathering every step, run the same requests in lockstep (admissions as others finish, retractions from a
tight pool, prefix sharing, pages of 1 and 4 tokens) and every step's tokens and logprobs are equal, in
float32 with the default and the deterministic kernels, where any change in what attention reads would
show in the last bits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.rank.replica import Replica
from rollout_worker.engine.rank.sequence import Sequence

from tests.worker.engine.engine_util import grpo_groups, requests
from tests.worker.engine.replica_util import replica


def _lockstep(model: Path, specs: list[RequestSpec], **kw: object) -> tuple[int, Replica]:
    """Steps both replicas until done, comparing each step's draws; returns the steps and the replica that
    kept its gather."""
    pair = [replica(model, dtype=torch.float32, max_batch=6, **kw) for _ in range(2)]  # type: ignore[arg-type]
    pair[1].gathered = None
    for rep in pair:
        for s in specs:
            rep.add(Sequence(spec=s))
    steps = 0
    while pair[0].unfinished:
        outs = [rep.step() for rep in pair]
        got = [[(seq.spec.id, d.token, d.logprob) for seq, d in o.draws] for o in outs]
        assert got[0] == got[1], steps
        assert outs[0].retracted == outs[1].retracted and outs[0].kind == outs[1].kind
        steps += 1
    assert not pair[1].unfinished
    cache = pair[0].gathered
    assert cache is not None and not cache.k  # emptied with the batch
    return steps, pair[0]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_kept_gather_reads_what_a_fresh_gather_reads(
    tiny32: Path, page_size: int, deterministic: bool
) -> None:
    specs = [
        dataclasses.replace(s, return_logprob=True, ignore_eos=True, max_new_tokens=20 + 13 * i % 50)
        for i, s in enumerate(requests(14, 11))
    ]
    steps, rep = _lockstep(tiny32, specs, pages=4096, page_size=page_size, deterministic=deterministic)
    assert rep.gathered is not None and steps > 20
    assert rep.gathered.kept > rep.gathered.gathers > 1  # the batch changed several times; mostly kept


def test_kept_gather_through_retraction_and_shared_prefixes(tiny32: Path) -> None:
    specs = [dataclasses.replace(s, return_logprob=True) for s in grpo_groups(requests(3, 5))]
    _, rep = _lockstep(tiny32, specs, pages=40, page_size=4)
    assert rep.retractions > 0 and rep.gathered is not None and rep.gathered.kept > 0
