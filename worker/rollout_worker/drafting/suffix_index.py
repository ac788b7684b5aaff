"""Drafts without a draft model: a bounded index of token documents (a request's own prompt and output,
its sibling samples, earlier responses to the same prompt, text a trainer adds) that proposes, for a
request's recent tokens, the tokens that followed their longest earlier occurrence.

The index keys every ``min_match``-gram (the *anchor*) to its most recent occurrences (at most ``per_key``).
:meth:`DraftIndex.propose` looks up the request's last ``min_match`` tokens and, among the anchor's
occurrences that have a continuation, takes the one whose preceding tokens match the request's furthest
back (up to ``max_match`` tokens; the most recent on a tie). One key per token keeps the index small (a few
hundred bytes a token; keying every n-gram up to ``max_match`` took kilobytes). Documents grow token by
token (:meth:`DraftIndex.extend`: a running request's output); when the index holds more than
``capacity`` tokens, the least recently extended documents are evicted with their occurrences. Pure
Python, no torch: a replica's scheduler calls it between steps.
"""

from __future__ import annotations

from collections import OrderedDict
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
    max_match: int = 8  # the longest suffix compared
    min_match: int = 2  # the anchor looked up, and the shortest match (1 token proposes too much noise)
    per_key: int = 16  # occurrences kept per anchor, the most recent
    capacity: int = 1 << 20  # tokens held in all documents before the least recently extended go
    docs: OrderedDict[Hashable, list[int]] = field(default_factory=OrderedDict)
    keys: dict[tuple[int, ...], list[tuple[Hashable, int]]] = field(default_factory=dict)
    tokens: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"min_match {self.min_match} must be in 1..max_match ({self.max_match})")
        if self.per_key < 1 or self.capacity < 1:
            raise ValueError(f"per_key ({self.per_key}) and capacity ({self.capacity}) must be >= 1")

    def extend(self, doc: Hashable, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to document ``doc`` (created if new) and index the anchors they end."""
        have = self.docs.get(doc)
        if have is None:
            have = self.docs[doc] = []
        self.docs.move_to_end(doc)
        n = self.min_match
        for tok in tokens:
            have.append(int(tok))
            end = len(have)
            self.tokens += 1
            if end < n:
                continue
            occ = self.keys.setdefault(tuple(have[end - n :]), [])
            occ.append((doc, end))
            if len(occ) > self.per_key:
                del occ[0]
        while self.tokens > self.capacity and len(self.docs) > 1:
            self.drop(next(iter(self.docs)))

    def drop(self, doc: Hashable) -> None:
        """Forget document ``doc`` and its occurrences (nothing when it is not held)."""
        have = self.docs.pop(doc, None)
        if have is None:
            return
        self.tokens -= len(have)
        n = self.min_match
        for end in range(n, len(have) + 1):
            key = tuple(have[end - n : end])
            occ = self.keys.get(key)
            if occ is None:
                continue
            kept = [o for o in occ if o[0] != doc]
            if kept:
                self.keys[key] = kept
            else:
                del self.keys[key]

    def propose(self, context: Sequence[int], k: int) -> Draft | None:
        """At most ``k`` tokens that followed the longest suffix of ``context`` (``min_match`` tokens at
        least, ``max_match`` at most) among the anchor's kept occurrences with something after them (the
        most recent of the longest); None when none has."""
        n, top = self.min_match, min(self.max_match, len(context))
        if k < 1 or len(context) < n:
            return None
        occ = self.keys.get(tuple(context[len(context) - n :]))
        best: tuple[int, Hashable, int] | None = None
        for doc, end in reversed(occ or ()):
            have = self.docs[doc]
            if end >= len(have):
                continue  # nothing after it (yet)
            m = n
            while m < top and m < end and have[end - 1 - m] == context[-1 - m]:
                m += 1
            if best is None or m > best[0]:
                best = (m, doc, end)
                if m == top:
                    break
        if best is None:
            return None
        m, doc, end = best
        return Draft(tuple(self.docs[doc][end : end + k]), m, doc)
