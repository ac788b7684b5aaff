"""`rolloutctl bench run`'s summary is computed from its trials: the ratio adaptive / best static is taken
per round against that round's fastest static layout, the switching overhead counts only committed switches,
and the token check reports any trial that drew different tokens."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from rollout_bench.job_run import Trial, summarize, table


def _switch(ms: float, outcome: str = "committed") -> dict[str, Any]:
    return {
        "pod": "p-0",
        "from": "2x1",
        "to": "1x2",
        "method": "migrate",
        "step": 3,
        "outcome": outcome,
        "predicted_ms": 20.0,
        "actual_ms": ms,
    }


def _prep() -> Any:
    job = SimpleNamespace(
        metadata=SimpleNamespace(name="j"), spec=SimpleNamespace(model=SimpleNamespace(dtype="float32"))
    )
    return SimpleNamespace(loaded=SimpleNamespace(job=job), layout="2x1")


def _trials(identical: bool = True) -> list[Trial]:
    return [
        Trial(1, "adaptive", 10.0, 1000, [_switch(50.0), _switch(900.0, "rolled_back")], [1.0, 2.0]),
        Trial(1, "static:2x1", 12.0, 1000, [], [3.0], True),
        Trial(1, "static:1x2", 11.0, 1000, [], [4.0], True),
        Trial(2, "static:1x2", 10.0, 1000, [], [1.0], True),
        Trial(2, "static:2x1", 15.0, 1000, [], [1.0], True),
        Trial(2, "adaptive", 12.0, 1000, [_switch(70.0)], [1.0], identical),
    ]


def test_the_ratio_is_against_each_rounds_best_static() -> None:
    s = summarize(_prep(), _trials(), rounds=2)
    r = s["adaptive_over_best_static"]
    assert r["per_round"] == pytest.approx([10 / 11, 12 / 10])
    assert r["best_static_per_round"] == ["static:1x2", "static:1x2"]
    assert r["median"] == pytest.approx((10 / 11 + 1.2) / 2)
    assert s["switch_overhead"]["median_ms"] == pytest.approx(60.0)  # the rolled-back one not counted
    assert s["policies"]["static:2x1"]["median_s"] == pytest.approx(13.5)
    assert s["identical_tokens"] is True
    lines = table(s)
    assert any("adaptive / best static (median of 2 rounds): 1.055" in x for x in lines)
    assert "tokens identical across trials: yes (float32)" in lines[-1]


def test_a_trial_with_other_tokens_is_reported() -> None:
    s = summarize(_prep(), _trials(identical=False), rounds=2)
    assert s["identical_tokens"] is False and "identical across trials: NO" in table(s)[-1]
