"""KV memory of the simulated replicas: admission, preemption, and the placement of requests.

A replica of TP size ``T`` holds ``K`` KV tokens (the profile's ``kv_capacity``; unlimited when unknown)
and at most ``max_batch_per_replica`` running requests. Waiting requests are admitted in queue order and the
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
  :mod:`rollout_worker.api.kv_schedule`): the replica holds ``K / page_size`` pages, a request the pages of
  its cached tokens; admission is optimistic (running requests charged their remaining tokens times the
  new-token ratio, which decays every decode step and is raised after a retraction); when the next step
  cannot get its pages, the requests that decoded fewest tokens are retracted to the head of the queue and
  later re-prefilled as under ``sglang``. Tokens are counted as the engine counts them: a running request
  caches its prompt and all but its last generated token.

:func:`balance` places requests over replicas: by work, longest first, each on the replica with the least
work so far (then the fewest requests); with equal work it deals them by count in index order, which is
how requests are dispatched on arrival (the replica with the fewest unfinished requests first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from rollout_worker.api.engine_settings import DEFAULTS
from rollout_worker.api.kv_schedule import SGLANG_RATIO, Req, admit, ratio_after_retraction, to_retract
from rollout_worker.api.pages import pages_for

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
    ) -> None:
        self.policy = policy
        self.max_batch = _NO_LIMIT if max_batch is None else max_batch
        self.tokens, self.prefill_per_ms = tokens, prefill_per_ms
        self.page_size = page_size
        self.pages = pages_for(int(tokens), page_size) if np.isfinite(tokens) else _NO_LIMIT
        self.ratio = [SGLANG_RATIO.init] * replicas  # ``paged``: each replica's new-token ratio
        self._retracted = [False] * replicas  # ``paged``: the next step follows a retraction (no decay)

    # -- paged: the engine's functions on the engine's counts -------------------------------------------
    def _reqs(self, req: Requests, idx: np.ndarray, running: bool) -> list[Req]:
        out = []
        for i in idx:
            r = Req(int(req.prompt[i]), int(req.gen[i]), int(req.cap[i]))
            out.append(replace(r, pages=pages_for(r.kv_len, self.page_size)) if running else r)
        return out

    def _free_pages(self, reqs: list[Req]) -> int:
        return self.pages - sum(r.pages for r in reqs)

    def _admit_paged(self, req: Requests, r: int, queue: np.ndarray, run: np.ndarray) -> int:
        running = self._reqs(req, run, True)
        free = self._free_pages(running)
        room = min(self.max_batch - run.size, queue.size, free + 1)  # each admitted takes a page or more
        if room <= 0:
            return 0
        waiting = self._reqs(req, queue[:room], False)
        ps = self.page_size
        return admit(running, waiting, free, ps, self.ratio[r], self.max_batch, DEFAULTS.max_prefill_tokens)

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
            stall += self._start(req, queue[:k])
            if self.policy != "paged":
                return stall

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
        order = run[np.argsort(req.seq[run], kind="stable")]  # admission order: the engine's tie-break
        running = self._reqs(req, order, True)
        pick = to_retract(running, self._free_pages(running), self.page_size)
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
            if req.on(int(req.rep[run[0]]), WAITING).size:  # the engine tries to admit at every step
                return 1
            return self._steps_with_pages(req, run)
        used = float((req.prompt[run] + req.gen[run]).sum())
        return max(1, int((self.tokens - used) // run.size))

    def _steps_with_pages(self, req: Requests, run: np.ndarray) -> int:
        """The most decode steps whose pages the free pages cover (at least 1: make_room made room)."""
        ps = self.page_size
        kv = req.prompt[run] + np.maximum(req.gen[run] - 1, 0)  # Req.kv_len
        held = np.ceil(kv / ps)
        free = self.pages - float(held.sum())

        def need(n: int) -> float:  # pages that n more steps take (step k writes position kv + k - 1)
            return float((np.ceil((kv + n) / ps) - held).sum())

        hi = 1
        while hi < _NO_LIMIT and need(2 * hi) <= free:
            hi *= 2
        lo, hi = hi, 2 * hi  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
        return lo
