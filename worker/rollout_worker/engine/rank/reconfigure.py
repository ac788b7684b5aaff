"""A reconfiguration on one rank, in lockstep with every other rank, all-or-nothing:
``reconfigure(state, target, ...) -> (new state, event, placements)``; the caller commits the new state.

Phases: (1) gather every replica's requests; (2) plan placements and pick the KV method with the shared
cost model (pure, identical on every rank); (3) reshard weights; (4) build the new KV cache by migration or
recompute; (5) vote. New weights and caches are built beside the old ones, so a failed vote (any rank
raised) returns the old state unchanged: no request is lost or altered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.model.weights import reshard
from rollout_worker.engine.rank.migration import (
    Placement,
    Transfer,
    Unfinished,
    kv_migration_plan,
    migrate_bytes,
    migrate_pages,
    place,
    recompute_tokens,
    shared_pages,
    transfer_bytes,
)
from rollout_worker.engine.rank.rank_state import RankState
from rollout_worker.engine.rank.replica import Replica
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.costs import Method
from rollout_worker.scheduling.layout import Layout

Placed = tuple[str, int, bool]  # (rid, new replica, running)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What an old replica's leader contributes: its requests (running in slot order, then waiting), its
    new-token ratio (the new replicas start from the highest, the most cautious) and its running requests
    whose K/V older weights computed (kept out of the new replicas' prefix caches too)."""

    running: list[tuple[RequestSpec, list[int]]]
    waiting: list[tuple[RequestSpec, list[int]]]
    step: int
    costs: Any  # CostModel of rank 0 decides for everyone
    pages: list[tuple[int, ...]]  # the running requests' page tables (equal pages: shared)
    ratio: float
    stale_kv: set[str]


def _snapshot(st: RankState) -> _Snapshot:
    rep = st.replica
    return _Snapshot(
        [(s.spec, list(s.output)) for s in rep.running],
        [(s.spec, list(s.output)) for s in rep.waiting],
        st.step,
        st.costs,
        [tuple(s.pages) for s in rep.running],
        rep.ratio,
        set(rep.stale_kv),
    )


def reconfigure(
    st: RankState, target: Layout, method: Method, reason: str
) -> tuple[RankState, ReconfigEvent, list[Placed]]:
    old = st.layout
    phases: dict[str, float] = {}
    t_all = t = time.perf_counter()
    gathered: list[Any] = [None] * st.cfg.world
    dist.all_gather_object(gathered, _snapshot(st) if st.is_leader else None)
    snaps: dict[int, _Snapshot] = {d: gathered[old.ranks_of(d)[0]] for d in range(old.replicas)}
    phases["sync_ms"] = _lap(t)

    t = time.perf_counter()
    reqs, outputs = _unfinished(snaps)
    eng = st.cfg.engine
    ratio = max(s.ratio for s in snaps.values())
    placements = place(reqs, target.replicas, eng.max_batch, eng.pool_pages, eng.page_size, ratio)
    shared = shared_pages(reqs, placements)
    transfers = kv_migration_plan(st.model, old, target, placements, eng.page_size, shared)
    elem = torch.empty((), dtype=st.dtype).element_size()
    moved = migrate_bytes(transfers, st.model, elem)
    tokens = recompute_tokens(placements, target.replicas)
    costs = snaps[0].costs
    choice = costs.choose(method, moved, tokens)
    phases["plan_ms"] = _lap(t)
    carried = [p for p in placements if p.dst_slot is not None]
    event = ReconfigEvent(
        step=max(s.step for s in snaps.values()),
        time_s=0.0,
        src=old,
        dst=target,
        requested=method,
        method=choice.method,
        reason=reason,
        requests_running=len(carried),
        requests_waiting=len(placements) - len(carried),
        requests_mid_decode=sum(1 for p in carried if outputs[p.id][1]),
        predicted_ms=round(costs.base_ms(old.tp, target.tp) + choice.ms, 3),
        predicted_migrate_ms=round(choice.migrate_ms, 3),
        predicted_recompute_ms=round(choice.recompute_ms, 3),
    )
    error: str | None = None
    new: RankState | None = None
    try:
        t = time.perf_counter()
        weights, wstats = reshard(st.weights, st.model, st.pstate(old), (old, target), st.rank)
        phases["reshard_ms"] = _lap(t)
        event.weights = wstats
        rep = st.make_replica(target, weights)
        rep.ratio = ratio
        _fill(st.rank, rep, target, placements, outputs)
        t = time.perf_counter()
        new_costs = costs
        if choice.method == "migrate":
            event.kv_bytes_moved, event.kv_pages_moved = moved, migrate_pages(transfers)
            stale = set().union(*(s.stale_kv for s in snaps.values()))
            rep.stale_kv = {r.spec.id for r in rep.running} & stale
            rep.hold_running_kv({rid: (s.kin, s.pages) for rid, s in shared.items()})
            _migrate(st, st.replica, rep, transfers)
            phases["kv_migrate_ms"] = _lap(t)
            if moved and phases["kv_migrate_ms"] > 0:
                new_costs = costs.measured(migrate_bytes_per_ms=moved / phases["kv_migrate_ms"])
        else:
            running = list(rep.running)
            rep.running.clear()
            if running:
                rep.prefill(running, sample_fresh=False)
                new_costs = costs.measured(recompute_tokens_per_ms=rep.prefill_tokens_per_ms)
            event.kv_tokens_recomputed = sum(s.kv_len for s in running)
            phases["kv_recompute_ms"] = _lap(t)
        st.fault("commit")
        new = replace(
            st,
            layout=target,
            weights=weights,
            replica=rep,
            costs=new_costs,
            epoch=st.epoch + 1,
            step=event.step,
        )
    except Exception as exc:
        error = f"rank {st.rank}: {type(exc).__name__}: {exc}"
    t = time.perf_counter()
    ok = _vote(error is None, st.sync_device)
    phases["vote_ms"] = _lap(t)
    phases["total_ms"] = _lap(t_all)
    event.phases = {k: round(v, 3) for k, v in phases.items()}
    event.actual_ms = event.phases["total_ms"]
    if ok and new is not None:
        return new, event, [(p.id, p.dst_replica, p.dst_slot is not None) for p in placements]
    event.outcome = "rolled_back"
    event.error = error or "another rank failed"
    return st, event, []


