"""The dense slab's recorded side of `rolloutctl bench memory`: the recordings kept in bench/ load and are
this tree's workload (the same requests' new tokens, the same model's KV bytes per token, the CLI's defaults
for the default one), their provenance says what was run where, and a file or a workload that does not fit
is refused, naming the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollout_bench.memory import METRICS, tail_lengths
from rollout_bench.memory_baseline import FIGURES, RECORDED, Baseline, check_model, check_workload, load
from rollout_worker.errors import UserError

TINY_KV_BYTES = 1024  # the tiny preset, float32: 2 (K, V) x 4 layers x 2 KV heads x 16 dims x 4 bytes
RECORDINGS = [(RECORDED, 64), (RECORDED.with_name("bench-memory-slab-256.json"), 256)]


@pytest.mark.parametrize(("path", "n"), RECORDINGS, ids=["64", "256"])
def test_the_recordings_are_this_trees_workload_with_their_provenance(path: Path, n: int) -> None:
    b = load(path)
    w = b.workload
    assert (w["requests"], w["prompt_len"], w["median_new"], w["longest_new"], b.budget_tokens) == (
        n,
        16,
        55.0,
        300,
        2048,
    )
    check_workload(b, n, 16, 55.0, 300, 2048)  # the CLI's defaults (and --requests 256)
    check_model(b, tail_lengths(n, 55.0, 300), TINY_KV_BYTES)
    assert b.where == "epyc, 2026-11-28" and b.recorded["torch"] and b.recorded["command"]
    assert b.recorded["slab_commit"].startswith("5904b9b")
    assert len(b.per_run) == b.runs == 3
    assert b.peak_allocated_tokens == b.per_run[0]["peak_allocated_tokens"] > b.budget_tokens
    assert b.median["max_running"] < n and 0 < b.median["bulk_utilisation"] < 0.2  # what the slab showed


def test_the_figures_a_recording_has_are_the_tables_rows() -> None:
    assert tuple(k for k, _, _ in METRICS) == FIGURES


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ((32, 16, 55.0, 300, 2048), "--requests: the baseline "),
        ((64, 8, 55.0, 300, 2048), "--prompt-len: the baseline "),
        ((64, 16, 40.0, 300, 2048), "--median-new: the baseline "),
        ((64, 16, 55.0, 400, 2048), "--longest-new: the baseline "),
        ((64, 16, 55.0, 300, 4096), "--kv-tokens: the baseline "),
    ],
)
def test_a_workload_the_baseline_was_not_recorded_on_is_refused(
    flags: tuple[int, int, float, int, int], message: str
) -> None:
    with pytest.raises(UserError) as err:
        check_workload(load(RECORDED), *flags)
    assert str(err.value).startswith(message), err.value
    assert "was recorded with" in str(err.value) and "--baseline" in str(err.value)


def _written(tmp_path: Path, change: dict[str, Any], drop: str | None = None) -> Path:
    data = {**json.loads(RECORDED.read_text()), **change}
    data.pop(drop or "", None)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t: t / "none.json", "cannot read"),
        (lambda t: (t / "x.json").write_text("{") and t / "x.json", "is not JSON"),
        (lambda t: _written(t, {"side": "paged"}), "is not a recorded slab side"),
        (lambda t: _written(t, {}, drop="per_run"), "has no per_run"),
        (lambda t: _written(t, {"median": {"max_running": 1}}), "its median has no bulk_utilisation"),
        (lambda t: _written(t, {"workload": {"requests": 64}}), "its workload has no prompt_len"),
    ],
    ids=["missing", "not-json", "not-slab", "no-runs", "no-figures", "no-workload"],
)
def test_a_file_that_is_not_a_recording_is_refused(tmp_path: Path, make: Any, message: str) -> None:
    with pytest.raises(UserError) as err:
        load(make(tmp_path))
    assert err.value.field == "--baseline" and message in err.value.message, err.value


def test_a_recording_of_other_requests_or_another_model_is_refused() -> None:
    b = load(RECORDED)
    lens = tail_lengths(64, 55.0, 300)
    with pytest.raises(UserError, match="new tokens are not this tree's"):
        check_model(b, [*lens[:-1], lens[-1] + 1], TINY_KV_BYTES)
    with pytest.raises(UserError, match="recorded with 1024 KV bytes per token, this tree's model has 2048"):
        check_model(b, lens, 2 * TINY_KV_BYTES)
    assert isinstance(b, Baseline)
