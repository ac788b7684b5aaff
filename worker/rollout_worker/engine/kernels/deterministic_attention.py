"""The deterministic setting's attention on torch's operations (on CUDA, and on CPUs without the
fixed-order kernel): each query row bitwise independent of its batch, its padding and the TP size.

The scores are one product per KV head (their sum runs over the head dimension, whatever the number of
keys); the softmax's denominator and the weighted values are summed per chunk of ``KEY_CHUNK`` keys (query
rows padded to both products' measured row rule, :func:`query_rows`), and the chunks are added in the
fixed tree (:func:`~rollout_worker.engine.kernels.tree_sums.tree_sum`), which a row's masked trailing
chunks (exact zeros) do not change. The products read only the keys some row sees, rounded up to
:func:`key_step` (measured: the last chunk's sum over its first keys is the whole chunk's where the rest
are zeros). The row's maximum is exact in any order. On CPUs that build it, the fixed-order kernel
computes this attention instead, in its own orders
(:func:`~rollout_worker.engine.kernels.fixed_order.attend`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rollout_worker.engine.kernels import row_rules as rules
from rollout_worker.engine.kernels.row_rules import KEY_CHUNK
from rollout_worker.engine.kernels.tree_sums import sum_last, tree_sum
from rollout_worker.scheduling.pages import round_up

KEY_STEPS = (8, 16, 32, 64)  # the multiples of keys attend may cut its products to, finest first (key_step)


@functools.cache
def key_step(hd: int, dtype: torch.dtype) -> int:
    """The multiple of keys :func:`attend`'s products read: the keys any row of a forward sees, rounded up to
    it, instead of to whole ``KEY_CHUNK`` chunks (at a step of 8, a forward at 257 keys reads 264, not 384).
    The finest of ``KEY_STEPS`` at which this CPU's products give every row the bits of whole chunks
    (:func:`_cuts_agree`), else ``KEY_CHUNK``; measured once per process. The
    elementwise work and the sums over keys still run over whole chunks (zeros past the cut), as before."""
    least = query_rows(hd, dtype)
    return next((step for step in KEY_STEPS if _cuts_agree(step, hd, dtype, least)), KEY_CHUNK)


def _cuts_agree(step: int, hd: int, dtype: torch.dtype, least: int) -> bool:
    """Whether a product cut to a multiple of ``step`` keys computes what whole chunks do, at query row counts
    from ``least`` to a prefill's 256: each score (a column of ``q @ keys_t``, its sum over ``hd``) the same
    in a product of fewer columns; and a chunk's weighted values (``e @ vals``, the sum over the chunk's keys)
    the same over its first keys as over all ``KEY_CHUNK``, where the row's later keys have ``e`` = 0 (its
    masked keys, or another row's) -- for every count of keys a row sees up to the cut."""
    gen = torch.Generator().manual_seed(step * hd)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    # the cuts a score is checked at: every multiple of the step up to 3 chunks, then a few longer contexts
    cuts = [*range(step, 3 * KEY_CHUNK, step), *(c * KEY_CHUNK + step for c in (8, 16, 32))]
    cap = round_up(cuts[-1], KEY_CHUNK) + 64  # the kept keys' capacity: a multiple of 64, past the span
    keys_t = rand(1, 2, hd, cap)  # [..., :n]: views of a wider matrix, as the kept keys are
    counts = (least, 2 * least + 1, 64, 256)
    weights = rand(8, max(counts), 2 * KEY_CHUNK).abs()
    vals = rand(8, 2 * KEY_CHUNK, hd)[:, KEY_CHUNK:]  # views of wider matrices, as _chunk_values' are
    for rows in counts:
        q = rand(1, 2, rows, hd)
        spans: dict[int, torch.Tensor] = {}
        for n in cuts:
            span = key_span(n)
            if span not in spans:
                spans[span] = torch.matmul(q, keys_t[..., :span])
            if not torch.equal(torch.matmul(q, keys_t[..., :n]), spans[span][..., :n]):
                return False
        for cut in range(step, KEY_CHUNK, step):
            seen = sorted({k for k in (1, 2, 3, step - 1, cut // 2, cut - step + 1, cut - 1, cut) if k >= 1})
            e = weights[: len(seen), :rows].clone()[:, :, KEY_CHUNK:]
            for i, k in enumerate(seen):
                e[i, :, k:] = 0
            v = vals[: len(seen)]
            if not torch.equal(torch.bmm(e[:, :, :cut], v[:, :cut]), torch.bmm(e, v)):
                return False
    return True


def query_rows(hd: int, dtype: torch.dtype) -> int:
    """The fewest query rows :func:`attend`'s two products run on this CPU: both products' row rule."""
    return max(rules.least_rows("scores", hd, dtype), rules.least_rows("values", KEY_CHUNK, dtype))


def key_span(length: int) -> int:
    """Keys a row attends over, rounded up to whole chunks (gather the pool's padding slots rather than pad
    the gathered keys: one copy instead of two)."""
    return max(round_up(length, KEY_CHUNK), KEY_CHUNK)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    seen: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, S, H, hd] over keys and vals [B, KVh, L, hd] under mask [B, 1, S, L] (a query's
    visible keys): [B, S, H * hd], each query row bitwise independent of B, S, L and the other rows. On CPU
    the keys' storage is each KV head's [hd, L] row-major (``keys`` a transposed view of it, as
    :meth:`~rollout_worker.engine.kernels.choice.Kernels.keys_of` lays them out), which the scores'
    products read. Head ``h`` uses KV head ``h // (H // KVh)``, as in grouped-query attention. The scores
    are one product per (row, KV head) (a score's sum runs over ``hd`` whatever L is); the sums over keys
    run per chunk. ``seen`` (default L): no row sees a key at or past it; the products read that many keys,
    rounded up to :func:`key_step`."""
    keys_t = keys.transpose(-1, -2)
    bsz, seq, heads, hd = q.shape
    kvh, length = keys_t.shape[1], keys_t.shape[3]
    group = heads // kvh
    rows = group * seq
    qg = (q * scale).view(bsz, seq, kvh, group, hd).permute(0, 2, 3, 1, 4).reshape(bsz, kvh, rows, hd)
    vis = mask[:, :, None].expand(bsz, 1, group, seq, length).reshape(bsz, 1, rows, length)  # rows (g, s)
    least = 0 if q.is_cuda else query_rows(hd, q.dtype)
    if rows < least:  # rows of zeros: they fill the products only (no elementwise work, no sums)
        qg = torch.cat((qg, qg.new_zeros(bsz, kvh, least - rows, hd)), dim=2)
    span = key_span(length)
    cut = span  # keys the products read: the keys any row sees, rounded up to key_step (CUDA: whole chunks)
    if not q.is_cuda:
        step = key_step(hd, q.dtype)
        cut = min(max(round_up(length if seen is None else seen, step), step), span)
    if cut > length:
        keys_t = F.pad(keys_t, (0, cut - length))
        vals = F.pad(vals, (0, 0, 0, cut - length))
    vis = F.pad(vis[..., :cut], (0, span - min(cut, length)), value=False)  # no key past the cut counts
    n = span // KEY_CHUNK
    scores = torch.matmul(qg, keys_t[..., :cut])  # [B, KVh, padded rows, cut]
    if cut < span:
        scores = F.pad(scores, (0, span - cut))
    e = scores[:, :, :rows].masked_fill_(~vis, float("-inf"))  # the query rows, in place from here on
    top = e.amax(dim=-1, keepdim=True)  # exact in any order
    e = e.sub_(top).exp_()  # the same bits in place: the same elementwise kernels (L: whole chunks)
    den = tree_sum(sum_last(e.view(bsz, kvh, rows, n, KEY_CHUNK)).movedim(-1, 0))  # [B, KVh, rows]
    num = tree_sum(_chunk_values(scores, vals, n, cut))[:, :, :rows]  # [B, KVh, rows, hd]
    out = num / den[..., None]
    return out.view(bsz, kvh, group, seq, hd).permute(0, 3, 1, 2, 4).reshape(bsz, seq, heads * hd)


def _chunk_values(e: torch.Tensor, vals: torch.Tensor, n: int, cut: int) -> torch.Tensor:
    """[n, B, KVh, rows, hd]: each chunk's weighted values, e [B, KVh, rows, n * C] @ vals [B, KVh, n * C,
    hd] over its C keys. On CPU one batched product per chunk over views of both (vals is a slice of the
    kept K/V, whose rows outrun L: a product over all chunks at once would first copy it, which took longer
    than the products); on CUDA one product over every chunk (one kernel, as measured there)."""
    bsz, kvh, rows, span = e.shape
    hd = vals.shape[-1]
    if e.is_cuda:
        chunked = e.view(bsz, kvh, rows, n, KEY_CHUNK).transpose(2, 3)  # [B, KVh, n, rows, C]
        return torch.matmul(chunked, vals.view(bsz, kvh, n, KEY_CHUNK, hd)).movedim(2, 0)
    ef, vf = e.view(bsz * kvh, rows, span), vals.reshape(bsz * kvh, vals.shape[2], hd)
    parts = [
        torch.bmm(ef[:, :, c : min(c + KEY_CHUNK, cut)], vf[:, c : min(c + KEY_CHUNK, cut)])
        for c in range(0, span, KEY_CHUNK)
    ]
    return torch.stack(parts).view(n, bsz, kvh, rows, hd)
