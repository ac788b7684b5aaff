"""Reconfiguration planner: when to switch the pod's layout and to which one. Pure functions, no I/O.

Prediction. From the snapshot's running requests (and waiting ones, as if admitted now with nothing generated)
and the fitted :class:`~rollout_profiler.planning.predictor.LengthPredictor`, the expected number of requests
still running ``k`` steps ahead is ``n(k) = sum_i S(g_i + k) / S(g_i)`` (0 once ``g_i + k`` reaches the cap),
and their mean context grows by one token per step. Requests are grouped by (generated // w, cap), w = 16
tokens (wider when lengths spread over more than 64 bins) so the cost does not grow with the requests.
``k`` runs over ``policy.chunks`` equal chunks up to the longest possible remaining length. The pod runs in
lockstep, one step = the slowest replica:

* the current layout keeps its requests where they are: step = ``step_ms(max_r n_r(k), ctx(k))``;
* a layout switched to is balanced by remaining work: step = ``step_ms(n(k) / D, ctx(k))``;

(batches are floored at 1 and the step scaled by ``min(1, n(k))``, the chance that anything still runs).
A chunk's time is its length x the step at its midpoint (so a drop at the cap, at the last boundary,
is not halved); switch costs use the KV tokens at the boundaries.

Plan. A dynamic programme over (chunk boundary, layout) finds the cheapest schedule of switches (a chain,
e.g. 8x1 -> 4x2 -> 1x8; growing TP only unless ``allow_shrink``). ``forward_plan`` returns its switches as
triggers "when unfinished <= n, switch to L with method M".

Decision. Switch now only if the plan's first move is at chunk 0 *and*
``gain > cost * (1 + margin) + min_gain_ms``, where ``gain`` = predicted remaining time if the current layout
is kept to the end minus the plan's remaining time after switching (later switch costs included), and
``cost`` the switch's cost. Nothing happens while a rank is not ready or within the cooldown.

Switch cost: :func:`switch_cost`, i.e. the one cost model of :mod:`rollout_worker.api.costs` that the engine
uses too, with the moved KV bytes estimated by :func:`~rollout_worker.api.costs.estimated_moved_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rollout_worker.api.costs import METHODS, CostModel, KVMethod, estimated_moved_bytes
from rollout_worker.api.errors import UserError
from rollout_worker.api.layout import Layout
from rollout_worker.api.plan import Trigger

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.predictor import LengthPredictor
from rollout_profiler.profile import Profile

_GEN_BIN = 16  # requests whose generated lengths differ by less than this are predicted alike
_MAX_GEN_BINS = 64  # ... and at most this many such bins (wider bins when lengths are spread out)


@dataclass(frozen=True, slots=True)
class ReplicaState:
    prompt_len: np.ndarray  # per running request
    generated: np.ndarray
    cap: np.ndarray  # max_new_tokens
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class PodSnapshot:
    layout: Layout
    replicas: tuple[ReplicaState, ...]
    ready: tuple[bool, ...]  # per rank
    step: int = 0
    time_s: float = 0.0
    waiting_prompt_len: int = 256  # assumed for waiting requests
    waiting_cap: int | None = None  # assumed for waiting requests (default: the largest running cap)


@dataclass(frozen=True, slots=True)
class PlannerPolicy:
    candidates: tuple[Layout, ...]
    margin: float = 0.1
    min_gain_ms: float = 50.0
    cooldown_s: float = 0.0
    cooldown_steps: int = 0
    method: str = "auto"
    allow_shrink: bool = False
    max_batch_per_replica: int | None = None
    chunks: int = 32

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"planner method must be one of {METHODS}, got {self.method!r}")
        if self.margin < 0 or self.min_gain_ms < 0 or self.chunks < 1:
            raise UserError("planner margin, min_gain_ms must be >= 0 and chunks >= 1")


@dataclass(frozen=True, slots=True)
class LastSwitch:
    step: int
    time_s: float


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
    moved = estimated_moved_bytes(tokens, kv_bytes_per_token, num_kv_heads, src.tp, dst.tp)
    choice = costs.choose(method, moved, tokens)
    return choice.method, costs.base_ms(src.tp, dst.tp) + choice.ms


def _cost_row(
    costs: CostModel, kvb: int, kvh: int, src: Layout, dst: Layout, tokens: np.ndarray, method: str
) -> tuple[list[float], np.ndarray]:
    """:func:`switch_cost` for many token counts: (ms as floats, True where migrate is used)."""
    mig, rec = costs.kv_ms(estimated_moved_bytes(tokens, kvb, kvh, src.tp, dst.tp), tokens)
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


def _model(p: Profile | LatencyModel) -> LatencyModel:
    return p if isinstance(p, LatencyModel) else LatencyModel(p)


def _curves(snap: PodSnapshot, pred: LengthPredictor, chunks: int) -> tuple[np.ndarray, ...]:
    """Boundaries k (M+1) with n_tot and KV tokens there; n_tot, max_r n_r, mean context at midpoints."""
    reps = snap.replicas
    counts = [len(r.generated) for r in reps]
    gen = np.concatenate([r.generated for r in reps] + [np.zeros(r.waiting) for r in reps]).astype(float)
    running_caps = [r.cap for r in reps if len(r.cap)]
    wcap = snap.waiting_cap or (max(int(c.max()) for c in running_caps) if running_caps else int(pred.x[-1]))
    cap = np.concatenate([r.cap for r in reps] + [np.full(r.waiting, wcap) for r in reps]).astype(float)
    ctx0 = gen + np.concatenate(
        [r.prompt_len for r in reps] + [np.full(r.waiting, snap.waiting_prompt_len) for r in reps]
    )
    rep = np.concatenate(
        [np.repeat(np.arange(len(reps)), counts), np.repeat(np.arange(len(reps)), [r.waiting for r in reps])]
    )
    width = max(_GEN_BIN, int(np.ptp(gen)) // _MAX_GEN_BINS + 1)
    keys, inv = np.unique((gen // width) * 4_194_304 + cap, return_inverse=True)
    n_g = keys.size
    size = np.bincount(inv, minlength=n_g).astype(float)
    g_grp = np.bincount(inv, weights=gen, minlength=n_g) / size
    cap_grp = keys % 4_194_304
    k = np.linspace(0.0, float(max((cap - gen).max(), 1.0)), chunks + 1)
    pts = np.concatenate([k, (k[1:] + k[:-1]) / 2])
    cs = pred.cond_survival(g_grp, cap_grp, pts)  # (groups, 2M+1): boundaries, then midpoints
    per_rep = np.bincount(rep * n_g + inv, minlength=len(reps) * n_g).reshape(len(reps), n_g).astype(float)
    n_max = (per_rep @ cs[:, k.size :]).max(axis=0)
    n_all = size @ cs
    tokens = np.bincount(inv, weights=ctx0, minlength=n_g) @ cs + pts * n_all
    ctx = tokens[k.size :] / np.maximum(n_all[k.size :], 1e-9)
    return k, n_all[: k.size], tokens[: k.size], n_all[k.size :], n_max, ctx


def _plan(model: LatencyModel, snap: PodSnapshot, policy: PlannerPolicy, pred: LengthPredictor) -> _Plan:
    prof = model.profile
    kvb, kvh = prof.model.kv_bytes_per_token(prof.dtype_bytes), prof.model.num_kv_heads
    k, n_tot, tokens, n_mid, n_max, ctx = _curves(snap, pred, policy.chunks)
    world = snap.layout.world
    total_now = float(n_tot[0])
    mb = policy.max_batch_per_replica
    cands = [
        c for c in policy.candidates if c.world == world and (mb is None or total_now / c.replicas <= mb)
    ]
    if not policy.allow_shrink:  # states a growing chain can never reach are left out
        cands = [c for c in cands if c.tp > snap.layout.tp]
    states = [snap.layout, *cands]
    alive = np.minimum(n_mid, 1.0)
    dk = np.diff(k)
    chunk: list[list[float]] = []
    for s, lay in enumerate(states):
        b = np.maximum(n_max if s == 0 else n_mid / lay.replicas, 1.0)
        chunk.append((dk * model.step_ms_many(lay, b, ctx) * alive).tolist())
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
    triggers, s = [], 0
    for j in range(m):
        t = choice[j][s]
        if t:
            ms, mig = cost[(s, t)]
            meth: KVMethod = "migrate" if mig[j] else "recompute"
            triggers.append(
                Trigger(
                    unfinished_at_most=round(float(n_tot[j])),
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
        if steps < policy.cooldown_steps or secs < policy.cooldown_s:
            why = f"{steps} steps" if steps < policy.cooldown_steps else f"{secs:.1f} s"
            return Decision("keep", cur, None, 0.0, 0.0, f"cooldown: {why} since switch")
    if not any(len(r.generated) or r.waiting for r in snapshot.replicas):
        return Decision("keep", cur, None, 0.0, 0.0, "no unfinished requests")
    plan = _plan(_model(profile_or_model), snapshot, policy, predictor)
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
    need = cost * (1 + policy.margin) + policy.min_gain_ms
    target = plan.states[t]
    if gain <= need:
        why = (
            f"gain {gain:.0f} ms of {cur}->{target} <= cost {cost:.0f} ms x (1+{policy.margin:g})"
            f" + {policy.min_gain_ms:g}"
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
    if not any(len(r.generated) or r.waiting for r in snapshot.replicas):
        return []
    return _plan(_model(profile_or_model), snapshot, policy, predictor).triggers
