"""Speculative decoding without a draft model, as a replica runs it (the ``speculative_algorithm`` setting).

Before a decode step the :class:`Speculator` drafts up to k tokens for each running request from a
:class:`~rollout_worker.drafting.suffix_index.DraftIndex` over every request the replica has run: the
request's own prompt and output (a loop drafts itself), its sibling samples, and finished responses (the
index keeps them until its bound evicts them); and from the external corpus a trainer adds (the longer
match wins). A step with drafts is a verify step: one forward pass over
each request's last token and its drafts (:func:`verify_inputs`, a prefill over the request's pages), and
the sampler's :func:`~rollout_worker.engine.rank.sampling.verify` emits, for each request, the drafts
plain decoding would have drawn and the first draw that differs: the tokens decoding without
speculation emits, 1 to k+1 of them a step. The K/V written at rejected positions is overwritten as the
request grows (its pages stay with it).

When to verify (the ``speculative_policy`` setting): ``always`` verifies whatever was drafted; ``auto``
verifies only where it pays. A pass over ``n`` token rows costs about ``a + b n`` (a decode step is a pass of
``B`` rows, a verify step of ``B (1 + w)`` rows, every row padded to the widest draft ``w``); the replica's
leader fits ``a`` and ``b`` to its measured steps (:class:`PassCost`) and tells its TP group ``r = b / a``
with the broadcast the ranks already share each step, so every rank decides alike. Each request's drafts
are accepted token by token with a probability learned from its own verify steps (:class:`Acceptance`);
:func:`choose_width` takes the width whose expected tokens per unit of cost is highest, 0 (plain decode)
included. In the bulk phase of a compute-bound device (``r B`` large) or where drafts miss, it is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rollout_worker.drafting.corpus import corpus_index
from rollout_worker.drafting.suffix_index import DraftIndex
from rollout_worker.engine.model.kv_cache import KVPool
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.pages import pages_for

# Cost ratio r = b / a exchanged as an integer (int64 broadcast) in these units.
COST_SCALE = 1_000_000


@dataclass
class PassCost:
    """The leader's fit of a forward pass's time to ``a + b x rows`` over its recent decode and verify steps
    (least squares, older steps weighted down by ``decay`` a step). :meth:`ratio` is ``b / a`` in units of
    :data:`COST_SCALE`: 0 until the rows have varied (a flat fit says nothing of ``b``)."""

    decay: float = 0.98
    s: list[float] = field(default_factory=lambda: [0.0] * 5)  # sum w, w n, w n^2, w t, w n t
    scaled: int = 0

    def add(self, rows: int, ms: float) -> None:
        n, d = float(rows), self.decay
        self.s = [d * x for x in self.s]
        for i, v in enumerate((1.0, n, n * n, ms, n * ms)):
            self.s[i] += v
        w, sn, snn, st, snt = self.s
        var = w * snn - sn * sn
        if var <= 1e-6 * max(w * snn, 1e-12):  # every pass of one size yet: the slope is unknown
            return
        b = max((w * snt - sn * st) / var, 0.0)
        a = (st - b * sn) / w
        a = max(a, 0.05 * st / w)  # a pass has a fixed part; a fit through 0 or below is noise
        self.scaled = min(round(b / a * COST_SCALE), 2**62)

    def ratio(self) -> int:
        return self.scaled


@dataclass
class Acceptance:
    """Per request, its drafted tokens accepted and its verify steps that rejected one: the chance the next
    drafted token is accepted is ``(accepted + 1) / (accepted + rejected + 2)`` (a geometric run, uniform
    prior). Updated from verify results, the same on every rank."""

    seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def p(self, rid: str) -> float:
        acc, rej = self.seen.get(rid, (0, 0))
        return (acc + 1) / (acc + rej + 2)

    def record(self, rid: str, drafted: int, accepted: int) -> None:
        acc, rej = self.seen.get(rid, (0, 0))
        self.seen[rid] = (acc + accepted, rej + (accepted < drafted))

    def forget(self, live: set[str]) -> None:
        for rid in [r for r in self.seen if r not in live]:
            del self.seen[rid]


def choose_width(drafts: list[list[int]], p: list[float], ratio: float) -> int:
    """The draft width to verify (0: a plain decode step): the ``w`` that maximises the expected tokens
    emitted per unit of pass cost, ``sum_i (1 + sum_{m <= min(w, L_i)} p_i^m) / (1 + ratio x B x (1 + w))``
    over the ``B`` requests (draft lengths ``L_i``, acceptance ``p_i``); ties go to the narrower width."""
    rows = len(drafts)
    best_w, best = 0, rows / (1.0 + ratio * rows)
    gain = [0.0] * rows  # expected accepted tokens of each request at the width tried
    for w in range(1, max((len(d) for d in drafts), default=0) + 1):
        for i, d in enumerate(drafts):
            if len(d) >= w:
                gain[i] += p[i] ** w
        rate = (rows + math.fsum(gain)) / (1.0 + ratio * rows * (1 + w))
        if rate > best * (1 + 1e-9):
            best_w, best = w, rate
    return best_w


@dataclass
class Speculator:
    k: int  # tokens drafted per request and verify step, at most
    auto: bool = False  # verify only where it pays (choose_width), else whatever was drafted
    index: DraftIndex = field(default_factory=DraftIndex)  # the replica's requests
    corpus: DraftIndex = field(default_factory=corpus_index)  # text added from outside (the rank's)
    acceptance: Acceptance = field(default_factory=Acceptance)
    ratio: int = 0  # the leader's pass cost ratio b / a (PassCost.ratio), set before each step

    def forget_requests(self) -> None:
        """Empty the index of the replica's requests and their acceptance (``/flush_cache``); the external
        corpus stays."""
        self.index = DraftIndex()
        self.acceptance = Acceptance()

    def _propose(self, context: list[int], k: int) -> list[int]:
        """The draft of the longer match: the replica's requests, or the external corpus (a tie: the
        requests)."""
        own = self.index.propose(context, k)
        ext = self.corpus.propose(context, k) if self.corpus.docs else None
        best = ext if ext is not None and (own is None or ext.matched > own.matched) else own
        return list(best.tokens) if best is not None else []

    def plan(self, seqs: list[Sequence]) -> list[list[int]]:
        """The drafts to verify this step (all empty: decode): :meth:`drafts`, cut to
        :func:`choose_width` under ``auto``."""
        drafts = self.drafts(seqs)
        if not self.auto or not any(drafts):
            return drafts
        p = [self.acceptance.p(s.spec.id) for s in seqs]
        w = choose_width(drafts, p, self.ratio / COST_SCALE)
        return [d[:w] for d in drafts]

    def learn(self, seqs: list[Sequence], drafts: list[list[int]], emitted: list[int]) -> None:
        """Record a verify step's outcome: request i emitted ``emitted[i]`` tokens for ``drafts[i]``."""
        for seq, d, n in zip(seqs, drafts, emitted, strict=True):
            if d:
                self.acceptance.record(seq.spec.id, len(d), max(0, min(n - 1, len(d))))
        if len(self.acceptance.seen) > 4 * max(len(seqs), 64):
            self.acceptance.forget({s.spec.id for s in seqs})

    def drafts(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each request's draft (possibly empty): never past its ``max_new_tokens`` (a verify step emits one
        token more than it accepts). The index learns each request's tokens since its last draft."""
        out = []
        for seq in seqs:
            rid, prompt = seq.spec.id, seq.spec.prompt_ids
            have = self.index.docs.get(rid)
            if have is not None and not len(prompt) <= len(have) <= len(prompt) + len(seq.output):
                self.index.drop(rid)  # another request under a reused id
                have = None
            if have is None:
                self.index.extend(rid, [*prompt, *seq.output])
            else:  # the tokens since its last draft only
                self.index.extend(rid, seq.output[len(have) - len(prompt) :])
            k = min(self.k, seq.remaining - 1)
            out.append(self._propose(self.index.docs[rid], k) if k > 0 else [])
        return out


