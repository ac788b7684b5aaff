"""The scheduler's KV decisions, as pure functions of counts (no tensors, no engine): which waiting requests
a replica admits, which running requests it retracts when a decode step cannot get its pages, and the
running estimate of future growth (SGLang's ``new_token_ratio``). The engine's replica calls them every
step; a simulator can import the same functions to make the same decisions.

Admission is optimistic, as SGLang's ``PrefillAdder``: a request is admitted by the pages its prefill
takes now plus an estimate of what the running requests will still take, ``min(remaining, CLIP) * ratio``
tokens each, not by ``prompt + max_new_tokens``. A request admitted in the same round is charged its
whole (clipped) remaining length plus a page of slack, so one round never overcommits by itself. The
ratio starts at 0.7, decays by ``(0.7 - 0.098) / 600`` per decode step to a floor of 0.098, and after a
retraction is raised to what the requests still running have actually needed
(``(decoded + 20 per request) / max_new_tokens``, at most 1).

Retraction (when the free pages cannot cover the pages the next decode step needs): requests leave in the
order SGLang retracts them, fewest tokens decoded first and, among equals, longest prompt first, until the
others fit. The request that has decoded least loses least: its KV is rebuilt by one prefill of prompt +
generated tokens (a batched, parallel pass), while the decode steps it took were sequential, so the work
thrown away grows with what was decoded; among equals the longest prompt gives back the most pages. The
longest-decoded request is retracted last (it is also the nearest to finishing and freeing everything).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollout_worker.scheduling.pages import pages_for

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_DECODE_STEPS = 20  # SGLang: steps of slack per request when the ratio is re-estimated


@dataclass(frozen=True, slots=True)
class RatioPolicy:
    """SGLang's defaults: ``SGLANG_INIT_NEW_TOKEN_RATIO`` 0.7, ``..._MIN_..._FACTOR`` 0.14, decay over 600
    decode steps."""

    init: float = 0.7
    min_factor: float = 0.14
    decay_steps: int = 600

    @property
    def floor(self) -> float:
        return self.init * self.min_factor

    def decayed(self, ratio: float) -> float:
        """The ratio after a decode step that retracted nothing."""
        step = (self.init - self.floor) / self.decay_steps
        return max(ratio - step, self.floor)


SGLANG_RATIO = RatioPolicy()


@dataclass(frozen=True, slots=True)
class Req:
    """What the scheduler knows of one request: prompt tokens, tokens generated, its ``max_new_tokens``,
    the pages it holds (0 while waiting) and how many of them other requests hold too (a retraction does
    not free those), and, while waiting, the tokens of its prefill the prefix cache already holds."""

    prompt: int
    generated: int
    max_new: int
    pages: int = 0
    shared: int = 0
    cached: int = 0

    @property
    def remaining(self) -> int:
        return max(self.max_new - self.generated, 0)

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are cached while running (all but the last sampled token), which is also what a
        (re-)prefill computes."""
        return self.prompt + max(self.generated - 1, 0)

    def step_pages(self, page_size: int) -> int:
        """Pages the next decode step needs beyond those held (it writes the K/V of position ``kv_len``)."""
        return max(pages_for(self.kv_len + 1, page_size) - self.pages, 0)


def clipped_remaining(running: Iterable[Req]) -> int:
    """The tokens the running requests may still take, each clipped at ``CLIP_MAX_NEW_TOKENS``."""
    return sum(min(r.remaining, CLIP_MAX_NEW_TOKENS) for r in running)


def admit(
    running: Sequence[Req],
    waiting: Iterable[Req],
    free_pages: int,
    page_size: int,
    ratio: float,
    max_batch: int,
    max_prefill_tokens: int,
) -> int:
    """How many requests from the head of ``waiting`` to prefill now (in order; admission stops at the
    first that does not fit, so the queue is served first come, first served)."""
    return admit_counts(
        len(running),
        clipped_remaining(running),
        waiting,
        free_pages,
        page_size,
        ratio,
        max_batch,
        max_prefill_tokens,
    )


def admit_counts(
    n_running: int,
    running_clipped: int,
    waiting: Iterable[Req],
    free_pages: int,
    page_size: int,
    ratio: float,
    max_batch: int,
    max_prefill_tokens: int,
) -> int:
    """:func:`admit` given only the number of running requests and their :func:`clipped_remaining` (what a
    simulator holding arrays computes at once). ``waiting`` is read lazily, only as far as admission goes."""
    rem = free_pages * page_size - running_clipped * ratio
    free, n, prefill = free_pages, 0, 0
    for w in waiting:
        if n_running + n >= max_batch:
            break
        fill = w.kv_len - w.cached  # the tokens its prefill computes
        if n and prefill + fill > max_prefill_tokens:
            break
        cached_pages = w.cached // page_size
        now = pages_for(w.kv_len, page_size) - cached_pages  # the pages it takes
        first = pages_for(w.kv_len + (1 if w.remaining else 0), page_size) - cached_pages  # and 1st decode
        grow = min(w.remaining, CLIP_MAX_NEW_TOKENS)
        alone = not n_running and n == 0  # an idle replica takes its first request whenever it can step
        if first > free or (not alone and now * page_size + grow + page_size >= rem):
            break
        rem -= now * page_size + grow
        free -= now
        n += 1
        prefill += fill
    return n


def to_retract(running: Sequence[Req], free_pages: int, page_size: int) -> list[int]:
    """Indices into ``running`` of the requests to retract so that every other one gets the pages of its
    next decode step (empty when they all fit). One request is never retracted: it always fits, since a
    request's prompt + max_new_tokens is checked against the pool when it is submitted."""
    need = sum(r.step_pages(page_size) for r in running)
    if need <= free_pages:
        return []
    order = sorted(range(len(running)), key=lambda i: (running[i].generated, -running[i].prompt, i))
    out: list[int] = []
    free = free_pages
    for i in order:
        if need <= free or len(out) == len(running) - 1:
            break
        out.append(i)
        free += running[i].pages - running[i].shared
        need -= running[i].step_pages(page_size)
    return out


def ratio_after_retraction(still_running: Sequence[Req]) -> float:
    """SGLang's re-estimate after a retraction, from the requests still running: (tokens they decoded +
    20 steps each) / their max_new_tokens, at most 1."""
    decoded = sum(r.generated for r in still_running)
    total = sum(r.max_new for r in still_running)
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(still_running)) / (total + 1))
