"""`rolloutctl bench memory`: the paged KV pool against the dense slab's recorded figures, same requests, same
KV budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rollout_worker.config.engine_settings import check_setting
from rollout_worker.data.files import check_writable
from rollout_worker.errors import UserError

from rollout_operator.cli.args import bench_group, needs_engine
from rollout_operator.cli.engine_opts import setting_default, setting_option

WORK = Path("build/bench-memory")


def register(app: typer.Typer) -> None:
    bench_group(app).command("memory")(needs_engine(bench_memory_cmd))


def check_memory_args(
    requests: int,
    prompt_len: int,
    median_new: float,
    longest_new: int,
    kv_tokens: int,
    page_size: int,
    runs: int,
    samples: int = 8,
    sharing_prompt_len: int = 128,
) -> None:
    """Refuse a workload either engine could not run, naming the flag."""
    if requests < 2:
        raise UserError(f"must be >= 2, got {requests}", "--requests")
    if prompt_len < 1:
        raise UserError(f"must be >= 1, got {prompt_len}", "--prompt-len")
    if not 1 <= median_new < longest_new:
        raise UserError(
            f"must be >= 1 and below --longest-new ({longest_new}), got {median_new:g}", "--median-new"
        )
    check_setting("page_size", page_size, "--page-size")
    if prompt_len + longest_new > kv_tokens:
        raise UserError(
            f"the longest request ({prompt_len} + {longest_new} tokens) must fit the budget, got {kv_tokens}",
            "--kv-tokens",
        )
    if runs < 1:
        raise UserError(f"must be >= 1, got {runs}", "--runs")
    if not (samples == 1 or 2 <= samples <= requests):
        raise UserError(
            f"must be 1 (no sharing part) or 2..--requests ({requests}), got {samples}", "--samples"
        )
    if sharing_prompt_len < 1 or sharing_prompt_len + longest_new > kv_tokens:
        raise UserError(
            f"must be >= 1, and with the longest request ({longest_new} new tokens) fit the budget "
            f"({kv_tokens}), got {sharing_prompt_len}",
            "--sharing-prompt-len",
        )


def bench_memory_cmd(
    requests: Annotated[int, typer.Option(help="Requests in the long-tailed set.")] = 64,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens of every request (random ids).")] = 16,
    median_new: Annotated[float, typer.Option(help="Median new tokens (lognormal).")] = 55.0,
    longest_new: Annotated[int, typer.Option(help="New tokens of the longest request.")] = 300,
    kv_tokens: Annotated[
        int,
        typer.Option(help="KV budget of the one replica, in tokens (both engines): small enough to queue."),
    ] = 2048,
    page_size: Annotated[
        int, setting_option("page_size", note="the paged engines' only (the slab has none)")
    ] = setting_default("bench memory", "page_size"),
    runs: Annotated[
        int, typer.Option(help="Runs (both paged engines each, alternating which goes first).")
    ] = 3,
    samples: Annotated[
        int, typer.Option(help="Samples per prompt of the prefix-sharing part (1: leave it out).")
    ] = 8,
    sharing_prompt_len: Annotated[int, typer.Option(help="Prompt tokens of the prefix-sharing part.")] = 128,
    baseline: Annotated[
        Path | None,
        typer.Option(
            help="The dense slab's recorded results to compare against (JSON; the workload flags must "
            "be its own). Default: bench-memory-slab.json in bench/results/epyc-2026-11-28/ beside the "
            "rollout_bench package (64 requests; for --requests 256: bench-memory-slab-256.json there)."
        ),
    ] = None,
    work: Annotated[Path, typer.Option(help="Where the model is kept.")] = WORK,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """KV utilisation in the bulk phase, the largest running batch and tokens/s of the paged engine, measured
    now on one replica of the tiny model, beside the dense slab's (an older commit's engine), recorded on a
    named machine and date; then prefix sharing: the samples of each prompt with the prefix cache on and
    off (prompt tokens prefilled, time)."""
    from rollout_bench import memory_baseline
    from rollout_bench.memory import run_memory_bench
    from rollout_worker.engine.model.checkpoint import ensure_model

    check_memory_args(
        requests, prompt_len, median_new, longest_new, kv_tokens, page_size, runs, samples, sharing_prompt_len
    )
    recorded = memory_baseline.load(baseline if baseline is not None else memory_baseline.RECORDED)
    memory_baseline.check_workload(recorded, requests, prompt_len, median_new, longest_new, kv_tokens)
    if json_out is not None:
        check_writable(json_out, "--json")
    work.mkdir(parents=True, exist_ok=True)
    model = ensure_model("tiny", work)
    run_memory_bench(
        model,
        recorded,
        page_size,
        runs,
        json_out,
        typer.echo,
        samples,
        sharing_prompt_len,
    )
