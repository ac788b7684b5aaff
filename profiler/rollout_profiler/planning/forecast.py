"""What each layout would take: the planner's prediction of the time to finish a pod's unfinished requests,
chunk by chunk, in the layout it is in and in each layout it may switch to (:func:`finish_ms`; the
planner's dynamic programme prices chains of switches with :func:`chunks`). Pure functions.

From the snapshot's running and waiting requests (a waiting one with the tokens it generated before a
retraction or a switch; one known by number only as fresh) and the fitted
:class:`~rollout_profiler.planning.predictor.LengthPredictor`, the expected number of requests still running
``k`` steps ahead is ``n(k) = sum_i S(g_i + k) / S(g_i)`` (0 once ``g_i + k`` reaches the cap), and their
mean context grows by one token per step. Requests are grouped by (generated // w, cap), w = 16 tokens
(wider when lengths spread over more than 64 bins) so the cost does not grow with the requests. ``k`` runs
over ``policy.chunks`` equal chunks up to the longest possible remaining length. Replicas step
independently and the pod is done when its slowest replica is, so per chunk:

* the current layout keeps its requests where they are: its busiest replica, ``b = max_r n_r(k)``;
* a layout switched to is balanced by remaining work at the switch, after which its replicas drift apart
  as requests finish: ``b`` = the expected busiest of ``D`` binomial shares of the survivors
  (``n(k) / D + z_D sqrt(n(0) / D x p (1 - p))``, ``p = n(k) / n(0)``).

Memory: under the ``paged`` admission (the engine's), :func:`_paged_ms`; under ``engine`` and ``sglang``, a
replica that holds ``b`` requests but can run only ``b_max`` at once (``max_batch_per_replica``; its KV
tokens over what a request takes: prompt + max_new_tokens under ``engine``, the mean context under
``sglang``) runs them in ``b / b_max`` turns. Batches are floored at 1 and the step scaled by
``min(1, n(k))``, the chance that anything still runs. A chunk's time is its length x the step at its
midpoint (so a drop at the cap, at the last boundary, is not halved). The waiting requests' prefills are
added at the pod's prefill rate, the same in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rollout_worker.scheduling.admission import CLIP_MAX_NEW_TOKENS
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.planning.latency import LatencyModel
from rollout_profiler.planning.policy import PlannerPolicy, PodSnapshot
from rollout_profiler.planning.predictor import LengthPredictor
from rollout_profiler.profile import Profile

_GEN_BIN = 16  # requests whose generated lengths differ by less than this are predicted alike
_MAX_GEN_BINS = 64  # ... and at most this many such bins (wider bins when lengths are spread out)


def as_model(p: Profile | LatencyModel) -> LatencyModel:
    return p if isinstance(p, LatencyModel) else LatencyModel(p)


@dataclass(frozen=True, slots=True)
class _Curves:
    """The unfinished requests' expected course, ``k`` steps ahead of now for each of them (lockstep)."""

    k: np.ndarray  # chunk boundaries (M + 1)
    n_tot: np.ndarray  # unfinished at the boundaries
    tokens: np.ndarray  # their KV tokens at the boundaries
    n_mid: np.ndarray  # unfinished at the chunk midpoints (M)
    n_max: np.ndarray  # ... on the current layout's busiest replica
    ctx: np.ndarray  # their mean context at the midpoints
    grow: np.ndarray  # their mean clipped remaining (min(max_new_tokens - generated, CLIP)) at the midpoints
    reserved: float  # the mean tokens an unfinished request reserves (prompt + max_new_tokens)
    prefill: float  # tokens the waiting requests' prefills compute (prompt + tokens generated before)
    dk: np.ndarray  # chunk lengths
    weights: np.ndarray  # rows 1, ctx, grow: what a chunk's work is weighted by (:func:`_paged_ms`)


def _curves(snap: PodSnapshot, pred: LengthPredictor, chunks: int) -> _Curves:
    """:class:`_Curves` of a snapshot, requests grouped by (generated // w, cap)."""
    reps = snap.replicas
    run, wait = [r.generated for r in reps], [r.wait_generated for r in reps]
    caps = [r.cap for r in reps] + [r.wait_cap for r in reps]
    known = [int(c.max()) for c in caps if c.size]
    wcap = snap.waiting_cap or (max(known) if known else int(pred.x[-1]))
    anon = sum(r.waiting for r in reps)  # waiting requests known by number only
    gen = np.concatenate([*run, *wait, np.zeros(anon)])
    cap = np.concatenate([*caps, np.full(anon, float(wcap))])
    prompts = [r.prompt_len for r in reps] + [r.wait_prompt_len for r in reps]
    ctx0 = gen + np.concatenate([*prompts, np.full(anon, float(snap.waiting_prompt_len))])
    ids = np.arange(len(reps))
    rep = np.concatenate([np.repeat(ids, [x.size for x in run]), np.repeat(ids, [x.size for x in wait]),
                          np.repeat(ids, [r.waiting for r in reps])])  # fmt: skip
    first = sum(x.size for x in run)  # the waiting ones from here on: what their (re-)prefills compute
    prefill = float((ctx0[first:] - np.minimum(gen[first:], 1.0)).sum())
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
    mid = k.size
    ctx = tokens[mid:] / np.maximum(n_all[mid:], 1e-9)
    clip = np.clip(cap_grp[:, None] - g_grp[:, None] - pts[None, mid:], 0.0, CLIP_MAX_NEW_TOKENS)
    grow = (size[:, None] * cs[:, mid:] * clip).sum(axis=0) / np.maximum(n_all[mid:], 1e-9)
    reserved = float((ctx0 - gen + cap).mean())  # prompt + max_new_tokens, per unfinished request
    weights = np.stack([np.ones(ctx.size), ctx, grow])
    return _Curves(
        k, n_all[:mid], tokens[:mid], n_all[mid:], n_max, ctx, grow, reserved, prefill, np.diff(k), weights
    )


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


