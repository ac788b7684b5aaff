"""Reconfiguration planner: when to switch the pod's layout and to which one. Pure functions, no I/O.

Prediction. From the snapshot's running requests (and waiting ones, as if admitted now with nothing generated)
and the fitted :class:`~rollout_profiler.planning.predictor.LengthPredictor`, the expected number of requests
still running ``k`` steps ahead is ``n(k) = sum_i S(g_i + k) / S(g_i)`` (0 once ``g_i + k`` reaches the cap),
and their mean context grows by one token per step. Requests are grouped by (generated // w, cap), w = 16
tokens (wider when lengths spread over more than 64 bins) so the cost does not grow with the requests.
``k`` runs over ``policy.chunks`` equal chunks up to the longest possible remaining length. Replicas step
independently and the pod is done when its slowest replica is, so per chunk:

* the current layout keeps its requests where they are: its busiest replica, ``b = max_r n_r(k)``;
* a layout switched to is balanced by remaining work at the switch, after which its replicas drift apart
  as requests finish: ``b`` = the expected busiest of ``D`` binomial shares of the survivors
  (``n(k) / D + z_D sqrt(n(0) / D x p (1 - p))``, ``p = n(k) / n(0)``);

and a replica that holds ``b`` requests but can run only ``b_max`` of them at once (``max_batch_per_replica``;
its KV tokens over what a request takes: prompt + max_new_tokens reserved under the ``engine`` admission
policy, the mean context under ``sglang``) runs them in ``b / b_max`` turns: step =
``step_ms(min(b, b_max), ctx(k)) x max(1, b / b_max)``, so waiting requests and memory limits are priced
(batches are floored at 1 and the step scaled by ``min(1, n(k))``, the chance that anything still runs).
A chunk's time is its length x the step at its midpoint (so a drop at the cap, at the last boundary,
is not halved); switch costs use the KV tokens at the boundaries.

Start. :func:`choose_start` picks the layout to start a rollout in (``initialLayout: auto``): the candidate
whose plan, from all requests waiting, is the cheapest.

Plan. A dynamic programme over (chunk boundary, layout) finds the cheapest schedule of switches (a chain,
e.g. 8x1 -> 4x2 -> 1x8; growing TP only unless ``allow_shrink``). ``forward_plan`` returns its switches as
triggers "when unfinished <= n, switch to L with method M".

Decision. Switch now only if the plan's first move is at chunk 0 *and*
``gain > cost * (1 + margin) + min_gain_ms``, where ``gain`` = predicted remaining time if the current layout
is kept to the end minus the plan's remaining time after switching (later switch costs included), and
``cost`` the switch's cost. Nothing happens while a rank is not ready or within the cooldown.

Switch cost: :func:`switch_cost`, i.e. the one cost model of :mod:`rollout_worker.scheduling.costs` that the
engine
uses too, with the moved KV bytes estimated by :func:`~rollout_worker.scheduling.costs.estimated_moved_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rollout_worker.api.plan import Trigger
from rollout_worker.errors import UserError
from rollout_worker.scheduling.costs import METHODS, CostModel, KVMethod, estimated_moved_bytes
from rollout_worker.scheduling.layout import Layout

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


# How a replica admits requests into its KV memory: "engine", the pre-paged engine's rule (prompt +
# max_new_tokens reserved); "sglang", tokens used, the newest preempted; "paged", the engine's paged pool
# (scheduling/admission: optimistic admission, the fewest-decoded retracted). The planner prices "sglang" and
# "paged" alike, by the tokens held.
ADMISSIONS = ("engine", "sglang", "paged")


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
    kv_tokens_per_replica: tuple[tuple[int, int], ...] = ()  # (TP size, KV tokens); absent: unlimited
    admission: str = "paged"  # one of ADMISSIONS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"must be one of {METHODS}, got {self.method!r}", "method")
        if self.margin < 0 or self.min_gain_ms < 0 or self.chunks < 1:
            raise UserError("margin, min_gain_ms must be >= 0 and chunks >= 1", "planner")
        if self.admission not in ADMISSIONS:
            raise UserError(f"must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}", "admission")


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


def _model(p: Profile | LatencyModel) -> LatencyModel:
    return p if isinstance(p, LatencyModel) else LatencyModel(p)


_Curves = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]


def _curves(snap: PodSnapshot, pred: LengthPredictor, chunks: int) -> _Curves:
    """Boundaries k (M+1) with n_tot and KV tokens there; n_tot, max_r n_r, mean context at midpoints; the
    mean tokens an unfinished request reserves (prompt + max_new_tokens)."""
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
    reserved = float((ctx0 - gen + cap).mean())  # prompt + max_new_tokens, per unfinished request
    return k, n_all[: k.size], tokens[: k.size], n_all[k.size :], n_max, ctx, reserved


# Expected maximum of D independent standard normal variables (D = 1, 2, 3, 4, 8, 16).
_MAX_Z = {1: 0.0, 2: 0.5642, 3: 0.8463, 4: 1.0294, 8: 1.4236, 16: 1.7660}


def _busiest(n: np.ndarray, n0: float, replicas: int) -> np.ndarray:
    """Requests left on the busiest of ``replicas`` replicas that shared ``n0`` requests evenly when ``n``
    are left in all: each request survives independently, so a replica's survivors are binomial and the
    busiest holds about ``n / D + z_D sqrt(n0 / D x p (1 - p))`` with ``p = n / n0``."""
    if replicas <= 1 or n0 <= 0:
        return n / max(replicas, 1)
    z = _MAX_Z.get(replicas, float(np.sqrt(2 * np.log(replicas))) * 0.8)
    p = np.clip(n / n0, 0.0, 1.0)
    return n / replicas + z * np.sqrt(n0 / replicas * p * (1 - p))


def _batch_limit(policy: PlannerPolicy, lay: Layout, ctx: np.ndarray, reserved: float) -> np.ndarray:
    """Requests one replica of ``lay`` can run at once, per chunk midpoint (inf: no limit)."""
    limit = np.full(ctx.shape, float(policy.max_batch_per_replica or np.inf))
    tokens = dict(policy.kv_tokens_per_replica).get(lay.tp)
    if tokens is not None:
        per_request = np.full(ctx.shape, reserved) if policy.admission == "engine" else ctx
        limit = np.minimum(limit, np.maximum(tokens / np.maximum(per_request, 1.0), 1.0))
    return limit


def _plan(model: LatencyModel, snap: PodSnapshot, policy: PlannerPolicy, pred: LengthPredictor) -> _Plan:
    prof = model.profile
    kvb, kvh = prof.model.kv_bytes_per_token(prof.dtype_bytes), prof.model.num_kv_heads
    k, n_tot, tokens, n_mid, n_max, ctx, reserved = _curves(snap, pred, policy.chunks)
    world = snap.layout.world
    cands = [c for c in policy.candidates if c.world == world]
    if not policy.allow_shrink:  # states a growing chain can never reach are left out
        cands = [c for c in cands if c.tp > snap.layout.tp]
    states = [snap.layout, *cands]
    alive = np.minimum(n_mid, 1.0)
    dk = np.diff(k)
    chunk: list[list[float]] = []
    for s, lay in enumerate(states):
        b = np.maximum(n_max if s == 0 else _busiest(n_mid, float(n_tot[0]), lay.replicas), 1.0)
        limit = _batch_limit(policy, lay, ctx, reserved)
        turns = np.maximum(b / limit, 1.0)
        chunk.append((dk * model.step_ms_many(lay, np.minimum(b, limit), ctx) * turns * alive).tolist())
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


def choose_start(
    profile_or_model: Profile | LatencyModel,
    snapshot: PodSnapshot,
    policy: PlannerPolicy,
    predictor: LengthPredictor,
) -> Layout:
    """The layout to start in (``initialLayout: auto``): for each candidate, the predicted time of its best
    plan with every request of ``snapshot`` (e.g. all waiting) dealt over its replicas; the cheapest wins.
    Ties go to the smaller TP size."""
    model = _model(profile_or_model)
    reps = snapshot.replicas
    prompt = np.concatenate([r.prompt_len for r in reps])
    gen = np.concatenate([r.generated for r in reps])
    cap = np.concatenate([r.cap for r in reps])
    waiting = sum(r.waiting for r in reps)
    best: tuple[float, int, Layout] | None = None
    for lay in sorted(policy.candidates, key=lambda c: c.tp):
        idx = [np.arange(d, gen.size, lay.replicas) for d in range(lay.replicas)]
        dealt = tuple(
            ReplicaState(prompt[ix], gen[ix], cap[ix], waiting // lay.replicas + (d < waiting % lay.replicas))
            for d, ix in enumerate(idx)
        )
        snap = PodSnapshot(lay, dealt, (True,) * lay.world, snapshot.step, snapshot.time_s,
                           snapshot.waiting_prompt_len, snapshot.waiting_cap)  # fmt: skip
        if not any(len(r.generated) or r.waiting for r in dealt):
            return lay
        ms = _plan(model, snap, policy, predictor).w0[0]
        if best is None or ms < best[0]:
            best = (ms, lay.tp, lay)
    if best is None:
        raise UserError("no candidate layout", "candidates")
    return best[2]
