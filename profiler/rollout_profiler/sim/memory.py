"""KV memory of the simulated replicas: admission, preemption, and the placement of requests.

A replica of TP size ``T`` holds ``K`` KV tokens (the profile's ``kv_capacity``; unlimited when unknown)
and at most ``max_batch`` running requests. Waiting requests are admitted in queue order and the
queue never skips its head (first come, first served):

* ``engine`` (what elastic-rollout's engine does): a request is admitted when it fits the tokens not yet
  *reserved*, every running request reserving prompt + max_new_tokens. Memory never runs out, nothing is
  preempted.
* ``sglang`` (SGLang's optimistic admission): a request is admitted when its current tokens (prompt +
  generated so far) and one more token for each running request fit what is *used* now. When the next step
  does not fit, the newest running request is preempted: its KV cache is dropped, it goes back to the head
  of the queue, and when it is admitted again its prompt + generated tokens are re-prefilled at the
  replica's share of the pod's prefill rate (``costs.recompute_tokens_per_ms x T / G``), which stalls that
  replica.
* ``paged`` (what the engine's paged pool does, decided by the engine's own functions,
  :mod:`rollout_worker.scheduling.admission`): the replica holds ``K / page_size`` pages, a request the pages
  of
  its cached tokens; admission is optimistic (running requests charged their remaining tokens times the
  new-token ratio, which decays every decode step and is raised after a retraction); when the next step
  cannot get its pages, the requests that decoded fewest tokens are retracted to the head of the queue and
  later re-prefilled. Each round of admissions is one prefill step, as in the engine: its tokens (fresh
  prompts and re-prefills) at the prefill rate, and never less than a decode step of as many rows; it
  samples each fresh request's first token. Tokens are counted as the engine counts them: a running
  request caches its prompt and all but its last generated token.

:func:`balance` places requests over replicas: by work, longest first, each on the replica with the least
work so far (then the fewest requests); with equal work it deals them by count in index order, which is
how requests are dispatched on arrival (the replica with the fewest unfinished requests first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from rollout_worker.config.engine_settings import DEFAULTS
from rollout_worker.scheduling.admission import (
    CLIP_MAX_NEW_TOKENS,
    SGLANG_RATIO,
    Req,
    admit_counts,
    ratio_after_retraction,
    to_retract,
)
from rollout_worker.scheduling.pages import pages_for

WAITING, RUNNING, DONE = 0, 1, 2
_NO_LIMIT = 1 << 40


@dataclass(slots=True)
class Requests:
    """Every request of a run: what it is (prompt, cap, length) and where it stands."""

    prompt: np.ndarray
    cap: np.ndarray
    lengths: np.ndarray
    gen: np.ndarray  # tokens generated so far
    status: np.ndarray  # WAITING, RUNNING, DONE
    rep: np.ndarray  # replica
    qkey: np.ndarray  # queue order on its replica (smaller first)
    seq: np.ndarray  # admission order (larger = newer)
    has_kv: np.ndarray  # its KV cache is in memory (else: re-prefill when admitted, if it generated any)
    next_seq: int = 0
    front: float = 0.0
    preemptions: int = 0
    recomputed: float = 0.0

    @classmethod
    def start(cls, prompt: np.ndarray, cap: np.ndarray, lengths: np.ndarray, start_gen: float) -> Requests:
        n = lengths.size
        return cls(
            prompt,
            cap,
            lengths,
            gen=np.minimum(np.full(n, float(start_gen)), lengths),
            status=np.where(lengths <= start_gen, DONE, WAITING).astype(np.int8),
            rep=np.zeros(n, dtype=np.int64),
            qkey=np.arange(n, dtype=float),
            seq=np.zeros(n, dtype=np.int64),
            has_kv=np.full(n, start_gen > 0),
        )

    def on(self, r: int, status: int) -> np.ndarray:
        return np.nonzero((self.rep == r) & (self.status == status))[0]


def balance(work: np.ndarray, idx: np.ndarray, replicas: int) -> np.ndarray:
    """Replica of each request in ``idx``: longest-processing-time-first on ``work`` (ties: index order)."""
    out = np.zeros(idx.size, dtype=np.int64)
    if replicas == 1 or idx.size == 0:
        return out
    w = np.asarray(work, dtype=float)[idx]
    if not np.any(w != w[0]):  # equal work: deal by count
        return np.arange(idx.size, dtype=np.int64) % replicas
    load = np.zeros(replicas)
    count = np.zeros(replicas, dtype=np.int64)
    for k in np.argsort(-w, kind="stable"):
        r = int(np.lexsort((count, load))[0])
        out[k] = r
        load[r] += w[k]
        count[r] += 1
    return out


class Admission:
    """Admission and preemption on the replicas of one layout (module docstring). ``tokens``: the KV
    tokens of one replica (inf: unlimited); ``prefill_per_ms``: one replica's re-prefill rate."""

    def __init__(
        self,
        policy: str,
        max_batch: int | None,
        tokens: float,
        prefill_per_ms: float,
        replicas: int = 1,
        page_size: int = 1,
        step_ms: Callable[[int, float], float] | None = None,
    ) -> None:
        self.policy = policy
        self.step_ms = step_ms  # ``paged``: a replica's decode step at (batch, context), a prefill's floor
        self.max_batch = _NO_LIMIT if max_batch is None else max_batch
        self.tokens, self.prefill_per_ms = tokens, prefill_per_ms
        self.page_size = page_size
        self.pages = pages_for(int(tokens), page_size) if np.isfinite(tokens) else _NO_LIMIT
        self.ratio = [SGLANG_RATIO.init] * replicas  # ``paged``: each replica's new-token ratio
        self._retracted = [False] * replicas  # ``paged``: the next step follows a retraction (no decay)

    # -- paged: the engine's functions on the engine's counts -------------------------------------------
    # The arrays give at once what the engine's ``Req`` objects give one by one: ``kv`` is ``Req.kv_len``,
    # ``held`` the pages of a running request (``pages_for(kv_len)``), and the scheduler's functions
    # (``admit_counts``, ``to_retract``) decide. Objects are built only where a decision needs them.
    def _reqs(self, req: Requests, idx: np.ndarray, running: bool) -> list[Req]:
        ps, out = self.page_size, []
        for p, g, c in zip(
            req.prompt[idx].tolist(), req.gen[idx].tolist(), req.cap[idx].tolist(), strict=True
        ):
            out.append(Req(p, g, c, pages_for(p + max(g - 1, 0), ps) if running else 0))
        return out

    @staticmethod
    def _waiting(req: Requests, queue: np.ndarray) -> Iterator[Req]:
        for p, g, c in zip(
            req.prompt[queue].tolist(), req.gen[queue].tolist(), req.cap[queue].tolist(), strict=True
        ):
            yield Req(p, g, c)

    def _kv(self, req: Requests, run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each running request's cached tokens (``Req.kv_len``) and the pages holding them."""
        kv = req.prompt[run] + np.maximum(req.gen[run] - 1, 0)
        return kv, np.ceil(kv / self.page_size)

    def _admit_paged(self, req: Requests, r: int, queue: np.ndarray, run: np.ndarray) -> int:
        _, held = self._kv(req, run)
        free = self.pages - int(held.sum())
        room = min(self.max_batch - run.size, queue.size, free + 1)  # each admitted takes a page or more
        if room <= 0:
            return 0
        left = np.minimum(
            np.maximum(req.cap[run] - req.gen[run], 0), CLIP_MAX_NEW_TOKENS
        )  # clipped_remaining
        return admit_counts(
            int(run.size),
            int(left.sum()),
            self._waiting(req, queue[:room]),
            free,
            self.page_size,
            self.ratio[r],
            self.max_batch,
            DEFAULTS.max_prefill_tokens,
        )

    def carry(self, req: Requests, r: int, idx: np.ndarray) -> np.ndarray:
        """``paged``: a switch carries the KV of requests ``idx`` (in their old slot order) onto replica
        ``r``; those that keep running there, as the engine's placement keeps them
        (``rollout_worker.engine.rank.migration.place``): one at a time, each when :func:`admit_counts` would
        admit it beside those kept before it. They run at once, with no prefill (their KV is moved or
        recomputed by the switch, which the switch's cost prices); the others wait, their KV dropped
        (re-prefilled when admitted). Returns the kept ones."""
        ps, free, n, left, keep = self.page_size, self.pages, 0, 0, []
        for i, q in zip(idx.tolist(), self._reqs(req, idx, False), strict=True):
            if admit_counts(n, left, [q], free, ps, self.ratio[r], self.max_batch, 1) == 1:
                keep.append(i)
                free -= pages_for(q.kv_len, ps)
                n += 1
                left += min(q.remaining, CLIP_MAX_NEW_TOKENS)
        kept = np.asarray(keep, dtype=np.int64)
        req.has_kv[np.setdiff1d(idx, kept)] = False
        if kept.size:
            req.status[kept] = RUNNING
            req.has_kv[kept] = True
            req.seq[kept] = np.arange(req.next_seq, req.next_seq + kept.size)
            req.next_seq += kept.size
        return kept

    def stepped(self, r: int, steps: int) -> None:
        """``steps`` decode steps of replica ``r`` retracted nothing: its ratio decays as the engine's."""
        if self.policy == "paged":
            ratio = self.ratio[r]
            steps -= self._retracted[r]  # the step that retracted set the ratio instead
            self._retracted[r] = False
            for _ in range(min(steps, SGLANG_RATIO.decay_steps + 1)):
                ratio = SGLANG_RATIO.decayed(ratio)
            self.ratio[r] = ratio

    def _need(self, req: Requests, idx: np.ndarray) -> np.ndarray:
        if self.policy == "engine":
            return req.prompt[idx] + req.cap[idx]
        return req.prompt[idx] + req.gen[idx]

    def admit(self, req: Requests, r: int) -> float:
        """Admit what fits on replica ``r``; returns the ms it stalls re-prefilling preempted requests.
        ``paged`` admits round after round while a round admits something, as the engine prefills step
        after step (a request admitted in a round is charged more than a running one)."""
        stall = 0.0
        while True:
            queue = req.on(r, WAITING)
            if queue.size == 0:
                return stall
            queue = queue[np.argsort(req.qkey[queue], kind="stable")]
            run = req.on(r, RUNNING)
            if self.policy == "paged":
                k = self._admit_paged(req, r, queue, run)
            else:
                need = np.cumsum(self._need(req, queue)) + float(self._need(req, run).sum())
                slots = run.size + np.arange(1, queue.size + 1)
                if self.policy == "sglang":
                    need = need + slots  # room for the next step of every running request
                fits = (need <= self.tokens) & (slots <= self.max_batch)
                k = queue.size if fits.all() else int(np.argmin(fits))  # first come, first served
            if k == 0:
                return stall
            if self.policy != "paged":
                return stall + self._start(req, queue[:k])
            stall += self._prefill_ms(req, queue[:k])
            self._start(req, queue[:k])

    def _prefill_ms(self, req: Requests, new: np.ndarray) -> float:
        """``paged``: one prefill step of ``new`` (the engine prefills each round of admissions in one step,
        in forward passes of like widths): its tokens at the prefill rate, and never less than a decode step
        of as many rows."""
        kv = req.prompt[new] + np.maximum(req.gen[new] - 1, 0)  # what a (re-)prefill computes: Req.kv_len
        ms = float(kv.sum()) / max(self.prefill_per_ms, 1e-12)
        if self.step_ms is not None:
            ms = max(ms, self.step_ms(int(new.size), float(kv.mean())))
        return ms

    def _start(self, req: Requests, new: np.ndarray) -> float:
        """``new`` run; returns the ms of re-prefilling those that had generated tokens before."""
        redo = new[~req.has_kv[new] & (req.gen[new] > 0)]
        if self.policy == "paged":  # the engine's prefill samples a fresh request's first token
            fresh = new[(req.gen[new] == 0) & (req.lengths[new] > 1)]
            req.gen[fresh] = 1
        req.status[new] = RUNNING
        req.seq[new] = np.arange(req.next_seq, req.next_seq + new.size)
        req.next_seq += new.size
        req.has_kv[new] = True
        if redo.size == 0:
            return 0.0
        redo_tokens = float((req.prompt[redo] + req.gen[redo]).sum())
        req.recomputed += redo_tokens
        return redo_tokens / max(self.prefill_per_ms, 1e-12)

    def make_room(self, req: Requests, r: int) -> np.ndarray:
        """``sglang``: preempt the newest requests until the next step fits; ``paged``: retract what the
        engine retracts; returns the running ones."""
        run = req.on(r, RUNNING)
        if self.policy == "paged":
            return self._retract_paged(req, r, run)
        if self.policy != "sglang" or run.size <= 1:
            return run
        used = float((req.prompt[run] + req.gen[run]).sum())
        if used + run.size <= self.tokens:
            return run
        order = run[np.argsort(-req.seq[run], kind="stable")]  # newest first
        sizes = req.prompt[order] + req.gen[order]
        drop = 0
        while run.size - drop > 1 and used + (run.size - drop) > self.tokens:
            used -= float(sizes[drop])
            drop += 1
        self._requeue(req, order[:drop])
        return np.sort(order[drop:])

    def _retract_paged(self, req: Requests, r: int, run: np.ndarray) -> np.ndarray:
        kv, held = self._kv(req, run)
        if _pages_for_steps(kv, held, 1, self.page_size) <= self.pages - float(held.sum()):
            return run  # the next step gets its pages: to_retract would retract nothing
        order = run[np.argsort(req.seq[run], kind="stable")]  # admission order: the engine's tie-break
        running = self._reqs(req, order, True)
        pick = to_retract(running, self.pages - sum(q.pages for q in running), self.page_size)
        if not pick:
            return run
        out = order[pick]
        self._requeue(req, out, in_order=True)
        kept = np.setdiff1d(run, out)
        self.ratio[r] = ratio_after_retraction(self._reqs(req, kept, True))
        self._retracted[r] = True
        return kept

    def _requeue(self, req: Requests, out: np.ndarray, in_order: bool = False) -> None:
        """Back to the head of the queue (``out[0]`` first with ``in_order``, else last), their KV dropped
        (re-prefilled later)."""
        req.status[out] = WAITING
        req.has_kv[out] = False
        req.front -= 1.0
        rank = out.size - np.arange(out.size) if in_order else np.arange(out.size)
        req.qkey[out] = req.front - rank * 1e-6
        req.preemptions += int(out.size)

    def held(self, req: Requests, run: np.ndarray) -> float:
        """KV tokens the running requests hold now; never above the replica's capacity (a step beyond it
        would be a state no engine can be in, like an infeasible profile point)."""
        used = float((req.prompt[run] + req.gen[run]).sum())
        if used > self.tokens:
            raise RuntimeError(
                f"internal: a replica holds {used:.0f} KV tokens, its capacity is {self.tokens:.0f}"
            )
        return used

    def steps_that_fit(self, req: Requests, run: np.ndarray) -> int:
        """Steps before the used tokens outgrow the replica (``sglang``) or a step cannot get its pages
        (``paged``); unlimited under ``engine``."""
        if self.policy == "engine" or not np.isfinite(self.tokens):
            return _NO_LIMIT
        if self.policy == "paged":
            r = int(req.rep[run[0]])
            queue = req.on(r, WAITING)
            steps = self._steps_with_pages(req, run)
            if queue.size:  # the engine tries to admit at every step: the segment ends where it might
                steps = min(steps, self._steps_admitting_none(req, r, run, queue))
            return steps
        used = float((req.prompt[run] + req.gen[run]).sum())
        return max(1, int((self.tokens - used) // run.size))

    def _steps_admitting_none(self, req: Requests, r: int, run: np.ndarray, queue: np.ndarray) -> int:
        """Decode steps from now during which :func:`admit_counts` provably admits nothing (at least 1), so
        the simulation need not ask it at every step. While the batch is constant the free pages only
        shrink and what the running requests may still take, ``ratio x clipped_remaining``, shrinks by at
        most ``batch x ratio + decay x remaining`` per step; the head of the queue is admitted only when its
        pages, growth and a page of slack fit under that (``admit_counts``), so no step before the bound
        first allows it can admit."""
        if run.size >= self.max_batch:
            return _NO_LIMIT  # nothing is admitted before a request finishes (the segment's end)
        head = queue[np.argmin(req.qkey[queue])]
        w, ps = Req(int(req.prompt[head]), int(req.gen[head]), int(req.cap[head])), self.page_size
        need = pages_for(w.kv_len, ps) * ps + min(w.remaining, CLIP_MAX_NEW_TOKENS) + ps
        _, held = self._kv(req, run)
        room = (self.pages - float(held.sum())) * ps
        left = float(np.minimum(np.maximum(req.cap[run] - req.gen[run], 0), CLIP_MAX_NEW_TOKENS).sum())
        step = (SGLANG_RATIO.init - SGLANG_RATIO.floor) / SGLANG_RATIO.decay_steps
        ratio, batch = self.ratio[r], float(run.size)

        def may_admit(k: int) -> bool:  # an upper bound of admit_counts' room after k steps exceeds need
            low_ratio = max(ratio - k * step - 1e-9, SGLANG_RATIO.floor - 1e-9)
            return room - low_ratio * max(left - batch * k, 0.0) > need

        if may_admit(1):
            return 1
        hi = 2
        while not may_admit(hi):
            if hi >= _NO_LIMIT:
                return _NO_LIMIT
            hi *= 2
        lo = hi // 2  # not may_admit(lo), may_admit(hi): the bound is monotone in k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if may_admit(mid) else (mid, hi)
        return hi

    def _steps_with_pages(self, req: Requests, run: np.ndarray) -> int:
        """The most decode steps whose pages the free pages cover (at least 1: make_room made room)."""
        kv, held = self._kv(req, run)
        free = self.pages - float(held.sum())

        def need(n: int) -> float:
            return _pages_for_steps(kv, held, n, self.page_size)

        hi = 1
        while hi < _NO_LIMIT and need(2 * hi) <= free:
            hi *= 2
        lo, hi = hi, 2 * hi  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
        return lo


def _pages_for_steps(kv: np.ndarray, held: np.ndarray, n: int, page_size: int) -> float:
    """Pages that ``n`` more decode steps take beyond those ``held`` by requests of ``kv`` cached tokens
    (step k writes position kv + k - 1; ``n`` = 1: the sum of their ``Req.step_pages``)."""
    return float((np.ceil((kv + n) / page_size) - held).sum())
