"""The paged pool through real rank processes (float64): pages of 4 tokens under a KV budget small enough
to force optimistic admission to retract, and a migration that moves pages, give the tokens of a run with
pages of 1 and no budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.engine.engine_util import run, tokens

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def static2(tiny64: Path) -> dict[str, list[int]]:
    return tokens(run(tiny64, 2, "2x1"))


def test_tight_pool_with_retractions_changes_no_token(tiny64: Path, static2: dict[str, list[int]]) -> None:
    # 8 requests per replica of up to 58 tokens each, in a pool of 16 pages of 4 tokens
    assert tokens(run(tiny64, 2, "2x1", kv_budget_tokens=64, page_size=4)) == static2


@pytest.mark.parametrize("method", ["migrate", "recompute"])
def test_switch_with_pages_changes_no_token(tiny64: Path, static2: dict[str, list[int]], method: str) -> None:
    res = run(tiny64, 2, "2x1", [f"10:2:{method}"], kv_budget_tokens=200, page_size=4)
    assert tokens(res) == static2
    ev = res.reconfigs[0]
    assert ev.outcome == "committed" and ev.method == method and ev.requests_mid_decode > 0
    if method == "migrate":
        # whole pages move: the bytes are a whole number of pages
        assert ev.kv_pages_moved > 0 and ev.kv_bytes_moved % ev.kv_pages_moved == 0
