"""Timing a server's GET routes from a process of its own, so that the figures are the server's and not a
busy client's event loop: every ``every_s``, each path once, until stopped (benchmarks)."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import httpx


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``xs``; NaN when empty."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _probe(url: str, paths: list[str], headers: dict[str, str], every_s: float, conn: Any) -> None:
    got: dict[str, list[float]] = {p: [] for p in paths}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        while not conn.poll(every_s):
            for path in paths:
                t0 = time.perf_counter()
                try:
                    ok = c.get(path).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    got[path].append((time.perf_counter() - t0) * 1e3)
    conn.send(got)


class Prober:
    """``with Prober(url, ["/health"]) as p: ...`` then ``p.ms["/health"]``: the latencies in ms of the
    answers that were 200 (a failed or refused probe is not a latency)."""

    def __init__(
        self, url: str, paths: list[str], headers: dict[str, str] | None = None, every_s: float = 0.02
    ) -> None:
        self.url, self.paths, self.headers, self.every_s = url, paths, headers or {}, every_s
        self.ms: dict[str, list[float]] = {}

    def __enter__(self) -> Prober:
        ctx = mp.get_context("spawn")
        self._mine, theirs = ctx.Pipe()
        args = (self.url, self.paths, self.headers, self.every_s, theirs)
        self._proc = ctx.Process(target=_probe, args=args, daemon=True)
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mine.send("stop")
        if self._mine.poll(30):
            self.ms = self._mine.recv()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
