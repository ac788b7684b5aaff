"""Lossless in float32 (issue 19, item 1): with ``deterministic`` on, the same requests give identical
tokens and bit-identical logprobs across every layout of 2 and 4 ranks and every transition (grow, shrink,
migrate, recompute) and across batch sizes (1 to 8 on the real model, 1 to 64 on ``small``) on the real
model and ``small``, and across batch sizes 1 to 64, arrival orders, retraction and prefix sharing on
``tiny``; real gloo ranks. Without it, the same float32 runs differ (the
control: the comparison can fail)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from rollout_bench.lossless import CHAINS, REFERENCE, STATIC, Case, chat_requests, run_case
from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.driver.fixed_batch import BatchResult
from rollout_worker.engine.model.checkpoint import make_model
from rollout_worker.scheduling.layout import Layout

from tests.worker.engine.engine_util import assert_chain_ran, grpo_groups, requests, run

pytestmark = pytest.mark.multiproc

PROMPTS = Path(__file__).resolve().parents[3] / "examples" / "math.jsonl"
Outputs = dict[str, tuple[list[int], list[float | None]]]


def outputs(res: BatchResult) -> Outputs:
    """Each request's tokens and logprobs (floats compared exactly)."""
    return {o["id"]: (o["output_ids"], o["output_token_logprobs"]) for o in res.outputs}


def logprobs(specs: list[RequestSpec]) -> list[RequestSpec]:
    return [dataclasses.replace(s, return_logprob=True) for s in specs]


@pytest.fixture(scope="module")
def chats(smollm2: Path) -> list[RequestSpec]:
    """8 math questions in the chat template, half greedy and half sampled, 2 to 16 new tokens."""
    return logprobs(chat_requests(smollm2, PROMPTS, 8, 16))


@pytest.fixture(scope="module")
def real_reference(smollm2: Path, chats: list[RequestSpec]) -> Outputs:
    """Two TP=1 replicas, float32, deterministic."""
    base = outputs(run_case(smollm2, REFERENCE, chats, "float32", deterministic=True))
    assert len(base) == 8 and all(toks and None not in lps for toks, lps in base.values())
    return base


@pytest.mark.parametrize("case", [*STATIC, *CHAINS], ids=lambda c: c.name)
def test_real_model_every_layout_and_transition_is_bitwise_equal(
    smollm2: Path, chats: list[RequestSpec], real_reference: Outputs, case: Case
) -> None:
    res = run_case(smollm2, case, chats, "float32", deterministic=True)
    assert outputs(res) == real_reference
    if case.switches:
        assert_chain_ran(case, res, {rid: toks for rid, (toks, _) in real_reference.items()})


@pytest.fixture(scope="module")
def small32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "small32"
    make_model("small", 0, out, "float32")
    return out


@pytest.mark.long
def test_small_through_both_chains_is_bitwise_equal(small32: Path) -> None:
    """``small`` (8 heads over 4 KV heads, 1536 intermediate): both chains of switches (every layout of 2
    and 4 ranks on the way) against two TP=1 replicas."""
    specs = logprobs(requests(16, 5, 4096))
    ref = outputs(run_case(small32, REFERENCE, specs, "float32", deterministic=True))
    for case in CHAINS:
        res = run_case(small32, case, specs, "float32", deterministic=True)
        assert outputs(res) == ref, case.name
        assert_chain_ran(case, res, {rid: toks for rid, (toks, _) in ref.items()})


def test_real_model_batch_sizes_change_nothing(
    smollm2: Path, chats: list[RequestSpec], real_reference: Outputs
) -> None:
    """The real model's 8 chats on one TP=1 replica, one at a time (batch 1) and all in one batch of 8,
    against the reference's two replicas of 4 (the kernel tests show a row among up to 63 others)."""
    for max_batch in (1, 8):
        assert outputs(_run(smollm2, "1x1", chats, max_batch=max_batch)) == real_reference, max_batch


@pytest.mark.long
def test_small_batch_sizes_change_nothing(small32: Path) -> None:
    """``small``, 64 requests: one at a time (batch 1), all in one batch of up to 64 (every size on the way
    down as they finish), and at TP 2 in batches of up to 64."""
    specs = logprobs(requests(64, 9, 4096))
    ref = outputs(_run(small32, "1x1", specs, max_batch=1))
    assert outputs(_run(small32, "1x1", specs, max_batch=64)) == ref
    assert outputs(_run(small32, "1x2", specs, max_batch=64)) == ref


def test_real_model_without_it_differs(
    smollm2: Path, chats: list[RequestSpec], real_reference: Outputs
) -> None:
    """The control: the default kernels, the same float32 runs (TP 2 against TP 1): logprobs differ."""
    ref = outputs(run_case(smollm2, REFERENCE, chats, "float32"))
    got = outputs(run_case(smollm2, Case("1x2"), chats, "float32"))
    assert got != ref


def _tiny(n: int, seed: int, vocab: int = 512) -> list[RequestSpec]:
    return logprobs(requests(n, seed, vocab))


def _run(model: Path, layout: str, specs: list[RequestSpec], **kw: Any) -> BatchResult:
    world = Layout.parse(layout).world
    return run(model, world, layout, kw.pop("triggers", ()), specs, dtype="float32", deterministic=True, **kw)


@pytest.mark.parametrize("packed_weights", ["auto", "off"])
def test_batch_sizes_and_arrival_order_change_nothing(tiny32: Path, packed_weights: str) -> None:
    """64 requests: all in one batch of up to 64, one at a time (batch 1), in reverse order, and as 2x1
    with a switch to 1x2 and back (batches of every size on the way down); on both float32 kernels (oneDNN
    on packed weights, and MKL's sgemm, whose row rule differs by CPU)."""
    specs = _tiny(64, 7)
    ref = outputs(_run(tiny32, "1x1", specs, max_batch=64, packed_weights=packed_weights))
    assert outputs(_run(tiny32, "1x1", specs, max_batch=1, packed_weights=packed_weights)) == ref
    assert outputs(_run(tiny32, "1x1", specs[::-1], max_batch=64, packed_weights=packed_weights)) == ref
    switches = ["40:2:migrate", "12:1:recompute"]
    res = _run(tiny32, "2x1", specs, max_batch=64, triggers=switches, packed_weights=packed_weights)
    assert outputs(res) == ref and len(res.reconfigs) == 2


def test_retraction_and_prefix_sharing_change_nothing(tiny32: Path) -> None:
    """GRPO groups (8 samples of each of 4 prompts) with the prefix cache on and off, and with a KV pool
    so small that decode steps retract requests (re-prefilled later from prompt + output)."""
    specs = grpo_groups(_tiny(4, 3))
    ref = outputs(_run(tiny32, "1x1", specs, prefix_cache=False))
    shared = _run(tiny32, "1x1", specs, page_size=4)
    assert outputs(shared) == ref and sum(o["cached_tokens"] for o in shared.outputs) > 0
    tight = _run(tiny32, "1x1", specs, page_size=4, kv_budget_tokens=160)
    assert outputs(tight) == ref and tight.retractions > 0
