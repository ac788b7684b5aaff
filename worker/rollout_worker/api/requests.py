"""What the engine's ranks need to know of a request (torch-free), and the JSONL input format of
``rolloutctl generate``, validated line by line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_worker.api.sampling import Sampling, default_seed
from rollout_worker.api.sglang import SamplingParams
from rollout_worker.data.jsonl import iter_jsonl
from rollout_worker.errors import UserError

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
    """One request as the ranks run it. Output shaping (stop strings, text) is the driver's business."""

    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0  # EOS and stop tokens are masked before this many tokens
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned; -1: none
    top_logprobs_num: int = 0

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids)


def check_fits(spec: RequestSpec, context_length: int, kv_budget: int | None, where: str = "") -> None:
    """Refuse a request the engine could never run (it would otherwise wait forever)."""
    check_length(len(spec.prompt_ids), spec.max_new_tokens, context_length, kv_budget, where)


def check_length(
    prompt_tokens: int, max_new_tokens: int, context_length: int, kv_budget: int | None, where: str = ""
) -> None:
    """Refuse a prompt of ``prompt_tokens`` that may generate ``max_new_tokens`` where it can never fit:
    beyond the context length, or the KV budget of a replica (``kv_budget``, None: no limit). The error's
    field is ``max_new_tokens``; its message does not name it, so that a caller may name it as its user
    does (``max_tokens``, ``spec.sampling.maxNewTokens``)."""
    pre = f"{where}: " if where else ""
    what = f"{pre}prompt ({prompt_tokens} tokens) + {max_new_tokens} new tokens exceeds"
    if prompt_tokens + max_new_tokens > context_length:
        raise UserError(f"{what} the context length {context_length}", "max_new_tokens")
    if kv_budget is not None and prompt_tokens + max_new_tokens > kv_budget:
        raise UserError(f"{what} the KV budget of a replica ({kv_budget} tokens)", "max_new_tokens")


def check_ids(ids: list[int] | tuple[int, ...], vocab_size: int, where: str, what: str = "token id") -> None:
    """Every id of ``ids`` is in the model's vocabulary."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise UserError(f"{where}: {what} {bad} out of range [0, {vocab_size})")


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
    check_ids(ids, vocab_size, where)
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
    seed = obj.get("seed", default_seed(rid))
    if not _is_int(seed):
        raise UserError(f"{where}: field 'seed' must be an integer")
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise UserError(f"{where}: field 'ignore_eos' must be true or false")
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
        raise UserError(f"{where}: field 'stop_token_ids' must be a list of integers")
    check_ids(stops, vocab_size, where, "stop token id")
    return RequestSpec(
        id=rid,
        prompt_ids=tuple(ids),
        max_new_tokens=max_new,
        sampling=SamplingParams(temperature=temp, top_p=top_p, top_k=top_k).engine(seed),
        ignore_eos=ignore_eos,
        stop_token_ids=tuple(stops),
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(obj: dict[str, Any], key: str, default: float, where: str, lo: float) -> float:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= lo:  # NaN too
        raise UserError(f"{where}: field {key!r} must be a number >= {lo}")
    return float(v)


def read_requests(
    path: str | Path, encode: Any, vocab_size: int, context_length: int, kv_budget: int | None = None
) -> list[RequestSpec]:
    """Parse a JSONL file; every error names the file and line. Ids must be unique."""
    specs: list[RequestSpec] = []
    seen: dict[str, int] = {}
    for where, n, obj in iter_jsonl(path, "prompts"):
        spec = parse_request(obj, where, encode, vocab_size)
        if spec.id in seen:
            raise UserError(f"{where}: duplicate id {spec.id!r} (first on line {seen[spec.id]})")
        try:
            check_fits(spec, context_length, kv_budget, where)
        except UserError as exc:
            raise UserError(exc.message) from None  # the message already names file and line
        seen[spec.id] = n
        specs.append(spec)
    if not specs:
        raise UserError(f"{path} has no requests", "prompts")
    return specs
