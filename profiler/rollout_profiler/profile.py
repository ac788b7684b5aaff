"""The profile: measured (or modelled) decode-step latency and reconfiguration costs of one model on one
kind of device. It is the contract between the profiler (which writes it), the database (which stores it),
and the latency model, planner and simulator (which read it).

JSON form (``Profile.to_json`` / ``Profile.from_json``)::

    {
      "schema": "elastic-rollout/profile/v1",
      "name": "tiny-cpu-2",
      "model": {"name": "tiny", "architecture": "LlamaForCausalLM", "shape_hash": "...",
                "hidden_size": 128, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
                "head_dim": 16, "intermediate_size": 384, "vocab_size": 512},
      "engine": "elastic-rollout 0.1.0",
      "device": {"kind": "cpu", "count": 2, "name": "2-core x86-64"},
      "dtype": "float32",
      "method": "measured" | "shard-equivalent" | "modelled",
      "provenance": {"measured": ["step_latency", ...], "modelled": [...], "notes": "...", "command": "..."},
      "created": "2026-11-21T20:00:00+00:00",
      "step_latency": [{"replicas": 2, "tp": 1, "batch": 8, "context": 256, "ms": 4.4}, ...],
      "reconfig_cost": [{"src": "2x1", "dst": "1x2", "method": "migrate", "tokens": 3000,
                         "bytes": 1200000, "ms": 12.5}, ...],
      "costs": {"migrate_bytes_per_ms": 1.0e6, "migrate_fixed_ms": 2.0,
                "recompute_tokens_per_ms": 50.0, "recompute_fixed_ms": 5.0,
                "reshard_grow_ms": 1.0, "reshard_shrink_ms": 50.0, "sync_ms": 5.0,
                "graph_capture_ms": 0.0, "kv_pool_ms": 0.0},
      "kv_capacity": {"tokens_per_replica": {"1": 391000, "2": 918000, ...},
                      "basis": {"gpu_bytes": ..., "fraction": 0.9, "weight_bytes": ..., ...}}  # optional
    }

``step_latency`` is the latency of one decode step of *one replica* of TP size ``tp`` while the pod runs
``replicas`` such replicas, at ``batch`` running requests on that replica and mean ``context`` tokens.
``costs`` is the linear reconfiguration cost model fitted from ``reconfig_cost`` (or given).

``kv_capacity`` (optional; absent = unknown, i.e. unlimited) is how many KV tokens one replica of each TP
size can hold, and ``basis`` how that was obtained (:meth:`KVCapacity.from_memory`: per-GPU memory x the
engine's memory fraction - weights / T - a reserve, divided by the KV bytes a rank keeps per token). A
``step_latency`` point whose ``batch x context`` tokens exceed its replica's capacity cannot occur in a real
engine: :meth:`Profile.infeasible_points` lists such points; the latency model and simulator never use them
for a state that could not exist.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollout_worker.config.engine_settings import DTYPE_BYTES, DTYPES
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.data.files import read_text, write_atomic
from rollout_worker.errors import UserError
from rollout_worker.scheduling.costs import KV_METHODS, CostModel
from rollout_worker.scheduling.head_shards import max_kv_heads

SCHEMA = "elastic-rollout/profile/v1"
PROFILE_METHODS = ("measured", "shard-equivalent", "modelled")  # how a profile was made
__all__ = ["CostModel", "KVCapacity", "ModelShape", "Profile", "ReconfigPoint", "StepPoint"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, name: str, cfg: ModelConfig) -> ModelShape:
        """The shape of a model's config."""
        return cls(
            name=name,
            architecture=cfg.architecture,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
        )

    @property
    def shape_hash(self) -> str:
        key = json.dumps({k: v for k, v in asdict(self).items() if k != "name"}, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * dtype_bytes

    def kv_bytes_per_token_per_rank(self, dtype_bytes: int, tp: int) -> int:
        """KV bytes the widest rank of a TP-``tp`` replica keeps per token: its share of the KV heads (one
        head, duplicated, once ``tp`` exceeds the number of KV heads; uneven shards when ``tp`` does not
        divide them, the widest one filling first)."""
        heads = max_kv_heads(self.num_kv_heads, tp)
        return self.num_layers * heads * self.head_dim * 2 * dtype_bytes


@dataclass(frozen=True, slots=True)
class StepPoint:
    replicas: int
    tp: int
    batch: int
    context: int
    ms: float


@dataclass(frozen=True, slots=True)
class ReconfigPoint:
    src: str  # layout "DxT"
    dst: str
    method: str  # "migrate" | "recompute"
    tokens: int  # KV tokens moved or recomputed
    bytes: int  # bytes moved (0 for recompute)
    ms: float  # whole switch, wall clock


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """KV tokens one replica of each TP size can hold (``tokens_per_replica``), and how that was obtained."""

    tokens_per_replica: dict[int, int]
    basis: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_memory(
        cls,
        model: ModelShape,
        dtype_bytes: int,
        tp_sizes: tuple[int, ...],
        *,
        gpu_bytes: float,
        fraction: float,
        weight_bytes: float,
        reserve_bytes: float,
    ) -> KVCapacity:
        """Per GPU: ``gpu_bytes x fraction - weight_bytes / T - reserve_bytes`` for the KV pool, divided by
        the KV bytes a rank keeps per token (:meth:`ModelShape.kv_bytes_per_token_per_rank`)."""
        tokens = {}
        for tp in tp_sizes:
            pool = gpu_bytes * fraction - weight_bytes / tp - reserve_bytes
            tokens[tp] = max(0, int(pool // model.kv_bytes_per_token_per_rank(dtype_bytes, tp)))
        basis = {
            "gpu_bytes": gpu_bytes,
            "fraction": fraction,
            "weight_bytes": weight_bytes,
            "reserve_bytes": reserve_bytes,
            "rule": "(gpu_bytes x fraction - weight_bytes / T - reserve_bytes) / KV bytes per token per rank",
        }
        return cls(tokens, basis)

    def tokens(self, tp: int) -> int | None:
        """KV tokens of one TP-``tp`` replica, or None when this TP size was not given."""
        return self.tokens_per_replica.get(tp)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_replica": {str(t): n for t, n in self.tokens_per_replica.items()},
            "basis": self.basis,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVCapacity:
        return cls({int(t): int(n) for t, n in d["tokens_per_replica"].items()}, dict(d.get("basis", {})))


@dataclass(slots=True)
class Profile:
    name: str
    model: ModelShape
    engine: str
    device_kind: str
    device_count: int
    device_name: str
    dtype: str
    method: str
    step_latency: list[StepPoint]
    reconfig_cost: list[ReconfigPoint]
    costs: CostModel
    provenance: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    kv_capacity: KVCapacity | None = None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_tokens(self, tp: int) -> int | None:
        """KV tokens one TP-``tp`` replica holds, or None when the profile does not say (unlimited)."""
        return None if self.kv_capacity is None else self.kv_capacity.tokens(tp)

    def infeasible_points(self) -> list[StepPoint]:
        """Step-latency points whose ``batch x context`` KV tokens exceed their replica's capacity: states
        no engine can be in (a roofline can compute them; a real engine never runs them)."""
        out = []
        for p in self.step_latency:
            cap = self.kv_tokens(p.tp)
            if cap is not None and p.batch * p.context > cap:
                out.append(p)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "name": self.name,
            "model": {**asdict(self.model), "shape_hash": self.model.shape_hash},
            "engine": self.engine,
            "device": {"kind": self.device_kind, "count": self.device_count, "name": self.device_name},
            "dtype": self.dtype,
            "method": self.method,
            "provenance": self.provenance,
            "created": self.created,
            "step_latency": [asdict(p) for p in self.step_latency],
            "reconfig_cost": [asdict(p) for p in self.reconfig_cost],
            "costs": asdict(self.costs),
            **({"kv_capacity": self.kv_capacity.to_dict()} if self.kv_capacity is not None else {}),
        }

    def dumps(self) -> str:
        """The profile's JSON file, as text."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def to_json(self, path: str | Path) -> None:
        write_atomic(path, self.dumps())

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> Profile:
        try:
            if d.get("schema") != SCHEMA:
                raise UserError(f"{where}: schema must be {SCHEMA!r}, got {d.get('schema')!r}")
            model = dict(d["model"])
            model.pop("shape_hash", None)
            prof = cls(
                name=str(d["name"]),
                model=ModelShape(**model),
                engine=str(d["engine"]),
                device_kind=str(d["device"]["kind"]),
                device_count=int(d["device"]["count"]),
                device_name=str(d["device"].get("name", "")),
                dtype=str(d["dtype"]),
                method=str(d["method"]),
                step_latency=[StepPoint(**p) for p in d["step_latency"]],
                reconfig_cost=[ReconfigPoint(**p) for p in d.get("reconfig_cost", [])],
                costs=CostModel(**d["costs"]),
                provenance=dict(d.get("provenance", {})),
                created=str(d.get("created", "")),
                kv_capacity=KVCapacity.from_dict(d["kv_capacity"]) if d.get("kv_capacity") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{where}: malformed profile ({type(exc).__name__}: {exc})") from exc
        prof.validate(where)
        return prof

    @classmethod
    def from_json(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(read_text(path, what="profile file"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from exc
        return cls.from_dict(data, where=str(path))

    def validate(self, where: str = "profile") -> None:
        if self.method not in PROFILE_METHODS:
            raise UserError(f"{where}: method must be one of {PROFILE_METHODS}, got {self.method!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"{where}: unknown dtype {self.dtype!r}")
        if not self.step_latency:
            raise UserError(f"{where}: step_latency is empty")
        for i, p in enumerate(self.step_latency):
            if p.replicas < 1 or p.tp < 1 or p.batch < 1 or p.context < 0 or not p.ms > 0:
                raise UserError(f"{where}: step_latency[{i}] out of range: {p}")
        for i, r in enumerate(self.reconfig_cost):
            if r.method not in KV_METHODS or r.ms < 0 or r.tokens < 0 or r.bytes < 0:
                raise UserError(f"{where}: reconfig_cost[{i}] out of range: {r}")
        if self.kv_capacity is not None:
            bad = {t: n for t, n in self.kv_capacity.tokens_per_replica.items() if t < 1 or n < 1}
            if bad:
                raise UserError(
                    f"{where}: kv_capacity.tokens_per_replica needs TP >= 1 and tokens >= 1: {bad}"
                )
