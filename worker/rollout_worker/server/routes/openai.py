"""OpenAI-compatible ``GET /v1/models`` and ``POST /v1/completions`` (with SGLang's extra sampling fields)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rollout_worker.api.engine_settings import dotted
from rollout_worker.api.errors import user_error
from rollout_worker.api.neutral import strip_neutral
from rollout_worker.api.sglang import Body, GenerateRequest, check_lengths, check_stops
from rollout_worker.engine.finish import matched_stop
from rollout_worker.server.convert import Output, to_jobs
from rollout_worker.server.deps import FastJSON, ServerState, server_state
from rollout_worker.server.routes.generate import STREAMED, run_generation, stream_generation

router = APIRouter(prefix="/v1", tags=["openai"])
# OpenAI's keys this engine does not implement, at their neutral values only (``api.neutral``)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None,),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class OpenAISampling(Body):
    """What OpenAI's completions and chat completions share: OpenAI's sampling fields plus SGLang's extras
    (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``rid``, ...)."""

    max_tokens: int | None = Field(None, ge=0)  # None: /generate's default
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    user: str | None = None
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_stops(v)

    @field_validator("min_tokens")
    @classmethod
    def _lengths(cls, v: int, info: ValidationInfo) -> int:
        return check_lengths(v, info, "max_tokens")

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        return strip_neutral(data, _NEUTRAL)

    @property
    def usage_wanted(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generate(self, prompt: Any, max_tokens: int | None, top_n: int | None) -> GenerateRequest:
        """The ``/generate`` request of ``prompt`` (text, texts, ids or lists of ids); ``top_n`` None: no
        logprobs."""
        text_in = isinstance(prompt, str) or (
            isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str)
        )
        sampling = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "n": self.n,
            "sampling_seed": self.seed,
        }
        body = {
            ("text" if text_in else "input_ids"): prompt,
            "sampling_params": sampling,
            "rid": self.rid,
            "return_logprob": top_n is not None,
            "top_logprobs_num": top_n or 0,
            "return_text_in_logprobs": True,
        }
        try:
            return GenerateRequest.model_validate(body)
        except ValidationError as exc:  # a rule of /generate's this body's own validation missed
            raise user_error(exc, dotted) from None


class CompletionRequest(OpenAISampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)

    def to_generate(self) -> GenerateRequest:
        return self.generate(self.prompt, self.max_tokens, self.logprobs)


def _models(state: ServerState) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "elastic-rollout",
                "root": state.model_name,
                "max_model_len": state.cfg.engine.context_length,
            }
        ],
    }


@router.get("/models", summary="The served model")
async def models(request: Request) -> dict[str, Any]:
    return _models(server_state(request))


def _logprobs(out: Output, start: int, want: bool) -> dict[str, Any] | None:
    if not want:
        return None
    codec = out.codec
    toks = out.ids[start:]
    texts = [codec.token_text(t) if codec else str(t) for t in toks]
    tops = out.tops[start:]
    offsets, pos = [], len(out.text[:0])
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": out.logprobs[start:],
        "top_logprobs": [
            {(codec.token_text(tok) if codec else str(tok)): lp for lp, tok in top} if top else None
            for top in tops
        ],
        "text_offset": offsets,
    }


def _choice(i: int, out: Output, text: str, start: int, want_logprobs: bool) -> dict[str, Any]:
    finish = out.finish
    return {
        "index": i,
        "text": text,
        "logprobs": _logprobs(out, start, want_logprobs),
        "finish_reason": finish.type if finish else None,
        "matched_stop": matched_stop(finish),
    }


def usage(outs: list[Output], n: int) -> dict[str, int]:
    prompt = sum(len(o.job.spec.prompt_ids) for o in outs) // max(n, 1)
    completion = sum(len(o.ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True, slots=True)
class Delta:
    text: str  # the text not sent yet
    start: int  # the first token not sent yet
    first: bool  # the choice's first chunk


@dataclass
class Deltas:
    """What a stream has sent of each choice, so that each chunk carries only what is new (OpenAI's streams
    are deltas, SGLang's cumulative)."""

    text: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def take(self, rid: str, out: Output) -> Delta | None:
        """What is new in ``out`` since the last take, or None when nothing is (and it has not finished)."""
        text = out.text
        delta = text[self.text.get(rid, 0) :]
        if not delta and out.finish is None:
            return None
        new = Delta(delta, self.tokens.get(rid, 0), rid not in self.text)
        self.text[rid], self.tokens[rid] = max(len(text), self.text.get(rid, 0)), len(out.ids)
        return new


@router.post("/completions", summary="OpenAI completions (stream and not)", responses=STREAMED)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = server_state(request)
    jobs = to_jobs(body.to_generate(), state.codec)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }
    want = body.logprobs is not None
    index = {j.spec.id: i for i, j in enumerate(jobs)}
    if not body.stream:
        outs = await run_generation(state, jobs, request)
        choices = [_choice(i, o, o.text, 0, want) for i, o in enumerate(outs)]
        return FastJSON({**head, "choices": choices, "usage": usage(outs, body.n)})
    sent = Deltas()

    def render(rid: str, out: Output) -> dict[str, Any] | None:
        new = sent.take(rid, out)
        if new is None:
            return None
        return {**head, "choices": [_choice(index[rid], out, new.text, new.start, want)]}

    def final(outs: list[Output]) -> dict[str, Any] | None:
        if not body.usage_wanted:
            return None
        return {**head, "choices": [], "usage": usage(outs, body.n)}

    events = await stream_generation(state, jobs, False, render, final)
    return StreamingResponse(events, media_type="text/event-stream")
