"""The math reward, as a table: GSM8K's `####` answer, else the last number; compared by value."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from rollout_worker.data.reward import answer, ground_truth, reward_of, score


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", Decimal(72)),
        ("#### 72 and then 5 more words with 9", Decimal(72)),  # the marked one wins over a later number
        ("#### 1 ... #### 2", Decimal(2)),  # the last marked one (VeRL's gsm8k reward)
        ("#### $1,234.50", Decimal("1234.50")),
        ("The total is 1,234,567 apples.", Decimal(1234567)),  # thousands commas
        ("The change is -15 degrees", Decimal(-15)),  # a negative
        ("5-3 = 2", Decimal(2)),
        ("5-3", Decimal(3)),  # the minus of a difference is no sign
        ("It costs 0.75 dollars.", Decimal("0.75")),  # decimals
        ("The answer is 72.", Decimal(72)),  # a full stop is no decimal point
        ("3, 4 and 5", Decimal(5)),  # a list, not a thousands number
        ("####", None),
        ("no number here", None),
        ("", None),
        ("#### seventy-two, i.e. 72", Decimal(72)),  # no number after ####: the last number
    ],
)
def test_the_answer_of_a_response(text: str, want: Decimal | None) -> None:
    assert answer(text) == want


@pytest.mark.parametrize(
    ("text", "truth", "want"),
    [
        ("#### 72", "72", 1.0),
        ("#### 72.0", "72", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("so 18 eggs... #### 18\n\nThat is all!", "18", 1.0),  # trailing text
        ("#### 71", "72", 0.0),
        ("72 then #### 5", "72", 0.0),
        ("I do not know", "72", 0.0),
        ("#### -4", "-4", 1.0),
        ("#### 4", "-4", 0.0),
        ("#### 72", "not a number", 0.0),
    ],
)
def test_the_score(text: str, truth: str, want: float) -> None:
    assert score(text, truth) == want


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"reward_model": {"style": "rule", "ground_truth": "72"}, "ground_truth": "1"}, "72"),  # VeRL's
        ({"ground_truth": 72}, "72"),  # JSONL's
        ({"reward_model": {"style": "model"}, "ground_truth": "5"}, "5"),
        ({"data_source": "x"}, None),
    ],
)
def test_the_ground_truth_of_a_prompt(fields: dict[str, Any], want: str | None) -> None:
    assert ground_truth(fields) == want


def test_a_prompt_without_ground_truth_has_no_reward() -> None:
    assert reward_of({}, "#### 72") is None
    assert reward_of({"ground_truth": "72"}, "#### 72") == 1.0
