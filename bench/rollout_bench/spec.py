"""``rolloutctl bench spec``: what speculative decoding (n-gram drafts, ``speculative_algorithm`` ngram)
saves on a real rollout, and that it changes no token.

The workload is the main job's: chat prompts rendered with the model's template, a GRPO group of samples
each (temperature 0.7, seeded, EOS honoured), run to ``max_new_tokens`` at most, on the deterministic
kernels. It is the second iteration of an RL loop: the same engine first runs the group with other seeds
(the previous iteration, untimed), so drafts may come from those responses, the request's own tokens and
its siblings, never from the timed samples' own earlier runs. Each layout runs with speculation off and
under each policy (``auto``, ``always``), alternating, ``runs`` times, fresh rank processes each; every
speculating run's tokens must equal the run without speculation's (a difference fails the benchmark).
Reported: generation seconds of the timed iteration (first request submitted to last finished; medians),
the tail's tokens/s (after three quarters of the requests finished), their ratios to off, decode and verify
steps, and the tokens a request's verify step emitted on average.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import BatchResult, run_batch
from rollout_worker.errors import EngineError
from rollout_worker.scheduling.layout import Layout

from rollout_bench.lossless import chat_prompts
from rollout_bench.record import host, write_json

Echo = Callable[[str], Any]
LAYOUTS = ("2x1", "1x2")
POLICIES = ("auto", "always")  # speculation's, each measured against off


def group_requests(
    model: Path, prompts: Path, n: int, samples: int, max_new_tokens: int, iteration: int = 0
) -> list[RequestSpec]:
    """``samples`` samples (temperature 0.7, seed 1000 x prompt + sample + 100 x ``iteration``) of each of
    the first ``n`` prompts (:func:`~rollout_bench.lossless.chat_prompts`); EOS honoured."""
    return [
        RequestSpec(
            f"i{iteration}-p{pid}-s{j}",
            ids,
            max_new_tokens,
            Sampling(temperature=0.7, seed=1000 * i + j + 100 * iteration),
        )
        for i, (pid, ids) in enumerate(chat_prompts(model, prompts, n))
        for j in range(samples)
    ]


def _run(
    model: Path, layout: str, mode: str, draft: int, specs: list[RequestSpec], before: list[RequestSpec]
) -> BatchResult:
    lay = Layout.parse(layout)
    cfg = EngineConfig.load(
        str(model),
        lay.world,
        lay,
        dtype="float32",
        deterministic=True,
        speculative_algorithm="none" if mode == "off" else "ngram",
        speculative_num_draft_tokens=draft,
        speculative_policy="always" if mode == "off" else mode,
    )
    return run_batch(cfg, specs, before=before)


def run_spec_bench(
    model: Path,
    specs: list[RequestSpec],
    runs: int,
    draft: int,
    json_out: Path | None,
    echo: Echo,
    about: dict[str, Any],
    before: list[RequestSpec] | None = None,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, Any]:
    """Off and each of ``policies`` at each layout, ``runs`` times; ``before`` runs first on each engine."""
    modes = ("off", *policies)
    measured: dict[tuple[str, str], list[BatchResult]] = {(lay, m): [] for lay in LAYOUTS for m in modes}
    reference: dict[str, dict[str, list[int]]] = {}
    for i in range(runs):
        t0 = time.perf_counter()
        for lay in LAYOUTS:
            for mode in modes:
                res = _run(model, lay, mode, draft, specs, before or [])
                measured[(lay, mode)].append(res)
                tokens = res.tokens()
                ref = reference.setdefault(lay, tokens)
                differ = sorted(rid for rid in ref if ref[rid] != tokens.get(rid))
                if differ:
                    raise EngineError(
                        f"{lay}, speculation {mode}: {len(differ)} sample(s) differ: {differ[:3]}"
                    )
        echo(f"run {i + 1}/{runs}: {time.perf_counter() - t0:.1f} s")
    rows = [
        _row(lay, mode, measured[(lay, "off")], measured[(lay, mode)]) for lay in LAYOUTS for mode in modes
    ]
    report = {
        **about,
        "runs": runs,
        "draft_tokens": draft,
        "requests": len(specs),
        "requests_before": len(before or []),
        "tokens": sum(len(t) for t in reference[LAYOUTS[0]].values()),
        "host": host(),
        "rows": rows,
    }
    _print(report, echo)
    if json_out is not None:
        write_json(json_out, report)
        echo(f"wrote {json_out}")
    return report


def _tail_rate(r: BatchResult) -> float:
    return r.tail_tokens / r.tail_s if r.tail_s > 0 else 0.0


def _row(layout: str, mode: str, off: list[BatchResult], on: list[BatchResult]) -> dict[str, Any]:
    off_s = statistics.median(r.gen_s for r in off)
    on_s = statistics.median(r.gen_s for r in on)
    off_tail = statistics.median(_tail_rate(r) for r in off)
    on_tail = statistics.median(_tail_rate(r) for r in on)
    last = on[-1]
    return {
        "layout": layout,
        "policy": mode,
        "s": on_s,
        "all_s": [r.gen_s for r in on],
        "speedup": off_s / on_s,
        "tail_tokens_per_s": on_tail,
        "tail_speedup": on_tail / off_tail if off_tail > 0 else None,
        "decode_steps": len(last.step_ms),
        "verify_steps": last.verify_steps,
        "accept_length": last.verify_tokens / last.verify_requests if last.verify_requests else None,
    }


def _print(report: dict[str, Any], echo: Echo) -> None:
    before = f", after {report['requests_before']} earlier ones" if report.get("requests_before") else ""
    echo(
        f"\nspeculative decoding (n-gram, {report['draft_tokens']} draft tokens): {report['requests']}"
        f" requests{before}, {report['tokens']} tokens, median of {report['runs']} runs; tokens identical"
    )
    echo(
        f"{'layout':>7} {'policy':>7} {'s':>8} {'speedup':>8} {'tail tok/s':>11} {'tail x':>7}"
        f" {'decode':>7} {'verify':>7} {'accept':>7}"
    )
    for r in report["rows"]:
        acc, tail = r["accept_length"], r["tail_speedup"]
        echo(
            f"{r['layout']:>7} {r['policy']:>7} {r['s']:>8.2f} {r['speedup']:>7.2f}x"
            f" {r['tail_tokens_per_s']:>11.1f} {'-' if tail is None else f'{tail:.2f}x':>7}"
            f" {r['decode_steps']:>7} {r['verify_steps']:>7} {'-' if acc is None else f'{acc:.2f}':>7}"
        )
