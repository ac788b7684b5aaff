"""A plan's triggers: one per threshold (a second one at the same threshold could never fire)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rollout_worker.api.plan import Plan
from rollout_worker.errors import field_errors


def test_two_triggers_at_one_threshold_are_refused_naming_the_second() -> None:
    body = {
        "based_on_layout": "2x1",
        "triggers": [{"unfinished_at_most": 3, "layout": "1x2"}, {"unfinished_at_most": 3, "layout": "2x1"}],
    }
    with pytest.raises(ValidationError) as exc:
        Plan.model_validate(body)
    assert field_errors(exc.value) == [
        (("triggers", 1, "unfinished_at_most"), "3 is the threshold of trigger 0 too")
    ]
    body["triggers"][1]["unfinished_at_most"] = 2  # type: ignore[index]
    assert len(Plan.model_validate(body).triggers) == 2
