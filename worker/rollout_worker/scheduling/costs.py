"""The one reconfiguration cost model, shared by the engine (which picks migrate or recompute when it
switches) and the planner and simulator (which predict what a switch will cost). They cannot disagree:
both call :meth:`CostModel.choose`.

A switch ``src -> dst`` costs ``sync_ms`` + the weight reshard (``reshard_grow_ms`` when T grows: ranks only
slice weights they hold; ``reshard_shrink_ms`` when T shrinks: an all-gather) + what a GPU engine pays to run
the new layout at all: ``graph_capture_ms`` (CUDA graphs of the decode step captured for the new TP size)
and ``kv_pool_ms`` (the KV pool re-laid out for the new number of KV heads per rank) + the cheaper (under
``auto``) of two ways to give every unfinished request its KV cache in the new layout:

* migrate: ``migrate_fixed_ms + moved_bytes / migrate_bytes_per_ms`` (the pod's aggregate rate);
* recompute: re-prefill prompt + generated tokens, ``recompute_fixed_ms + tokens / recompute_tokens_per_ms``.

The engine knows ``moved_bytes`` exactly (its migration plan) and ``tokens`` for its busiest replica; the
planner estimates them with :func:`estimated_moved_bytes`. Every function here works on floats and,
elementwise, on numpy arrays (the planner evaluates many token counts at once).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from rollout_worker.errors import UserError
from rollout_worker.scheduling.head_shards import moved_kv_fraction
from rollout_worker.scheduling.layout import Layout

KVMethod = Literal["migrate", "recompute"]
Method = Literal["auto", "migrate", "recompute"]
KV_METHODS: tuple[KVMethod, ...] = ("migrate", "recompute")
METHODS: tuple[Method, ...] = ("auto", "migrate", "recompute")


@dataclass(frozen=True, slots=True)
class KVChoice:
    method: KVMethod
    migrate_ms: float
    recompute_ms: float

    @property
    def ms(self) -> float:
        return self.migrate_ms if self.method == "migrate" else self.recompute_ms


@dataclass(frozen=True, slots=True)
class CostModel:
    """Linear reconfiguration cost model: ms = fixed + size / rate. The two GPU terms default to 0 (a CPU
    engine captures no graphs; profiles written before they existed still load)."""

    migrate_bytes_per_ms: float
    migrate_fixed_ms: float
    recompute_tokens_per_ms: float
    recompute_fixed_ms: float
    reshard_grow_ms: float
    reshard_shrink_ms: float
    sync_ms: float
    graph_capture_ms: float = 0.0
    kv_pool_ms: float = 0.0

    def base_ms(self, src_tp: int, dst_tp: int) -> float:
        """What every switch pays whatever happens to the KV cache: sync, weight reshard, CUDA-graph
        capture for the new TP size and the KV pool's re-layout."""
        reshard = self.reshard_grow_ms if dst_tp > src_tp else self.reshard_shrink_ms
        return self.sync_ms + reshard + self.graph_capture_ms + self.kv_pool_ms

    def kv_ms(self, moved_bytes: Any, tokens: Any) -> tuple[Any, Any]:
        """(migrate ms, recompute ms) for ``moved_bytes`` to move or ``tokens`` to re-prefill."""
        mig = self.migrate_fixed_ms + moved_bytes / max(self.migrate_bytes_per_ms, 1e-12)
        rec = self.recompute_fixed_ms + tokens / max(self.recompute_tokens_per_ms, 1e-12)
        return mig, rec

    def choose(self, requested: str, moved_bytes: float, tokens: float) -> KVChoice:
        """Resolve ``auto`` (the cheaper one; migrate on a tie); an explicit method is kept."""
        mig, rec = self.kv_ms(moved_bytes, tokens)
        if requested == "auto":
            return KVChoice("migrate" if mig <= rec else "recompute", float(mig), float(rec))
        if requested not in KV_METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {requested!r}")
        method: KVMethod = "migrate" if requested == "migrate" else "recompute"
        return KVChoice(method, float(mig), float(rec))

    def measured(
        self, *, migrate_bytes_per_ms: float | None = None, recompute_tokens_per_ms: float | None = None
    ) -> CostModel:
        """The model with rates replaced by measured ones (None keeps the current rate)."""
        return replace(
            self,
            migrate_bytes_per_ms=migrate_bytes_per_ms or self.migrate_bytes_per_ms,
            recompute_tokens_per_ms=recompute_tokens_per_ms or self.recompute_tokens_per_ms,
        )


# Priors of an engine that has measured nothing yet: loopback gloo on CPU, about 200 MB/s per rank pair,
# prefill of a small model at about 20 tokens/ms. Measurements replace the rates as the engine runs.
DEFAULT_COSTS = CostModel(
    migrate_bytes_per_ms=200_000.0,
    migrate_fixed_ms=1.0,
    recompute_tokens_per_ms=20.0,
    recompute_fixed_ms=1.0,
    reshard_grow_ms=1.0,
    reshard_shrink_ms=50.0,
    sync_ms=5.0,
)


def estimated_moved_bytes(
    tokens: Any, kv_bytes_per_token: float, num_kv_heads: int, src: Layout, dst: Layout
) -> Any:
    """KV bytes a pod moves to switch ``src -> dst`` with ``tokens`` cached tokens unfinished.

    Per request, the heads its new replica's ranks do not already hold, as the engine's migration plan
    sends them (:func:`~rollout_worker.scheduling.head_shards.moved_kv_fraction`: whole heads, uneven shards
    and
    duplicated KV heads included), for a request whose new replica shares ranks with its old one.
    """
    return tokens * kv_bytes_per_token * moved_kv_fraction(num_kv_heads, src, dst)


COSTS_ENV = "ROLLOUT_COSTS_JSON"  # how a pod's engine gets its cost model (the same JSON, inline)


def costs_json(costs: CostModel) -> str:
    """The cost model as ``ROLLOUT_COSTS_JSON`` carries it."""
    return json.dumps(asdict(costs), sort_keys=True)


def parse_costs(text: str, source: str) -> CostModel:
    """A cost model from JSON: the rates alone, or a profile (its ``costs``). Errors name ``source`` (the
    file or variable it came from)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{source} is not JSON: {exc}", source) from None
    body = doc.get("costs", doc) if isinstance(doc, dict) else doc
    if not isinstance(body, dict):
        raise UserError(f"{source}: expected an object of cost rates", source)
    for key, value in body.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise UserError(f"{source}: costs.{key} must be a number >= 0, got {value!r}", source)
    try:
        return CostModel(**body)
    except TypeError as exc:
        raise UserError(f"{source}: not a cost model ({exc})", source) from None
