"""`rolloutctl simulate` (one pod, several policies), `rolloutctl bench planner` and `bench simulator`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rollout_worker.config.engine_settings import DTYPES, check_setting
from rollout_worker.data.files import check_writable, save
from rollout_worker.errors import UserError

from rollout_operator.cli.args import bench_group, needs_engine
from rollout_operator.cli.engine_opts import setting_default, setting_option

if TYPE_CHECKING:
    from rollout_profiler.planning.speculation import Speculation

ADMISSION_HELP = (
    "KV admission: engine (reserve prompt + max_new_tokens), sglang (optimistic, preempts the newest) or "
    "paged (the engine's paged pool: its own admission and retraction functions)."
)

# fields of the simulator's and benchmark's configuration -> the flags that set them
FLAGS = {
    "policies": "--policies",
    "admission": "--admission",
    "initial_layout": "--initial-layout",
    "decide_every_ms": "--decide-every-ms",
    "max_batch": "--max-batch",
    "workload": "--workload",
}


SpecAccept = Annotated[
    float | None,
    typer.Option(
        help="Every replica speculates (the engine's auto policy; bench planner: the static layouts and "
        "adaptive run again so), a drafted token accepted with this chance (bench spec measures it as tokens "
        "a verify step emits)."
    ),
]
DraftTokens = Annotated[int, typer.Option(help="With --spec-accept: the widest draft verified.")]


@contextmanager
def flags(names: dict[str, str] = FLAGS) -> Iterator[None]:
    """Errors that name a configuration field are re-attributed to its flag."""
    try:
        yield
    except UserError as exc:
        raise exc.renamed(names) from None


class Ticker:
    """Progress of a long simulation on stderr: a line per run every ``every_s`` seconds of wall clock."""

    def __init__(self, requests: int, every_s: float = 5.0) -> None:
        self.requests, self.every_s = requests, every_s
        self.start = self.last = time.monotonic()

    def __call__(self, run: str, t_ms: float, unfinished: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        typer.echo(
            f"simulating {run}: {t_ms / 1e3:.0f} s simulated, {self.requests - unfinished} of "
            f"{self.requests} requests finished ({now - self.start:.0f} s)",
            err=True,
        )


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
    bench = bench_group(app)
    bench.command("planner")(bench_planner_cmd)
    bench.command("simulator")(needs_engine(bench_simulator_cmd))


def simulate_cmd(
    profile: Annotated[
        Path, typer.Option(help="Profile JSON file (e.g. profiles/llama-3.1-8b-h100x8-modelled.json).")
    ],
    gpus: Annotated[int, typer.Option(help="GPUs in the pod.")] = 8,
    workload: Annotated[
        str, typer.Option(help="A named workload (deepscaler-8k, sparse-tail, ...) or a .jsonl of lengths.")
    ] = ("deepscaler-8k"),
    policies: Annotated[
        str | None,
        typer.Option(
            help="Comma list of static:T, adaptive, oracle (count-balanced), oracle-clairvoyant, "
            "free-switch, tail-bound (default: static:T for each T that divides --gpus and the profile "
            "has, adaptive, oracle, free-switch, tail-bound)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of a synthetic workload.")] = 0,
    prior: Annotated[
        str, typer.Option(help="Lengths the adaptive predictor starts from: none | previous | a .jsonl.")
    ] = "previous",
    admission: Annotated[str, typer.Option(help=ADMISSION_HELP)] = "paged",
    initial_layout: Annotated[
        str, typer.Option(help="Adaptive's first layout: auto (the planner picks), smallest, or DxT.")
    ] = "auto",
    decide_every_ms: Annotated[
        float, typer.Option(help="Simulated ms between two planner decisions.")
    ] = 500.0,
    max_batch: Annotated[
        int, setting_option("max_batch", note="0 = only KV memory limits")
    ] = setting_default("simulate", "max_batch"),
    memory: Annotated[bool, typer.Option(help="Limit each replica to the profile's KV capacity.")] = True,
    spec_accept: SpecAccept = None,
    draft_tokens: DraftTokens = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of unfinished requests and TP over time.")
    ] = None,
) -> None:
    """Simulate one rollout batch on one pod under each policy; print latency, GPU-busy share, switches.

    `--prior previous` uses the same synthetic workload with seed + 1000 (the previous iteration's lengths).
    """
    from rollout_profiler.planning.latency import LatencyModel
    from rollout_profiler.planning.predictor import Prior
    from rollout_profiler.planning.speculation import SpeculativeLatency
    from rollout_profiler.profile import Profile
    from rollout_profiler.sim.config import SimConfig
    from rollout_profiler.sim.report import plot_png, table
    from rollout_profiler.sim.simulate import default_policies, parse_policies, simulate
    from rollout_profiler.sim.workloads import RECIPES, load

    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if max_batch < 0:
        raise UserError(f"--max-batch must be >= 0, got {max_batch}")
    if max_batch:
        check_setting("max_batch", max_batch, "--max-batch")
    if seed < 0:
        raise UserError(f"must be >= 0, got {seed}", "--seed")
    if plot is not None:
        check_writable(plot, "--plot")
    spec = _speculation(spec_accept, draft_tokens)
    with flags():
        names = parse_policies(policies, gpus) if policies is not None else []
        cfg_args: dict[str, Any] = dict(
            admission=admission, initial_layout=initial_layout, decide_every_ms=decide_every_ms, memory=memory
        )
        SimConfig(gpus, **cfg_args)  # validate before the slow part
    try:
        prof = Profile.from_json(profile)
    except UserError as exc:  # the file's own errors: it came from --profile
        raise (exc if exc.field else exc.with_field("--profile")) from None
    with flags():
        wl = load(workload, seed)
    if prior == "none":
        pri = None
    elif prior == "previous":
        prev = load(workload, seed + 1000) if workload in RECIPES else None
        pri = Prior.from_samples(prev.lengths, prev.caps) if prev is not None else None
    else:
        with flags({"workload": "--prior"}):
            prev = load(prior)
        pri = Prior.from_samples(prev.lengths, prev.caps)
    model = LatencyModel(prof) if spec is None else SpeculativeLatency(prof, spec)
    names = names or default_policies(gpus, (lay.tp for lay in model.layouts))
    with flags():
        cfg = SimConfig(gpus, max_batch=max_batch or None, prior=pri, **cfg_args)
        results = simulate(model, wl, cfg, names, Ticker(len(wl.lengths)))
    if plot is not None:
        title = f"{wl.name} on {gpus} GPUs, {prof.name}, admission {admission}"
        save(plot, plot_png(results, title), "--plot")
    if as_json:
        out: dict[str, Any] = {
            "profile": prof.name,
            "gpus": gpus,
            "admission": admission,
            "speculation": None
            if spec is None
            else {"accept": spec.accept, "draft_tokens": spec.draft_tokens},
            "workload": wl.summary(),
            "results": {k: r.to_dict() for k, r in results.items()},
        }
        typer.echo(json.dumps(out, indent=1))
    else:
        s = wl.summary()
        typer.echo(
            f"{s['name']}: {s['requests']} requests, mean {s['mean']:.0f} tokens, "
            f"{s['at_cap'] * 100:.1f}% at cap; "
            f"{gpus} GPUs, profile {prof.name} ({prof.method}), admission {admission}"
            + ("" if spec is None else f", speculating (accept {spec.accept:g}, {spec.draft_tokens} drafted)")
        )
        typer.echo(table(results))
    if plot is not None:
        typer.echo(f"wrote {plot}", err=as_json)


def _speculation(accept: float | None, draft_tokens: int) -> Speculation | None:
    """``--spec-accept`` and ``--draft-tokens``, checked (None: no speculation)."""
    if accept is None:
        return None
    from rollout_profiler.planning.speculation import Speculation

    with flags({"spec_accept": "--spec-accept", "draft_tokens": "--draft-tokens"}):
        return Speculation(accept, draft_tokens)


def bench_planner_cmd(
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the results as JSON to this file.")
    ] = None,
    runs: Annotated[int, typer.Option(help="Seeds per named workload.")] = 3,
    profile: Annotated[
        list[Path] | None,
        typer.Option(
            help="Profile JSON, repeatable (default: the modelled Llama-3.1-8B and Qwen3-14B H100 profiles)."
        ),
    ] = None,
    workload: Annotated[
        list[str] | None,
        typer.Option(help="Named workload or .jsonl of real lengths, repeatable (default: every named one)."),
    ] = None,
    admission: Annotated[str, typer.Option(help=ADMISSION_HELP)] = "paged",
    decide_calls: Annotated[int, typer.Option(help="decide() calls timed per snapshot.")] = 2000,
    spec_accept: SpecAccept = None,
    draft_tokens: DraftTokens = 4,
) -> None:
    """One table per model: static TP 1/2/4/8, adaptive, oracles and bounds per workload; decide() latency;
    with --spec-accept, the same speculating."""
    from rollout_bench import planner as bench_planner
    from rollout_profiler.sim.workloads import load

    if runs < 1:
        raise UserError(f"--runs must be >= 1, got {runs}")
    if decide_calls < 10:
        raise UserError(f"--decide-calls must be >= 10, got {decide_calls}")
    from rollout_profiler.planning.policy import ADMISSIONS

    if admission not in ADMISSIONS:
        raise UserError(f"must be one of {', '.join(ADMISSIONS)}, got {admission!r}", "--admission")
    speculation = _speculation(spec_accept, draft_tokens)
    workloads = list(workload or bench_planner.WORKLOADS)
    with flags():
        for w in workloads:
            load(w, 0)  # fail fast on a bad name or file
    profiles = bench_planner.load_profiles(list(profile or []))
    with flags():
        result = bench_planner.run(
            profiles,
            workloads,
            runs,
            admission,
            decide_calls,
            say=lambda line: typer.echo(line, err=True),
            speculation=speculation,
        )
    typer.echo(bench_planner.report(result))
    if json_out is not None:
        from rollout_bench.record import write_json

        write_json(json_out, result)
        typer.echo(f"wrote {json_out}")


def bench_simulator_cmd(
    runs: Annotated[int, typer.Option(help="Engine runs per workload (the median is reported).")] = 3,
    page_size: Annotated[int, setting_option("page_size")] = setting_default("bench simulator", "page_size"),
    max_batch: Annotated[int, setting_option("max_batch")] = setting_default("bench simulator", "max_batch"),
    dtype: Annotated[str, typer.Option(help=f"One of {', '.join(DTYPES)}.")] = "float32",
    work: Annotated[Path, typer.Option(help="Where the tiny model is kept.")] = Path("build/bench-simulator"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
) -> None:
    """The simulator against the engine: three small long-tailed workloads on one replica of the tiny model
    (a pool tight enough to retract), and the simulator fed that engine's measured profile; retractions and
    generation seconds side by side."""
    from rollout_bench.simulator import CASES, run_agreement_bench
    from rollout_worker.engine.model.checkpoint import ensure_model

    if runs < 1:
        raise UserError(f"must be >= 1, got {runs}", "--runs")
    check_setting("page_size", page_size, "--page-size")
    check_setting("max_batch", max_batch, "--max-batch")
    if dtype not in DTYPES:
        raise UserError(f"must be one of {', '.join(DTYPES)}, got {dtype!r}", "--dtype")
    if json_out is not None:
        check_writable(json_out, "--json")
    work.mkdir(parents=True, exist_ok=True)
    model = ensure_model("tiny", work, dtype)
    run_agreement_bench(model, CASES, page_size, max_batch, runs, dtype, json_out, typer.echo)
