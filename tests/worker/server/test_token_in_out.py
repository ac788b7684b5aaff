"""Token in, token out on the OpenAI routes with the real model (SmolLM2-135M-Instruct, its tokenizer and chat
template), one replica, through the ``openai`` client: an agent loop's turns sent as exact token ids and
found in the prefix cache, chat logprobs' raw bytes, and stop strings of several-byte characters streamed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.worker.server.served import Served, start

pytestmark = pytest.mark.multiproc

TURNS = ["What is 2 + 3?", "And times 4?", "Say it in words.", "Thanks! One more: 7 - 2?"]
REPLY = 8  # tokens per reply


@pytest.fixture(scope="module")
def smol(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The real model, one replica (its prefix cache holds every turn), float32."""
    s = start(smollm2, tmp_path_factory.mktemp("smol"), "--ranks", "1", "--dtype", "float32", timeout=180)
    yield s
    s.stop()


def _client(served: Served) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _extra(obj: Any, name: str) -> Any:
    """A field the OpenAI types do not declare (SGLang's and vLLM's ``prompt_token_ids``, ``token_ids``)."""
    extra = obj.model_extra or {}
    assert name in extra, (name, obj)
    return extra[name]


def _next_turn(tok: Any, user: str) -> list[int]:
    """What an agent loop appends to the ids of the conversation so far (ending in a reply that did not end
    its turn): the chat template's text after an assistant message's content, closing it, then the user's
    new message and the next generation prompt, as ``transformers`` renders and tokenizes it."""
    mark = "\x00reply\x00"
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": mark},
        {"role": "user", "content": user},
    ]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text.split(mark, 1)[1], add_special_tokens=False))


def test_an_agent_loop_sends_exact_ids_and_the_cache_holds_every_earlier_turn(
    smol: Served, smollm2: Path
) -> None:
    """Turn k+1's prompt is turn k's prompt ids + its reply's ids + the next message's rendered ids: the
    server runs those ids as sent (``prompt_token_ids``), answers the ids it generated (``token_ids``), and
    finds every earlier token whose K/V exists in its prefix cache (all but the last reply token, never
    computed): ``cached_tokens`` = the previous prompt + the previous reply - 1. The first turn is rendered by
    the server, as ``transformers`` renders and tokenizes it; the last is streamed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    client = _client(smol)
    greedy: dict[str, Any] = {"max_tokens": REPLY, "temperature": 0}
    messages: list[dict[str, str]] = [{"role": "user", "content": TURNS[0]}]
    first = client.chat.completions.create(
        model="m", messages=messages, **greedy, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    (choice,) = first.choices
    prompt, reply = _extra(choice, "prompt_token_ids"), _extra(choice, "token_ids")
    assert prompt == tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert len(reply) == REPLY and choice.message.content == tok.decode(reply, skip_special_tokens=True)
    for k, user in enumerate(TURNS[1:], 1):
        messages += [
            {"role": "assistant", "content": choice.message.content or ""},
            {"role": "user", "content": user},
        ]
        ids = prompt + reply + _next_turn(tok, user)
        body = {"input_ids": ids, "ignore_eos": True, "return_token_ids": True}
        if k < len(TURNS) - 1:
            done = client.chat.completions.create(model="m", messages=messages, **greedy, extra_body=body)
            (choice,) = done.choices
            got_prompt, got_reply, usage = (
                _extra(choice, "prompt_token_ids"),
                _extra(choice, "token_ids"),
                done.usage,
            )
            text = choice.message.content
        else:
            chunks = list(
                client.chat.completions.create(
                    model="m",
                    messages=messages,
                    **greedy,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=body,
                )
            )
            parts = [c.choices[0] for c in chunks if c.choices]
            got_prompt = _extra(parts[0], "prompt_token_ids")
            assert all("prompt_token_ids" not in (p.model_extra or {}) for p in parts[1:])
            got_reply = [t for p in parts for t in _extra(p, "token_ids")]
            usage, text = chunks[-1].usage, "".join(p.delta.content or "" for p in parts)
        assert got_prompt == ids, k  # run as sent: nothing tokenized again
        assert len(got_reply) == REPLY and text == tok.decode(got_reply, skip_special_tokens=True), k
        assert usage is not None and usage.prompt_tokens == len(ids) and usage.completion_tokens == REPLY
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == len(prompt) + len(reply) - 1, k
        prompt, reply = got_prompt, got_reply


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(smol: Served) -> None:
    """A reply of emoji, whose characters split over byte-level tokens: each token's ``bytes`` are its own
    (not the UTF-8 of U+FFFD), so that they join to exactly the UTF-8 of the reply; the top alternative of
    a greedy draw is the token itself, with the same bytes."""
    done = _client(smol).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Reply with three emoji."}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    (choice,) = done.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = choice.logprobs.content
    assert b"".join(bytes(t.bytes or []) for t in tokens) == (choice.message.content or "").encode()
    assert len(tokens) == 24 and any(
        not _utf8(bytes(t.bytes or [])) for t in tokens
    )  # some split a character
    assert all(t.top_logprobs[0].bytes == t.bytes for t in tokens)


def test_a_stop_string_of_several_byte_characters_is_not_streamed(smol: Served, smollm2: Path) -> None:
    """Full-width exclamation marks (3 bytes each, split over tokens) as the stop string: the streamed deltas
    join to the non-streamed (trimmed) text, on both routes (completions given the chat's prompt)."""
    from transformers import AutoTokenizer

    client = _client(smol)
    messages = [{"role": "user", "content": "用中文回答：你好吗？"}]
    chat: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 24, "temperature": 0}
    free = client.chat.completions.create(**chat).choices[0].message.content or ""
    assert "！！" in free[1:], free  # the reply this test needs: the stop string, not at the start
    done = client.chat.completions.create(**chat, stop="！！").choices[0]
    assert (done.finish_reason, _extra(done, "matched_stop")) == ("stop", "！！") and done.message.content
    chunks = list(client.chat.completions.create(**chat, stop="！！", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.message.content
    prompt = AutoTokenizer.from_pretrained(smollm2).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    plain: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    text = client.completions.create(**plain, stop="！！").choices[0]
    assert text.finish_reason == "stop" and text.text
    streamed = client.completions.create(**plain, stop="！！", stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.text
