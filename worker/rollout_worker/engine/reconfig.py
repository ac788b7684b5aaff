"""Executing a reconfiguration on one rank, in lockstep with all others, all-or-nothing.

Phases: (1) gather every replica's request state; (2) plan placements and pick the KV method (pure,
identical on every rank); (3) reshard weights; (4) build the new KV cache by migration or recompute;
(5) vote. New weights and caches are built beside the old ones, so a failed vote (any rank raised)
simply drops them: the engine keeps its old layout and no request is lost or altered.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rollout_worker.api.errors import ReconfigurationFailed
from rollout_worker.api.layout import Layout
from rollout_worker.engine.migration import (
    Placement,
    Transfer,
    Unfinished,
    choose_method,
    kv_migration_plan,
    migrate_bytes,
    place,
    recompute_tokens,
    transfer_bytes,
)
from rollout_worker.engine.replica import Replica
from rollout_worker.engine.sequence import Sequence
from rollout_worker.engine.weights import reshard

if TYPE_CHECKING:
    from rollout_worker.engine.rank import RankEngine


def _snapshot(eng: RankEngine) -> dict[str, Any]:
    rep = eng.replica
    return {
        "running": [(s.spec.id, list(s.output), list(s.history)) for s in rep.running],
        "waiting": [(s.spec.id, list(s.output), list(s.history)) for s in rep.waiting],
        "bytes_per_ms": eng.migrate_bytes_per_ms,
        "tokens_per_ms": rep.prefill_tokens_per_ms or eng.cfg.recompute_tokens_per_ms,
    }


def reconfigure(eng: RankEngine, target: Layout, method: str, reason: str) -> dict[str, Any]:
    old = eng.layout
    phases: dict[str, float] = {}
    t_all = t = time.perf_counter()
    gathered: list[Any] = [None] * eng.cfg.world
    mine = _snapshot(eng) if old.shard_of(eng.rank) == 0 else None
    dist.all_gather_object(gathered, mine)
    states = {d: gathered[old.ranks_of(d)[0]] for d in range(old.replicas)}
    phases["sync_ms"] = _lap(t)

    t = time.perf_counter()
    reqs, outputs = _unfinished(eng, states)
    placements = place(reqs, target.replicas, eng.cfg.max_batch, eng.cfg.kv_budget_tokens)
    transfers = kv_migration_plan(eng.model, old, target, placements)
    elem = torch.empty((), dtype=eng.dtype).element_size()
    moved = migrate_bytes(transfers, eng.model, elem)
    tokens = recompute_tokens(placements, target.replicas)
    chosen, pred_mig, pred_rec = choose_method(
        method, moved, tokens, states[0]["bytes_per_ms"], states[0]["tokens_per_ms"]
    )
    phases["plan_ms"] = _lap(t)

    event: dict[str, Any] = {
        "step": eng.step_no,
        "from": str(old),
        "to": str(target),
        "requested": method,
        "method": chosen,
        "reason": reason,
        "requests_moved": sum(p.dst_slot is not None for p in placements),
        "requests_waiting": sum(p.dst_slot is None for p in placements),
        "predicted_migrate_ms": round(pred_mig, 3),
        "predicted_recompute_ms": round(pred_rec, 3),
    }
    error: str | None = None
    new_weights, new_replica = None, None
    try:
        t = time.perf_counter()
        new_weights, wstats = reshard(
            eng.weights, eng.model, eng.pstate(old), target.tp, target.shard_of(eng.rank)
        )
        phases["reshard_ms"] = _lap(t)
        event["reshard"] = wstats
        new_replica = eng.make_replica(target, new_weights)
        _fill(eng, new_replica, target, placements, outputs)
        t = time.perf_counter()
        if chosen == "migrate":
            event["kv_bytes_moved"] = moved
            _migrate(eng, eng.replica, new_replica, transfers)
            phases["kv_migrate_ms"] = _lap(t)
            if moved and phases["kv_migrate_ms"] > 0:
                eng.migrate_bytes_per_ms = moved / phases["kv_migrate_ms"]
        else:
            running = list(new_replica.running)
            new_replica.running.clear()
            if running:
                new_replica.prefill(running, sample_fresh=False)
            event["kv_tokens_recomputed"] = sum(s.kv_len for s in running)
            phases["kv_recompute_ms"] = _lap(t)
        _maybe_fault(eng, "commit")
    except Exception as exc:
        error = f"rank {eng.rank}: {type(exc).__name__}: {exc}"
    t = time.perf_counter()
    ok = _vote(error is None, eng.sync_device)
    phases["vote_ms"] = _lap(t)
    if ok and new_weights is not None and new_replica is not None:
        eng.weights, eng.replica, eng.layout = new_weights, new_replica, target
        event["outcome"] = "committed"
    else:
        event["outcome"] = "rolled_back"
        event["error"] = error or "another rank failed"
    phases["total_ms"] = _lap(t_all)
    event["phases"] = {k: round(v, 3) for k, v in phases.items()}
    return event


def _lap(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


def _unfinished(eng: RankEngine, states: dict[int, Any]) -> tuple[list[Unfinished], dict[str, Any]]:
    reqs, outputs = [], {}
    for d, st in states.items():
        slots: list[int | None] = [*range(len(st["running"])), *[None] * len(st["waiting"])]
        for slot, (rid, out, hist) in zip(slots, [*st["running"], *st["waiting"]], strict=True):
            seq = Sequence(spec=eng.specs[rid], output=out)
            reqs.append(Unfinished(rid, d, slot, seq.kv_len, seq.reserved_tokens, seq.remaining))
            outputs[rid] = (out, hist)
    return reqs, outputs


def _fill(
    eng: RankEngine, rep: Replica, target: Layout, placements: list[Placement], outputs: dict[str, Any]
) -> None:
    """Populate the new replica (this rank's) with its requests: running ones in slot order, then waiting."""
    d = target.replica_of(eng.rank)
    mine = [p for p in placements if p.dst_replica == d]
    for p in sorted((p for p in mine if p.dst_slot is not None), key=lambda p: p.dst_slot or 0):
        rep.running.append(_seq(eng, p, outputs, target))
    for p in mine:
        if p.dst_slot is None:
            rep.waiting.append(_seq(eng, p, outputs, target))


def _seq(eng: RankEngine, p: Placement, outputs: dict[str, Any], target: Layout) -> Sequence:
    out, hist = outputs[p.id]
    entry = {"layout": str(target), "replica": p.dst_replica, "step": eng.step_no}
    return Sequence(spec=eng.specs[p.id], output=list(out), history=[*hist, entry])


def _migrate(eng: RankEngine, old: Replica, new: Replica, plan: list[Transfer]) -> None:
    """One packed buffer per (source, destination) pair; local pieces are plain copies."""
    me = eng.rank
    elem = torch.empty((), dtype=eng.dtype).element_size()
    sends: dict[int, list[Transfer]] = {}
    recvs: dict[int, list[Transfer]] = {}
    for t in plan:
        if t.src == me and t.dst == me:
            new.slab.insert(
                t.dst_slot, t.dst_heads, t.kv_len, old.slab.extract(t.src_slot, t.src_heads, t.kv_len)
            )
        elif t.src == me:
            sends.setdefault(t.dst, []).append(t)
        elif t.dst == me:
            recvs.setdefault(t.src, []).append(t)
    stage = eng.stage_cpu
    ops, inbox = [], {}
    for dst, ts in sorted(sends.items()):
        buf = torch.cat([old.slab.extract(t.src_slot, t.src_heads, t.kv_len) for t in ts])
        ops.append(dist.P2POp(dist.isend, buf.cpu() if stage else buf, dst))
    for src, ts in sorted(recvs.items()):
        n = sum(transfer_bytes(t, eng.model, elem) for t in ts) // elem
        buf = torch.empty(n, dtype=eng.dtype, device="cpu" if stage else eng.device)
        inbox[src] = buf
        ops.append(dist.P2POp(dist.irecv, buf, src))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for i, (src, buf) in enumerate(sorted(inbox.items())):
        if i == len(inbox) // 2:
            _maybe_fault(eng, "migrate")  # test hook: fail half-way through unpacking
        off = 0
        for t in recvs[src]:
            n = transfer_bytes(t, eng.model, elem) // elem
            new.slab.insert(t.dst_slot, t.dst_heads, t.kv_len, buf[off : off + n].to(eng.device))
            off += n
    if not inbox:
        _maybe_fault(eng, "migrate")


def _maybe_fault(eng: RankEngine, phase: str) -> None:
    if eng.cfg.fault_rank(phase) == eng.rank:
        raise ReconfigurationFailed(f"injected fault in phase {phase!r}")


def _vote(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
