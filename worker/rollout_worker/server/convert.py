"""SGLang ``/generate`` bodies <-> engine requests and SGLang-shaped responses.

A body becomes one :class:`Job` per prompt and per sample (``n``); each job's :class:`Output` accumulates the
engine's updates and renders SGLang's response: cumulative ``text`` and ``output_ids``, and ``meta_info``
with ``finish_reason``, token counts, latency and, when asked, ``[logprob, token_id, text|null]`` triples.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import default_seed, derived_seed
from rollout_worker.api.sglang import GenerateRequest, SamplingParams
from rollout_worker.engine.driver.request_table import Update
from rollout_worker.engine.finish import Finish, finish_json, matched_stop
from rollout_worker.engine.messages import TopLogprobs
from rollout_worker.engine.model.tokenizer import IncrementalText, TextCodec
from rollout_worker.errors import UserError


@dataclass(frozen=True, slots=True)
class Job:
    spec: RequestSpec
    stop: tuple[str, ...]
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    text_in_logprobs: bool = False
    prompt: int | None = None  # its prompt's index in a batch (None: the request's one prompt)

    def blame(self, exc: UserError) -> UserError:
        """``exc`` (a check of this job's request) as a batch names it: an error of the prompt itself at the
        prompt's place (``input_ids.3``), any other one saying which prompt."""
        if self.prompt is None:
            return exc
        if exc.field in _PROMPT_FIELDS:
            return exc.with_field(f"{exc.field}.{self.prompt}")
        return type(exc)(f"{exc.message} (prompt {self.prompt} of the batch)", exc.field)


_PROMPT_FIELDS = ("text", "input_ids")


def to_jobs(req: GenerateRequest, codec: TextCodec | None) -> list[Job]:
    """One job per prompt x sample; errors name the field (``sampling_params.top_p``, ``text``, the prompt
    of a batch: ``input_ids.3``)."""
    jobs: list[Job] = []
    prompts = req.prompts()
    base_rids = _rids(req.rid, len(prompts))
    for i, prompt in enumerate(prompts):
        sp = _pick(req, req.sampling_params, i, SamplingParams())
        if sp.stop and codec is None:  # matched in the text: never, without a tokenizer
            raise UserError(
                "stop strings need the model's tokenizer.json, which it has not", "sampling_params.stop"
            )
        index = i if req.is_batch else None
        name = "text" if req.text is not None else "input_ids"
        ids = tuple(_encode(prompt, codec, name if index is None else f"{name}.{index}"))
        rid = base_rids[i]
        want_logprobs = bool(_pick(req, req.return_logprob, i, False))
        start = int(_pick(req, req.logprob_start_len, i, -1))
        tops = int(_pick(req, req.top_logprobs_num, i, 0))
        for j in range(sp.n):
            sub = rid if sp.n == 1 else f"{rid}-{j}"
            seed = sp.sampling_seed if sp.sampling_seed is not None else default_seed(sub)
            if sp.n > 1 and sp.sampling_seed is not None:
                seed = derived_seed(seed, j)
            jobs.append(
                Job(
                    RequestSpec(
                        id=sub,
                        prompt_ids=ids,
                        max_new_tokens=sp.max_tokens,
                        sampling=sp.engine(seed),
                        ignore_eos=sp.ignore_eos,
                        stop_token_ids=tuple(sp.stop_token_ids or ()),
                        min_new_tokens=sp.min_new_tokens,
                        return_logprob=want_logprobs,
                        logprob_start_len=start,
                        top_logprobs_num=tops,
                    ),
                    sp.stops(),
                    sp.skip_special_tokens,
                    sp.no_stop_trim,
                    req.return_text_in_logprobs,
                    index,
                )
            )
    return jobs


def check_jobs(check: Callable[[RequestSpec], None], jobs: list[Job]) -> None:
    """``check`` (the engine's) every job before any is submitted; an error names the prompt of a batch."""
    for job in jobs:
        try:
            check(job.spec)
        except UserError as exc:
            raise job.blame(exc) from None


def _pick(req: GenerateRequest, value: Any, i: int, default: Any) -> Any:
    try:
        return req.at(value, i, default)
    except ValueError as exc:
        raise UserError(str(exc), "sampling_params") from None


def _rids(rid: str | list[str] | None, n: int) -> list[str]:
    if isinstance(rid, list):
        if len(rid) != n:
            raise UserError(f"{len(rid)} rid(s) for {n} prompt(s)", "rid")
        return rid
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    return [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]


def _encode(prompt: str | list[int], codec: TextCodec | None, where: str) -> list[int]:
    if isinstance(prompt, str):
        if codec is None:
            raise UserError("this model has no tokenizer.json: send the prompt as token ids", where)
        ids = codec.encode(prompt)
    else:
        ids = prompt
    if not ids:
        raise UserError("the prompt is empty", where)
    return ids


@dataclass(slots=True)
class Output:
    """One job's output as it grows; renders SGLang's response dict."""

    job: Job
    codec: TextCodec | None
    weight_version: str = "default"
    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[TopLogprobs | None] = field(default_factory=list)
    prompt: Any = None
    cached: int = 0  # prompt tokens the engine found in its prefix cache
    finish: Finish | None = None
    started: float = field(default_factory=time.perf_counter)
    latency: float | None = None
    layouts: list[str] = field(default_factory=list)
    verify_ct: int = 0  # speculative decoding's verify steps it took part in
    _text: IncrementalText | None = None

    def __post_init__(self) -> None:
        if self.codec is not None:
            self._text = IncrementalText(self.codec, self.job.skip_special_tokens)

    def add(self, u: Update) -> None:
        for tok in u.tokens:
            self.ids.append(tok.token)
            self.logprobs.append(tok.logprob)
            self.tops.append(tok.top)
        if u.prompt is not None:
            self.prompt = u.prompt
        if u.cached is not None:
            self.cached = u.cached
        if u.finish is not None:
            self.finish = u.finish
            self.latency = time.perf_counter() - self.started
            self.layouts = list(dict.fromkeys(str(p["layout"]) for p in u.placements))
            self.verify_ct = u.verify_ct

    @property
    def text(self) -> str:
        """Cumulative text; detokenised on demand (once per rendered chunk, not per token)."""
        if self._text is None:
            return ""
        self._text.extend(self.ids[len(self._text.ids) :])
        return self._text.text if self.finish is None else self._final_text()

    @property
    def stream_text(self) -> str:
        """The text a stream of deltas may send by now: the final text once finished; before, the text less
        an end that may still turn out to begin a stop string (the final text trims a stop string), so that
        what a stream sends is always a prefix of the final text."""
        text = self.text
        if self.finish is not None or self.job.no_stop_trim:
            return text
        return text[: len(text) - _stop_start(text, self.job.stop)]

    def _final_text(self) -> str:
        assert self._text is not None and self.finish is not None
        matched = matched_stop(self.finish)
        if self.job.no_stop_trim or matched is None:
            return self._text.final()
        if isinstance(matched, str):
            full = self._text.final()
            pos = full.find(matched)
            return full[:pos] if pos >= 0 else full
        assert self.codec is not None
        return self.codec.decode(self.ids[:-1], self.job.skip_special_tokens)  # the matched stop token

    def render(self) -> dict[str, Any]:
        spec = self.job.spec
        meta: dict[str, Any] = {
            "id": spec.id,
            "finish_reason": finish_json(self.finish),
            "prompt_tokens": len(spec.prompt_ids),
            "completion_tokens": len(self.ids),
            "cached_tokens": self.cached,
            "weight_version": self.weight_version,
        }
        if self.latency is not None:
            meta["e2e_latency"] = round(self.latency, 6)
            meta["layouts"] = self.layouts  # ours: every layout the request ran on
        if self.verify_ct:  # SGLang's, under speculative decoding: the verify steps it took part in
            meta["spec_verify_ct"] = self.verify_ct
        if spec.return_logprob:
            self._logprob_meta(meta)
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}

    def _logprob_meta(self, meta: dict[str, Any]) -> None:
        spec, want_text = self.job.spec, self.job.text_in_logprobs
        meta["output_token_logprobs"] = [
            [lp, tok, self._tok_text(tok, want_text)] for lp, tok in zip(self.logprobs, self.ids, strict=True)
        ]
        start = spec.logprob_start_len
        if self.prompt is not None:
            toks = spec.prompt_ids[self.prompt.start :]
            meta["input_token_logprobs"] = [
                [lp, tok, self._tok_text(tok, want_text)]
                for lp, tok in zip(self.prompt.logprobs, toks, strict=True)
            ]
        else:
            meta["input_token_logprobs"] = [] if start < 0 else None
        if spec.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [self._tops(t, want_text) for t in self.tops]
            prompt_tops = self.prompt.top if self.prompt is not None and self.prompt.top is not None else ()
            meta["input_top_logprobs"] = [self._tops(t, want_text) for t in prompt_tops]

    def _tops(self, top: TopLogprobs | None, want_text: bool) -> list[list[Any]] | None:
        return None if top is None else [[lp, tok, self._tok_text(tok, want_text)] for lp, tok in top]

    def _tok_text(self, tok: int, want: bool) -> str | None:
        return self.codec.token_text(tok) if want and self.codec is not None else None


def _stop_start(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``stops`` (0: none); only where a stop
    string's first character is are the ends compared."""
    best = 0
    for stop in stops:
        at = text.find(stop[0], max(len(text) - len(stop), 0))
        while at >= 0 and len(text) - at > best:
            if stop.startswith(text[at:]):
                best = len(text) - at
                break
            at = text.find(stop[0], at + 1)
    return best
