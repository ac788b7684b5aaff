"""`rolloutctl run JOB.yaml`: a whole RolloutJob on this machine (each pod: engine server + sidecar)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rollout_worker.api.errors import UserError


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)


class _Bars:
    """Live progress: a bar per pod (samples written), its running batch, layout and switches."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        self.tasks: dict[str, Any] = {}

    def __call__(self, progress: dict[str, dict[str, Any]]) -> None:
        for pod, p in progress.items():
            info = (
                f"running {p.get('running', 0):>3}  layout {p.get('layout', '?'):>4}  "
                f"switches {p.get('reconfigurations', 0)}  {p.get('tokens_per_s', 0):.0f} tok/s"
            )
            total = int(p.get("samples_total", 0)) or None
            if pod not in self.tasks:
                self.tasks[pod] = self.progress.add_task(pod, total=total, info=info)
            self.progress.update(
                self.tasks[pod], completed=int(p.get("samples_done", 0)), total=total, info=info
            )


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
    from rollout_operator.local.app import RunOptions, outputs_equal, run_job

    if policy not in (None, "adaptive", "static"):
        raise UserError(f"must be adaptive or static, got {policy!r}", "--policy")
    if compare not in (None, "static"):
        raise UserError(f"only `static` can be compared, got {compare!r}", "--compare")
    loaded = load_job(job)
    opts = RunOptions(policy=policy, output=output, compare_static=compare == "static", db_url=db)
    bars = _Bars()
    with bars.progress:
        results = run_job(loaded, opts, typer.echo, bars)
    for r in results:
        for line in rep.lines(r):
            typer.echo(line)
    extra: dict[str, Any] = {"job": loaded.job.metadata.name}
    if len(results) == 2:
        same, detail = outputs_equal(results[0].out_dir, results[1].out_dir)
        ratio = results[1].seconds / results[0].seconds if results[0].seconds else 0.0
        typer.echo(
            f"compare: {results[0].policy} {results[0].seconds:.2f} s vs static {results[1].seconds:.2f} s "
            f"({ratio:.2f}x); outputs {'identical' if same else 'DIFFER'} ({detail})"
        )
        extra["compare"] = {"identical": same, "detail": detail, "speedup": ratio}
        if not same:
            raise UserError(f"the outputs differ from the static run: {detail}")
    png = timeline or Path(output or loaded.job.spec.output.path) / "timeline.png"
    typer.echo(f"timeline: {rep.timeline_png(png, results)}")
    if report is not None:
        rep.write_json(report, results, extra)
        typer.echo(f"report: {report}")
