"""The oracle policy: knows every length, picks the best chain of switches. A lower bound for the others.

Search space: monotone chains of TP growth (e.g. 8x1 -> 4x2 -> 1x8) whose switches happen when the number
of unfinished requests first drops to a threshold on a geometric grid (``oracle_per_octave`` points per
halving, plus the steps at which the adaptive run switched). Without a batch limit the set of unfinished
requests at a step does not depend on the layout, so a chain's latency is the sum of independent phases:
one simulation per (grid step, layout) — starting there, balanced by true remaining length — gives the
elapsed time to every later grid step, and a dynamic programme over (grid step, layout) finds the best
chain exactly. At step 0 the oracle may also deal requests balanced by their true lengths (no cost: nothing
is placed yet). The chosen chain is then replayed from step 0 with the normal simulator.

``balance="count"`` gives the best chain for a policy blind to lengths: every switch deals the requests by
count (index order), and the start is dealt round-robin. The gap between the two oracles is the value of
knowing lengths when placing requests, which no predictor-guided policy has in a synchronous rollout
(every unfinished request then has the same predicted remaining length).

The result is the minimum of that replay and of every other policy's result passed in (static layouts are
chains without switches; the adaptive run is a chain the grid may miss, and it balances by *predicted*
work), so the oracle is never slower than any policy it is compared with; ``detail`` says which won.
"""

from __future__ import annotations

import numpy as np

from rollout_profiler.planning.planner import switch_cost
from rollout_profiler.sim.simulator import ScheduleController, SimResult, Simulator


def _grid_steps(sim: Simulator, extra: list[int]) -> list[int]:
    srt = np.sort(sim.lengths)
    n, per = srt.size, max(1, sim.cfg.oracle_per_octave)
    steps = set(extra)
    i = 1
    while True:
        left = round(n * 2 ** (-i / per))
        if left < 1:
            break
        steps.add(int(srt[n - left - 1]) if n - left - 1 >= 0 else 0)
        i += 1
    last = int(srt[-1])
    return sorted(s for s in steps if 0 < s < last)


Node = tuple[int, int]  # (grid index, layout index)


def oracle(sim: Simulator, others: list[SimResult], balance: str = "length") -> SimResult:
    """``balance="count"``: switches deal requests by count only, as a policy blind to lengths must."""
    layouts = sorted(sim.candidates(), key=lambda lay: lay.tp)
    adaptive_steps = [r.step for o in others for r in o.reconfigs]
    grid = [0] if sim.cfg.max_batch_per_replica is not None else [0, *_grid_steps(sim, adaptive_steps)]
    marks = tuple(grid[1:])
    prof = sim.model.profile
    tokens = [float((sim.prompt[sim.lengths > s] + s).sum()) for s in grid]
    best: dict[Node, tuple[float, Node | None]] = {}

    def value(li: int, to_mark: dict[int, float], total: float, after: int) -> tuple[float, Node | None]:
        """Best continuation of a phase in layouts[li]: run to the end, or switch at a later grid step."""
        out: tuple[float, Node | None] = (total, None)
        for j in range(after + 1, len(grid)):
            if grid[j] not in to_mark:
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
                v = to_mark[grid[j]] + c + best[(j, lj)][0]
                if v < out[0]:
                    out = (v, (j, lj))
        return out

    for i in range(len(grid) - 1, 0, -1):  # phases entered by a switch at grid[i]
        for li in range(1, len(layouts)):
            key = sim.lengths - grid[i] if balance == "length" else np.zeros_like(sim.lengths)
            r = sim.run(layouts[li], name="phase", start_step=grid[i], work=key, marks=marks)
            best[(i, li)] = value(li, r.marks, r.latency_s * 1e3, i)
    starts = []  # at step 0: each layout, requests dealt round-robin (as static) or balanced by length
    works: tuple[np.ndarray | None, ...] = (None, sim.lengths) if balance == "length" else (None,)
    for li, lay in enumerate(layouts):
        for work in works:
            r = sim.run(lay, name="phase", work=work, marks=marks)
            starts.append((value(li, r.marks, r.latency_s * 1e3, 0), li, work))
    (dp_ms, node), li0, work0 = min(starts, key=lambda x: x[0][0])
    schedule = []
    while node is not None:
        schedule.append((grid[node[0]], layouts[node[1]]))
        node = best[node][1]
    ctl = ScheduleController(schedule, balance=balance) if schedule else None
    replay = sim.run(layouts[li0], name="oracle", work=work0, controller=ctl)
    chain = " -> ".join([str(layouts[li0]), *(f"{lay}@{s}" for s, lay in schedule)])
    dealt = "dealt" if work0 is None else "balanced"
    replay.detail = f"dp chain {chain}, start {dealt} (dp {dp_ms / 1e3:.2f} s, {len(grid)} grid steps)"
    winner = min([replay, *others], key=lambda r: r.latency_s)
    if winner is replay:
        return replay
    return SimResult(
        "oracle",
        winner.latency_s,
        winner.gpu_busy,
        list(winner.reconfigs),
        list(winner.timeline),
        f"schedule of {winner.policy} (dp chain {chain}: {replay.latency_s:.2f} s)",
    )