def extra_pages(seqs: list[Sequence], drafts: list[list[int]], page_size: int) -> int:
    """Pages a verify step takes beyond those its requests hold."""
    return sum(
        max(0, pages_for(s.kv_len + 1 + len(d), page_size) - len(s.pages))
        for s, d in zip(seqs, drafts, strict=True)
    )


def verify_inputs(
    seqs: list[Sequence], drafts: list[list[int]], pool: KVPool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify pass's tokens, positions and K/V slots [B, S] (S = 1 + the longest draft; the rows bound to
    token-table rows 0..B-1 with pages for every position) and the slots it reads [B, L]: row b computes
    its last token and its drafts at positions kv_len.. (padding repeats the last position and writes the
    null slot, as a prefill pass's)."""
    width = 1 + max(len(d) for d in drafts)
    rows = len(seqs)
    tokens = torch.zeros((rows, width), dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    write = torch.zeros((rows, width), dtype=torch.long, device=device)
    keys = 0
    for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
        start, n = seq.kv_len, 1 + len(d)
        tokens[b, :n] = torch.tensor([seq.output[-1], *d])
        positions[b, :n] = torch.arange(start, start + n)
        positions[b, n:] = start + n - 1
        write[b, :n] = pool.table[b, start : start + n]
        keys = max(keys, start + n)
    return tokens.to(device), positions.to(device), write, pool.table[:rows, :keys]
