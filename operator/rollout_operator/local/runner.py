"""One run of a job's pods on this machine: start each pod (engine server + sidecar) as local processes on
loopback ports, tick the planner loop (adaptive) until every sample is written (job mode) or until SIGTERM /
Ctrl-C (service mode), then stop the pods and write the manifest and the run's record."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import PlannerPolicy
from rollout_profiler.planning.predictor import Prior
from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.api.sidecar import Progress, Sample, output_files, read_outputs
from rollout_worker.errors import EngineError
from rollout_worker.proc import free_port
from rollout_worker.scheduling.layout import Layout
from rollout_worker.sidecar.outputs import write_manifest

from rollout_operator.api.manifest import LoadedJob
from rollout_operator.control.links import SidecarLink
from rollout_operator.control.planner_loop import Outcome, PlannerLoop, Recorder
from rollout_operator.local.pods import PodProcesses, build_pods
from rollout_operator.local.processes import LocalPods
from rollout_operator.local.result import Point, RunResult, record

log = logging.getLogger(__name__)
log.propagate = False  # the runner's own lines go to its log file only: the terminal shows the live progress

TICK_S = 0.25
LATEST = 2**62  # as since_step: no finished lengths, only the counts
ENDPOINTS = "endpoints.json"


@dataclass(frozen=True)
class Planning:
    """The planner's side of an adaptive run."""

    model: LatencyModel
    policy: PlannerPolicy
    prior: Prior | None
    recorder: Recorder | None


@dataclass(frozen=True)
class PodRun:
    """One run of the job's pods."""

    loaded: LoadedJob
    policy: str  # adaptive | static
    layout: Layout
    candidates: list[Layout]
    out_dir: Path
    planning: Planning | None  # None: static


class Interrupted(Exception):
    """Ctrl-C or SIGTERM during a job-mode run: the pods were stopped; rerunning resumes."""


def _secrets(dir_: Path) -> tuple[Path, str]:
    """Fresh API key and sidecar token, readable by this user only."""
    dir_.mkdir(parents=True, exist_ok=True)
    dir_.chmod(0o700)
    token = secrets.token_urlsafe(24)
    for name, value in (("engine-key", secrets.token_urlsafe(24)), ("sidecar-token", token)):
        f = dir_ / name
        f.write_text(value + "\n")
        f.chmod(0o600)
    return dir_, token


def _decision_row(o: Outcome) -> dict[str, Any]:
    d = o.result.decision
    return {
        "pod": o.pod,
        "to": str(d.target),
        "method": d.method,
        "gain_ms": d.predicted_gain_ms,
        "cost_ms": d.predicted_cost_ms,
        "reason": d.reason,
    }


