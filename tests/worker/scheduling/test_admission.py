"""The scheduler's KV decisions (rollout_worker.scheduling.admission), computed by hand."""

from __future__ import annotations

import pytest
from rollout_worker.scheduling import admission
from rollout_worker.scheduling.admission import Req, admit, to_retract

SGLANG_RATIO = admission.SGLANG_RATIO


def test_ratio_starts_optimistic_and_decays_to_sglangs_floor() -> None:
    r = SGLANG_RATIO.init
    assert r == 0.7 and SGLANG_RATIO.floor == pytest.approx(0.098)
    assert SGLANG_RATIO.decayed(r) == pytest.approx(0.7 - 0.602 / 600)
    for _ in range(599):
        r = SGLANG_RATIO.decayed(r)
    assert r == pytest.approx(0.098 + 0.602 / 600)
    assert SGLANG_RATIO.decayed(SGLANG_RATIO.decayed(r)) == pytest.approx(0.098)  # the floor holds


def test_ratio_after_a_retraction_is_what_the_running_requests_needed() -> None:
    still = [Req(10, 30, 100, 9), Req(5, 10, 50, 4)]
    assert admission.ratio_after_retraction(still) == pytest.approx((40 + 2 * 20) / 151)
    assert admission.ratio_after_retraction([Req(1, 90, 100)]) == 1.0  # capped
    assert admission.ratio_after_retraction([]) == 0.0


def test_admission_charges_running_requests_by_the_ratio() -> None:
    # 10 free pages of 4 = 40 tokens; the running request may still grow 20 tokens, charged 20 x 0.5 = 10:
    # 30 left. w1 takes 2 pages now and may grow 8: 8 + 8 + 4 (a page of slack) = 20 < 30, admitted, 14
    # left; w2: 4 + 4 + 4 = 12 < 14, admitted, 6 left; w3: 4 + 1 + 4 = 9 >= 6, not admitted.
    running = [Req(8, 4, 24, 3)]
    waiting = [Req(6, 0, 8), Req(3, 0, 4), Req(1, 0, 1)]
    assert admit(running, waiting, 10, 4, 0.5, 64, 8192) == 2
    assert admit(running, waiting, 10, 4, 1.0, 64, 8192) == 0  # 40 - 20 = 20: w1's 20 does not fit
    assert admit(running, waiting, 10, 4, 0.5, 2, 8192) == 1  # max_batch
    assert admit(running, waiting, 10, 4, 0.5, 64, 8) == 1  # max prefill tokens: w1 alone (6)
    # a retracted request is re-prefilled from prompt + generated - 1 tokens, and only its rest is charged
    assert admit([], [Req(6, 11, 12)], 5, 4, 0.7, 64, 8192) == 1  # alone: 4 pages of KV + 1 <= 5
    assert admit(running, [Req(6, 11, 12)], 10, 4, 0.0, 64, 8192) == 1  # 16 + 1 + 4 = 21 < 40


def test_an_idle_replica_admits_a_request_whose_prefill_fits() -> None:
    assert admit([], [Req(30, 0, 100)], 10, 4, 0.7, 64, 8192) == 1  # 8 pages now, 1 more for the step
    assert admit([], [Req(40, 0, 100)], 10, 4, 0.7, 64, 8192) == 0  # 41 tokens > 10 pages: not even alone
    # a request that fills the pool exactly (prompt + max_new = 16 = 4 pages of 4), re-admitted after 10
    # tokens: its KV (13 tokens) and next step (position 13) fit 4 pages, so it is admitted alone
    assert admit([], [Req(4, 10, 12)], 4, 4, 0.7, 64, 8192) == 1
    assert admit([], [Req(16, 0, 0)], 4, 4, 0.7, 64, 8192) == 1  # prefill only: no decode step to fit


def test_retraction_picks_the_fewest_decoded_then_the_longest_prompt() -> None:
    # A: prompt 4, 11 decoded, KV 14 tokens in 4 pages of 4: the step writes position 14, no new page.
    # B: prompt 6, 11 decoded, KV 16 tokens in 4 pages: position 16 needs a fifth page; none is free.
    a, b = Req(4, 11, 12, 4), Req(6, 11, 12, 4)
    assert a.step_pages(4) == 0 and b.step_pages(4) == 1
    assert to_retract([a, b], 0, 4) == [1]  # a tie on decoded tokens: the longer prompt (B) goes
    assert to_retract([a, b], 1, 4) == []
    # the fewest decoded goes first even with the shorter prompt; retracting C (3 pages) covers both needs
    c, d = Req(2, 5, 40, 3), Req(9, 20, 40, 7)  # C: KV 6 -> 7 fits; D: KV 28, 7 pages -> needs an 8th
    assert to_retract([d, c], 0, 4) == [1]
    e = Req(20, 30, 40, 13)  # KV 49 in 13 pages: position 49 needs a 14th
    assert to_retract([e, d], 0, 4) == [1]  # D (20 decoded) before E (30); its 7 pages cover E's one
    assert to_retract([e], 0, 4) == []  # never the last request: it always fits


def test_policy_is_a_setting_of_the_replica() -> None:
    p = admission.RatioPolicy(init=0.0)
    assert p.floor == 0.0 and p.decayed(0.0) == 0.0
