"""The prefix-sharing part of ``rolloutctl bench memory``: GRPO's shape, ``samples`` samples of each prompt
sent together (sampled, temperature 1, a seed each), run by this tree's paged engine with the prefix cache
on and off, on the same long-tailed lengths and the same KV budget, with the same measuring code as the rest
of the benchmark (:mod:`rollout_bench.memory_probe`, in a fresh process, the order reversed
every other run).

Measured per mode and run, from every step's report: the prompt tokens the prefills computed (re-prefills
after a retraction included), generation seconds and tokens/s on the whole set, the largest running batch,
retractions. Ratios (on / off) are taken within each run, then the median.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

MODES = ("shared", "unshared")
LABELS = {"shared": "prefix cache on", "unshared": "prefix cache off"}
METRICS = (
    ("prefill_tokens", "prompt tokens prefilled", "{:.0f}"),
    ("prefill_ms", "prefill steps, ms in all", "{:.0f}"),
    ("gen_s", "generation s, whole set", "{:.2f}"),
    ("tokens_per_s", "tokens/s, whole set", "{:.1f}"),
    ("max_running", "largest running batch", "{:.0f}"),
    ("retractions", "retractions", "{:.0f}"),
)
RATIOS = ("prefill_tokens", "prefill_ms", "gen_s", "tokens_per_s")

Probe = Callable[[dict[str, Any], str], dict[str, Any]]  # (spec, label) -> the probe's result


def grouped_requests(
    lengths: Sequence[int], prompt_len: int, samples: int, vocab: int, seed: int = 1
) -> list[dict[str, Any]]:
    """``len(lengths) // samples`` prompts of ``prompt_len`` random tokens, ``samples`` requests each (sample
    ``j`` of prompt ``g`` takes ``lengths[g * samples + j]``), sent together as GRPO sends them."""
    rng = random.Random(seed)
    out = []
    for g in range(len(lengths) // samples):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for j in range(samples):
            out.append(
                {
                    "id": f"p{g}-{j}",
                    "input_ids": prompt,
                    "max_new_tokens": lengths[g * samples + j],
                    "sampling": {"temperature": 1.0, "seed": 1000 * g + j},
                }
            )
    return out


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]
    prefills = [s for s in steps if s["kind"] == "prefill"]
    tokens = sum(result["tokens"].values())
    return {
        "prefill_tokens": sum(s["prefill_tokens"] for s in prefills),
        "prefill_ms": sum(s["ms"] for s in prefills),
        "gen_s": result["gen_s"],
        "tokens": tokens,
        "tokens_per_s": tokens / result["gen_s"] if result["gen_s"] > 0 else 0.0,
        "max_running": max((s["running"] for s in steps), default=0),
        "retractions": sum(s["retractions"] for s in steps),
    }


def combine(runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians of each mode's figures, and the median of the per-run ratios on / off."""
    med = {m: {k: statistics.median(r[m][k] for r in runs) for k, _, _ in METRICS} for m in MODES}
    ratios = {
        k: statistics.median(
            r["shared"][k] / r["unshared"][k] if r["unshared"][k] else float("inf") for r in runs
        )
        for k in RATIOS
    }
    return {"median": med, "ratios": ratios}


def run_sharing(
    requests: list[dict[str, Any]], base: dict[str, Any], runs: int, probe: Probe, echo: Callable[[str], Any]
) -> dict[str, Any]:
    """``runs`` rounds of both modes; ``base``: the probe's spec but the requests and the prefix cache."""
    demand = sum(r["max_new_tokens"] for r in requests)
    per_run: list[dict[str, dict[str, Any]]] = []
    for i in range(runs):
        got = {}
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            settings = {**base["settings"], "prefix_cache": mode == "shared"}
            spec = {**base, "settings": settings, "requests": requests}
            got[mode] = summarise(probe(spec, f"{mode}-{i}"))
            if got[mode]["tokens"] != demand:
                raise RuntimeError(f"{mode}: {got[mode]['tokens']} tokens generated, {demand} asked")
        per_run.append(got)
        echo(
            f"sharing run {i + 1}/{runs}: "
            + "; ".join(f"{m} {got[m]['prefill_tokens']} prefilled, {got[m]['gen_s']:.2f} s" for m in MODES)
        )
    return {"runs": runs, "per_run": per_run, **combine(per_run)}


def table(sharing: dict[str, Any], prompts: int) -> list[str]:
    med, ratios = sharing["median"], sharing["ratios"]
    samples, prompt_len = sharing["samples"], sharing["prompt_len"]
    lines = [
        f"{prompts} prompts of {prompt_len} tokens x {samples} samples (temperature 1), the same lengths and "
        f"budget; median of {sharing['runs']} runs",
        "",
        "| | " + " | ".join(LABELS[m] for m in MODES) + " | on / off |",
        "|---|---:|---:|---:|",
    ]
    for key, label, fmt in METRICS:
        ratio = f"{ratios[key]:.3f}x" if key in ratios else ""
        lines.append(f"| {label} | " + " | ".join(fmt.format(med[m][key]) for m in MODES) + f" | {ratio} |")
    return lines
