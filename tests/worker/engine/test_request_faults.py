"""Fault isolation (issue 17): a request that fails on its own is aborted, with the error as the message, by
every rank of its TP group at the same step; the other requests' tokens are those of a run without it, its
KV is freed and the engine serves on. Ranks that disagree on a failure fail the engine, never diverge."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.driver.engine import Engine, Observer
from rollout_worker.engine.driver.fixed_batch import Collector
from rollout_worker.engine.driver.request_table import Update
from rollout_worker.engine.finish import FinishAbort
from rollout_worker.engine.messages import Faults, StepReport
from rollout_worker.errors import EngineError

from tests.worker.engine.engine_util import config, requests, run, tokens

pytestmark = pytest.mark.multiproc
BAD, AT = "q3", 4  # q3 (sampled, 4 tokens or more) gets NaN logits from its 5th output token on


def test_a_request_with_nan_logits_is_aborted_alone_on_every_rank(tiny64: Path) -> None:
    specs = requests(8)
    clean = tokens(run(tiny64, 2, "1x2", specs=specs))
    reports: list[StepReport] = []
    col, more = Collector([s.id for s in specs]), Collector(["after"])

    def listener(updates: list[Update]) -> None:
        col(updates)
        more(updates)

    engine = Engine(
        config(tiny64, 2, "1x2"),
        listener=listener,
        observer=Observer(on_report=reports.append),
        faults=Faults("logits", -1, rid=BAD, at=AT),
    )
    with engine:
        for s in specs:
            engine.submit(s)
        assert col.done.wait(120), "the requests did not all finish"
        bad = col.outs[BAD]
        assert isinstance(bad.finish, FinishAbort), bad.finish
        assert bad.finish.message == f"request failed: the logits of output token {AT} are not finite"
        assert bad.output_ids == clean[BAD][:AT]  # what it had generated before the failure is kept
        others = {rid: o.output_ids for rid, o in col.outs.items() if rid != BAD}
        assert others == {rid: t for rid, t in clean.items() if rid != BAD}
        assert all(not isinstance(o.finish, FinishAbort) for rid, o in col.outs.items() if rid != BAD)
        assert engine.status.serving
        last = reports[-1]  # the replica holds nothing any more: the aborted request's KV was freed
        assert (last.running, last.waiting, last.kv_tokens) == (0, 0, 0)
        # and it serves on
        engine.submit(RequestSpec("after", (5, 6, 7), 4, Sampling(), ignore_eos=True))
        assert more.done.wait(60)
        assert len(more.outs["after"].output_ids) == 4 and engine.status.serving


def test_ranks_that_disagree_on_a_failure_fail_the_engine(tiny64: Path) -> None:
    """A failure one rank alone sees (not a request's own: the ranks computed different values) would let
    the ranks run different batches; the step's broadcast catches it and the engine fails, saying why."""
    with pytest.raises(EngineError, match="disagree on which requests failed"):
        run(tiny64, 2, "1x2", specs=requests(4), faults=Faults("logits", 1, rid=BAD, at=AT))
