"""The pure parts of `rolloutctl bench memory` (the benchmark itself runs the engine and is not run here):
the long-tailed lengths, a run's summary from step reports, medians beside the recorded slab's and the
ratios to it, the table that says which side was recorded and which measured; and the bench's wiring with
the engine runs replaced (the slab is never run; the paged pool at the slab's bytes gets the recorded
peak)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from rollout_bench import memory
from rollout_bench import sharing as bench_sharing
from rollout_bench.memory import combine, requests, summarise, table, tail_lengths
from rollout_bench.memory_baseline import RECORDED, load
from rollout_worker.engine.model.checkpoint import ensure_model


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


def _step(kind: str, running: int, waiting: int, held: int, paged: int, **kw: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "ms": 1.0,
        "running": running,
        "waiting": waiting,
        "finished": kw.get("finished", 0),
        "kv_tokens": held,
        "kv_capacity": 4096,
        "kv_paged": paged,
        "retractions": kw.get("retractions", 0),
    }


def test_summary_bulk_phase_is_the_decode_steps_while_requests_wait() -> None:
    """Bulk = decode steps while requests wait (utilisation 100/800 and 300/400: median 0.4375); the
    prefill and the tail step (nothing waits) do not count; the pages in use are the allocation."""
    steps = [
        _step("prefill", 4, 6, 40, 800),
        _step("decode", 4, 6, 100, 800),
        _step("decode", 4, 2, 300, 400, finished=2),
        _step("decode", 1, 0, 50, 1600, finished=4),
    ]
    s = summarise({"gen_s": 2.0, "tokens": {"a": 30, "b": 10}, "steps": steps}, budget=1000)
    assert s["bulk_steps"] == 2 and s["decode_steps"] == 3
    assert s["bulk_utilisation"] == pytest.approx(0.4375)
    assert s["bulk_budget_use"] == pytest.approx(0.2)  # 100 / 1000 and 300 / 1000
    assert (s["max_running"], s["peak_allocated_tokens"], s["tokens_per_s"]) == (4, 1600, 20.0)
    assert s["retractions"] == 0


def test_summary_of_a_paged_run_without_a_queue() -> None:
    """Nothing ever waited, so the bulk phase is the decode steps before the first request finished;
    retractions are summed."""
    steps = [
        _step("prefill", 3, 0, 30, 32),
        _step("decode", 3, 0, 33, 36, retractions=1),
        _step("decode", 2, 1, 20, 20, finished=1),
        _step("decode", 2, 0, 22, 24),
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


def _run(paged: tuple[float, int, float], at_slab: tuple[float, int, float]) -> dict[str, dict[str, Any]]:
    return {"paged": _fig(*paged), "paged_at_slab": _fig(*at_slab)}


SLAB = {**_fig(0.1, 10, 1000.0), "peak_allocated_tokens": 16384, "decode_steps": 341}


def test_medians_beside_the_recorded_slab_and_ratios_of_what_the_machine_does_not_change() -> None:
    """The measured engines' medians over runs; the slab's are the recording's; ratios to it only of the
    utilisation and the batch: its tokens/s (1000, another machine's) gives no ratio."""
    runs = [_run((1.0, 30, 200), (1.0, 64, 300)), _run((0.9, 40, 100), (1.0, 64, 150))]
    runs.append(_run((0.8, 20, 150), (1.0, 64, 250)))
    out = combine(runs, SLAB)
    assert out["median"]["slab"] == SLAB
    assert (
        out["median"]["paged"]["tokens_per_s"] == 150 and out["median"]["paged_at_slab"]["max_running"] == 64
    )
    assert out["ratios"]["paged"] == {"bulk_utilisation": pytest.approx(9.0), "max_running": 3.0}
    assert out["ratios"]["paged_at_slab"] == {"bulk_utilisation": pytest.approx(10.0), "max_running": 6.4}


def _report(runs: int = 1) -> dict[str, Any]:
    recorded = {"machine": "epyc", "date": "2026-11-28", "cpu": "AMD EPYC", "torch": "2.13.0+cpu"}
    return {
        "workload": {
            "requests": 64,
            "prompt_len": 16,
            "median_new": 55.0,
            "longest_new": 300,
            "demand_tokens": 5495,
        },
        "baseline": {"path": "slab.json", "recorded": recorded, "runs": 3},
        "measured": {"date": "2026-12-01", "cpu": "Other CPU", "cpus": 8, "torch": "2.14.1"},
        "budget_tokens": 2048,
        "budget_bytes": 2048 * 4096,
        "slab_peak_tokens": 16384,
        "slab_peak_bytes": 16384 * 4096,
        "page_size": 1,
        "runs": runs,
        **combine([_run((1.0, 30, 200), (1.0, 64, 300))], SLAB),
    }


def test_table_says_which_side_was_recorded_and_labels_its_timings() -> None:
    lines = table(_report())
    assert "KV budget 2048 tokens (8.39 MB); the slab's peak: 16384 tokens (67.11 MB)" in lines[0]
    assert lines[1].startswith(
        "dense slab: recorded on epyc, 2026-11-28 (AMD EPYC; torch 2.13.0+cpu; median of 3"
    )
    assert "paged: measured now (2026-12-01; Other CPU, 8 CPUs; torch 2.14.1; median of 1 runs)" in lines[1]
    assert lines[3].startswith(
        "| | dense slab (recorded: epyc, 2026-11-28) | paged, same budget (now) | "
        "paged, the slab's peak bytes (now) |"
    )
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[5:] if line.startswith("| ")}
    assert rows["KV utilisation, bulk phase (held / allocated)"].endswith(
        "| 0.100 | 1.000 | 1.000 | 10.00x | 10.00x |"
    )
    assert rows["largest running batch"].endswith("| 10 | 30 | 64 | 3.00x | 6.40x |")
    assert rows["tokens/s, whole set"].endswith("| 1000.0 † | 200.0 | 300.0 |  |  |")
    assert rows["generation s, whole set"].endswith("| 1.00 † | 1.00 | 1.00 |  |  |")
    assert rows["decode steps, whole set (load-independent)"].endswith("| 341 | 300 | 300 |  |  |")
    assert lines[-1] == (
        "† the dense slab's timings are its recording's, on epyc, 2026-11-28, not this run's: "
        "no ratio is taken"
    )


