"""`rolloutctl serve`: the engine as an HTTP service (SGLang's API, OpenAI completions, planner endpoints)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rollout_worker.api.errors import UserError

from rollout_operator.cli.args import bench_group, needs_engine, on_off
from rollout_operator.cli.engine_cmds import CUDA_GRAPHS_HELP


def register(app: typer.Typer) -> None:
    app.command("serve")(needs_engine(serve_cmd))
    bench_group(app).command("serve")(needs_engine(bench_serve_cmd))


def serve_cmd(
    model: Annotated[
        Path, typer.Option(help="Checkpoint directory (config.json, safetensors, tokenizer.json).")
    ],
    ranks: Annotated[int, typer.Option(help="Rank processes G.")] = 1,
    layout: Annotated[str | None, typer.Option(help="Initial layout DxT with D*T = G (default Gx1).")] = None,
    candidates: Annotated[
        str | None, typer.Option(help="Layouts it may switch to, e.g. 4x1,2x2 (default: all).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 30000,
    api_key_file: Annotated[
        Path | None, typer.Option(help="File holding the API key (or set ROLLOUT_API_KEY).")
    ] = None,
    weights_root: Annotated[
        Path | None,
        typer.Option(help="update_weights_from_disk only loads below here (default: --model's parent)."),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Name in /v1/models (default: --model).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 | float64 | bfloat16 | float16")] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    max_batch: Annotated[int, typer.Option(help="Max running requests per replica.")] = 64,
    kv_budget: Annotated[int | None, typer.Option(help="Max reserved KV tokens per replica.")] = None,
    context_length: Annotated[int, typer.Option(help="Max prompt + output tokens (0: the model's).")] = 0,
    timeout: Annotated[float, typer.Option(help="Timeout of every collective, seconds.")] = 120.0,
    cuda_graphs: Annotated[str, typer.Option(help=CUDA_GRAPHS_HELP)] = "off",
    drain_seconds: Annotated[
        float, typer.Option(help="On SIGTERM, let requests finish this long first.")
    ] = 0.0,
    access_log: Annotated[bool, typer.Option(help="Log one line per HTTP request.")] = False,
    costs: Annotated[
        Path | None,
        typer.Option(
            help="Switch-cost model: a profile JSON (its `costs`) or the costs alone, so the engine prices "
            "and picks a switch's KV method as the planner does (or $ROLLOUT_COSTS_JSON, the same JSON "
            "inline; default: built-in priors)."
        ),
    ] = None,
) -> None:
    """Serve the engine over HTTP until SIGTERM / Ctrl-C; exits non-zero if a rank dies."""
    from rollout_worker.server.run import serve
    from rollout_worker.server.settings import ServerSettings

    from rollout_operator.cli.engine_cmds import engine_config

    key = _api_key(api_key_file)
    cfg = engine_config(
        model,
        ranks,
        layout,
        candidates,
        dtype,
        device,
        max_batch,
        kv_budget,
        timeout,
        context_length,
        cuda_graphs=on_off(cuda_graphs, "--cuda-graphs"),
    )
    cost_model = _cost_model(costs)
    if cost_model is not None:
        cfg = replace(cfg, costs=cost_model)
    if weights_root is not None and not weights_root.is_dir():
        raise UserError(f"{weights_root} is not a directory", "--weights-root")
    settings = ServerSettings(
        model=model,
        ranks=ranks,
        layout=str(cfg.layout),
        candidates=",".join(map(str, cfg.candidates)),
        host=host,
        port=port,
        api_key=key,
        weights_root=weights_root,
        served_model_name=served_model_name,
        dtype=dtype,
        device=device,
        max_batch=max_batch,
        kv_budget=kv_budget,
        context_length=cfg.context_length,
        timeout=timeout,
        cuda_graphs=cfg.cuda_graphs,
        drain_seconds=drain_seconds,
        access_log=access_log,
    )
    code = serve(settings, cfg)
    sys.exit(code)


COSTS_ENV = "ROLLOUT_COSTS_JSON"  # the cost model inline (what the operator's pods get; no file to mount)


def _cost_model(path: Path | None) -> Any:
    """The switch-cost model from ``--costs`` (a file), else from ``$ROLLOUT_COSTS_JSON``, else None."""
    if path is not None:
        try:
            return _parse_costs(path.read_text(), str(path), "--costs")
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror}", "--costs") from None
    text = os.environ.get(COSTS_ENV)
    return _parse_costs(text, COSTS_ENV, COSTS_ENV) if text else None


def _parse_costs(text: str, source: str, name: str) -> Any:
    import json

    from rollout_worker.api.costs import CostModel

    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{source} is not JSON: {exc}", name) from None
    body = doc.get("costs", doc) if isinstance(doc, dict) else doc
    if not isinstance(body, dict):
        raise UserError(f"{source}: expected an object of cost rates", name)
    for key, value in body.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise UserError(f"{source}: costs.{key} must be a number >= 0, got {value!r}", name)
    try:
        return CostModel(**body)
    except TypeError as exc:
        raise UserError(f"{source}: not a cost model ({exc})", name) from None


def _api_key(path: Path | None) -> str | None:
    if path is not None:
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror}", "--api-key-file") from None
        if not key:
            raise UserError(f"{path} is empty", "--api-key-file")
        return key
    return os.environ.get("ROLLOUT_API_KEY") or None


def bench_serve_cmd(
    presets: Annotated[str, typer.Option(help="Comma-separated model presets.")] = "tiny,small",
    ranks: Annotated[
        int, typer.Option(help="Ranks G (layout G x 1; the switch goes to another candidate).")
    ] = 2,
    clients: Annotated[int, typer.Option(help="Concurrent streaming clients.")] = 64,
    requests: Annotated[
        str, typer.Option(help="Requests per preset, e.g. tiny=512,small=128.")
    ] = "tiny=512,small=128",
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 32,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per request (ignore_eos).")] = 64,
    runs: Annotated[int, typer.Option(help="Alternated runs (in-process, then server) per preset.")] = 3,
    work: Annotated[Path, typer.Option(help="Where checkpoints are cached.")] = Path("build/models"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """The HTTP server against the in-process engine on the same requests, event-loop latency under load,
    and a layout change under load."""
    from rollout_worker.server.bench import run_serve_bench

    per: dict[str, int] = {}
    for item in requests.split(","):
        name, _, n = item.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise UserError(f"{item!r} is not PRESET=N", "--requests")
        per[name.strip()] = int(n)
    names = [p.strip() for p in presets.split(",") if p.strip()]
    run_serve_bench(names, ranks, per, prompt_len, max_new_tokens, clients, runs, work, json_out, typer.echo)
