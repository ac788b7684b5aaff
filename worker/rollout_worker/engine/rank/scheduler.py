"""A replica's scheduling, over :mod:`rollout_worker.scheduling.admission`'s rules: which waiting requests a
step admits, which running ones a decode step retracts when it cannot get its pages, and how a prefill is
cut (the order of its rows, its padded passes, the tokens each row computes and may take from the prefix
cache). Every rank of a replica computes the same answers from the same state: the choices depend only on
the requests (the simulator makes the same ones).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from rollout_worker.engine.model.kv_cache import KVPool
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.admission import Req, admit, to_retract


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch: int
    max_prefill_tokens: int


def sched_req(seq: Sequence, pool: KVPool, shared: bool = False, cached: int = 0) -> Req:
    """The scheduler's view of ``seq``; with ``shared``, how many of its pages others hold too (a
    retraction does not free those); ``cached``: prefill tokens the prefix cache holds."""
    n_shared = 0
    if shared:
        held = pool.shared.holders
        n_shared = sum(1 for p in seq.pages if held(p) > 1)
    return seq.sched(n_shared, cached)


def cacheable_row(seq: Sequence) -> tuple[list[int], int]:
    """The tokens a prefill of ``seq`` computes K/V for, and how many of them it may take from the
    prefix cache (all but the last, whose logits it needs; none when it wants its prompt's logprobs)."""
    row = prefill_row(seq)
    wants_prompt = not seq.output and seq.spec.wants_input_logprobs
    return row, 0 if wants_prompt else len(row) - 1


def admissible(
    waiting: deque[Sequence],
    running: list[Sequence],
    pool: KVPool,
    ratio: float,
    limits: Limits,
) -> int:
    """How many of the first ``waiting`` requests the next step admits (with the new-token ``ratio``): as
    many as fit the batch, the prefill's tokens and the free pages (a cached prefix it would share is taken
    off the free ones)."""
    room = limits.max_batch - len(running)
    if not waiting or room <= 0:
        return 0
    candidates: list[Req] = []
    shared_idle: set[int] = set()
    for seq in itertools.islice(waiting, room):
        pages = pool.shared.match(*cacheable_row(seq)) if pool.shared.cached else []
        shared_idle.update(p for p in pages if pool.shared.is_idle(p))  # taken off the free ones
        candidates.append(sched_req(seq, pool, cached=len(pages) * pool.page_size))
    return admit(
        [s.req for s in running],
        candidates,
        pool.free_pages - len(shared_idle),
        pool.page_size,
        ratio,
        limits.max_batch,
        limits.max_prefill_tokens,
    )


def to_retract_now(running: list[Sequence], pool: KVPool) -> list[Sequence]:
    """The running requests to retract so that the next decode step gets its pages (none when it gets them
    as it is): what :func:`~rollout_worker.scheduling.admission.to_retract` picks. Ties are broken by the
    order of admission, not by row (rows are compacted as requests finish), so the choice depends only on
    the requests (the simulator makes the same one)."""
    free, ps = pool.free_pages, pool.page_size
    if sum(s.req.step_pages(ps) for s in running) <= free:  # (sorted only when short of pages)
        return []
    order = sorted(running, key=lambda s: s.admitted)
    pick = to_retract([sched_req(s, pool, shared=True) for s in order], free, ps)  # frees unshared pages
    return [order[i] for i in pick]


# What one more forward pass costs, in tokens computed: about the tokens whose products cost as much as
# reading the weights once (the roofline's ridge: tens on a CPU core, hundreds on a GPU). The same on every
# rank of a replica (a constant per device), so its ranks cut a prefill into the same passes.
PASS_TOKENS = {"cpu": 32, "cuda": 256}


def prompts_first(seqs: list[Sequence]) -> list[Sequence]:
    """``seqs`` with the first request of each prompt ahead of the later ones (each kind in its order): the
    samples of a prompt, which clients send together, then prefill as one pass of whole prompts and one of
    later samples (each computing one token on its prompt's cached pages, :func:`prefill_passes`), not as
    alternating wide and narrow rows. Every later sample still comes after the first of its prompt, whose
    pages it reads."""
    seen: set[tuple[int, ...]] = set()
    first: list[Sequence] = []
    later: list[Sequence] = []
    for s in seqs:
        (later if s.spec.prompt_ids in seen else first).append(s)
        seen.add(s.spec.prompt_ids)
    return first + later


def prefill_passes(widths: list[int], pass_tokens: int) -> list[range]:
    """Consecutive runs of prefill rows (``widths``: tokens each computes), each run one padded pass: a row
    starts a new pass when padding it and the pass so far to one width computes more than a pass costs
    (``pass_tokens``). Rows keep their order: a row may read the pages a row before it writes."""
    passes: list[range] = []
    start, width = 0, 0
    for i, w in enumerate(widths):
        rows = i - start
        if rows and (rows + 1) * max(width, w) > rows * width + w + pass_tokens:
            passes.append(range(start, i))
            start, width = i, w
        else:
            width = max(width, w)
    return [*passes, range(start, len(widths))]


def prefill_row(seq: Sequence) -> list[int]:
    """The tokens whose K/V a prefill of ``seq`` computes: its prompt and all but its last output token."""
    return list(seq.spec.prompt_ids) + seq.output[:-1] if seq.output else list(seq.spec.prompt_ids)
