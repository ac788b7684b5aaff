"""``rolloutctl bench spec``: what speculative decoding (n-gram drafts, ``speculative_algorithm`` ngram)
saves on a real rollout, and that it changes no token.

The workload is the main job's: chat prompts rendered with the model's template, a GRPO group of samples
each (temperature 0.7, seeded, EOS honoured), run to ``max_new_tokens`` at most, on the deterministic
kernels. Each layout runs with speculation off and on, alternating, ``runs`` times, fresh rank processes
each; every speculating run's tokens must equal the run without speculation's (a difference fails the
benchmark). Reported: generation seconds (first request submitted to last finished; medians), their
ratio, decode and verify steps, and the tokens a request's verify step emitted on average.
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
MODES = ("none", "ngram")


def group_requests(
    model: Path, prompts: Path, n: int, samples: int, max_new_tokens: int
) -> list[RequestSpec]:
    """``samples`` samples (temperature 0.7, seed 1000 x prompt + sample) of each of the first ``n``
    prompts (:func:`~rollout_bench.lossless.chat_prompts`); EOS honoured."""
    return [
        RequestSpec(f"p{pid}-s{j}", ids, max_new_tokens, Sampling(temperature=0.7, seed=1000 * i + j))
        for i, (pid, ids) in enumerate(chat_prompts(model, prompts, n))
        for j in range(samples)
    ]


def _run(model: Path, layout: str, spec: str, draft: int, specs: list[RequestSpec]) -> BatchResult:
    lay = Layout.parse(layout)
    cfg = EngineConfig.load(
        str(model),
        lay.world,
        lay,
        dtype="float32",
        deterministic=True,
        speculative_algorithm=spec,
        speculative_num_draft_tokens=draft,
    )
    return run_batch(cfg, specs)


def run_spec_bench(
    model: Path,
    specs: list[RequestSpec],
    runs: int,
    draft: int,
    json_out: Path | None,
    echo: Echo,
    about: dict[str, Any],
) -> dict[str, Any]:
    measured: dict[tuple[str, str], list[BatchResult]] = {(lay, m): [] for lay in LAYOUTS for m in MODES}
    reference: dict[str, dict[str, list[int]]] = {}
    for i in range(runs):
        t0 = time.perf_counter()
        for lay in LAYOUTS:
            for mode in MODES:
                res = _run(model, lay, mode, draft, specs)
                measured[(lay, mode)].append(res)
                tokens = res.tokens()
                ref = reference.setdefault(lay, tokens)
                differ = sorted(rid for rid in ref if ref[rid] != tokens.get(rid))
                if differ:
                    raise EngineError(
                        f"{lay}, speculation {mode}: {len(differ)} sample(s) differ: {differ[:3]}"
                    )
        echo(f"run {i + 1}/{runs}: {time.perf_counter() - t0:.1f} s")
    rows = [_row(lay, measured[(lay, "none")], measured[(lay, "ngram")]) for lay in LAYOUTS]
    report = {
        **about,
        "runs": runs,
        "draft_tokens": draft,
        "requests": len(specs),
        "tokens": sum(len(t) for t in reference[LAYOUTS[0]].values()),
        "host": host(),
        "rows": rows,
    }
    _print(report, echo)
    if json_out is not None:
        write_json(json_out, report)
        echo(f"wrote {json_out}")
    return report


def _row(layout: str, off: list[BatchResult], on: list[BatchResult]) -> dict[str, Any]:
    off_s = statistics.median(r.gen_s for r in off)
    on_s = statistics.median(r.gen_s for r in on)
    last = on[-1]
    return {
        "layout": layout,
        "off_s": off_s,
        "on_s": on_s,
        "off_all_s": [r.gen_s for r in off],
        "on_all_s": [r.gen_s for r in on],
        "speedup": off_s / on_s,
        "decode_steps_off": len(off[-1].step_ms),
        "decode_steps_on": len(last.step_ms),
        "verify_steps": last.verify_steps,
        "accept_length": last.verify_tokens / last.verify_requests if last.verify_requests else None,
    }


def _print(report: dict[str, Any], echo: Echo) -> None:
    echo(
        f"\nspeculative decoding (n-gram, {report['draft_tokens']} draft tokens): {report['requests']}"
        f" requests, {report['tokens']} tokens, median of {report['runs']} runs; tokens identical"
    )
    echo(
        f"{'layout':>7} {'off s':>8} {'on s':>8} {'speedup':>8} {'decode steps off/on':>20}"
        f" {'verify':>7} {'accept':>7}"
    )
    for r in report["rows"]:
        acc = r["accept_length"]
        echo(
            f"{r['layout']:>7} {r['off_s']:>8.2f} {r['on_s']:>8.2f} {r['speedup']:>7.2f}x"
            f" {r['decode_steps_off']:>9}/{r['decode_steps_on']:<10} {r['verify_steps']:>7}"
            f" {'-' if acc is None else f'{acc:.2f}':>7}"
        )
