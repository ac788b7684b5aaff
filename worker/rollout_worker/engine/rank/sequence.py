"""A request in flight on a replica (rank side): the spec, the tokens generated so far, where it ran."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.finish import Finish
from rollout_worker.scheduling.admission import Req


@dataclass(slots=True, eq=False)
class Sequence:
    """``output`` survives every reconfiguration; the KV cache may not. Compared by identity. ``pages``: the
    KV pool's pages this request holds, in position order (empty while it waits)."""

    spec: RequestSpec
    output: list[int] = field(default_factory=list)
    finish: Finish | None = None
    pages: list[int] = field(default_factory=list)
    admitted: int = 0  # when its replica last admitted it (the replica's count of admissions then)

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are cached while running: all but the last sampled token."""
        return len(self.spec.prompt_ids) + max(len(self.output) - 1, 0)

    @property
    def remaining(self) -> int:
        return self.spec.max_new_tokens - len(self.output)

    @property
    def req(self) -> Req:
        """What the KV scheduler (:mod:`rollout_worker.scheduling.admission`) knows of this request."""
        return self.sched()

    def sched(self, shared: int = 0, cached: int = 0) -> Req:
        """:attr:`req`, with ``shared`` of its pages held by others too and ``cached`` prefill tokens."""
        n_prompt, n_out = len(self.spec.prompt_ids), len(self.output)
        return Req(n_prompt, n_out, self.spec.max_new_tokens, len(self.pages), shared, cached)