def test_the_bench_runs_only_the_paged_engines_and_sizes_the_second_by_the_recorded_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the engine runs replaced: two paged engines per run, never the slab, the second's budget the
    slab's recorded peak; the report carries the recording's medians and provenance and this run's host."""
    baseline = load(RECORDED)
    specs: list[dict[str, Any]] = []

    def fake_probe(spec: dict[str, Any], scratch: Path) -> dict[str, Any]:
        specs.append(spec)
        budget = spec["settings"]["kv_budget_tokens"]
        tokens = {r["id"]: r["max_new_tokens"] for r in spec["requests"]}
        return {"gen_s": 1.0, "tokens": tokens, "steps": [_step("decode", 3, 1, 30, min(32, budget))]}

    monkeypatch.setattr(memory, "run_probe", fake_probe)
    model = ensure_model("tiny", tmp_path)
    lines: list[str] = []
    report = memory.run_memory_bench(model, baseline, 1, 2, tmp_path / "r.json", lines.append, samples=1)
    assert [s["settings"]["kv_budget_tokens"] for s in specs] == [2048, 16384, 16384, 2048]
    assert all(s["settings"]["page_size"] == 1 and len(s["requests"]) == 64 for s in specs)
    assert report["median"]["slab"] == baseline.median and report["slab_peak_tokens"] == 16384
    assert report["baseline"]["recorded"]["machine"] == "epyc" and report["measured"]["cpus"] >= 1
    assert set(report["per_run"][0]) == {"paged", "paged_at_slab"}
    assert json.loads((tmp_path / "r.json").read_text())["ratios"] == report["ratios"]
    assert any("recorded: epyc, 2026-11-28" in line for line in lines)


def test_grouped_requests_send_the_samples_of_a_prompt_together() -> None:
    reqs = bench_sharing.grouped_requests([5, 6, 7, 8, 9, 10, 11], prompt_len=4, samples=3, vocab=512)
    assert [r["id"] for r in reqs] == ["p0-0", "p0-1", "p0-2", "p1-0", "p1-1", "p1-2"]  # 7 // 3 prompts
    assert [r["max_new_tokens"] for r in reqs] == [5, 6, 7, 8, 9, 10]
    assert reqs[0]["input_ids"] == reqs[2]["input_ids"] != reqs[3]["input_ids"]
    assert len({r["sampling"]["seed"] for r in reqs}) == 6  # the samples differ


def test_sharing_summary_ratios_and_table() -> None:
    """Prompt tokens prefilled are summed over prefill steps; ratios on / off are per run, then the median."""

    def result(prefilled: list[int], gen_s: float) -> dict[str, Any]:
        steps = [{**_step("prefill", 8, 0, 0, 8), "prefill_tokens": n, "ms": 2.0} for n in prefilled]
        steps.append({**_step("decode", 8, 0, 0, 8), "prefill_tokens": 0})
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
    lines = bench_sharing.table({"runs": 3, "samples": 8, "prompt_len": 128, **out}, prompts=8)
    assert lines[0].startswith("8 prompts of 128 tokens x 8 samples")
    assert "| prompt tokens prefilled | 142 | 384 | 0.370x |" in lines
