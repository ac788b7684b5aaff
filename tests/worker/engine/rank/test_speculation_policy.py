"""When speculation verifies (``speculative_policy: auto``): the leader's fit of a pass's time, each request's
learned acceptance, and the width choice they feed, on hand-made numbers."""

from __future__ import annotations

import pytest
from rollout_worker.engine.rank.speculation import COST_SCALE, Acceptance, PassCost, choose_width


def test_the_pass_cost_fit_recovers_fixed_and_per_row_parts() -> None:
    cost = PassCost()
    for rows in [8, 8, 8]:
        cost.add(rows, 10.0 + 0.5 * rows)
    assert cost.ratio() == 0  # one pass size only: the slope is unknown, no claim made
    for rows in [1, 4, 16, 32, 2, 64]:
        cost.add(rows, 10.0 + 0.5 * rows)
    assert cost.ratio() / COST_SCALE == pytest.approx(0.05, rel=1e-3)  # b / a = 0.5 / 10


def test_the_pass_cost_fit_forgets_old_steps() -> None:
    cost = PassCost(decay=0.9)
    for rows in [1, 8, 32, 64] * 10:
        cost.add(rows, 10.0 + 1.0 * rows)
    before = cost.ratio()
    for rows in [1, 8, 32, 64] * 30:  # the layout got faster per row
        cost.add(rows, 10.0 + 0.1 * rows)
    assert before / COST_SCALE == pytest.approx(0.1, rel=1e-3)
    assert cost.ratio() / COST_SCALE == pytest.approx(0.01, rel=0.05)


def test_the_pass_cost_fit_never_claims_a_negative_or_free_pass() -> None:
    cost = PassCost()
    for rows, ms in [(1, 20.0), (64, 5.0), (2, 19.0), (32, 8.0)]:  # faster when larger: noise
        cost.add(rows, ms)
    assert cost.ratio() == 0
    cost = PassCost()
    for rows in [1, 2, 4, 8]:
        cost.add(rows, 3.0 * rows)  # through the origin: the fixed part is floored, the ratio finite
    assert 0 < cost.ratio() < 2**62


def test_acceptance_learns_from_verify_steps() -> None:
    acc = Acceptance()
    assert acc.p("a") == 0.5  # nothing seen
    acc.record("a", drafted=4, accepted=4)
    acc.record("a", drafted=4, accepted=4)
    assert acc.p("a") == pytest.approx(9 / 10)
    acc.record("b", drafted=4, accepted=0)
    acc.record("b", drafted=4, accepted=1)
    assert acc.p("b") == pytest.approx(2 / 5)
    acc.forget({"b"})
    assert acc.p("a") == 0.5 and acc.p("b") == pytest.approx(2 / 5)


def test_a_free_pass_verifies_every_draft() -> None:
    drafts = [[1, 2, 3, 4], [5, 6], []]
    assert choose_width(drafts, [0.9, 0.9, 0.5], ratio=0.0) == 4
    assert choose_width([[1, 2, 3, 4]], [0.01], ratio=0.0) == 4  # any accepted token is a gain


def test_a_compute_bound_bulk_phase_decodes() -> None:
    bulk = [[1, 2, 3, 4]] * 64
    # each row costs as much as the pass's fixed part: verifying 5 rows a request doubles the cost and
    # more, for at most 1 + 0.5 + 0.25 + ... tokens a request
    assert choose_width(bulk, [0.5] * 64, ratio=1.0) == 0


def test_the_tail_speculates_where_the_bulk_would_not() -> None:
    p = 0.7
    assert choose_width([[1, 2, 3, 4]] * 64, [p] * 64, ratio=0.05) == 0
    assert choose_width([[1, 2, 3, 4]] * 2, [p] * 2, ratio=0.05) == 4


def test_drafts_that_miss_are_not_verified() -> None:
    assert choose_width([[1, 2, 3, 4]] * 4, [0.02] * 4, ratio=0.1) == 0


def test_the_width_is_the_best_of_all_widths() -> None:
    drafts, p, ratio = [[1, 2, 3, 4, 5, 6]] * 8, [0.6] * 8, 0.02

    def rate(w: int) -> float:
        return 8 * (1 + sum(0.6**m for m in range(1, w + 1))) / (1 + ratio * 8 * (1 + w))

    best = max(range(7), key=rate)
    assert 0 < best < 6  # an interior optimum: neither decode nor the full draft
    assert choose_width(drafts, p, ratio) == best
