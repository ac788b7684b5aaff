"""Pure planning of a reconfiguration: where each unfinished request goes, which KV heads move from
which rank to which, and how many bytes or tokens each way of rebuilding the KV cache costs (the
shared :class:`~rollout_worker.scheduling.costs.CostModel` then picks migrate or recompute).

Every rank computes the same plan from the same gathered metadata, so no plan is ever sent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.kv_cache import kv_elements
from rollout_worker.scheduling.admission import Req, admit
from rollout_worker.scheduling.head_shards import kv_sources
from rollout_worker.scheduling.layout import Layout
from rollout_worker.scheduling.pages import pages_for


@dataclass(frozen=True, slots=True)
class Unfinished:
    """A request before the switch: its old replica, its slot there (None while waiting), and what the KV
    scheduler knows of it (prompt, generated, max_new_tokens)."""

    id: str
    src_replica: int
    src_slot: int | None
    req: Req
    src_pages: tuple[int, ...] = ()  # its page table on the old replica (running requests)

    @property
    def kv_len(self) -> int:
        return self.req.kv_len

    @property
    def remaining(self) -> int:
        """max_new_tokens - generated (an upper bound on the work left)."""
        return self.req.remaining


@dataclass(frozen=True, slots=True)
class Placement:
    id: str
    src_replica: int
    src_slot: int | None
    dst_replica: int
    dst_slot: int | None  # None: waits on the new replica (its KV is dropped, rebuilt at admission)
    kv_len: int


@dataclass(frozen=True, slots=True)
class Shared:
    """A running request's first ``pages`` pages are those of ``kin``, placed before it on the same new
    replica: they shared them on the old replica, they share them on the new one, and they move once."""

    kin: str
    pages: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """KV heads of one request moving from ``src`` to ``dst`` (ranks); head ranges are rank-local. The
    request's pages ``skip .. pages - 1`` move whole (its first ``pages`` pages hold its ``kv_len`` cached
    tokens; the first ``skip`` are shared with a request placed before it, and move with that one)."""

    src: int
    dst: int
    id: str
    src_slot: int
    dst_slot: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    kv_len: int
    pages: int
    page_size: int
    skip: int = 0

    @property
    def moved_pages(self) -> int:
        return self.pages - self.skip


def place(
    reqs: list[Unfinished],
    replicas: int,
    max_batch: int,
    pool_pages: int,
    page_size: int,
    ratio: float,
) -> list[Placement]:
    """Balance requests over ``replicas`` by remaining work (longest first onto the least loaded replica).

    A request that held a slot keeps running on its new replica when the replica's admission rule
    (:func:`~rollout_worker.scheduling.admission.admit`, optimistic, with the new-token ``ratio``) would
    admit it
    beside the ones kept before it, in a pool of ``pool_pages`` pages: its cached tokens and next decode
    step must fit in the free pages, and the pool must cover the estimated growth of those kept plus its
    own. The rest wait there (re-prefilled when admitted). Order inside each replica follows the input
    order, so slots are deterministic.
    """
    load = [0] * replicas
    target: dict[str, int] = {}
    for r in sorted(reqs, key=lambda r: (-r.remaining, r.id)):
        d = min(range(replicas), key=lambda i: (load[i], i))
        target[r.id] = d
        load[d] += r.remaining
    kept: list[list[Req]] = [[] for _ in range(replicas)]
    free = [pool_pages] * replicas
    out = []
    for r in sorted(reqs, key=lambda r: (r.src_slot is None, r.src_replica, r.src_slot or 0, r.id)):
        d = target[r.id]
        cand = replace(r.req, pages=0)
        # one candidate at a time: the prefill-token cap never binds (it applies from a round's second)
        if r.src_slot is not None and admit(kept[d], [cand], free[d], page_size, ratio, max_batch, 1) == 1:
            held = pages_for(r.kv_len, page_size)  # what the new replica holds for it before decoding
            out.append(Placement(r.id, r.src_replica, r.src_slot, d, len(kept[d]), r.kv_len))
            kept[d].append(replace(cand, pages=held))
            free[d] -= held
        else:
            out.append(Placement(r.id, r.src_replica, r.src_slot, d, None, r.kv_len))
    return out


def shared_pages(reqs: list[Unfinished], placements: list[Placement]) -> dict[str, Shared]:
    """For each request that keeps running, the request placed before it on the same new replica, from the
    same old one, with which it shares the most leading pages there (none: not in the result)."""
    by_id = {r.id: r for r in reqs}
    seen: dict[tuple[int, int, int], list[Unfinished]] = {}  # (old replica, new replica, first page)
    out: dict[str, Shared] = {}
    carried = [p for p in placements if p.src_slot is not None and p.dst_slot is not None]
    for p in sorted(carried, key=lambda p: (p.dst_replica, p.dst_slot or 0)):
        r = by_id[p.id]
        if not r.src_pages:
            continue
        group = seen.setdefault((p.src_replica, p.dst_replica, r.src_pages[0]), [])
        best: Shared | None = None
        for kin in group:
            n = _common(kin.src_pages, r.src_pages)
            if best is None or n > best.pages:
                best = Shared(kin.id, n)
        if best is not None:
            out[p.id] = best
        group.append(r)
    return out


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def kv_migration_plan(
    cfg: ModelConfig,
    old: Layout,
    new: Layout,
    placements: list[Placement],
    page_size: int = 1,
    shared: dict[str, Shared] | None = None,
) -> list[Transfer]:
    """For every running request, every destination rank gets each KV head it needs from one rank of the
    old replica that holds it: itself when it can (a local copy), else the lowest shard holding it
    (:func:`~rollout_worker.scheduling.head_shards.kv_sources`, which the planner's byte estimate uses too).
    Pages a
    request shares with one placed before it (``shared``) move with that one only."""
    plan = []
    for p in placements:
        if p.src_slot is None or p.dst_slot is None:
            continue
        pages = pages_for(p.kv_len, page_size)
        skip = shared[p.id].pages if shared and p.id in shared else 0
        if skip >= pages:
            continue
        for dst in new.ranks_of(p.dst_replica):
            for src, src_heads, dst_heads in kv_sources(cfg.num_kv_heads, old, p.src_replica, new, dst):
                plan.append(
                    Transfer(
                        src,
                        dst,
                        p.id,
                        p.src_slot,
                        p.dst_slot,
                        src_heads,
                        dst_heads,
                        p.kv_len,
                        pages,
                        page_size,
                        skip,
                    )
                )
    return plan


def transfer_bytes(t: Transfer, cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of the whole pages a transfer moves."""
    heads = t.src_heads[1] - t.src_heads[0]
    return kv_elements(cfg.num_layers, heads, t.moved_pages * t.page_size, cfg.head_dim) * dtype_bytes


def migrate_bytes(plan: list[Transfer], cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes that cross between ranks (local copies are free): whole pages, the cost model's input."""
    return sum(transfer_bytes(t, cfg, dtype_bytes) for t in plan if t.src != t.dst)


def migrate_pages(plan: list[Transfer]) -> int:
    """Pages (of some of a request's KV heads) that cross between ranks."""
    return sum(t.moved_pages for t in plan if t.src != t.dst)


def recompute_tokens(placements: list[Placement], replicas: int) -> int:
    """Tokens to re-prefill on the busiest new replica (replicas prefill in parallel)."""
    per = [0] * replicas
    for p in placements:
        if p.dst_slot is not None:
            per[p.dst_replica] += p.kv_len
    return max(per)
