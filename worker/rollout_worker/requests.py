"""Requests: the JSONL input format, validated line by line, and the per-request state the engine keeps."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_worker.errors import UserError
from rollout_worker.jsonl import iter_jsonl
from rollout_worker.sampling import SamplingParams

FIELDS = {
    "id",
    "prompt",
    "input_ids",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "stop_token_ids",
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @property
    def reserved_tokens(self) -> int:
        """KV tokens the request may need: prompt + max_new_tokens."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(slots=True)
class Sequence:
    """A request in flight. ``output`` survives every reconfiguration; the KV cache may not."""

    spec: RequestSpec
    output: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # {"layout", "replica", "step"}

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are cached while running: all but the last sampled token."""
        return len(self.spec.prompt_ids) + max(len(self.output) - 1, 0)

    @property
    def remaining(self) -> int:
        return self.spec.max_new_tokens - len(self.output)

    @property
    def reserved_tokens(self) -> int:
        return self.spec.reserved_tokens


def _default_seed(rid: str) -> int:
    return int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "little") >> 1


def parse_request(obj: Any, where: str, encode: Any, vocab_size: int) -> RequestSpec:
    """One JSON object -> RequestSpec. ``encode(text) -> list[int]``. Errors name ``where`` and the field."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise UserError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if "id" not in obj or not isinstance(obj["id"], str | int) or isinstance(obj["id"], bool):
        raise UserError(f"{where}: field 'id' (string or integer) is required")
    rid = str(obj["id"])
    if ("prompt" in obj) == ("input_ids" in obj):
        raise UserError(f"{where}: give exactly one of 'prompt' (text) or 'input_ids'")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise UserError(f"{where}: field 'prompt' must be a non-empty string")
        ids = list(encode(obj["prompt"]))
    else:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
            raise UserError(f"{where}: field 'input_ids' must be a non-empty list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"{where}: token id {bad[0]} out of range [0, {vocab_size})")
    max_new = obj.get("max_new_tokens")
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise UserError(f"{where}: field 'max_new_tokens' must be an integer >= 1")
    temp = _number(obj, "temperature", 0.0, where, lo=0.0)
    top_p = _number(obj, "top_p", 1.0, where, lo=0.0)
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"{where}: field 'top_p' must be in (0, 1]")
    top_k = obj.get("top_k", 0)
    if not _is_int(top_k) or top_k < -1:
        raise UserError(f"{where}: field 'top_k' must be an integer >= -1 (0 or -1: off)")
    seed = obj.get("seed", _default_seed(rid))
    if not _is_int(seed):
        raise UserError(f"{where}: field 'seed' must be an integer")
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise UserError(f"{where}: field 'ignore_eos' must be true or false")
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
        raise UserError(f"{where}: field 'stop_token_ids' must be a list of integers")
    return RequestSpec(
        id=rid,
        prompt_ids=tuple(ids),
        max_new_tokens=max_new,
        sampling=SamplingParams(temperature=temp, top_p=top_p, top_k=max(top_k, 0), seed=seed),
        ignore_eos=ignore_eos,
        stop_token_ids=tuple(stops),
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(obj: dict[str, Any], key: str, default: float, where: str, lo: float) -> float:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or v < lo:
        raise UserError(f"{where}: field {key!r} must be a number >= {lo}")
    return float(v)


def read_requests(path: str | Path, encode: Any, vocab_size: int, max_positions: int) -> list[RequestSpec]:
    """Parse a JSONL file; every error names the file and line. Ids must be unique."""
    specs: list[RequestSpec] = []
    seen: dict[str, int] = {}
    for where, n, obj in iter_jsonl(path, "--prompts"):
        spec = parse_request(obj, where, encode, vocab_size)
        if spec.id in seen:
            raise UserError(f"{where}: duplicate id {spec.id!r} (first on line {seen[spec.id]})")
        if len(spec.prompt_ids) + spec.max_new_tokens > max_positions:
            raise UserError(
                f"{where}: prompt ({len(spec.prompt_ids)} tokens) + max_new_tokens ({spec.max_new_tokens}) "
                f"exceeds max_position_embeddings={max_positions}"
            )
        seen[spec.id] = n
        specs.append(spec)
    if not specs:
        raise UserError(f"--prompts: {path} has no requests")
    return specs
