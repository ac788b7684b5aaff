"""Which attention heads each shard of a TP-``T`` replica owns, for any head counts: uneven head shards.

A model has ``H`` query heads in ``KV`` groups of ``G = H / KV`` (grouped-query attention: the heads of
group ``g`` read KV head ``g``). Shard ``s`` of ``T`` owns

* ``T <= KV``: whole groups ``[s*KV//T, (s+1)*KV//T)``, their KV heads and their query heads. When ``T``
  does not divide ``KV`` the shards differ in width: 3 KV heads (SmolLM2-135M: 9 heads) over 2 ranks
  give shard 0 one group (3 query heads) and shard 1 two (6 query heads).
* ``T > KV``: one KV head, ``g = s*KV//T`` (duplicated on every shard of its group), and a contiguous
  part of group ``g``'s query heads, split as evenly as the ranks of the group allow: 3 groups over 4
  ranks give group 0 two ranks (1 and 2 query heads) and groups 1 and 2 one rank each (3 query heads).

When the counts divide evenly this is the usual equal split (``H/T`` query heads per shard, ``KV/T`` KV
heads or one duplicated head). Query and KV ranges are contiguous and grow with ``s``, so a rank's
column-parallel q/k/v rows and its row-parallel o_proj columns are each one slice of the full tensor.

Why uneven shards rather than zero-padded heads: every head is computed whole on exactly one rank (no
head is split, none is padded), so a rank's attention is ordinary grouped-query attention over its own
KV heads and the o_proj all-reduce sums partial products over disjoint heads, as with equal shards. No
KV head is stored twice below ``T = KV`` (padding 3 KV heads to 4 would add a third to the KV cache,
which is what bounds the batch), no FLOPs go to padding, and the checkpoint's tensors are sliced as
they are: padded widths would change with ``T`` and every reshard would have to pad and unpad. The
cost is balance: the widest shard (6 of 9 query heads at TP 2) sets the attention's step time, no
worse than padding to 12 heads would (6 per rank). A TP size above ``H`` would leave a rank without
a query head and is refused.
"""

from __future__ import annotations

from functools import lru_cache

from rollout_worker.scheduling.layout import Layout


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` near-equal contiguous parts of ``range(n)`` (the larger parts last)."""
    return i * n // parts, (i + 1) * n // parts


def kv_head_range(num_kv_heads: int, tp: int, shard: int) -> tuple[int, int]:
    """KV heads [lo, hi) held by ``shard`` of ``tp`` (one duplicated head when tp > KV heads)."""
    if tp <= num_kv_heads:
        return split(num_kv_heads, tp, shard)
    g = shard * num_kv_heads // tp
    return g, g + 1


def q_head_range(num_heads: int, num_kv_heads: int, tp: int, shard: int) -> tuple[int, int]:
    """Query heads [lo, hi) of ``shard`` of ``tp``: its KV heads' groups, or its part of one group."""
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        lo, hi = split(num_kv_heads, tp, shard)
        return lo * group, hi * group
    g = shard * num_kv_heads // tp
    first, stop = -(-g * tp // num_kv_heads), -(-(g + 1) * tp // num_kv_heads)  # shards of group g
    lo, hi = split(group, stop - first, shard - first)
    return g * group + lo, g * group + hi


def max_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads of the widest shard (what bounds a replica's KV memory per rank)."""
    return max(hi - lo for lo, hi in (kv_head_range(num_kv_heads, tp, s) for s in range(tp)))


def max_q_heads(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """Query heads of the widest shard (what sets a replica's attention time)."""
    return max(hi - lo for lo, hi in (q_head_range(num_heads, num_kv_heads, tp, s) for s in range(tp)))


def kv_sources(
    num_kv_heads: int, old: Layout, src_replica: int, new: Layout, dst_rank: int
) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Where ``dst_rank`` of ``new`` gets each KV head of a request that ran on ``src_replica`` of ``old``:
    ``(source rank, heads local to it, heads local to dst_rank)``, from itself when it held them (a local
    copy), else from the lowest shard of the old replica holding them."""
    sources = [(r, kv_head_range(num_kv_heads, old.tp, old.shard_of(r))) for r in old.ranks_of(src_replica)]
    lo, hi = kv_head_range(num_kv_heads, new.tp, new.shard_of(dst_rank))
    out = []
    h = lo
    while h < hi:
        src, (slo, shi) = next(
            ((r, rng) for r, rng in sources if r == dst_rank and rng[0] <= h < rng[1]),
            next((r, rng) for r, rng in sources if rng[0] <= h < rng[1]),
        )
        end = min(hi, shi)
        out.append((src, (h - slo, end - slo), (h - lo, end - lo)))
        h = end
    return out


@lru_cache(maxsize=256)
def moved_kv_fraction(num_kv_heads: int, old: Layout, new: Layout) -> float:
    """KV heads one request sends between ranks when the layout switches ``old -> new``, per KV head of the
    model: what :func:`kv_sources` sends, averaged over the (old, new) replica pairs that share a rank
    (a request is assumed to stay on some of its ranks: growing merges whole old replicas into a new
    one). Above 1 when the new replica holds duplicated heads (TP above the KV heads) on ranks that did
    not hold them."""
    moved, pairs = 0, 0
    for d in range(old.replicas):
        for d2 in range(new.replicas):
            if not set(old.ranks_of(d)) & set(new.ranks_of(d2)):
                continue
            pairs += 1
            for dst in new.ranks_of(d2):
                moved += sum(
                    b - a for src, (a, b), _ in kv_sources(num_kv_heads, old, d, new, dst) if src != dst
                )
    return moved / (pairs * num_kv_heads)
