"""`rolloutctl make-model`, `rolloutctl generate`, `rolloutctl bench engine`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rollout_worker.api.errors import UserError

from rollout_operator.cli.args import int_list


def register(app: typer.Typer) -> None:
    app.command("make-model")(make_model_cmd)
    app.command("generate")(generate_cmd)
    bench = typer.Typer(help="Benchmarks (JSON output + printed tables).", no_args_is_help=True)
    bench.command("engine")(bench_engine_cmd)
    app.add_typer(bench, name="bench")


def make_model_cmd(
    preset: Annotated[str, typer.Option(help="tiny | small | medium | llama-3.1-8b | qwen3-14b")],
    out: Annotated[Path, typer.Option(help="Directory to create (must not exist or be empty).")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    dtype: Annotated[
        str, typer.Option(help="Checkpoint dtype: float32 | bfloat16 | float64 | float16.")
    ] = "float32",
) -> None:
    """Write a seeded random checkpoint in Hugging Face layout plus a byte-level tokenizer.json."""
    from rollout_worker.engine.checkpoint import make_model

    cfg = make_model(preset, seed, out, dtype)
    typer.echo(
        f"wrote {out}: {cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, {dtype}"
    )


def generate_cmd(
    model: Annotated[
        Path, typer.Option(help="Checkpoint directory (config.json, safetensors, tokenizer.json).")
    ],
    prompts: Annotated[Path, typer.Option(help="Input JSONL: id, prompt|input_ids, max_new_tokens, ...")],
    out: Annotated[Path, typer.Option(help="Output JSONL (written atomically at the end).")],
    ranks: Annotated[int, typer.Option(help="Number of rank processes G.")] = 1,
    layout: Annotated[str | None, typer.Option(help="Initial layout DxT with D*T = G (default Gx1).")] = None,
    reconfigure: Annotated[
        list[str] | None,
        typer.Option(help="RUNNING:TP:METHOD, e.g. 12:4:migrate (method migrate|recompute|auto)."),
    ] = None,
    candidates: Annotated[
        str | None, typer.Option(help="Candidate layouts, e.g. 4x1,2x2,1x4 (default: all).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 | float64 | bfloat16 | float16")] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    max_batch: Annotated[int, typer.Option(help="Max running requests per replica.")] = 64,
    kv_budget: Annotated[int | None, typer.Option(help="Max reserved KV tokens per replica.")] = None,
    log_every: Annotated[int, typer.Option(help="Print progress every N steps.")] = 20,
    timeout: Annotated[float, typer.Option(help="Timeout of every collective, seconds.")] = 120.0,
) -> None:
    """Generate with G ranks, optionally changing the TP layout while requests run."""
    from rollout_worker.engine.config import Trigger
    from rollout_worker.engine.generate import generate, write_jsonl

    cfg, model_cfg = _engine_config(
        model,
        ranks,
        layout,
        candidates,
        dtype,
        device,
        max_batch,
        kv_budget,
        [Trigger.parse(t) for t in reconfigure or []],
        log_every,
        timeout,
    )
    specs, tok = _read_prompts(prompts, model, model_cfg)
    _check_writable(out)
    typer.echo(
        f"generate: {len(specs)} requests, {ranks} ranks, layout {cfg.layout}, "
        f"candidates {', '.join(map(str, cfg.candidates))}, {dtype} on {device}",
        err=True,
    )
    res = generate(cfg, specs, on_event=_print_event)
    for row in res.outputs:
        row["text"] = tok.decode(row["output_ids"], skip_special_tokens=False) if tok else None
    write_jsonl(out, res.outputs)
    _print_summary(res, out)


def _engine_config(
    model: Path,
    ranks: int,
    layout: str | None,
    candidates: str | None,
    dtype: str,
    device: str,
    max_batch: int,
    kv_budget: int | None,
    triggers: list[Any],
    log_every: int,
    timeout: float,
) -> tuple[Any, Any]:
    from rollout_worker.api.layout import Layout, parse_candidates
    from rollout_worker.api.model_config import ModelConfig
    from rollout_worker.engine.config import EngineConfig

    model_cfg = ModelConfig.load(model)
    if ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {ranks}")
    lay = Layout.parse(layout, "--layout") if layout else Layout(ranks, 1)
    if lay.world != ranks:
        raise UserError(f"--layout {lay}: {lay.world} ranks, but --ranks is {ranks} (TP size must divide G)")
    why = model_cfg.tp_problem(lay.tp)
    if why:
        raise UserError(f"--layout {lay}: {why}")
    cands = parse_candidates(candidates, ranks) if candidates else model_cfg.candidate_layouts(ranks)
    cfg = EngineConfig(
        model_dir=str(model),
        world=ranks,
        layout=lay,
        candidates=tuple(cands),
        dtype=dtype,
        device=device,
        max_batch=max_batch,
        kv_budget_tokens=kv_budget,
        triggers=tuple(triggers),
        log_every=max(1, log_every),
        collective_timeout_s=timeout,
    )
    cfg.validate(model_cfg)
    return cfg, model_cfg


def _read_prompts(prompts: Path, model: Path, model_cfg: Any) -> tuple[list[Any], Any]:
    from rollout_worker.api.requests import read_requests
    from rollout_worker.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model) if (model / "tokenizer.json").exists() else None

    def encode(text: str) -> list[int]:
        if tok is None:
            raise UserError(f"--model: no tokenizer.json in {model}; use input_ids instead of prompt")
        return list(tok.encode(text, add_special_tokens=False).ids)

    specs = read_requests(prompts, encode, model_cfg.vocab_size, model_cfg.max_position_embeddings)
    for spec in specs:
        bad = spec.stop_token_ids and max(spec.stop_token_ids) >= model_cfg.vocab_size
        if bad:
            raise UserError(f"request {spec.id}: stop_token_ids out of range [0, {model_cfg.vocab_size})")
    return specs, tok


def _check_writable(out: Path) -> None:
    if out.exists() and out.is_dir():
        raise UserError(f"--out: {out} is a directory")
    if not out.parent.exists():
        raise UserError(f"--out: directory {out.parent} does not exist")


def _print_event(kind: str, rank: int, ev: dict[str, Any]) -> None:
    if kind == "progress":
        typer.echo(
            f"step {ev['step']:>6} | layout {ev['layout']:>5} | finished {ev['finished']}/{ev['total']}"
            f" | unfinished {ev['unfinished']} | step {ev['step_ms_median']:.2f} ms (median)",
            err=True,
        )
    elif kind == "reconfig":
        phases = ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in ev["phases"].items())
        extra = ""
        if "kv_bytes_moved" in ev:
            extra = f", {ev['kv_bytes_moved'] / 1e6:.2f} MB KV moved"
        elif "kv_tokens_recomputed" in ev:
            extra = f", {ev['kv_tokens_recomputed']} KV tokens recomputed"
        typer.echo(
            f"reconfigure at step {ev['step']}: {ev['from']} -> {ev['to']} ({ev['method']}, "
            f"requested {ev['requested']}; {ev['reason']}) {ev['outcome'].upper()}: {phases}{extra}",
            err=True,
        )
        if ev["outcome"] != "committed":
            typer.echo(f"  rolled back: {ev.get('error')}", err=True)


def _print_summary(res: Any, out: Path) -> None:
    ms = sorted(res.step_ms)
    pct = (lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]) if ms else (lambda q: 0.0)
    toks = sum(r["completion_tokens"] for r in res.outputs)
    typer.echo(
        f"done: {len(res.outputs)} requests, {toks} tokens, {res.steps} steps in {res.wall_s:.2f} s "
        f"(step p50 {pct(0.5):.2f} ms, p90 {pct(0.9):.2f} ms, max {ms[-1] if ms else 0:.2f} ms); "
        f"{len(res.reconfigs)} reconfiguration(s); wrote {out}",
        err=True,
    )
    sys.stderr.flush()


def bench_engine_cmd(
    preset: Annotated[
        str, typer.Option(help="Model preset to benchmark (made under --work if missing).")
    ] = "tiny",
    ranks: Annotated[int, typer.Option(help="Ranks G.")] = 2,
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,4,16",
    context: Annotated[str, typer.Option(help="Comma-separated context lengths.")] = "64,256",
    steps: Annotated[int, typer.Option(help="Timed decode steps per grid point.")] = 10,
    runs: Annotated[int, typer.Option(help="Repetitions of the whole grid.")] = 3,
    dtype: Annotated[str, typer.Option(help="float32 | float64 | bfloat16")] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    work: Annotated[Path, typer.Option(help="Where checkpoints are cached.")] = Path("build/models"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Per-step latency by layout x batch x context, and reconfiguration phases with bytes moved."""
    from rollout_worker.engine.bench import run_engine_bench

    run_engine_bench(
        preset=preset,
        ranks=ranks,
        batches=int_list(batch, "--batch"),
        contexts=int_list(context, "--context"),
        steps=steps,
        runs=runs,
        dtype=dtype,
        device=device,
        work=work,
        json_out=json_out,
        echo=typer.echo,
    )
