"""The draft index: the longest suffix that occurred before proposes what followed it (the most recent
occurrence with a continuation), within the request's own tokens (loops) and across documents (siblings,
earlier responses); bounded occurrences per key and bounded tokens, the least recently extended documents
evicted with their keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_worker.drafting.suffix_index import Draft, DraftIndex


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    idx = DraftIndex(max_match=4, min_match=2)
    idx.extend("old", [5, 6, 7, 8, 9, 10])  # 6 7 8 -> 9 10
    idx.extend("new", [1, 7, 8, 2, 3])  # 7 8 -> 2 3, more recent but shorter
    assert idx.propose([0, 6, 7, 8], 2) == Draft((9, 10), 3, "old")
    assert idx.propose([0, 0, 7, 8], 2) == Draft((2, 3), 2, "new")  # equal length: the most recent


def test_a_request_drafts_its_own_loop() -> None:
    idx = DraftIndex(max_match=3, min_match=2)
    out = [4, 1, 2, 3, 1, 2, 3, 1, 2]
    idx.extend("r0", out)
    # its own last occurrence of 1 2 (the end) has nothing after it; the one before proposes the loop
    assert idx.propose(out, 4) == Draft((3, 1, 2), 3, "r0")
    assert idx.propose(out, 2) == Draft((3, 1), 3, "r0")
    assert idx.propose([9, 9], 3) is None
    assert idx.propose([2], 3) is None  # shorter than min_match
    assert idx.propose(out, 0) is None


def test_occurrences_per_key_are_bounded_to_the_most_recent() -> None:
    idx = DraftIndex(max_match=2, min_match=2, per_key=2)
    for i in range(4):
        idx.extend(f"d{i}", [1, 2, 10 + i])
    assert len(idx.keys[(1, 2)]) == 2
    assert idx.propose([1, 2], 1) == Draft((13,), 2, "d3")


def test_capacity_evicts_the_least_recently_extended_document_and_its_keys() -> None:
    idx = DraftIndex(max_match=3, min_match=2, capacity=10)
    idx.extend("a", [1, 2, 3, 4])
    idx.extend("b", [5, 6, 7, 8])
    idx.extend("a", [9])  # a is extended last: b is now the oldest
    idx.extend("c", [1, 5, 6])  # 12 tokens > 10: b goes
    assert list(idx.docs) == ["a", "c"] and idx.tokens == 8
    assert all(doc != "b" for occ in idx.keys.values() for doc, _ in occ)
    assert (6, 7) not in idx.keys and idx.propose([5, 6], 2) is None  # c's 5 6 has nothing after it
    assert idx.propose([2, 3], 2) == Draft((4, 9), 2, "a")
    idx.drop("a")
    idx.drop("nothing")
    assert idx.tokens == 3 and all(doc == "c" for occ in idx.keys.values() for doc, _ in occ)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"min_match 3 must be in 1\.\.max_match"):
        DraftIndex(max_match=2, min_match=3)
    with pytest.raises(ValueError, match="per_key"):
        DraftIndex(per_key=0)


@settings(max_examples=200, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4),
    context=st.lists(st.integers(0, 3), max_size=8),
    k=st.integers(1, 5),
)
def test_a_proposal_is_what_followed_the_longest_matching_suffix(
    docs: list[list[int]], context: list[int], k: int
) -> None:
    """Against a brute force over every document (occurrences unbounded): the matched length is the longest
    suffix (2 to 4 tokens) with an occurrence that has a continuation, and the tokens are what followed one
    of its occurrences."""
    idx = DraftIndex(max_match=4, min_match=2, per_key=1000)
    for i, d in enumerate(docs):
        idx.extend(i, d)
    best = 0
    for n in range(min(4, len(context)), 1, -1):
        suffix = context[len(context) - n :]
        if any(d[e - n : e] == suffix and e < len(d) for d in docs for e in range(n, len(d) + 1)):
            best = n
            break
    got = idx.propose(context, k)
    if best == 0:
        assert got is None
        return
    assert got is not None and got.matched == best
    d = docs[int(got.source)]  # type: ignore[call-overload]
    suffix = context[len(context) - best :]
    assert any(d[e - best : e] == suffix and tuple(d[e : e + k]) == got.tokens for e in range(best, len(d)))
