"""The oracles: the best chain of switches when every length is known. Lower references for the policies.

Search space: monotone chains of TP growth (e.g. 8x1 -> 4x2 -> 1x8) whose switches fire when the number of
unfinished requests first drops to a threshold: thresholds on a geometric grid (``oracle_per_octave`` points
per halving of the unfinished requests, plus the points at which the other policies switched). Replicas run
independently, so the state at a threshold depends on the layouts before it; the search approximates it by
the lockstep state (every unfinished request has generated as many tokens as the shortest of them needed)
so that a chain's time is a sum of independent phases: one simulation per (threshold, layout), starting
there, gives the time to every later threshold, and a dynamic programme over (threshold, layout) finds the
best chain. That chain, and the chains the other policies ran (as thresholds), are then improved by a local
search that replays each candidate with the real simulator from the start (a threshold moved to a
neighbouring grid point, a switch dropped or added, another start layout), at most ``oracle_replays``
replays; the best replay is the value reported.

* ``balance="count"`` (the headline oracle): every switch deals the requests by count, as any policy blind
  to lengths must (in a synchronous rollout every unfinished request has the same prediction); the start is
  dealt by count too. It is what a real system could reach with perfect timing.
* ``balance="length"`` (labelled clairvoyant): switches, and optionally the start, balance by the true
  remaining length. The gap between the two is the value of knowing lengths when placing requests.

The result is the minimum of the replay and of every other result passed in (static layouts are chains
without switches; the adaptive run is a chain the grid may miss), so an oracle is never slower than any
policy it is compared with; ``detail`` says which won.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
from rollout_worker.errors import UserError

from rollout_profiler.planning.planner import switch_cost
from rollout_profiler.sim.config import SimResult
from rollout_profiler.sim.policies import ScheduleController
from rollout_profiler.sim.simulator import Simulator

Node = tuple[int, int]  # (threshold index, layout index)


def _grid(sim: Simulator, extra: list[int]) -> list[tuple[int, float]]:
    """(unfinished threshold, lockstep step at which it is reached), most unfinished first."""
    srt = np.sort(sim.lengths)
    n, per = srt.size, sim.cfg.oracle_per_octave
    counts = set(extra)
    i = 1
    while (left := round(n * 2 ** (-i / per))) >= 1:
        counts.add(left)
        i += 1
    out = {}
    for c in sorted(counts, reverse=True):
        if 1 <= c < n:
            step = float(srt[n - c - 1])  # the lockstep step at which only c requests are left
            left = int((sim.lengths > step).sum())
            if 0 < left < n:
                out[left] = step
    return sorted(out.items(), reverse=True)


Chain = tuple[
    int, tuple[tuple[int, int], ...]
]  # (start layout index, ((threshold index, layout index), ...))


def _chains_of(others: list[SimResult], grid: list[tuple[int, float]], layouts: list) -> list[Chain]:
    """The switches other policies ran, as chains on the grid (nearest threshold)."""
    out = []
    counts = np.array([c for c, _ in grid])
    for o in others:
        if not o.reconfigs or o.reconfigs[0].src not in layouts:
            continue
        steps = []
        for e in o.reconfigs:
            if e.dst in layouts and counts.size:
                j = int(np.argmin(np.abs(counts - (e.requests_running + e.requests_waiting))))
                steps.append((j, layouts.index(e.dst)))
        out.append((layouts.index(o.reconfigs[0].src), tuple(steps)))
    return out


def _valid(chain: Chain) -> bool:
    li, steps = chain
    for _, lj in steps:
        if lj <= li:
            return False
        li = lj
    return all(a[0] < b[0] for a, b in pairwise(steps))


def _neighbours(chain: Chain, n_grid: int, n_layouts: int) -> list[Chain]:
    li, steps = chain
    out: list[Chain] = [(l0, steps) for l0 in range(n_layouts) if l0 != li]
    for k, (j, lj) in enumerate(steps):
        for dj in (-2, -1, 1, 2):
            if 0 <= j + dj < n_grid:
                out.append((li, (*steps[:k], (j + dj, lj), *steps[k + 1 :])))
        out.append((li, (*steps[:k], *steps[k + 1 :])))
        for other in range(n_layouts):
            if other != lj:
                out.append((li, (*steps[:k], (j, other), *steps[k + 1 :])))
    last_j = steps[-1][0] if steps else -1
    last_l = steps[-1][1] if steps else li
    for j in range(last_j + 1, n_grid, 2):
        for lj in range(last_l + 1, n_layouts):
            out.append((li, (*steps, (j, lj))))
    return [c for c in out if _valid(c)]


def oracle(sim: Simulator, others: list[SimResult], balance: str = "count") -> SimResult:
    """The best chain found (module docstring); ``balance`` is ``count`` or ``length`` (clairvoyant)."""
    name = "oracle" if balance == "count" else "oracle-clairvoyant"
    layouts = sorted(sim.candidates(), key=lambda lay: lay.tp)
    if not layouts:
        raise UserError("no candidate layout fits the workload", "candidates")
    extra = [r.requests_running + r.requests_waiting for o in others for r in o.reconfigs]
    grid = _grid(sim, extra)
    marks = tuple(c for c, _ in grid)
    prof = sim.model.profile
    tokens = [float((sim.prompt[sim.lengths > s] + s).sum()) for _, s in grid]
    best: dict[Node, tuple[float, Node | None]] = {}

    def value(li: int, to_mark: dict[int, float], total: float, after: int) -> tuple[float, Node | None]:
        """Best continuation of a phase in layouts[li]: run to the end, or switch at a later threshold."""
        out: tuple[float, Node | None] = (total, None)
        for j in range(after + 1, len(grid)):
            if grid[j][0] not in to_mark:
                continue
            for lj in range(li + 1, len(layouts)):
                _, c = switch_cost(
                    prof.costs,
                    sim.kv_bytes,
                    prof.model.num_kv_heads,
                    layouts[li],
                    layouts[lj],
                    tokens[j],
                    "auto",
                )
                v = to_mark[grid[j][0]] + c + best[(j, lj)][0]
                if v < out[0]:
                    out = (v, (j, lj))
        return out

    for i in range(len(grid) - 1, -1, -1):  # phases entered by a switch at threshold i
        key = sim.lengths - grid[i][1] if balance == "length" else None
        for li in range(1, len(layouts)):
            r = sim.run(layouts[li], name="phase", start_gen=grid[i][1], work=key, marks=marks)
            best[(i, li)] = value(li, r.marks, r.latency_s * 1e3, i)
    starts = []  # at the start: each layout, dealt by count (as static) or balanced by length
    works: tuple[np.ndarray | None, ...] = (None, sim.lengths) if balance == "length" else (None,)
    for li, lay in enumerate(layouts):
        for work in works:
            r = sim.run(lay, name="phase", work=work, marks=marks)
            starts.append((value(li, r.marks, r.latency_s * 1e3, -1), li, work))
    (dp_ms, node), li0, work0 = min(starts, key=lambda x: x[0][0])
    steps = []
    while node is not None:
        steps.append(node)
        node = best[node][1]
    replays: dict[Chain, SimResult] = {}

    def replay(chain: Chain) -> float:
        if chain not in replays:
            schedule = [(grid[j][0], layouts[lj]) for j, lj in chain[1]]
            ctl = ScheduleController(schedule, balance=balance) if schedule else None
            replays[chain] = sim.run(layouts[chain[0]], name=name, work=work0, controller=ctl)
        return replays[chain].latency_s

    for seed in [(li0, tuple(steps)), *_chains_of(others, grid, layouts)]:
        replay(seed)
    cur = min(replays, key=replay)
    improved = True
    while improved and len(replays) < sim.cfg.oracle_replays:
        improved = False
        for cand in _neighbours(cur, len(grid), len(layouts)):
            if len(replays) >= sim.cfg.oracle_replays:
                break
            if replay(cand) < replay(cur) - 1e-9:
                cur, improved = cand, True
                break
    found = replays[cur]
    chain = " -> ".join([str(layouts[cur[0]]), *(f"{layouts[lj]}@{grid[j][0]}" for j, lj in cur[1])])
    dealt = "dealt by count" if work0 is None else "balanced by length"
    found.detail = (
        f"chain {chain} (unfinished <= n), start {dealt}; dp {dp_ms / 1e3:.2f} s on {len(grid)} thresholds, "
        f"{len(replays)} replays"
    )
    winner = min([found, *others], key=lambda r: r.latency_s)
    if winner is found:
        return found
    return winner.adopted(name, f"schedule of {winner.policy} (chain {chain}: {found.latency_s:.2f} s)")
