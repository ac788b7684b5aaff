"""OpenAI-compatible ``POST /v1/chat/completions``: the messages rendered with the model's chat template (as a
job's chat prompts are, ``api.prompts.ChatTemplate``), then generated as ``/v1/completions`` generates a
text prompt (stream and not, ``n``, ``logprobs`` / ``top_logprobs``, SGLang's extra sampling fields).

Token in, token out as SGLang's chat API: ``input_ids`` is the prompt as token ids (the messages are not
rendered then: an agent loop sends each turn's exact prompt, the earlier turns' ids plus the new message's);
``return_token_ids`` puts ``prompt_token_ids`` and ``token_ids`` in each choice (``return_prompt_token_ids``
only the prompt's), in a stream as ``/v1/completions`` does.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator, model_validator

from rollout_worker.api.neutral_keys import strip_neutral
from rollout_worker.api.sglang import Body
from rollout_worker.engine.finish import matched_stop
from rollout_worker.errors import FieldAt, UserError
from rollout_worker.server.convert import Job, Output
from rollout_worker.server.deps import FastJSON, ServerState
from rollout_worker.server.routes.generate import STREAMED, stream_generation
from rollout_worker.server.routes.openai import Deltas, OpenAISampling, respond, token_ids, usage

router = APIRouter(prefix="/v1", tags=["openai"])
# OpenAI's chat keys this engine does not implement (tools, structured output, audio, ...), neutral only
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "chat_template_kwargs": (None, {}),
}


class ChatMessage(Body):
    role: str = Field(min_length=1)
    content: str | list[Any] | None = None  # text, or text parts {type: "text", text}
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[Any] | None) -> str | list[Any] | None:
        for i, part in enumerate(v if isinstance(v, list) else ()):
            ok = isinstance(part, dict) and set(part) == {"type", "text"} and isinstance(part["text"], str)
            if not ok or part["type"] != "text":
                kind = (
                    f"type {json.dumps(part.get('type'))[:40]}" if isinstance(part, dict) else "not an object"
                )
                raise ValueError(f"part {i} ({kind}): only text parts {{type: 'text', text}} are supported")
        return v

    def rendered(self) -> dict[str, Any]:
        """The message as a chat template reads it: ``role`` and ``content`` as one text."""
        c = self.content
        text = "".join(p["text"] for p in c) if isinstance(c, list) else (c or "")
        return {"role": self.role, "content": text} | ({"name": self.name} if self.name else {})


class ChatRequest(OpenAISampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # OpenAI's newer name: copied to max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    input_ids: list[int] | None = None  # SGLang's: the prompt as token ids (the messages are not rendered)
    return_prompt_token_ids: bool = False  # SGLang's: each choice's prompt_token_ids

    @model_validator(mode="before")
    @classmethod
    def _chat_neutral(cls, data: Any) -> Any:
        data = strip_neutral(data, _NEUTRAL)
        most = data.get("max_completion_tokens") if isinstance(data, dict) else None
        if isinstance(most, int) and not isinstance(most, bool) and most >= 0:
            data = {**data, "max_tokens": most}  # it wins over max_tokens (and bounds min_tokens)
        return data

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldAt(("top_logprobs",), "needs logprobs: true")
        return self

    @property
    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_ids_wanted(self) -> bool:
        return self.return_token_ids or self.return_prompt_token_ids

    def sources(self) -> dict[str, str]:
        names = super().sources()
        if self.max_completion_tokens is not None:  # the name the user wrote (it is copied to max_tokens)
            names = {k: "max_completion_tokens" if v == "max_tokens" else v for k, v in names.items()}
        prompt = {"text": "messages", "input_ids": "input_ids"}
        return names | prompt | {"return_logprob": "logprobs", "top_logprobs_num": "top_logprobs"}

    def prompt(self, state: ServerState) -> str | list[int]:
        """The prompt: ``input_ids`` as given, else the messages rendered."""
        return self.input_ids if self.input_ids is not None else render_messages(state, self.messages)


def render_messages(state: ServerState, messages: list[ChatMessage]) -> str:
    """The prompt text: ``messages`` through the model's chat template, ready for the assistant's turn."""
    if state.codec is None:
        raise UserError("the served model has no tokenizer.json, so it cannot take chat messages", "messages")
    if state.chat is None:
        raise UserError(
            "the served model has no chat template (tokenizer_config.json's chat_template); "
            "use /v1/completions or /generate with a rendered prompt",
            "messages",
        )
    try:
        return state.chat.render([m.rendered() for m in messages])
    except Exception as exc:  # the template's own error (raise_exception) or a message it cannot take
        raise UserError(f"the chat template failed: {exc}", "messages") from None


def _token(out: Output, tok: int, lp: float | None) -> dict[str, Any]:
    """One token of chat ``logprobs``: its text, logprob and raw bytes (a token that splits a character has
    bytes that are not text of their own: the tokens' bytes, joined, are the UTF-8 of the text)."""
    if out.codec is None:
        return {"token": str(tok), "logprob": lp, "bytes": list(str(tok).encode())}
    return {"token": out.codec.token_text(tok), "logprob": lp, "bytes": list(out.codec.token_bytes(tok))}


def _logprobs(out: Output, start: int, top_n: int | None) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs``: per token its text, logprob, bytes and ``top_logprobs`` alternatives."""
    if top_n is None:
        return None
    content = [
        {**_token(out, tok, lp), "top_logprobs": [_token(out, t, v) for v, t in (top or ())][:top_n]}
        for tok, lp, top in zip(out.ids[start:], out.logprobs[start:], out.tops[start:], strict=True)
    ]
    return {"content": content, "refusal": None}


def _finish(out: Output) -> dict[str, Any]:
    return {
        "finish_reason": out.finish.type if out.finish else None,
        "matched_stop": matched_stop(out.finish),
    }


@router.post("/chat/completions", summary="OpenAI chat completions (stream and not)", responses=STREAMED)
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    return await respond(request, body, body.prompt, body.top_n, _stream, _answer)


def _answer(body: ChatRequest, outs: list[Output]) -> FastJSON:
    """The whole answer, rendered: message, logprobs and token ids of every choice."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": _logprobs(o, 0, body.top_n),
            **_finish(o),
            **token_ids(body, o, 0, True),
        }
        for i, o in enumerate(outs)
    ]
    return FastJSON(
        {**_head(body), "object": "chat.completion", "choices": choices, "usage": usage(outs, body.n)}
    )


def _head(body: ChatRequest) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model}


async def _stream(state: ServerState, body: ChatRequest, jobs: list[Job]) -> StreamingResponse:
    index = {j.spec.id: i for i, j in enumerate(jobs)}
    sent = Deltas()
    chunk_head = {**_head(body), "object": "chat.completion.chunk"}

    def render(rid: str, out: Output) -> dict[str, Any] | None:
        new = sent.take(rid, out)
        if new is None:
            return None
        role = {"role": "assistant"} if new.first else {}
        choice = {
            "index": index[rid],
            "delta": {**role, "content": new.text},
            "logprobs": _logprobs(out, new.start, body.top_n),
            **_finish(out),
            **token_ids(body, out, new.start, new.first),
        }
        return {**chunk_head, "choices": [choice]}

    def final(outs: list[Output]) -> dict[str, Any] | None:
        return {**chunk_head, "choices": [], "usage": usage(outs, body.n)} if body.usage_wanted else None

    return await stream_generation(state, jobs, False, render, final)
