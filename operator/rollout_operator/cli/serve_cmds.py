"""`rolloutctl serve`: the engine as an HTTP service (SGLang's API, OpenAI completions, planner endpoints)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rollout_worker.config.engine_settings import EngineSettings, dotted
from rollout_worker.config.engine_shape import EngineShape
from rollout_worker.data.files import MAX_SECRET_BYTES, read_text
from rollout_worker.errors import UserError, user_error
from rollout_worker.server.settings import ServerSettings

from rollout_operator.cli.args import bench_group, needs_engine
from rollout_operator.cli.engine_opts import structural_options, with_engine_settings, with_model_options


def register(app: typer.Typer) -> None:
    app.command("serve")(needs_engine(serve_cmd))
    bench_group(app).command("serve")(needs_engine(bench_serve_cmd))


@structural_options(envvar=True)
@with_engine_settings(envvar=True)
@with_model_options(ServerSettings, "server", envvar=True, exclude=("model", "api_key"))
def serve_cmd(
    shape: EngineShape,
    engine: EngineSettings,
    server: dict[str, Any],
    api_key_file: Annotated[
        Path | None, typer.Option(help="File holding the API key (or set ROLLOUT_API_KEY).")
    ] = None,
    costs: Annotated[
        Path | None,
        typer.Option(
            help="Switch-cost model: a profile JSON (its `costs`) or the costs alone, so the engine prices "
            "and picks a switch's KV method as the planner does (or $ROLLOUT_COSTS_JSON, the same JSON "
            "inline; default: built-in priors)."
        ),
    ] = None,
) -> None:
    """Serve the engine over HTTP until SIGTERM / Ctrl-C; exits non-zero if a rank dies. Every flag can
    also come from the environment as ROLLOUT_SERVE_<NAME> (e.g. ROLLOUT_SERVE_MAX_BATCH=32)."""
    from rollout_worker.server.run import serve

    from rollout_operator.cli.engine_cmds import engine_config

    key = _api_key(api_key_file)
    cfg = engine_config(shape, engine)
    cost_model = _cost_model(costs)
    if cost_model is not None:
        cfg = replace(cfg, costs=cost_model)
    root = server["weights_root"]
    if root is not None and not root.is_dir():
        raise UserError(f"{root} is not a directory", "weights_root")
    try:
        settings = ServerSettings(model=shape.model, api_key=key, **server)
    except ValidationError as exc:
        raise user_error(exc, dotted) from None
    code = serve(settings, cfg, _corpus(settings, cfg))
    sys.exit(code)


def _corpus(settings: ServerSettings, cfg: Any) -> list[str]:
    """The documents of ``--speculative-ngram-external-corpus-path``, checked before anything starts."""
    path = settings.speculative_ngram_external_corpus_path
    if path is None:
        return []
    field = "speculative_ngram_external_corpus_path"
    if cfg.engine.speculative_algorithm == "none":
        raise UserError("a corpus needs speculative decoding: add --speculative-algorithm ngram", field)
    from rollout_worker.data.jsonl import read_strings

    docs = read_strings(path, field)
    if not (Path(settings.model) / "tokenizer.json").is_file():
        raise UserError(f"{settings.model} has no tokenizer.json to tokenize the corpus with", field)
    return docs


def _cost_model(path: Path | None) -> Any:
    """The switch-cost model from ``--costs`` (a file), else from ``$ROLLOUT_COSTS_JSON`` (how a pod's
    engine gets it, locally and on a cluster), else None."""
    from rollout_worker.scheduling.costs import COSTS_ENV, parse_costs

    if path is not None:
        text = read_text(path, "--costs", "costs file")
        try:
            return parse_costs(text, str(path))
        except UserError as exc:
            raise exc.with_field("--costs") from None
    inline = os.environ.get(COSTS_ENV)
    return parse_costs(inline, COSTS_ENV) if inline else None


def _api_key(path: Path | None) -> str | None:
    if path is not None:
        key = read_text(path, "--api-key-file", "key file", MAX_SECRET_BYTES).strip()
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
    from rollout_bench.serve import run_serve_bench

    per: dict[str, int] = {}
    for item in requests.split(","):
        name, _, n = item.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise UserError(f"{item!r} is not PRESET=N", "--requests")
        per[name.strip()] = int(n)
    names = [p.strip() for p in presets.split(",") if p.strip()]
    run_serve_bench(names, ranks, per, prompt_len, max_new_tokens, clients, runs, work, json_out, typer.echo)
