"""OpenAI-compatible ``GET /v1/models`` and ``POST /v1/completions`` (with SGLang's extra sampling fields).

Token in, token out (SGLang's and vLLM's ``return_token_ids``): a prompt may be token ids, and each choice can
carry its prompt's ids and the ids generated (``prompt_token_ids``, ``token_ids``; in a stream the prompt's
in a choice's first chunk, each chunk the ids new in it), exactly what the engine ran, so that a trainer
never tokenizes text again. ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens found in
the prefix cache.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from rollout_worker.api.neutral_keys import strip_neutral
from rollout_worker.api.sglang import Body, GenerateRequest, check_lengths, check_stops
from rollout_worker.config.engine_settings import dotted
from rollout_worker.engine.finish import matched_stop
from rollout_worker.errors import UserError, user_error
from rollout_worker.server.convert import Job, Output, to_jobs
from rollout_worker.server.deps import FastJSON, ServerState, server_state
from rollout_worker.server.routes.generate import STREAMED, run_generation, stream_generation
from rollout_worker.web.errors import UNION_TAGS

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
# SGLang's and vLLM's, and OpenAI's newer, stream options, which change nothing here at these values
_STREAM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "continuous_usage_stats": (None, False),
    "include_obfuscation": (None, False),
}
# the ``sampling_params`` key of /generate each OpenAI field becomes: the translation, and the way back from
# an error of /generate's checks to the field the user wrote
_SAMPLING_KEY = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "n": "n",
    "seed": "sampling_seed",
}


class StreamOptions(Body):
    """OpenAI's ``stream_options``; an unknown key is refused, naming it (SGLang's and vLLM's
    ``continuous_usage_stats`` and OpenAI's ``include_obfuscation`` only at their neutral values)."""

    include_usage: bool = False

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        return strip_neutral(data, _STREAM_NEUTRAL)


class OpenAISampling(Body):
    """What OpenAI's completions and chat completions share: OpenAI's sampling fields plus SGLang's extras
    (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``rid``, ``return_token_ids``,
    ...)."""

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
    return_token_ids: bool = False  # each choice's prompt_token_ids and token_ids

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

    @property
    def prompt_ids_wanted(self) -> bool:
        return self.return_token_ids

    def generate(self, prompt: str | list[Any], top_n: int | None) -> GenerateRequest:
        """The ``/generate`` request of ``prompt`` (text, texts, ids or lists of ids); ``top_n`` None: no
        logprobs. Call it, and everything that checks what it returns, inside :meth:`named_errors`."""
        text_in = isinstance(prompt, str) or (
            isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str)
        )
        body = {
            ("text" if text_in else "input_ids"): prompt,
            "sampling_params": {key: getattr(self, name) for name, key in _SAMPLING_KEY.items()},
            "rid": self.rid,
            "return_logprob": top_n is not None,
            "top_logprobs_num": top_n or 0,
            "return_text_in_logprobs": True,
        }
        try:
            return GenerateRequest.model_validate(body)
        except ValidationError as exc:  # a rule of /generate's this body's own validation missed
            raise user_error(exc, dotted, UNION_TAGS) from None

    def sources(self) -> dict[str, str]:
        """Each field of the /generate request this body becomes (and the engine's name ``max_new_tokens``)
        -> the field of this body it came from; a subclass adds its prompt's and its logprobs' fields."""
        names = {f"sampling_params.{key}": name for name, key in _SAMPLING_KEY.items()}
        return names | {"max_new_tokens": "max_tokens"}

    def user_field(self, field_name: str) -> str:
        """The field of this body that a field of its /generate request came from: ``sampling_params.stop.0``
        -> ``stop.0``, ``input_ids.3`` -> ``prompt.3``, the engine's ``max_new_tokens`` -> ``max_tokens``."""
        names, head, rest = self.sources(), field_name, ""
        while head:
            if head in names:
                return names[head] + rest
            head, _, last = head.rpartition(".")
            rest = f".{last}{rest}"
        return field_name

    @contextmanager
    def named_errors(self) -> Iterator[None]:
        """Inside, an error of /generate's checks (the translation's, the engine's) names the field of this
        body the user wrote, not /generate's."""
        try:
            yield
        except UserError as exc:
            raise (exc.with_field(self.user_field(exc.field)) if exc.field else exc) from None


class CompletionRequest(OpenAISampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)

    def sources(self) -> dict[str, str]:
        prompt, logprobs = {"text": "prompt", "input_ids": "prompt"}, "logprobs"
        return super().sources() | prompt | {"return_logprob": logprobs, "top_logprobs_num": logprobs}


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


