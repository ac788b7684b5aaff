"""The pure parts of `rolloutctl bench memory` (the benchmark itself runs two engines and is not run here):
the long-tailed lengths, a run's summary from step reports, medians and side-by-side ratios, the table."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from rollout_bench import sharing as bench_sharing
from rollout_bench.memory import combine, requests, summarise, table, tail_lengths


def test_tail_lengths_are_lognormal_quantiles() -> None:
    lens = tail_lengths(64, 55, 300)
    assert len(lens) == 64 and max(lens) == 300 and min(lens) >= 1
    assert statistics.median(lens) == pytest.approx(55, abs=1.5)
    assert sorted(lens)[-2] < 300 * 0.8  # a tail: the longest stands alone
    assert lens != sorted(lens) and tail_lengths(64, 55, 300) == lens  # shuffled, seeded
    with pytest.raises(ValueError, match="median < longest"):
        tail_lengths(64, 300, 300)


def test_requests_share_lengths_and_prompts() -> None:
    reqs = requests([3, 9], prompt_len=5, vocab=512)
    assert [r["max_new_tokens"] for r in reqs] == [3, 9]
    assert all(len(r["input_ids"]) == 5 and all(0 <= t < 512 for t in r["input_ids"]) for r in reqs)
    assert requests([3, 9], 5, 512) == reqs  # the same requests for both engines


def _step(
    kind: str, running: int, waiting: int, held: int, cap: int, paged: int | None, **kw: Any
) -> dict[str, Any]:
    return {
        "kind": kind,
        "ms": 1.0,
        "running": running,
        "waiting": waiting,
        "finished": kw.get("finished", 0),
        "kv_tokens": held,
        "kv_capacity": cap,
        "kv_paged": paged,
        "retractions": kw.get("retractions", 0),
    }


def test_summary_of_a_slab_run() -> None:
    """The slab reports no pages: its allocation is the whole slab. Bulk = decode steps while requests wait
    (utilisation 100/800 and 300/800: median 0.25); the tail step (nothing waits) does not count."""
    steps = [
        _step("prefill", 4, 6, 40, 800, None),
        _step("decode", 4, 6, 100, 800, None),
        _step("decode", 4, 2, 300, 800, None, finished=2),
        _step("decode", 1, 0, 50, 1600, None, finished=4),
    ]
    s = summarise({"gen_s": 2.0, "tokens": {"a": 30, "b": 10}, "steps": steps}, budget=1000)
    assert s["bulk_steps"] == 2 and s["decode_steps"] == 3
    assert s["bulk_utilisation"] == pytest.approx(0.25)
    assert s["bulk_budget_use"] == pytest.approx(0.2)  # 100 / 1000 and 300 / 1000
    assert (s["max_running"], s["peak_allocated_tokens"], s["tokens_per_s"]) == (4, 1600, 20.0)
    assert s["retractions"] == 0


def test_summary_of_a_paged_run_without_a_queue() -> None:
    """Pages in use are the allocation; nothing ever waited, so the bulk phase is the decode steps before
    the first request finished; retractions are summed."""
    steps = [
        _step("prefill", 3, 0, 30, 4096, 32),
        _step("decode", 3, 0, 33, 4096, 36, retractions=1),
        _step("decode", 2, 1, 20, 4096, 20, finished=1),
        _step("decode", 2, 0, 22, 4096, 24),
    ]
    s = summarise({"gen_s": 1.0, "tokens": {"a": 5}, "steps": steps}, budget=4096)
    assert s["bulk_steps"] == 1  # waiting > 0 at step 3: that step is the bulk
    assert s["bulk_utilisation"] == pytest.approx(1.0)
    steps[2]["waiting"] = 0
    s = summarise({"gen_s": 1.0, "tokens": {"a": 5}, "steps": steps}, budget=4096)
    assert s["bulk_steps"] == 1 and s["bulk_utilisation"] == pytest.approx(33 / 36)
    assert (s["peak_allocated_tokens"], s["retractions"]) == (36, 1)


def _fig(util: float, batch: int, tps: float) -> dict[str, Any]:
    return {
        "bulk_utilisation": util,
        "bulk_budget_use": util / 2,
        "max_running": batch,
        "peak_allocated_tokens": 100,
        "tokens_per_s": tps,
        "gen_s": 1.0,
        "decode_steps": 300,
        "retractions": 0,
    }


def _run(slab: tuple[float, int, float], paged: tuple[float, int, float]) -> dict[str, dict[str, Any]]:
    return {"slab": _fig(*slab), "paged": _fig(*paged), "paged_at_slab": _fig(1.0, 64, 2 * slab[2])}


def test_ratios_are_taken_within_each_run_then_the_median() -> None:
    """Run 2 is slow for every engine (a loaded machine): the ratio of each run is kept, so the median
    ratio is 2.0 although the median tokens/s of slab and paged are 100 and 150 (1.5x)."""
    runs = [_run((0.1, 10, 100), (1.0, 30, 200)), _run((0.1, 10, 50), (1.0, 30, 100))]
    runs.append(_run((0.2, 10, 200), (0.9, 40, 150)))
    out = combine(runs)
    assert out["median"]["slab"]["tokens_per_s"] == 100 and out["median"]["paged"]["tokens_per_s"] == 150
    assert out["ratios"]["paged"]["tokens_per_s"] == 2.0
    assert out["ratios"]["paged"]["max_running"] == 3.0 and out["ratios"]["paged"]["bulk_utilisation"] == 10.0
    assert out["ratios"]["paged_at_slab"]["max_running"] == 6.4


def test_table_lists_every_engine_and_the_ratios() -> None:
    report = {
        "workload": {
            "requests": 64,
            "prompt_len": 16,
            "median_new": 55.0,
            "longest_new": 300,
            "demand_tokens": 5495,
        },
        "budget_tokens": 2048,
        "budget_bytes": 2048 * 4096,
        "slab_peak_tokens": 16384,
        "slab_peak_bytes": 16384 * 4096,
        "page_size": 1,
        "runs": 1,
        **combine([_run((0.1, 10, 100), (1.0, 30, 200))]),
    }
    lines = table(report)
    assert "KV budget 2048 tokens (8.39 MB); the slab's peak: 16384 tokens (67.11 MB)" in lines[0]
    assert lines[2].startswith("| | dense slab | paged, same budget | paged, the slab's peak bytes |")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[4:]}
    assert rows["KV utilisation, bulk phase (held / allocated)"].endswith(
        "| 0.100 | 1.000 | 1.000 | 10.00x | 10.00x |"
    )
    assert rows["largest running batch"].endswith("| 10 | 30 | 64 | 3.00x | 6.40x |")
    assert rows["tokens/s, whole set"].endswith("| 100.0 | 200.0 | 200.0 | 2.00x | 2.00x |")
    assert rows["retractions"].endswith("| 0 | 0 | 0 |  |  |")
    assert rows["decode steps, whole set (load-independent)"].endswith("| 300 | 300 | 300 |  |  |")


def test_grouped_requests_send_the_samples_of_a_prompt_together() -> None:
    reqs = bench_sharing.grouped_requests([5, 6, 7, 8, 9, 10, 11], prompt_len=4, samples=3, vocab=512)
    assert [r["id"] for r in reqs] == ["p0-0", "p0-1", "p0-2", "p1-0", "p1-1", "p1-2"]  # 7 // 3 prompts
    assert [r["max_new_tokens"] for r in reqs] == [5, 6, 7, 8, 9, 10]
    assert reqs[0]["input_ids"] == reqs[2]["input_ids"] != reqs[3]["input_ids"]
    assert len({r["sampling"]["seed"] for r in reqs}) == 6  # the samples differ


def test_sharing_summary_ratios_and_table() -> None:
    """Prompt tokens prefilled are summed over prefill steps; ratios on / off are per run, then the median."""

    def result(prefilled: list[int], gen_s: float) -> dict[str, Any]:
        steps = [{**_step("prefill", 8, 0, 0, 64, 8), "prefill_tokens": n, "ms": 2.0} for n in prefilled]
        steps.append({**_step("decode", 8, 0, 0, 64, 8), "prefill_tokens": 0})
        return {"gen_s": gen_s, "tokens": {"a": 40}, "steps": steps}

    on, off = (
        bench_sharing.summarise(result([128, 7, 7], 2.0)),
        bench_sharing.summarise(result([128] * 3, 4.0)),
    )
    assert (on["prefill_tokens"], on["prefill_ms"], on["tokens_per_s"]) == (142, 6.0, 20.0)
    slow = {"shared": {**on, "gen_s": 9.0}, "unshared": {**off, "gen_s": 12.0}}
    out = bench_sharing.combine([{"shared": on, "unshared": off}, slow, {"shared": on, "unshared": off}])
    assert out["ratios"]["prefill_tokens"] == pytest.approx(142 / 384)
    assert out["ratios"]["gen_s"] == 0.5 and out["median"]["unshared"]["gen_s"] == 4.0
    lines = bench_sharing.table({"runs": 3, **out}, prompts=8, samples=8, prompt_len=128)
    assert lines[0].startswith("8 prompts of 128 tokens x 8 samples")
    assert "| prompt tokens prefilled | 142 | 384 | 0.370x |" in lines
