"""``rolloutctl bench serve``: the HTTP service against the in-process engine on the same requests.

Per model preset and run (alternated, in one process, on the same cores):
* the in-process engine (``run_batch``, closed loop with ``clients`` requests in flight) generates the
  request set: tokens/s over the generation;
* the server (``rolloutctl serve`` in a subprocess) gets the same requests from ``clients`` concurrent
  streaming clients: tokens/s and requests lost; meanwhile a prober in its own process times ``/health``
  and ``/v1/state`` (the event loop must never wait for the engine);
* once per preset, the same load with a layout change in the middle: every stream must continue.

Request lengths are uniform in [max_new/2, max_new] (bench_serving's range ratio 0.5): with equal lengths
every request finishes in the same step and the replicas idle while all clients resubmit at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.engine.model.checkpoint import ensure_model
from rollout_worker.server.process import start_server, stop_server
from rollout_worker.web.probe import Prober, percentile

from rollout_bench.record import write_json

Echo = Callable[[str], Any]
Request = tuple[list[int], int]  # (prompt ids, new tokens)


@dataclass
class Load:
    """The outcome of one HTTP load run."""

    tokens: int = 0
    lost: list[str] = field(default_factory=list)
    seconds: float = 0.0
    health_ms: list[float] = field(default_factory=list)
    state_ms: list[float] = field(default_factory=list)
    switch: dict[str, Any] | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)  # server, ranks, client: CPU seconds in the run

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def make_requests(n: int, prompt_len: int, max_new: int, vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    low = max(1, max_new // 2)
    return [([rng.randrange(vocab) for _ in range(prompt_len)], rng.randint(low, max_new)) for _ in range(n)]


def _complete(chunk: dict[str, Any], max_new: int) -> bool:
    """The request ran to its length (ignore_eos) and said so."""
    finish = chunk["meta_info"]["finish_reason"] or {}
    return len(chunk["output_ids"]) == max_new and finish.get("type") == "length"


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used (Linux /proc; 0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(
    url: str,
    reqs: list[Request],
    clients: int,
    switch_to: str | None,
    pids: tuple[int, list[int]] | None = None,
) -> Load:
    """The requests through ``clients`` streaming clients; ``pids`` (server, ranks) for CPU accounting."""
    out = Load()
    server_pid, rank_pids = pids or (0, [])
    cpu0 = (_cpu_s(server_pid), sum(_cpu_s(p) for p in rank_pids), time.process_time())
    todo = list(enumerate(reqs))[::-1]
    finished = 0
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:

        async def client() -> None:
            nonlocal finished
            while todo:
                i, (prompt, max_new) = todo.pop()
                sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
                body = {"input_ids": prompt, "rid": f"b{i}", "stream": True, "sampling_params": sp}
                last = ""  # a client that wants the result parses only the last chunk
                async with c.stream("POST", "/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = line
                final = json.loads(last[6:]) if last else None
                if final is not None and _complete(final, max_new):
                    out.tokens += max_new
                else:
                    out.lost.append(f"b{i}")
                finished += 1

        async def switch() -> None:
            while finished < len(reqs) // 3:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/reconfigure", json={"layout": switch_to, "method": "auto"})
            out.switch = r.json().get("event")

        with Prober(url, ["/health", "/v1/state"]) as prober:
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(client()) for _ in range(clients)]
            if switch_to:
                tasks.append(asyncio.create_task(switch()))
            await asyncio.gather(*tasks)
            out.seconds = time.perf_counter() - t0
            cpu1 = (_cpu_s(server_pid), sum(_cpu_s(p) for p in rank_pids), time.process_time())
        out.cpu_s = dict(
            zip(("server", "ranks", "client"), (b - a for a, b in zip(cpu0, cpu1, strict=True)), strict=True)
        )
        out.health_ms, out.state_ms = prober.ms["/health"], prober.ms["/v1/state"]
    return out


def bench_preset(
    preset: str,
    ranks: int,
    n: int,
    prompt_len: int,
    max_new: int,
    clients: int,
    runs: int,
    work: Path,
    echo: Echo,
) -> dict[str, Any]:
    model = ensure_model(preset, work)
    cfg = EngineConfig.load(str(model), ranks)
    reqs = make_requests(n, prompt_len, max_new, cfg.model.vocab_size)
    specs = [RequestSpec(f"b{i}", tuple(p), k, Sampling(), ignore_eos=True) for i, (p, k) in enumerate(reqs)]
    total = sum(k for _, k in reqs)
    switch_to = next((str(c) for c in cfg.candidates if c != cfg.layout), None)
    proc, url = start_server(model, ["--ranks", str(ranks)], Path(tempfile.mkdtemp()) / "server.log")
    rows: list[dict[str, Any]] = []
    try:
        warm = {"input_ids": reqs[0][0], "sampling_params": {"max_new_tokens": 4}}
        httpx.post(url + "/generate", json=warm, timeout=60)
        pids = (proc.pid, [p for p in httpx.get(url + "/get_server_info").json()["rank_pids"] if p])
        for i in range(runs):
            res = run_batch(cfg, specs, concurrency=clients)
            inproc = total / res.gen_s
            load = asyncio.run(_load(url, reqs, clients, None, pids))
            row = {
                "run": i + 1,
                "inproc_tps": inproc,
                "server_tps": load.tps,
                "lost": len(load.lost),
                "health_p50_ms": percentile(load.health_ms, 0.5),
                "health_p99_ms": percentile(load.health_ms, 0.99),
                "state_p50_ms": percentile(load.state_ms, 0.5),
                "state_p99_ms": percentile(load.state_ms, 0.99),
                "probes": len(load.health_ms) + len(load.state_ms),
                "server_cpu_per_token_us": 1e6 * load.cpu_s["server"] / total,
                "rank_cpu_per_token_us": 1e6 * load.cpu_s["ranks"] / total,
                "client_cpu_per_token_us": 1e6 * load.cpu_s["client"] / total,
                "server_cpu_share": load.cpu_s["server"] / max(load.cpu_s["ranks"], 1e-9),
            }
            rows.append(row)
            echo(
                f"  {preset} run {i + 1}/{runs}: in-process {inproc:.0f} tok/s, server {load.tps:.0f} tok/s, "
                f"lost {len(load.lost)}, p99 /health {row['health_p99_ms']:.1f} ms, "
                f"/v1/state {row['state_p99_ms']:.1f} ms; CPU per token: "
                f"server {row['server_cpu_per_token_us']:.0f} us, "
                f"ranks {row['rank_cpu_per_token_us']:.0f} us, "
                f"load client {row['client_cpu_per_token_us']:.0f} us"
            )
        switched = asyncio.run(_load(url, reqs, clients, switch_to))
        echo(
            f"  {preset}, switching to {switch_to} under load: {switched.tps:.0f} tok/s, "
            f"lost {len(switched.lost)}"
        )
    finally:
        stop_server(proc)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "run"}
    return {
        "preset": preset,
        "ranks": ranks,
        "layout": str(cfg.layout),
        "requests": n,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new,
        "tokens": total,
        "clients": clients,
        "runs": rows,
        "median": med,
        "server_overhead": 1.0 - med["server_tps"] / med["inproc_tps"],
        "switch_under_load": {
            "to": switch_to,
            "tps": switched.tps,
            "lost": len(switched.lost),
            "event": switched.switch,
        },
    }


def run_serve_bench(
    presets: list[str],
    ranks: int,
    requests: dict[str, int],
    prompt_len: int,
    max_new: int,
    clients: int,
    runs: int,
    work: Path,
    json_out: Path | None,
    echo: Echo,
) -> dict[str, Any]:
    results = [
        bench_preset(p, ranks, requests.get(p, 128), prompt_len, max_new, clients, runs, work, echo)
        for p in presets
    ]
    echo(
        "\n| model | in-process tok/s | server tok/s | overhead | server CPU / rank CPU | lost "
        "| /health p99 | /v1/state p99 | switch under load |"
    )
    echo("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        echo(_row(r))
    report = {"benchmark": "serve", "results": results}
    if json_out is not None:
        write_json(json_out, report)
        echo(f"wrote {json_out}")
    return report


def _row(r: dict[str, Any]) -> str:
    m, sw = r["median"], r["switch_under_load"]
    ev = sw["event"] or {}
    what = f"{r['preset']} ({r['layout']}, {r['clients']} streams, {r['requests']} requests)"
    switch = (
        f"{ev.get('src')}->{ev.get('dst')} {ev.get('method')}, {ev.get('requests_mid_decode')} mid-decode"
    )
    return (
        f"| {what} | {m['inproc_tps']:.0f} | {m['server_tps']:.0f} | {100 * r['server_overhead']:.1f}% "
        f"| {100 * m['server_cpu_share']:.1f}% | {int(m['lost'])} | {m['health_p99_ms']:.1f} ms "
        f"| {m['state_p99_ms']:.1f} ms "
        f"| {switch}, lost {sw['lost']} |"
    )
