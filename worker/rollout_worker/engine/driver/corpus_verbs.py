"""The driver's corpus verbs (speculative decoding's external corpus, SGLang's ``/add_external_corpus``):
every rank adds or drops the same documents at a step boundary, so the ranks of a replica draft alike. The
driver keeps what each corpus holds (its tokens), refuses a corpus beyond the ranks' bound before sending
anything, and lists them."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from rollout_worker.drafting.corpus import CORPUS_TOKENS
from rollout_worker.engine import messages as m
from rollout_worker.engine.driver.shared import Shared
from rollout_worker.errors import UserError


class CorpusVerbs:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._held: dict[str, int] = {}  # corpus id -> tokens
        self._lock = threading.Lock()

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)

    def add(self, corpus_id: str, documents: Sequence[Sequence[int]]) -> int:
        """Every rank adds ``documents`` under ``corpus_id``; returns the tokens added."""
        if self._shared.cfg.engine.speculative_algorithm == "none":
            raise UserError(
                "speculative decoding is off (start with --speculative-algorithm ngram)", "corpus_id"
            )
        docs = tuple(tuple(int(t) for t in d) for d in documents if len(d))
        if not docs:
            raise UserError("no document has any token", "documents")
        tokens = sum(len(d) for d in docs)
        with self._shared.one_at_a_time:
            with self._lock:
                if corpus_id in self._held:
                    raise UserError(f"corpus {corpus_id!r} exists; remove it first", "corpus_id")
                total = sum(self._held.values()) + tokens
                if total > CORPUS_TOKENS:
                    raise UserError(
                        f"the corpora would hold {total} tokens, more than {CORPUS_TOKENS}", "documents"
                    )
            self._shared.on_every_rank(lambda ticket: m.AddCorpus(corpus_id, docs, ticket), None)
            with self._lock:
                self._held[corpus_id] = tokens
        return tokens

    def remove(self, corpus_id: str) -> None:
        """Every rank drops ``corpus_id``'s documents."""
        with self._shared.one_at_a_time:
            with self._lock:
                if corpus_id not in self._held:
                    raise UserError(f"no corpus {corpus_id!r}", "corpus_id")
            self._shared.on_every_rank(lambda ticket: m.RemoveCorpus(corpus_id, ticket), None)
            with self._lock:
                del self._held[corpus_id]
