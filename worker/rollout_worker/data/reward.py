"""The reward of a math sample (torch-free): 1 when the response's answer equals the prompt's ground truth,
else 0; GSM8K's rule, as VeRL's ``gsm8k`` reward reads it.

The response's answer is the number after the last ``####`` (GSM8K's format, ``#### 72``), or else the last
number in the response. Numbers are compared by value: ``1,234`` = ``1234``, ``72.0`` = ``72``,
``$5`` = ``5``, ``-3`` is negative (but the ``-`` of ``5-3`` is not a sign). The ground truth is
``reward_model.ground_truth`` (VeRL's Parquet) when the prompt has it, else its ``ground_truth`` field
(JSONL); a prompt with neither has no reward (None).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

# a number: an optional sign (not the minus of "5-3"), digits with thousands commas or plain, decimals
_NUMBER = r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])"
NUMBER = re.compile(_NUMBER)
MARKED = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")


def value(number: str) -> Decimal | None:
    """The value of a number as written (commas, a dollar sign and spaces ignored); None if not a number."""
    try:
        return Decimal(number.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None


def answer(text: str) -> Decimal | None:
    """The response's answer: the number after the last ``####``, else the last number; None without one."""
    marked = MARKED.findall(text)
    if marked:
        return value(marked[-1])
    numbers = NUMBER.findall(text)
    return value(numbers[-1]) if numbers else None


def score(text: str, truth: str) -> float:
    """1.0 when the response's answer equals ``truth`` (by value), else 0.0."""
    got, want = answer(text), value(truth)
    return 1.0 if got is not None and want is not None and got == want else 0.0


def ground_truth(fields: Mapping[str, Any]) -> str | None:
    """A prompt's ground truth from its pass-through fields: VeRL's ``reward_model.ground_truth``, else
    ``ground_truth``; None when it has neither."""
    rm = fields.get("reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, Mapping) else None
    if truth is None:
        truth = fields.get("ground_truth")
    return None if truth is None else str(truth)


def reward_of(fields: Mapping[str, Any], text: str) -> float | None:
    """The reward of a response ``text`` to a prompt with pass-through ``fields`` (None: no ground truth)."""
    truth = ground_truth(fields)
    return None if truth is None else score(text, truth)
