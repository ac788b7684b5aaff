"""`rolloutctl run JOB.yaml`: a whole RolloutJob on this machine (each pod: engine server + sidecar)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rollout_worker.data.files import check_writable, save
from rollout_worker.errors import UserError

from rollout_operator.cli.args import bench_group, needs_engine


def register(app: typer.Typer) -> None:
    app.command("run")(needs_engine(run_cmd))
    bench_group(app).command("run")(needs_engine(bench_run_cmd))


UNWRAPPED = 1000  # columns of the progress lines when the output is not a terminal


class Bars:
    """Live progress, started on first use: the model being made (bytes), then a bar per pod (samples
    written) with its layout, running batch, waiting requests and switches."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console()
        if not console.is_terminal:  # a log or a pipe: whole lines, not cut to rich's default 80 columns
            console = Console(width=UNWRAPPED)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            transient=False,
            console=console,
        )
        self.tasks: dict[str, Any] = {}
        self.live = False

    def _start(self) -> None:
        if not self.live:
            self.progress.start()
            self.live = True

    def stop(self) -> None:
        if self.live:
            self.progress.stop()
            self.live = False

    def say(self, line: str) -> None:
        """A line above the bars, as written (paths and URLs unwrapped, no markup)."""
        self.progress.console.print(line, soft_wrap=True, markup=False, highlight=False)

    def model_bytes(self, done: int, total: int) -> None:
        self._start()
        mib = 1 << 20
        if "model" not in self.tasks:
            self.tasks["model"] = self.progress.add_task("making the model", total=total // mib, info="MiB")
        self.progress.update(self.tasks["model"], completed=done // mib)

    def __call__(self, progress: dict[str, Any]) -> None:
        self._start()
        for pod, p in progress.items():
            info = (
                f"{p.layout or '?':>4}  running {p.running:>3}  waiting {p.waiting:>3}  "
                f"switches {p.reconfigurations}  {p.tokens_per_s:>5.0f} tok/s"
            )
            if pod not in self.tasks:
                self.tasks[pod] = self.progress.add_task(pod, total=p.samples_total, info=info)
            self.progress.update(self.tasks[pod], completed=p.samples_done, total=p.samples_total, info=info)


def run_cmd(
    job: Annotated[Path, typer.Argument(help="RolloutJob manifest (the same YAML kubectl apply takes).")],
    policy: Annotated[
        str | None, typer.Option(help="adaptive | static (overrides spec.parallelism.policy).")
    ] = None,
    output: Annotated[
        Path | None, typer.Option(help="Output directory (overrides spec.output.path).")
    ] = None,
    compare: Annotated[
        str | None, typer.Option(help="`static`: run again as static independent replicas and compare.")
    ] = None,
    report: Annotated[Path | None, typer.Option(help="Write the report as JSON here.")] = None,
    timeline: Annotated[
        Path | None, typer.Option(help="Timeline PNG (default: OUTPUT/timeline.png).")
    ] = None,
    db: Annotated[
        str | None, typer.Option(help="Database URL (default: $ROLLOUT_DB_URL, else SQLite).")
    ] = None,
) -> None:
    """Run the job: pods as local processes on loopback ports, the planner loop in this process. Rerunning
    the same command resumes from the outputs. Ctrl-C stops every child process."""
    from rollout_operator.api.manifest import load_job
    from rollout_operator.local import report as rep
    from rollout_operator.local.local_job import RunOptions, execute, outputs_equal, prepare
    from rollout_operator.local.result import Comparison
    from rollout_operator.local.runner import Interrupted

    if policy not in (None, "adaptive", "static"):
        raise UserError(f"must be adaptive or static, got {policy!r}", "--policy")
    if compare not in (None, "static"):
        raise UserError(f"only `static` can be compared, got {compare!r}", "--compare")
    loaded = load_job(job)
    png = timeline or Path(output or loaded.job.spec.output.path) / "timeline.png"
    for path, flag in ((report, "--report"), (timeline, "--timeline")):
        if path is not None:
            check_writable(path, flag)  # before the job runs, not after it finished
    opts = RunOptions(policy=policy, output=output, compare_static=compare == "static", db_url=db)
    bars = Bars()
    try:
        prepared = prepare(loaded, opts, bars.say, bars.model_bytes)
        results = execute(prepared, bars.say, bars)
    except Interrupted:
        out = output or Path(loaded.job.spec.output.path)
        typer.echo(f"interrupted: every process stopped; the samples so far are in {out}; rerun to resume")
        raise typer.Exit(130) from None
    finally:
        bars.stop()
    for r in results:
        for line in rep.lines(r):
            typer.echo(line)
    extra: dict[str, Any] = {"job": loaded.job.metadata.name}
    if len(results) == 2:
        same, detail = outputs_equal(results[0].out_dir, results[1].out_dir)
        comparison = Comparison(results[0], results[1], same, detail)
        dtype, spec = loaded.job.spec.model.dtype, loaded.job.spec
        lossless = dtype == "float64" or spec.engine.deterministic  # every token must be the same
        for line in rep.compare_lines(comparison, None if lossless else dtype):
            typer.echo(line)
        extra["compare"] = rep.compare_dict(comparison)
        if not same and lossless:
            typer.echo(f"error: the outputs differ from the static run's: {detail}", err=True)
            raise typer.Exit(1)
    typer.echo(f"timeline: {save(png, rep.timeline_png(results), '--timeline')}")
    if report is not None:
        typer.echo(f"report: {save(report, rep.report_json(results, extra), '--report')}")


def bench_run_cmd(
    job: Annotated[Path, typer.Argument(help="RolloutJob manifest.")] = Path("examples/medium-rollout.yaml"),
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each runs every policy once.")] = 3,
    work: Annotated[Path, typer.Option(help="Where the trials write (emptied per trial).")] = Path(
        "build/bench-run"
    ),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    db: Annotated[
        str | None, typer.Option(help="Database URL (default: a fresh SQLite file under --work).")
    ] = None,
) -> None:
    """The job adaptive and static at every candidate layout, alternated over rounds on this machine: the
    median ratio adaptive / best static, the switching overhead and the sidecar's /v1/progress p99 under
    load. Minutes to tens of minutes; kept out of CI."""

    from rollout_bench.job_run import bench_job, table

    from rollout_operator.api.manifest import load_job
    from rollout_operator.local.local_job import RunOptions, prepare

    loaded = load_job(job)
    if loaded.job.spec.mode != "job":
        raise loaded.error(("spec", "mode"), "the benchmark runs job mode (prompts to generate)")
    work.mkdir(parents=True, exist_ok=True)
    url = db or f"sqlite:///{(work / 'bench.db').resolve()}"
    prep = prepare(loaded, RunOptions(policy="adaptive", output=work, db_url=url), typer.echo)
    try:
        summary = bench_job(prep, rounds, work, typer.echo)
    finally:
        prep.db.finish(None, "benchmark")
    for line in table(summary):
        typer.echo(line)
    if json_out is not None:
        from rollout_bench.record import write_json

        write_json(json_out, summary)
        typer.echo(f"wrote {json_out}")
