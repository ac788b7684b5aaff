"""Speculative decoding changes no token: the engine with n-gram drafting (``speculative_algorithm``
ngram) emits the tokens of the engine without it, greedy and sampled (a GRPO group's siblings draft for
each other, a looping response drafts itself), and its verify steps accept drafts (it did speculate).
float64 on the default kernels (the logprobs to rounding: a verify pass computes a position's logits in a
prefill's products, not a decode step's); float32 on the deterministic kernels, logprobs bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rollout_worker.api.plan import Trigger
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.driver.fixed_batch import BatchResult, run_batch
from rollout_worker.scheduling.layout import Layout

from tests.worker.engine.engine_util import config, requests

pytestmark = pytest.mark.multiproc


def _workload() -> list[RequestSpec]:
    """Mixed requests, and two groups of 4 samples of one prompt (temperature 0.7 and 1.0, top-p 0.9), with
    logprobs and top logprobs, long enough that the tiny model's outputs repeat."""
    base = [dataclasses.replace(r, max_new_tokens=r.max_new_tokens + 40) for r in requests(8, seed=3)]
    groups = [
        dataclasses.replace(
            base[0],
            id=f"g{t}-{j}",
            sampling=Sampling(temperature=t, top_p=0.9, seed=7 * j),
            max_new_tokens=60,
        )
        for t in (0.7, 1.0)
        for j in range(4)
    ]
    return [dataclasses.replace(r, return_logprob=True, top_logprobs_num=2) for r in [*base, *groups]]


def _run(model: Path, dtype: str, spec: str, **kw: object) -> BatchResult:
    cfg = config(model, 2, "2x1", dtype=dtype, speculative_algorithm=spec, speculative_policy="always", **kw)
    return run_batch(cfg, _workload())


def _outputs(res: BatchResult) -> dict[str, tuple[list[int], str]]:
    return {o["id"]: (o["output_ids"], o["finish_reason"]["type"]) for o in res.outputs}


def _logprobs(res: BatchResult) -> list[float]:
    return [x for o in res.outputs for x in o["output_token_logprobs"]]


@pytest.mark.parametrize(
    ("dtype", "kw"), [("float64", {}), ("float32", {"deterministic": True})], ids=["float64", "deterministic"]
)
def test_speculation_emits_the_tokens_and_logprobs_of_plain_decoding(
    tiny64: Path, tiny32: Path, dtype: str, kw: dict[str, object]
) -> None:
    model = tiny64 if dtype == "float64" else tiny32
    plain = _run(model, dtype, "none", **kw)
    spec = _run(model, dtype, "ngram", speculative_num_draft_tokens=4, **kw)
    assert _outputs(spec) == _outputs(plain)
    if kw.get("deterministic"):
        assert _logprobs(spec) == _logprobs(plain)
    else:
        assert _logprobs(spec) == pytest.approx(_logprobs(plain), rel=1e-12, abs=1e-12)
    assert plain.verify_steps == 0 and spec.verify_steps > 0
    assert spec.verify_tokens > spec.verify_steps  # drafts were accepted: more than a token a step


@pytest.mark.parametrize("method", ["migrate", "recompute"])
def test_speculation_survives_a_switch_and_retraction_unchanged(tiny64: Path, method: str) -> None:
    """A layout switch mid-request (2x1 -> 1x2 by migration or recomputation) and retractions under a small
    KV budget, with drafting on: the tokens of plain decoding on the same path. Under the ``auto`` policy
    too, whose choice each step rests on the leader's measured step times: the 1x2 replica's two ranks
    take it from their leader, or they would run different passes and the run would fail."""
    switch = [Trigger(unfinished_at_most=6, layout=Layout(1, 2), method=method)]
    kw: dict[str, object] = {"kv_budget_tokens": 160, "page_size": 4}
    runs = {
        (spec, policy): run_batch(
            config(tiny64, 2, "2x1", speculative_algorithm=spec, speculative_policy=policy, **kw),
            _workload(),
            switch,
        )
        for spec, policy in (("none", "auto"), ("ngram", "always"), ("ngram", "auto"))
    }
    plain, always, auto = runs[("none", "auto")], runs[("ngram", "always")], runs[("ngram", "auto")]
    assert _outputs(always) == _outputs(plain) and _outputs(auto) == _outputs(plain)
    assert always.verify_steps > 0 and [str(e.dst) for e in always.reconfigs] == ["1x2"]
    assert [str(e.dst) for e in auto.reconfigs] == ["1x2"]
    assert always.retractions > 0
