"""Reconfiguration planner: when to switch the pod's layout and to which one. Pure functions, no I/O.

Prediction: :mod:`rollout_profiler.planning.forecast` (each layout's time per chunk of the horizon); the
planner's inputs: :mod:`rollout_profiler.planning.policy`.

Start. :func:`choose_start` picks the layout to start a rollout in (``initialLayout: auto``): the candidate
whose plan, from all requests waiting, is the cheapest.

Plan. A dynamic programme over (chunk boundary, layout) finds the cheapest schedule of switches (a chain,
e.g. 8x1 -> 4x2 -> 1x8; growing TP only unless ``allow_shrink``). ``forward_plan`` returns its switches as
triggers "when unfinished <= n, switch to L with method M".

Decision. Switch now only if the plan's first move is at chunk 0 *and*
``gain > cost * (1 + margin) + max(min_gain_ms, min_gain_fraction * time left)``, where ``gain`` = predicted
remaining time if the current layout is kept to the end (``time left``) minus the plan's remaining time after
switching (later switch costs included), and ``cost`` the switch's cost. Nothing happens while a rank is not
ready or within the cooldown (by default ten times the last switch's duration).

Switch cost: :func:`switch_cost`, i.e. the one cost model of :mod:`rollout_worker.scheduling.costs` that the
engine uses too, with the moved KV bytes estimated by
:func:`~rollout_worker.scheduling.costs.estimated_moved_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rollout_worker.api.plan import Trigger
from rollout_worker.errors import UserError
from rollout_worker.scheduling.costs import CostModel, KVMethod, estimated_moved_bytes
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.planning.forecast import as_model, chunks
from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import LastSwitch, PlannerPolicy, PodSnapshot, ReplicaState
from rollout_profiler.planning.predictor import LengthPredictor
from rollout_profiler.profile import Profile

ForwardPlan = list[Trigger]


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # "keep" | "switch"
    target: Layout
    method: str | None
    predicted_gain_ms: float
    predicted_cost_ms: float
    reason: str
    plan: tuple[Trigger, ...] = field(default=())


def switch_cost(
    costs: CostModel,
    kv_bytes_per_token: int,
    num_kv_heads: int,
    src: Layout,
    dst: Layout,
    tokens: float,
    method: str,
) -> tuple[str, float]:
    """(method used, ms) of switching ``src -> dst`` with ``tokens`` KV tokens unfinished."""
    moved = estimated_moved_bytes(tokens, kv_bytes_per_token, num_kv_heads, src, dst)
    choice = costs.choose(method, moved, tokens)
    return choice.method, costs.base_ms(src.tp, dst.tp) + choice.ms


def _cost_row(
    costs: CostModel, kvb: int, kvh: int, src: Layout, dst: Layout, tokens: np.ndarray, method: str
) -> tuple[list[float], np.ndarray]:
    """:func:`switch_cost` for many token counts: (ms as floats, True where migrate is used)."""
    mig, rec = costs.kv_ms(estimated_moved_bytes(tokens, kvb, kvh, src, dst), tokens)
    use_mig = np.full(tokens.shape, method == "migrate") if method != "auto" else mig <= rec
    return (costs.base_ms(src.tp, dst.tp) + np.where(use_mig, mig, rec)).tolist(), use_mig


@dataclass(slots=True)
class _Plan:
    states: list[Layout]  # states[0] = current layout, unbalanced; others balanced candidates
    keep_ms: float
    w0: list[float]  # value of being in state s at boundary 0 without switching there
    cost0: list[tuple[str, float]]
    triggers: list[Trigger]
    first: int  # state switched to at boundary 0, or 0 (stay)


def _plan(model: LatencyModel, snap: PodSnapshot, policy: PlannerPolicy, pred: LengthPredictor) -> _Plan:
    prof = model.profile
    kvb, kvh = prof.model.kv_bytes_per_token(prof.dtype_bytes), prof.model.num_kv_heads
    ch = chunks(model, snap, policy, pred)
    states, k, n_tot, tokens, chunk = ch.states, ch.k, ch.n_tot, ch.tokens, ch.ms
    dk = np.diff(k)
    shrink = policy.allow_shrink
    allowed = [
        [t for t in range(1, len(states)) if states[t] != src and (shrink or states[t].tp > src.tp)]
        for src in states
    ]
    cost = {
        (s, t): _cost_row(prof.costs, kvb, kvh, states[s], states[t], tokens, policy.method)
        for s in range(len(states))
        for t in allowed[s]
    }
    edges = [[(t, cost[(s, t)][0]) for t in allowed[s]] for s in range(len(states))]
    n_s, m = len(states), len(dk)
    v = [0.0] * n_s
    choice = [[0] * n_s for _ in range(m)]
    w: list[float] = v
    for j in range(m - 1, -1, -1):
        w = [chunk[s][j] + v[s] for s in range(n_s)]
        nv = w[:]
        row = choice[j]
        for s in range(n_s):
            for t, ms in edges[s]:
                c = ms[j] + w[t]
                if c < nv[s]:
                    nv[s], row[s] = c, t
        v = nv
    triggers: list[Trigger] = []
    s = 0
    for j in range(m):
        t = choice[j][s]
        at_most = round(float(n_tot[j]))
        if t and triggers and triggers[-1].unfinished_at_most == at_most:
            s = t  # a second switch at one threshold would never fire (Plan.fire): one per threshold
        elif t:
            ms, mig = cost[(s, t)]
            meth: KVMethod = "migrate" if mig[j] else "recompute"
            triggers.append(
                Trigger(
                    unfinished_at_most=at_most,
                    layout=states[t],
                    method=meth,
                    steps_ahead=round(float(k[j])),
                    cost_ms=ms[j],
                )
            )
            s = t
    cost0 = [("", 0.0)] * n_s
    for t in allowed[0]:
        ms, mig = cost[(0, t)]
        cost0[t] = ("migrate" if mig[0] else "recompute", ms[0])
    return _Plan(states, float(sum(chunk[0])), w, cost0, triggers, choice[0][0])


def decide(
    profile_or_model: Profile | LatencyModel,
    snapshot: PodSnapshot,
    policy: PlannerPolicy,
    predictor: LengthPredictor,
    last_switch: LastSwitch | None = None,
) -> Decision:
    """Keep or switch now (module docstring). Pass a LatencyModel: building one from a Profile is slower."""
    cur = snapshot.layout
    not_ready = [r for r, ok in enumerate(snapshot.ready) if not ok]
    if not_ready:
        return Decision("keep", cur, None, 0.0, 0.0, f"ranks not ready: {not_ready}")
    if last_switch is not None:
        steps, secs = snapshot.step - last_switch.step, snapshot.time_s - last_switch.time_s
        if steps < policy.cooldown_steps or secs < last_switch.cooldown_s(policy):
            why = f"{steps} steps" if steps < policy.cooldown_steps else f"{secs:.1f} s"
            return Decision("keep", cur, None, 0.0, 0.0, f"cooldown: {why} since switch")
    if not any(r.unfinished for r in snapshot.replicas):
        return Decision("keep", cur, None, 0.0, 0.0, "no unfinished requests")
    plan = _plan(as_model(profile_or_model), snapshot, policy, predictor)
    trig = tuple(plan.triggers)
    if not plan.first:
        if trig:
            return Decision(
                "keep", cur, None, 0.0, 0.0, f"plan: {trig[0]} in ~{trig[0].steps_ahead} steps", trig
            )
        alts = [t for t, (m, _) in enumerate(plan.cost0) if m]
        if not alts:
            return Decision("keep", cur, None, 0.0, 0.0, "no candidate layout to switch to", trig)
        t = min(alts, key=lambda a: plan.w0[a] + plan.cost0[a][1])
        gain, cost = plan.keep_ms - plan.w0[t], plan.cost0[t][1]
        why = f"best switch {cur}->{plan.states[t]}: gain {gain:.0f} ms <= cost {cost:.0f} ms"
        return Decision("keep", cur, None, gain, cost, why, trig)
    t = plan.first
    meth, cost = plan.cost0[t]
    gain = plan.keep_ms - plan.w0[t]
    floor = max(policy.min_gain_ms, policy.min_gain_fraction * plan.keep_ms)
    need = cost * (1 + policy.margin) + floor
    target = plan.states[t]
    if gain <= need:
        why = (
            f"gain {gain:.0f} ms of {cur}->{target} <= cost {cost:.0f} ms x (1+{policy.margin:g})"
            f" + {floor:.0f}"
        )
        return Decision("keep", cur, None, gain, cost, why, trig)
    return Decision(
        "switch",
        target,
        meth,
        gain,
        cost,
        f"{cur}->{target} ({meth}): gain {gain:.0f} ms > {need:.0f} ms",
        trig,
    )


def forward_plan(
    profile_or_model: Profile | LatencyModel,
    snapshot: PodSnapshot,
    policy: PlannerPolicy,
    predictor: LengthPredictor,
) -> ForwardPlan:
    """The predicted schedule of switches from now on (hysteresis and cooldown not applied)."""
    if not any(r.unfinished for r in snapshot.replicas):
        return []
    return _plan(as_model(profile_or_model), snapshot, policy, predictor).triggers


def choose_start(
    profile_or_model: Profile | LatencyModel,
    snapshot: PodSnapshot,
    policy: PlannerPolicy,
    predictor: LengthPredictor,
) -> Layout:
    """The layout to start in (``initialLayout: auto``): for each candidate, the predicted time of its best
    plan with every request of ``snapshot`` (e.g. all waiting) dealt over its replicas; the cheapest wins.
    Ties go to the smaller TP size."""
    model = as_model(profile_or_model)
    reps = snapshot.replicas

    def pooled(field: str) -> np.ndarray:
        return np.concatenate([getattr(r, field) for r in reps])

    prompt, gen, cap = pooled("prompt_len"), pooled("generated"), pooled("cap")
    w_prompt, w_gen, w_cap = pooled("wait_prompt_len"), pooled("wait_generated"), pooled("wait_cap")
    waiting = sum(r.waiting for r in reps)
    best: tuple[float, int, Layout] | None = None
    for lay in sorted(policy.candidates, key=lambda c: c.tp):
        n = lay.replicas
        dealt = tuple(
            ReplicaState(
                prompt[d::n],
                gen[d::n],
                cap[d::n],
                waiting // n + (d < waiting % n),
                w_prompt[d::n],
                w_gen[d::n],
                w_cap[d::n],
            )
            for d in range(n)
        )
        snap = PodSnapshot(lay, dealt, (True,) * lay.world, snapshot.step, snapshot.time_s,
                           snapshot.waiting_prompt_len, snapshot.waiting_cap)  # fmt: skip
        if not any(r.unfinished for r in dealt):
            return lay
        ms = _plan(model, snap, policy, predictor).w0[0]
        if best is None or ms < best[0]:
            best = (ms, lay.tp, lay)
    if best is None:
        raise UserError("no candidate layout", "candidates")
    return best[2]