def _endpoints(pods: list[PodProcesses], secrets_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Where each pod listens, written as ``endpoints.json`` before the pods start: the sidecars' progress,
    and in service mode where an RL framework sends its requests."""
    info = {
        "pods": [
            {"pod": p.name, "engine_url": p.engine_url, "sidecar_url": p.api_url, "admin_url": p.admin_url}
            for p in pods
        ],
        "engine_key_file": str(secrets_dir / "engine-key"),
        "sidecar_token_file": str(secrets_dir / "sidecar-token"),
    }
    tmp = out_dir / f".{ENDPOINTS}.tmp"
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    tmp.replace(out_dir / ENDPOINTS)
    return info


def _serving(info: dict[str, Any], echo: Callable[[str], Any]) -> None:
    for r in info["pods"]:
        echo(f"{r['pod']}: SGLang API at {r['engine_url']}, progress at {r['sidecar_url']}/v1/progress")
    echo(f"API key in {info['engine_key_file']}; sidecar token in {info['sidecar_token_file']}")
    echo("serving until Ctrl-C or SIGTERM")


@dataclass
class Running:
    """What a run of the pods holds from its start to its finish (``_start``, ``_monitor``, ``_finish``)."""

    run: PodRun
    service: bool
    before: list[Sample]  # samples already written (by an earlier, interrupted run)
    local: LocalPods
    links: list[SidecarLink]
    loop: PlannerLoop | None  # None: static
    info: dict[str, Any]  # endpoints.json
    log_file: logging.Handler
    stop: asyncio.Event  # set by SIGINT / SIGTERM
    timeline: list[Point] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    closest: dict[str, dict[str, Any]] = field(default_factory=dict)
    progress: dict[str, Progress] = field(default_factory=dict)

    def done(self) -> bool:
        """Every sample written (job mode); EngineError once a pod died."""
        if self.local.dead():
            c = self.local.dead()[0]
            raise EngineError(f"{c.name} exited with code {c.proc.returncode}:\n{c.tail()}")
        if self.service or len(self.progress) != len(self.links):
            return False
        return all(p.done for p in self.progress.values())


@dataclass(frozen=True)
class Ended:
    """How the monitored run ended."""

    seconds: float  # from every pod ready until the end
    events: dict[str, list[ReconfigEvent]]  # per pod, its switches
    served: int  # service mode: the requests the engines finished


async def run_pods(
    run: PodRun, on_progress: Callable[[dict[str, Progress]], Any], echo: Callable[[str], Any]
) -> RunResult:
    r = _start(run)
    try:
        ended = await _monitor(r, on_progress, echo)
    except EngineError as exc:  # a pod died, while starting or later: the log says which and how
        log.error("%s: stopping every pod", str(exc).splitlines()[0].rstrip(":"))
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().remove_signal_handler(sig)
        for link in r.links:
            await link.aclose()
        r.local.stop()
        log.info("every pod stopped")
        _unlog(r.log_file)
    return _finish(r, ended)


def _start(run: PodRun) -> Running:
    """Write the secrets and the endpoints, take SIGINT / SIGTERM and start every pod (without waiting)."""
    spec = run.loaded.job.spec
    run.out_dir.mkdir(parents=True, exist_ok=True)
    secrets_dir, token = _secrets(run.out_dir / ".secrets")
    before = read_outputs(run.out_dir)
    ports = [free_port() for _ in range(3 * spec.pods)]
    # the engines price a switch with the planner's (the profile's) costs
    costs = run.planning.model.profile.costs if run.planning is not None else None
    pods = build_pods(
        run.loaded.job.metadata.name, spec, run.layout, run.candidates, ports, run.out_dir, secrets_dir, costs
    )
    local = LocalPods(pods, run.out_dir / "logs")
    log_file = _log_to(run.out_dir / "logs" / "runner.log")
    log.info(
        "%s: %s, %d pod(s) from %s, starting as %s; %d sample(s) already written",
        run.loaded.job.metadata.name,
        run.policy,
        spec.pods,
        run.loaded.file,
        run.layout,
        len(before),
    )
    links = [SidecarLink(p.name, p.api_url, p.admin_url, token) for p in pods]
    plan = run.planning
    loop = PlannerLoop(list(links), plan.model, plan.policy, plan.prior, plan.recorder) if plan else None
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, stop.set)
    info = _endpoints(pods, secrets_dir, run.out_dir)
    for p in pods:
        log.info("%s: engine %s, sidecar %s (admin %s)", p.name, p.engine_url, p.api_url, p.admin_url)
    local.start()
    return Running(run, spec.mode == "service", before, local, links, loop, info, log_file, stop)


async def _monitor(
    r: Running, on_progress: Callable[[dict[str, Progress]], Any], echo: Callable[[str], Any]
) -> Ended:
    """Wait until every pod is ready, then poll the progress and tick the planner until every sample is
    written (job mode) or until SIGINT / SIGTERM (service mode; Interrupted in job mode)."""
    await _until(r.local.wait_ready(), r.stop)
    t0 = time.monotonic()
    log.info("every pod is ready; generation starts")
    if r.service:
        _serving(r.info, echo)
    while not r.done() and not r.stop.is_set():
        await _poll(r, t0, on_progress)
        if r.loop is not None:
            outcomes = await r.loop.run_once()
            r.decisions += _pushed(outcomes)
            _nearest(r.closest, outcomes)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(r.stop.wait(), TICK_S)
    if r.stop.is_set() and not r.service:
        log.info("interrupted (Ctrl-C or SIGTERM): stopping every pod")
        raise Interrupted
    await _poll(r, t0, on_progress)
    seconds = time.monotonic() - t0
    log.info("%s after %.2f s", "stopped serving" if r.service else "every sample written", seconds)
    events = {link.name: await link.events() for link in r.links}
    served = 0
    if r.service:  # the engines' own count, live (the sidecars' progress lags by a poll)
        for link in r.links:
            state, _ = await link.state(LATEST)
            served += state.finished.total
    if r.loop is not None:
        await r.loop.run_once()  # records the outcome of the switches since the last tick
        plan = r.run.planning
        if r.service and plan is not None and plan.recorder is not None:
            for mem in r.loop.memory.values():
                plan.recorder.lengths(mem.lengths, mem.capped)
    return Ended(seconds, events, served)


async def _poll(r: Running, t0: float, on_progress: Callable[[dict[str, Progress]], Any]) -> None:
    """Every pod's progress, and a point of the timeline per pod that answered."""
    for link in r.links:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            p = r.progress[link.name] = await link.progress()
            tp = Layout.parse(p.layout).tp if p.layout else r.run.layout.tp
            r.timeline.append(Point(time.monotonic() - t0, link.name, p.running, tp))
    on_progress(r.progress)


def _finish(r: Running, ended: Ended) -> RunResult:
    """The run's result; in job mode also the samples counted, the manifest and the run's record written."""
    run = r.run
    result = RunResult(
        run.policy, run.layout, run.out_dir, ended.seconds, 0, 0, ended.events, r.decisions, r.timeline
    )
    result.closest = r.closest
    if r.service:
        result.samples, result.service = ended.served, True
    else:
        _tally(result, r.before)
        write_manifest(
            run.out_dir,
            output_files(run.out_dir),
            {"job": run.loaded.job.metadata.name, "policy": run.policy},
        )
        record(result)
    return result


def _tally(result: RunResult, before: list[Sample]) -> None:
    """Count a job-mode run's samples and tokens from its outputs; those of ``before`` (written by an
    earlier, interrupted run) were not generated now."""
    samples = read_outputs(result.out_dir)
    result.samples, result.tokens = len(samples), sum(s.completion_tokens for s in samples)
    result.resumed, result.resumed_tokens = len(before), sum(s.completion_tokens for s in before)


def _nearest(closest: dict[str, dict[str, Any]], outcomes: list[Outcome]) -> None:
    """Keep, per pod, the decision to stay whose predicted gain came nearest its cost: why the planner did
    not switch, for the report of a pod that never did."""
    for o in outcomes:
        d, seen = o.result.decision, o.result.inputs
        if d.action != "keep" or d.predicted_cost_ms <= 0:
            continue  # not weighed (cooldown, ranks not ready, a switch planned for later)
        best = closest.get(o.pod)
        if best is None or d.predicted_gain_ms - d.predicted_cost_ms > best["gain_ms"] - best["cost_ms"]:
            closest[o.pod] = {
                "step": seen["step"],
                "unfinished": seen["running"] + seen["waiting"],
                "gain_ms": d.predicted_gain_ms,
                "cost_ms": d.predicted_cost_ms,
                "reason": d.reason,
            }


def _pushed(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """The decisions a planner tick pushed, as report rows, each also in the runner's log."""
    rows = [_decision_row(o) for o in outcomes if o.pushed]
    for row in rows:
        log.info(
            "%(pod)s: plan pushed: %(to)s (%(method)s), gain %(gain_ms).1f ms, "
            "cost %(cost_ms).1f ms: %(reason)s",
            row,
        )
    for o in outcomes:
        for e in o.new_events:
            log.info("%s: %s -> %s (%s) at step %d: %s", o.pod, e.src, e.dst, e.method, e.step, e.outcome)
    return rows


# the runner's own lines (which do not propagate), and the code it runs: the loop, links, the planner
LOGGERS = (__name__, "rollout_operator", "rollout_profiler")


def _log_to(path: Path) -> logging.Handler:
    """The runner's own log, in full (what it starts, the planner's decisions and warnings with their
    tracebacks, the switches, how it ends), beside the pods' logs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    return handler


def _unlog(handler: logging.Handler) -> None:
    for name in LOGGERS:
        logging.getLogger(name).removeHandler(handler)
    handler.close()


async def _until(work: Any, stop: asyncio.Event) -> None:
    """Await ``work`` unless ``stop`` is set first (then: Interrupted)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        task.cancel()
        raise Interrupted
    task.result()