def _lap(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


def _unfinished(
    snaps: dict[int, _Snapshot],
) -> tuple[list[Unfinished], dict[str, tuple[RequestSpec, list[int]]]]:
    reqs, outputs = [], {}
    for d, snap in snaps.items():
        slots: list[int | None] = [*range(len(snap.running)), *[None] * len(snap.waiting)]
        tables = [*snap.pages, *[()] * len(snap.waiting)]
        for slot, (spec, out), table in zip(slots, [*snap.running, *snap.waiting], tables, strict=True):
            reqs.append(Unfinished(spec.id, d, slot, Sequence(spec=spec, output=out).req, table))
            outputs[spec.id] = (spec, out)
    return reqs, outputs


def _fill(
    rank: int,
    rep: Replica,
    target: Layout,
    placements: list[Placement],
    outputs: dict[str, tuple[RequestSpec, list[int]]],
) -> None:
    """Populate the new replica (this rank's) with its requests: running ones in slot order, then waiting."""
    d = target.replica_of(rank)
    mine = [p for p in placements if p.dst_replica == d]
    for p in sorted((p for p in mine if p.dst_slot is not None), key=lambda p: p.dst_slot or 0):
        spec, out = outputs[p.id]
        rep.running.append(Sequence(spec=spec, output=list(out)))
    for p in mine:
        if p.dst_slot is None:
            spec, out = outputs[p.id]
            rep.waiting.append(Sequence(spec=spec, output=list(out)))


def _migrate(st: RankState, old: Replica, new: Replica, plan: list[Transfer]) -> None:
    """One packed buffer per (source, destination) pair; local pieces are plain copies."""
    me = st.rank
    elem = torch.empty((), dtype=st.dtype).element_size()
    sends: dict[int, list[Transfer]] = {}
    recvs: dict[int, list[Transfer]] = {}

    def extract(t: Transfer) -> torch.Tensor:
        return old.pool.extract(old.running[t.src_slot].pages[t.skip : t.pages], t.src_heads)

    def insert(t: Transfer, flat: torch.Tensor) -> None:
        new.pool.insert(new.running[t.dst_slot].pages[t.skip : t.pages], t.dst_heads, flat)

    for t in plan:
        if t.src == me and t.dst == me:
            insert(t, extract(t))
        elif t.src == me:
            sends.setdefault(t.dst, []).append(t)
        elif t.dst == me:
            recvs.setdefault(t.src, []).append(t)
    stage = st.stage_cpu
    ops, inbox = [], {}
    for dst, ts in sorted(sends.items()):
        buf = torch.cat([extract(t) for t in ts])
        ops.append(dist.P2POp(dist.isend, buf.cpu() if stage else buf, dst))
    for src, ts in sorted(recvs.items()):
        n = sum(transfer_bytes(t, st.model, elem) for t in ts) // elem
        buf = torch.empty(n, dtype=st.dtype, device="cpu" if stage else st.device)
        inbox[src] = buf
        ops.append(dist.P2POp(dist.irecv, buf, src))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for i, (src, buf) in enumerate(sorted(inbox.items())):
        if i == len(inbox) // 2:
            st.fault("migrate")  # test hook: fail half-way through unpacking
        off = 0
        for t in recvs[src]:
            n = transfer_bytes(t, st.model, elem) // elem
            insert(t, buf[off : off + n].to(st.device))
            off += n
    if not inbox:
        st.fault("migrate")


def _vote(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
