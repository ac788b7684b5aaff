"""``rolloutctl bench memory``: the paged KV pool against the dense slab it replaced, on the same long-tailed
requests and the same KV budget, side by side.

* the dense slab: recorded, not run (:mod:`rollout_bench.memory_baseline`): the figures of the engine's
  last commit with the slab, measured once on a named machine and date and kept as JSON. Its
  KV cache is one slab ``[slots, heads, capacity, dim]`` per layer, whose capacity follows the longest
  running request, and it admits a request only while the ``prompt + max_new_tokens`` of those running fit
  the budget;
* the paged engine: this tree (pages of ``page_size`` tokens, optimistic admission, retraction), measured
  now, twice: with the same budget setting, and with a pool of the bytes the slab allocated at most (its
  slots x capacity can exceed the budget, which bounds only its reservations): the same KV bytes;
* requests: ``n`` prompts of ``prompt_len`` random tokens, new-token counts lognormal (the quantiles of a
  lognormal with the given median whose longest is ``longest``, in a seeded shuffled order), EOS ignored,
  one replica of one rank, the tiny random-weight model in float32: the recording's workload;
* each run measures both paged engines (in turn, the order reversed every other run), each in a fresh
  process (:mod:`rollout_bench.memory_probe`).

Measured per engine and run, from every step's report: KV utilisation in the bulk phase (the decode steps
while a request waits for memory): tokens held / tokens allocated (the pages in use x page size), the median
over those steps, and the budget's use (tokens held / budget); the largest running batch; the most tokens
allocated at once; generation tokens/s on the whole set (first submit to last finish); retractions. The
figures that do not depend on the machine (utilisation, batch, tokens allocated, decode steps) compare
directly with the recording's (ratios paged / slab of the medians); its timings are its machine's, shown
and labelled as such, and no ratio is taken of them.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

from rollout_worker.config.model_config import ModelConfig

from rollout_bench import sharing as bench_sharing
from rollout_bench.memory_baseline import Baseline, check_model
from rollout_bench.record import host, write_json

Echo = Callable[[str], Any]
ENGINES = ("paged", "paged_at_slab")  # measured; the last: a pool of the bytes the slab allocated at most
COLUMNS = ("slab", *ENGINES)  # the recorded slab first
LABELS = {
    "slab": "dense slab",
    "paged": "paged, same budget",
    "paged_at_slab": "paged, the slab's peak bytes",
}


def tail_lengths(n: int, median: float, longest: int, seed: int = 0) -> list[int]:
    """``n`` new-token counts: the ``(i + 0.5) / n`` quantiles of the lognormal of this median whose
    highest quantile is ``longest``, shuffled with ``seed`` (each at least 1)."""
    if n < 2 or not 1 <= median < longest:
        raise ValueError(f"need n >= 2 and 1 <= median < longest, got {n}, {median}, {longest}")
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    sigma = math.log(longest / median) / z[-1]
    lens = [max(1, round(median * math.exp(sigma * zi))) for zi in z]
    lens[-1] = longest
    random.Random(seed).shuffle(lens)
    return lens


def requests(lengths: Sequence[int], prompt_len: int, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"id": f"m{i}", "input_ids": [rng.randrange(vocab) for _ in range(prompt_len)], "max_new_tokens": k}
        for i, k in enumerate(lengths)
    ]


def summarise(result: dict[str, Any], budget: int) -> dict[str, Any]:
    """One paged run: bulk-phase utilisation, largest batch, peak allocation, tokens/s, retractions."""
    steps = result["steps"]
    decode = [s for s in steps if s["kind"] == "decode"]
    bulk = [s for s in decode if s["waiting"] > 0]
    if not bulk:  # nothing ever waited: the decode steps before the first request finished
        first = next((i for i, s in enumerate(steps) if s["finished"]), len(steps))
        bulk = [s for s in steps[:first] if s["kind"] == "decode"]
    tokens = sum(result["tokens"].values())
    return {
        "gen_s": result["gen_s"],
        "tokens": tokens,
        "tokens_per_s": tokens / result["gen_s"] if result["gen_s"] > 0 else 0.0,
        "max_running": max((s["running"] for s in steps), default=0),
        "peak_allocated_tokens": max((s["kv_paged"] for s in steps), default=0),
        "bulk_steps": len(bulk),
        "decode_steps": len(decode),
        "bulk_utilisation": _median([s["kv_tokens"] / s["kv_paged"] for s in bulk if s["kv_paged"]]),
        "bulk_budget_use": _median([s["kv_tokens"] / budget for s in bulk]),
        "retractions": sum(s["retractions"] for s in steps),
    }


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


METRICS = (
    ("bulk_utilisation", "KV utilisation, bulk phase (held / allocated)", "{:.3f}"),
    ("bulk_budget_use", "budget in use, bulk phase (held / budget)", "{:.3f}"),
    ("max_running", "largest running batch", "{:.0f}"),
    ("peak_allocated_tokens", "most KV tokens allocated at once", "{:.0f}"),
    ("tokens_per_s", "tokens/s, whole set", "{:.1f}"),
    ("gen_s", "generation s, whole set", "{:.2f}"),
    ("decode_steps", "decode steps, whole set (load-independent)", "{:.0f}"),
    ("retractions", "retractions", "{:.0f}"),
)
TIMINGS = ("tokens_per_s", "gen_s")  # the machine's: the recorded side's are not compared
RATIOS = ("bulk_utilisation", "max_running")


def combine(runs: list[dict[str, dict[str, Any]]], slab: dict[str, Any]) -> dict[str, Any]:
    """Medians over runs of each measured engine's figures beside the recorded slab's medians, and for each
    measured engine the ratios to the slab of the figures that do not depend on the machine."""
    med = {e: {k: statistics.median(r[e][k] for r in runs) for k, _, _ in METRICS} for e in ENGINES}
    med = {"slab": {k: slab[k] for k, _, _ in METRICS}, **med}
    ratios = {e: {k: _ratio(med[e][k], slab[k]) for k in RATIOS} for e in ENGINES}
    return {"median": med, "ratios": ratios}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def table(report: dict[str, Any]) -> list[str]:
    """A Markdown table: the recorded slab's medians, the measured engines', the ratios, each side named."""
    w, rec, now = report["workload"], report["baseline"]["recorded"], report["measured"]
    med, ratios = report["median"], report["ratios"]
    where = f"{rec['machine']}, {rec['date']}"
    lines = [
        f"{w['requests']} requests, prompts of {w['prompt_len']} tokens, new tokens lognormal (median "
        f"{w['median_new']:g}, longest {w['longest_new']}; {w['demand_tokens']} tokens in all), EOS "
        f"ignored, one replica; KV budget {report['budget_tokens']} tokens "
        f"({report['budget_bytes'] / 1e6:.2f} MB); the slab's peak: {report['slab_peak_tokens']} tokens "
        f"({report['slab_peak_bytes'] / 1e6:.2f} MB); page size {report['page_size']}",
        f"dense slab: recorded on {where} ({rec['cpu']}; torch {rec['torch']}; median of "
        f"{report['baseline']['runs']} runs; {report['baseline']['path']}); paged: measured now "
        f"({now['date']}; {now['cpu']}, {now['cpus']} CPUs; torch {now['torch']}; median of {report['runs']} "
        "runs)",
        "",
        f"| | {LABELS['slab']} (recorded: {where}) | "
        + " | ".join(f"{LABELS[e]} (now)" for e in ENGINES)
        + " | "
        + " | ".join(f"{LABELS[e]} / slab" for e in ENGINES)
        + " |",
        "|---" * (len(COLUMNS) + len(ENGINES) + 1) + "|",
    ]
    for key, label, fmt in METRICS:
        cells = [fmt.format(med[e][key]) + (" †" if e == "slab" and key in TIMINGS else "") for e in COLUMNS]
        cells += [f"{ratios[e][key]:.2f}x" if key in ratios[e] else "" for e in ENGINES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"† the dense slab's timings are its recording's, on {where}, not this run's: no ratio is taken",
    ]
    return lines


def run_probe(spec: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """One engine run of this tree in a fresh process (:mod:`rollout_bench.memory_probe`)."""
    (scratch / "spec.json").write_text(json.dumps(spec))
    out = scratch / "out.json"
    cmd = [sys.executable, "-m", "rollout_bench.memory_probe", str(scratch / "spec.json"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=scratch, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"the paged engine failed ({r.returncode}):\n{r.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _line(engine: str, fig: dict[str, Any]) -> str:
    return (
        f"{engine} {fig['tokens_per_s']:.1f} tok/s, batch {fig['max_running']}, "
        f"{fig['retractions']} retractions"
    )


def run_memory_bench(
    model: Path,
    baseline: Baseline,
    page_size: int,
    runs: int,
    json_out: Path | None,
    echo: Echo,
    samples: int = 8,
    sharing_prompt_len: int = 128,
) -> dict[str, Any]:
    """The paged engines against the recorded slab on its workload and budget (module docstring), then with
    ``samples`` > 1 prefix sharing on this tree (:mod:`rollout_bench.sharing`) on prompts of
    ``sharing_prompt_len`` tokens."""
    w, budget = baseline.workload, baseline.budget_tokens
    cfg = ModelConfig.load(model)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    n, prompt_len = w["requests"], w["prompt_len"]
    lens = tail_lengths(n, w["median_new"], w["longest_new"])
    check_model(baseline, lens, per_token)
    reqs = requests(lens, prompt_len, cfg.vocab_size)
    base: dict[str, Any] = {"model": str(model.resolve()), "dtype": "float32", "requests": reqs}
    settings: dict[str, Any] = {"max_batch": n, "page_size": page_size}
    budgets = {"paged": budget, "paged_at_slab": baseline.peak_allocated_tokens}
    per_run: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:

        def probe(spec: dict[str, Any], label: str) -> dict[str, Any]:
            scratch = Path(tmp) / label
            scratch.mkdir()
            return run_probe(spec, scratch)

        for i in range(runs):
            got = {}
            for e in ENGINES if i % 2 == 0 else ENGINES[::-1]:
                spec = {**base, "settings": {**settings, "kv_budget_tokens": budgets[e]}}
                got[e] = summarise(probe(spec, f"{e}-{i}"), budgets[e])
                if got[e]["tokens"] != sum(lens):
                    raise RuntimeError(f"{e}: {got[e]['tokens']} tokens generated, {sum(lens)} asked")
            per_run.append(got)
            echo(f"run {i + 1}/{runs}: " + "; ".join(_line(e, got[e]) for e in ENGINES))
        sharing = None
        if samples > 1:
            grouped = bench_sharing.grouped_requests(lens, sharing_prompt_len, samples, cfg.vocab_size)
            share_base = {**base, "settings": {**settings, "kv_budget_tokens": budget}}
            sharing = bench_sharing.run_sharing(grouped, share_base, runs, probe, echo)
            sharing |= {"samples": samples, "prompt_len": sharing_prompt_len}
    report: dict[str, Any] = {
        "benchmark": "memory",
        "model": str(model),
        "baseline": {"path": str(baseline.path), "recorded": baseline.recorded, "runs": baseline.runs},
        "measured": host(),
        "workload": {
            "requests": n,
            "prompt_len": prompt_len,
            "median_new": w["median_new"],
            "longest_new": w["longest_new"],
            "new_tokens": lens,
            "demand_tokens": sum(prompt_len + k for k in lens),
        },
        "budget_tokens": budget,
        "budget_bytes": budget * per_token,
        "slab_peak_tokens": baseline.peak_allocated_tokens,
        "slab_peak_bytes": baseline.peak_allocated_tokens * per_token,
        "page_size": page_size,
        "runs": runs,
        "per_run": per_run,
        **combine(per_run, baseline.median),
        "sharing": sharing,
    }
    echo("")
    for line in table(report):
        echo(line)
    if sharing is not None:
        echo("")
        for line in bench_sharing.table(sharing, len(lens) // samples):
            echo(line)
    if json_out is not None:
        write_json(json_out, report)
        echo(f"wrote {json_out}")
    return report
