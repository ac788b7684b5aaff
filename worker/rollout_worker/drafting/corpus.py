"""Speculative decoding's external corpus: text a trainer adds (SGLang's ``/add_external_corpus``), as token
documents in a :class:`~rollout_worker.drafting.suffix_index.DraftIndex` of its own. Each rank holds one, so
it outlives layout switches (every new replica's speculator drafts from it); it is never evicted (the
driver refuses documents beyond :data:`CORPUS_TOKENS`). A document's key is ``(corpus id, its index)``."""

from __future__ import annotations

from rollout_worker.drafting.suffix_index import DraftIndex

# Tokens the external corpus (text a trainer adds, ``/add_external_corpus``) holds at most, on every rank.
CORPUS_TOKENS = 1 << 21  # a few hundred bytes a token: at most about 600 MB a rank


def corpus_index() -> DraftIndex:
    """An empty external corpus."""
    return DraftIndex(capacity=CORPUS_TOKENS + 1)


def add_corpus(corpus: DraftIndex, corpus_id: str, documents: tuple[tuple[int, ...], ...]) -> None:
    for i, doc in enumerate(documents):
        corpus.extend((corpus_id, i), doc)


def remove_corpus(corpus: DraftIndex, corpus_id: str) -> None:
    for key in [k for k in corpus.docs if isinstance(k, tuple) and k[0] == corpus_id]:
        corpus.drop(key)
