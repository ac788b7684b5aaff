"""Typed messages between the driver (the process that owns the engine) and its rank processes.

Driver -> rank, through each rank's inbox, applied at a step boundary:
    Submit, Abort, Pause, Resume, ReleaseMemory, ResumeMemory, FlushCache, AddCorpus, RemoveCorpus,
    Join/LeaveWeightGroup, Shutdown
    (per replica: every rank of a replica applies the same messages at the same step), and the *global*
    commands Reconfigure, LoadWeights and ReceiveWeights, at which every rank meets.
Rank -> driver, through one shared pipe written under a lock (so messages are ordered causally):
    Ready, StepReport (replica leaders only), Switched / Done (outcomes of commands), MemoryHeld, Failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_worker.api.plan import ReconfigEvent
from rollout_worker.api.requests import RequestSpec
from rollout_worker.engine.finish import Finish
from rollout_worker.errors import ReconfigurationFailed
from rollout_worker.scheduling.costs import Method
from rollout_worker.scheduling.layout import Layout

TopLogprobs = tuple[tuple[float, int], ...]  # (logprob, token id), best first
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True, slots=True)
class Faults:
    """Test hook, kept out of the engine's configuration: rank ``rank`` fails in phase ``phase``; or, in
    phase ``logits``, request ``rid``'s logits are NaN from its output token ``at`` on, on rank ``rank``
    (-1: on every rank)."""

    phase: str  # migrate | commit | load | logits
    rank: int
    rid: str = ""
    at: int = 0

    def check(self, phase: str, rank: int) -> None:
        if phase == self.phase and rank == self.rank:
            raise ReconfigurationFailed(f"injected fault in phase {phase!r}")

    def poison(self, rank: int) -> tuple[str, int] | None:
        """The request whose logits rank ``rank`` makes NaN, and from which output token, if any."""
        return (self.rid, self.at) if self.phase == "logits" and self.rank in (-1, rank) else None


# -- driver -> rank ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    spec: RequestSpec


@dataclass(frozen=True, slots=True)
class Abort:
    rids: tuple[str, ...] | None  # None: every request of the replica
    finish: Finish


@dataclass(frozen=True, slots=True)
class Pause:
    mode: str  # abort | retract | in_place


@dataclass(frozen=True, slots=True)
class Resume:
    pass


@dataclass(frozen=True, slots=True)
class Reconfigure:
    target: Layout
    method: Method
    reason: str
    ticket: int


@dataclass(frozen=True, slots=True)
class LoadWeights:
    path: str
    ticket: int


@dataclass(frozen=True, slots=True)
class JoinWeightGroup:
    """Every rank joins the trainer's group as ``rank_offset + rank`` (``weight_sync``), beside its step loop,
    giving up after ``timeout_s``; each rank answers for itself."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    ticket: int


@dataclass(frozen=True, slots=True)
class ReceiveWeights:
    """Every rank receives the trainer's broadcast (one per tensor, or one ``bucket`` of them all); rank 0
    writes it to ``file`` (the staged checkpoint ``path`` reads it), then every rank loads ``path`` as for
    LoadWeights."""

    group_name: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    bucket: bool
    path: str
    file: str
    ticket: int


@dataclass(frozen=True, slots=True)
class LeaveWeightGroup:
    group_name: str
    ticket: int


@dataclass(frozen=True, slots=True)
class ReleaseMemory:
    tags: tuple[str, ...]
    ticket: int


@dataclass(frozen=True, slots=True)
class ResumeMemory:
    tags: tuple[str, ...]
    ticket: int


@dataclass(frozen=True, slots=True)
class FlushCache:
    ticket: int


@dataclass(frozen=True, slots=True)
class AddCorpus:
    """Documents (token ids) every rank adds to its draft corpus under ``corpus_id``."""

    corpus_id: str
    documents: tuple[tuple[int, ...], ...]
    ticket: int


@dataclass(frozen=True, slots=True)
class RemoveCorpus:
    corpus_id: str
    ticket: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = (
    Submit
    | Abort
    | Pause
    | Resume
    | Reconfigure
    | LoadWeights
    | JoinWeightGroup
    | ReceiveWeights
    | LeaveWeightGroup
    | ReleaseMemory
    | ResumeMemory
    | FlushCache
    | AddCorpus
    | RemoveCorpus
    | Shutdown
)
GLOBAL_COMMANDS = (Reconfigure, LoadWeights, ReceiveWeights)


# -- rank -> driver ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True, slots=True)
class TokenOut:
    rid: str
    token: int
    logprob: float | None = None
    top: TopLogprobs | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprob of each prompt token from ``start`` on (None for token 0), and optional top logprobs."""

    start: int
    logprobs: tuple[float | None, ...]
    top: tuple[TopLogprobs | None, ...] | None = None


@dataclass(slots=True)
class StepReport:
    """What one replica did at one step (sent by the replica's leader, shard 0)."""

    replica: int
    epoch: int  # committed reconfigurations so far
    step: int
    kind: str  # prefill | decode | idle
    ms: float
    admitted: tuple[str, ...] = ()
    tokens: list[TokenOut] = field(default_factory=list)
    finished: list[tuple[str, Finish]] = field(default_factory=list)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    retracted: tuple[str, ...] = ()
    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0  # KV tokens held by the running requests
    cached: dict[str, int] = field(default_factory=dict)  # admitted requests' prompt tokens found cached
    prefill_tokens: int = 0  # tokens the step's prefill computed
    reused_tokens: int = 0  # tokens the step's prefill took from the prefix cache
    kv_capacity: int = 0  # tokens of the replica's KV pool (its pages x page size)
    kv_paged: int = 0  # tokens of the pages the running requests hold (pages in use x page size)
    retractions: int = 0  # requests this step retracted for want of KV pages (a pause's are not counted)


@dataclass(frozen=True, slots=True)
class Switched:
    """A global reconfiguration's outcome (sent by rank 0 after every rank voted)."""

    ticket: int
    event: ReconfigEvent
    placements: tuple[tuple[str, int, bool], ...]  # (rid, new replica, running)
    epoch: int
    step: int


@dataclass(frozen=True, slots=True)
class Done:
    ticket: int
    rank: int
    ok: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class MemoryHeld:
    """The bytes of weights and KV cache a rank holds, as it measured them once started and after each
    release or resume of memory (sent before that command's Done)."""

    rank: int
    weights_bytes: int
    kv_cache_bytes: int


@dataclass(frozen=True, slots=True)
class TaskResult:
    """The result of a measurement task run on a rank instead of the serving loop."""

    rank: int
    result: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failed:
    rank: int
    error: str
    traceback: str


Report = Ready | StepReport | Switched | Done | MemoryHeld | TaskResult | Failed
