"""The central guarantee on the real model (SmolLM2-135M-Instruct, 9 heads in 3 KV groups: uneven head shards
at every TP size above 1), in float64 on real gloo ranks: every layout of 2 and 4 ranks, and two chains of
switches mid-decode (grow and shrink, each with migrate and recompute), give the static TP=1 run's tokens on
chat prompts. The cases and their checks are ``rolloutctl bench lossless``'s, which measures float32 too."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_bench.lossless import (
    CHAINS,
    REFERENCE,
    STATIC,
    Case,
    chat_requests,
    run_case,
)
from rollout_worker.api.requests import RequestSpec

from tests.worker.engine.engine_util import assert_chain_ran

pytestmark = pytest.mark.multiproc

PROMPTS = Path(__file__).resolve().parents[3] / "examples" / "math.jsonl"


@pytest.fixture(scope="module")
def chats(smollm2: Path) -> list[RequestSpec]:
    """8 math questions in the chat template, half greedy and half sampled, 2 to 16 new tokens."""
    return chat_requests(smollm2, PROMPTS, 8, 16)


@pytest.fixture(scope="module")
def real_static(smollm2: Path, chats: list[RequestSpec]) -> dict[str, list[int]]:
    """Two TP=1 replicas of the whole model, in float64 (the float32 checkpoint widened: exact)."""
    base = run_case(smollm2, REFERENCE, chats, "float64").tokens()
    assert len(base) == 8 and all(base.values())
    return base


@pytest.mark.parametrize("case", STATIC, ids=lambda c: c.name)
def test_real_model_every_layout_agrees_with_tp1(
    smollm2: Path, chats: list[RequestSpec], real_static: dict[str, list[int]], case: Case
) -> None:
    res = run_case(smollm2, case, chats, "float64")
    assert res.tokens() == real_static
    assert {p["layout"] for o in res.outputs for p in o["placements"]} == {case.start}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.long) if c.name.startswith("4x1") else c for c in CHAINS],
    ids=lambda c: c.name.replace(" ", ""),
)  # the 4-rank chain: test_deterministic runs it too, bit for bit in float32
def test_real_model_switch_chains_are_lossless(
    smollm2: Path, chats: list[RequestSpec], real_static: dict[str, list[int]], case: Case
) -> None:
    """The tokens equal the static run's through switches mid-decode in both directions. A plan fires the
    lowest threshold reached when requests finish past several at once (the README), which under load can
    happen between two step reports of this chain's replicas, so one planned switch may be skipped (seen
    once in the suite on the 4-rank chain): at least three of the four must commit, mid-decode, growing and
    shrinking. `rolloutctl bench lossless` keeps the strict check (every switch as planned)."""
    res = run_case(smollm2, case, chats, "float64")
    assert res.tokens() == real_static
    assert_chain_ran(case, res, real_static)
