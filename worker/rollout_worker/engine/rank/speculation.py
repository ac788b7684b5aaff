"""Speculative decoding without a draft model, as a replica runs it (the ``speculative_algorithm`` setting).

Before a decode step the :class:`Speculator` drafts up to k tokens for each running request from a
:class:`~rollout_worker.drafting.suffix_index.DraftIndex` over every request the replica has run: the
request's own prompt and output (a loop drafts itself), its sibling samples, and finished responses (the
index keeps them until its bound evicts them). A step with drafts is a verify step: one forward pass over
each request's last token and its drafts (:func:`verify_inputs`, a prefill over the request's pages), and
the sampler's :func:`~rollout_worker.engine.rank.sampling.verify` emits, for each request, the drafts
plain decoding would have drawn and the first draw that differs: the tokens decoding without
speculation emits, 1 to k+1 of them a step. The K/V written at rejected positions is overwritten as the
request grows (its pages stay with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout_worker.drafting.suffix_index import DraftIndex
from rollout_worker.engine.model.kv_cache import KVPool
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.pages import pages_for


@dataclass
class Speculator:
    k: int  # tokens drafted per request and verify step, at most
    index: DraftIndex = field(default_factory=DraftIndex)

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
            draft = self.index.propose(self.index.docs[rid], k) if k > 0 else None
            out.append(list(draft.tokens) if draft is not None else [])
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
