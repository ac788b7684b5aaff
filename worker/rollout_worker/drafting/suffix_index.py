"""Drafts without a draft model: a bounded index of token documents (a request's own prompt and output,
its sibling samples, earlier responses to the same prompt, text a trainer adds) that proposes, for a
request's recent tokens, the tokens that followed their longest earlier occurrence.

The index keys every n-gram of ``min_match`` to ``max_match`` tokens to its most recent occurrences (at
most ``per_key`` each). :meth:`DraftIndex.propose` tries the request's last ``max_match`` tokens first and
backs off to shorter suffixes; among the occurrences of the longest suffix that matches it takes the most
recent one with a continuation. Documents grow token by token (:meth:`DraftIndex.extend`: a running
request's output); when the index holds more than ``capacity`` tokens, the least recently extended
documents are evicted with their keys. Pure Python, no torch: a replica's scheduler calls it between
steps.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Draft:
    """Up to k proposed tokens, the length of the suffix they continue, and the document they come from."""

    tokens: tuple[int, ...]
    matched: int
    source: Hashable


@dataclass
class DraftIndex:
    max_match: int = 8  # the longest suffix looked up
    min_match: int = 2  # the shortest (a 1-token match proposes too much noise)
    per_key: int = 4  # occurrences kept per n-gram, the most recent
    capacity: int = 1 << 20  # tokens held in all documents before the least recently extended go
    docs: OrderedDict[Hashable, list[int]] = field(default_factory=OrderedDict)
    keys: dict[tuple[int, ...], deque[tuple[Hashable, int]]] = field(default_factory=dict)
    tokens: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"min_match {self.min_match} must be in 1..max_match ({self.max_match})")
        if self.per_key < 1 or self.capacity < 1:
            raise ValueError(f"per_key ({self.per_key}) and capacity ({self.capacity}) must be >= 1")

    def extend(self, doc: Hashable, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to document ``doc`` (created if new) and index the n-grams they end."""
        have = self.docs.get(doc)
        if have is None:
            have = self.docs[doc] = []
        self.docs.move_to_end(doc)
        for tok in tokens:
            have.append(int(tok))
            end = len(have)
            for n in range(self.min_match, min(self.max_match, end) + 1):
                occ = self.keys.setdefault(tuple(have[end - n :]), deque(maxlen=self.per_key))
                occ.append((doc, end))
            self.tokens += 1
        while self.tokens > self.capacity and len(self.docs) > 1:
            self.drop(next(iter(self.docs)))

    def drop(self, doc: Hashable) -> None:
        """Forget document ``doc`` and its n-grams (nothing when it is not held)."""
        have = self.docs.pop(doc, None)
        if have is None:
            return
        self.tokens -= len(have)
        for end in range(1, len(have) + 1):
            for n in range(self.min_match, min(self.max_match, end) + 1):
                key = tuple(have[end - n : end])
                occ = self.keys.get(key)
                if occ is None:
                    continue
                kept = [o for o in occ if o[0] != doc]
                if kept:
                    self.keys[key] = deque(kept, maxlen=self.per_key)
                else:
                    del self.keys[key]

    def propose(self, context: Sequence[int], k: int) -> Draft | None:
        """At most ``k`` tokens that followed the longest suffix of ``context`` (``min_match`` tokens at
        least) where it occurred last with something after it; None when no suffix matches."""
        if k < 1:
            return None
        for n in range(min(self.max_match, len(context)), self.min_match - 1, -1):
            occ = self.keys.get(tuple(context[len(context) - n :]))
            if not occ:
                continue
            for doc, end in reversed(occ):
                after = self.docs[doc][end : end + k]
                if after:
                    return Draft(tuple(after), n, doc)
        return None