def token_ids(body: OpenAISampling, out: Output, start: int, first: bool) -> dict[str, Any]:
    """A choice's token-in/token-out fields, when asked: its prompt's ids (in a stream: the choice's first
    chunk) and the ids generated from token ``start`` on (in a stream: the chunk's new ones)."""
    ids: dict[str, Any] = {}
    if first and body.prompt_ids_wanted:
        ids["prompt_token_ids"] = list(out.job.spec.prompt_ids)
    if body.return_token_ids:
        ids["token_ids"] = out.ids[start:]
    return ids


def usage(outs: list[Output], n: int) -> dict[str, Any]:
    """OpenAI's ``usage``: each prompt counted once (its first sample's, as SGLang), with the prompt tokens
    the engine found in its prefix cache."""
    firsts = outs[::n]  # outs are prompt-major: n samples of each prompt
    prompt = sum(len(o.job.spec.prompt_ids) for o in firsts)
    completion = sum(len(o.ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached for o in firsts)},
    }


@dataclass(frozen=True, slots=True)
class Delta:
    text: str  # the text not sent yet
    start: int  # the first token not sent yet
    first: bool  # the choice's first chunk


@dataclass
class Deltas:
    """What a stream has sent of each choice, so that each chunk carries only what is new (OpenAI's streams
    are deltas, SGLang's cumulative): text that can no longer be trimmed (``Output.stream_text``), and the
    tokens generated since the last chunk."""

    text: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def take(self, rid: str, out: Output) -> Delta | None:
        """What is new in ``out`` since the last take, or None when nothing is (and it has not finished)."""
        text, sent = out.stream_text, self.text.get(rid, 0)
        delta = text[sent:]
        if not delta and out.finish is None:
            return None
        new = Delta(delta, self.tokens.get(rid, 0), rid not in self.text)
        self.text[rid], self.tokens[rid] = max(len(text), sent), len(out.ids)
        return new


B = TypeVar("B", bound=OpenAISampling)


async def respond(
    request: Request,
    body: B,
    prompt: Callable[[ServerState], Any],
    top_n: int | None,
    stream: Callable[[ServerState, B, list[Job]], Awaitable[Any]],
    answer: Callable[[B, list[Output]], FastJSON],
) -> Any:
    """An OpenAI route's answer: ``prompt`` (of the server's state) generated as /generate generates it,
    streamed (``stream``) or answered whole (``answer``); errors name the field of ``body`` the user wrote.
    A large batch's jobs are built and its answer rendered in a worker thread (``bridge.work``)."""
    state = server_state(request)
    with body.named_errors():
        req = body.generate(prompt(state), top_n)
        jobs = await state.bridge.work(req.requests, to_jobs, req, state.codec)
        if body.stream:
            return await stream(state, body, jobs)
        outs = await run_generation(state, jobs, request)
    return await state.bridge.work(len(outs), answer, body, outs)


@router.post("/completions", summary="OpenAI completions (stream and not)", responses=STREAMED)
async def completions(body: CompletionRequest, request: Request) -> Any:
    return await respond(request, body, lambda _: body.prompt, body.logprobs, _stream, _answer)


def _answer(body: CompletionRequest, outs: list[Output]) -> FastJSON:
    """The whole answer, rendered: text, logprobs and token ids of every choice."""
    want = body.logprobs is not None
    choices = [_choice(i, o, o.text, 0, want) | token_ids(body, o, 0, True) for i, o in enumerate(outs)]
    return FastJSON({**_head(body), "choices": choices, "usage": usage(outs, body.n)})


def _head(body: CompletionRequest) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }


async def _stream(state: ServerState, body: CompletionRequest, jobs: list[Job]) -> StreamingResponse:
    head, want = _head(body), body.logprobs is not None
    index = {j.spec.id: i for i, j in enumerate(jobs)}
    sent = Deltas()

    def render(rid: str, out: Output) -> dict[str, Any] | None:
        new = sent.take(rid, out)
        if new is None:
            return None
        choice = _choice(index[rid], out, new.text, new.start, want)
        return {**head, "choices": [choice | token_ids(body, out, new.start, new.first)]}

    def final(outs: list[Output]) -> dict[str, Any] | None:
        if not body.usage_wanted:
            return None
        return {**head, "choices": [], "usage": usage(outs, body.n)}

    return await stream_generation(state, jobs, False, render, final)