@dataclass(slots=True)
class Chunks:
    states: list[Layout]  # states[0] = current layout, unbalanced; others balanced candidates
    k: np.ndarray  # chunk boundaries, in steps ahead
    n_tot: np.ndarray  # unfinished requests at the boundaries
    tokens: np.ndarray  # their KV tokens at the boundaries
    ms: list[list[float]]  # ms[s][j]: chunk j's time in state s


def chunks(model: LatencyModel, snap: PodSnapshot, policy: PlannerPolicy, pred: LengthPredictor) -> Chunks:
    """Each state's predicted time per chunk (module docstring)."""
    cv = _curves(snap, pred, policy.chunks)
    k, n_tot, n_mid, ctx = cv.k, cv.n_tot, cv.n_mid, cv.ctx
    world = snap.layout.world
    cands = [c for c in policy.candidates if c.world == world]
    if not policy.allow_shrink:  # states a growing chain can never reach are left out
        cands = [c for c in cands if c.tp > snap.layout.tp]
    states = [snap.layout, *cands]
    dk = cv.dk
    b = np.stack(
        [np.maximum(cv.n_max if s == 0 else _busiest(n_mid, float(n_tot[0]), lay.replicas), 1.0)
         for s, lay in enumerate(states)]
    )  # fmt: skip
    if policy.admission == "paged":
        kv = dict(policy.kv_tokens_per_replica)
        tokens = np.array([float(kv.get(lay.tp, np.inf)) for lay in states])
        ms = _paged_ms(model, states, b, cv, tokens, policy.max_batch_per_replica)
    else:
        ms = np.empty_like(b)
        for s, lay in enumerate(states):
            limit = _batch_limit(policy, lay, ctx, cv.reserved)
            turns = np.maximum(b[s] / limit, 1.0)
            ms[s] = dk * model.step_ms_many(lay, np.minimum(b[s], limit), ctx) * turns
    ms *= np.minimum(n_mid, 1.0)
    ms[:, 0] += cv.prefill / max(model.profile.costs.recompute_tokens_per_ms, 1e-12)  # the waiting
    return Chunks(states, k, n_tot, cv.tokens, ms.tolist())  # requests' prefills, at the pod's rate


def finish_ms(
    profile_or_model: Profile | LatencyModel,
    snapshot: PodSnapshot,
    policy: PlannerPolicy,
    predictor: LengthPredictor,
) -> dict[Layout, float]:
    """Predicted ms until every unfinished request of ``snapshot`` is done: in the current layout with its
    requests where they are, and in each other candidate of the pod switched to now and kept (balanced,
    the switch's own cost left out). What every decision rests on; checked against the simulator."""
    if not any(r.unfinished for r in snapshot.replicas):
        return {snapshot.layout: 0.0}
    c = chunks(as_model(profile_or_model), snapshot, policy, predictor)
    return {lay: float(sum(ms)) for lay, ms in zip(c.states, c.ms, strict=True)}


# The new-token ratio a replica under KV pressure admits with, on average over its cycle of retraction
# (ratio raised), admissions blocked, decay (rollout_worker.scheduling.admission); fitted on the simulator.
PRESSURE_RATIO = 0.3


def _paged_ms(
    model: LatencyModel,
    states: list[Layout],
    b: np.ndarray,
    cv: _Curves,
    tokens: np.ndarray,
    max_batch: int | None,
) -> np.ndarray:
    """Chunk times (states x chunks) of one replica of each state's layout holding ``b[s]`` (per chunk
    midpoint) of the requests under the paged pool's admission, ``tokens[s]`` KV tokens (inf: unlimited).

    While the requests left would not fit at once (each holding its context and reserving the ratio x its
    clipped remaining; at most ``max_batch``), the replica runs under pressure: its running batch is what
    fits, ``tokens / (c + ratio x grow)`` (at most ``max_batch``), at the context ``c`` of the work it
    does: the *work-weighted* mean context of the pressured chunks from each chunk on (a request holds a
    slot as long as it runs, so the long ones fill the batch), not the mean context of the requests left.
    Each chunk's time is the difference of those suffix times, so that switching in at any chunk and
    staying costs what the model says from there. After the pressure, all run at once."""
    dk, ctx, m = cv.dk, cv.ctx, cv.dk.size
    cap = float(max_batch or np.inf)
    over = (b * (ctx + PRESSURE_RATIO * cv.grow) > tokens[:, None]) | (b > cap)
    end = np.where(over.any(axis=1), m - np.argmax(over[:, ::-1], axis=1), 0)  # pressured: [0, end)
    pressed = np.arange(m) < end[:, None]
    work = dk * b * pressed
    w_suf, c, g = (
        (work[:, None, ::-1] * cv.weights[None, :, ::-1]).cumsum(axis=2)[:, :, ::-1].transpose(1, 0, 2)
    )
    w_safe = np.maximum(w_suf, 1e-12)
    c, g = np.where(pressed, c / w_safe, ctx), g / w_safe
    fits = np.minimum(tokens[:, None] / np.maximum(c + PRESSURE_RATIO * g, 1.0), cap)
    batch = np.where(pressed, np.clip(fits, 1.0, b), b)
    step = model.step_ms_layouts(states, batch, c)
    suffix = np.where(pressed, w_suf / batch * step, 0.0)  # the pressured time from each chunk on
    nxt = np.concatenate([suffix[:, 1:], np.zeros((len(states), 1))], axis=1)
    return np.where(pressed, np.maximum(suffix - nxt, 0.0), dk * step)
