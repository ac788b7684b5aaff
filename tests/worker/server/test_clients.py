"""Real clients that others wrote, unchanged, against the server on loopback: sglang's frontend language
(RuntimeEndpoint: gen, stream, select, run_batch), ``python -m sglang.bench_serving`` (backends sglang and
sglang-oai on random-ids), and the ``openai`` client on /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.worker.server.served import Served

pytestmark = pytest.mark.multiproc


def test_sglang_frontend(server: Served) -> None:
    import sglang as sgl
    from sglang import RuntimeEndpoint

    sgl.set_default_backend(RuntimeEndpoint(server.url))

    @sgl.function
    def qa(s, q):  # type: ignore[no-untyped-def]
        s += "Q: " + q + "\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    @sgl.function
    def pick(s):  # type: ignore[no-untyped-def]
        s += "Is it? "
        s += sgl.select("choice", choices=["yes", "no", "maybe"])

    direct = server.post(
        "/generate", {"text": "Q: Hello\nA:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    ).json()
    answer = qa.run(q="Hello")["answer"]
    assert answer == direct["text"]  # the frontend sees exactly what /generate returns
    streamed = "".join(qa.run(q="Hello", stream=True).text_iter("answer"))
    assert streamed == answer
    assert pick.run()["choice"] in ("yes", "no", "maybe")
    batch = qa.run_batch([{"q": "a"}, {"q": "b"}, {"q": "Hello"}])
    assert len(batch) == 3 and batch[2]["answer"] == answer


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
def test_bench_serving(server: Served, tiny64: Path, backend: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.bench_serving",
            "--backend",
            backend,
            "--base-url",
            server.url,
            "--dataset-name",
            "random-ids",
            "--num-prompts",
            "12",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--random-range-ratio",
            "1.0",
            "--tokenizer",
            str(tiny64),
            "--request-rate",
            "inf",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # it writes its results file into the working directory
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ok = re.search(r"Successful requests:\s+(\d+)", r.stdout)
    toks = re.search(r"Total generated tokens:\s+(\d+)", r.stdout)
    assert ok and int(ok.group(1)) == 12, r.stdout[-2000:]
    assert toks and int(toks.group(1)) == 12 * 8  # ignore_eos: every request runs to its length


def test_openai_client(server: Served) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    done = client.completions.create(
        model=model, prompt="Hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 6)
    direct = server.post(
        "/generate",
        {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}},
    ).json()
    assert done.choices[0].text == direct["text"]
    chunks = list(
        client.completions.create(
            model=model,
            prompt=["Hello", "Hi"],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts[0] == done.choices[0].text and set(texts) == {0, 1}
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    )
    with_lp = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = with_lp.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 3 and len((lp.top_logprobs or [])[0]) == 2


def _tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer as transformers loads it (the reference, not ours)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _chat_prompt(model_dir: Path, messages: list[dict[str, str]]) -> str:
    """The prompt as transformers renders the model's chat template (the reference, not our renderer)."""
    tok = _tokenizer(model_dir)
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


def test_openai_chat_client(server: Served, tiny64: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompt = _chat_prompt(tiny64, CHAT)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    direct = server.post("/generate", {"text": prompt, "sampling_params": greedy}).json()
    done = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    (choice,) = done.choices
    assert choice.message.role == "assistant" and choice.message.content == direct["text"]
    assert choice.finish_reason == "length" and done.object == "chat.completion"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (
        direct["meta_info"]["prompt_tokens"],
        8,
    )

    # n samples with a seed and logprobs: the samples /generate draws for the same prompt, seed and n
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True, "n": 3}
    body = {"text": prompt, "sampling_params": {**sampled, "sampling_seed": 9}, "return_logprob": True}
    want = server.post("/generate", {**body, "top_logprobs_num": 2, "return_text_in_logprobs": True}).json()
    got = client.chat.completions.create(
        model=model,
        messages=CHAT,  # type: ignore[arg-type]
        max_completion_tokens=6,
        temperature=1.0,
        top_p=0.9,
        n=3,
        seed=9,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    for c, w in zip(got.choices, want, strict=True):
        assert c.message.content == w["text"]
        assert c.logprobs is not None and c.logprobs.content is not None
        # (the two calls meet the prefix cache differently: float64 rounding apart, the tokens equal)
        assert [t.logprob for t in c.logprobs.content] == pytest.approx(
            [x[0] for x in w["meta_info"]["output_token_logprobs"]], rel=1e-12, abs=1e-12
        )
        assert [t.token for t in c.logprobs.content] == [
            x[2] for x in w["meta_info"]["output_token_logprobs"]
        ]
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert len({c.message.content for c in got.choices}) > 1  # three samples, not one thrice

    # streamed: deltas (the role first), the same text, a usage chunk, then the end
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == direct["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    )


def _openai(server: Served) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _by_choice(chunks: list[Any], part: Callable[[Any], Any]) -> dict[int, list[Any]]:
    """``part(choice)`` of each chunk, by the choice's index, in stream order."""
    out: dict[int, list[Any]] = {}
    for c in chunks:
        for ch in c.choices:
            out.setdefault(ch.index, []).append(part(ch))
    return out


def _clean_stops(text: str) -> list[str]:
    """Stop strings taken from ``text``, one after the other past its start: of 3 characters (3 byte
    tokens), 2 and 1; none with U+FFFD (what a partial character decodes to)."""
    picks, i = [], 3
    for n in (3, 2, 1):
        i = next(j for j in range(i, len(text) - n + 1) if "\ufffd" not in text[j : j + n])
        picks.append(text[i : i + n])
        i += n
    return picks


def test_openai_streams_end_where_the_stop_string_trims_the_text(server: Served) -> None:
    """Stop strings of 1 to 3 characters spanning tokens, alone and in a list: the streamed deltas join to
    the non-streamed text, which ends where the first stop string begins (the stream holds back what may
    still turn out to begin one), on both routes."""
    client = _openai(server)
    plain: dict[str, Any] = {"model": "m", "prompt": "Hello", "max_tokens": 80, "temperature": 0}
    chat: dict[str, Any] = {"model": "m", "messages": CHAT, "max_tokens": 80, "temperature": 0}
    routes: list[tuple[Any, dict[str, Any], Callable[[Any], str], Callable[[Any], str]]] = [
        (client.completions.create, plain, lambda c: c.text, lambda c: c.text),
        (client.chat.completions.create, chat, lambda c: c.message.content, lambda c: c.delta.content or ""),
    ]
    for create, body, text_of, delta_of in routes:
        free = text_of(create(**body).choices[0])
        stops = _clean_stops(free)
        for stop in [*stops, stops[:2]]:
            (done,) = create(**body, stop=stop).choices
            first = min(free.index(s) for s in ([stop] if isinstance(stop, str) else stop))
            assert done.finish_reason == "stop" and text_of(done) == free[:first], (stop, free)
            streamed = _by_choice(list(create(**body, stop=stop, stream=True)), delta_of)
            assert {i: "".join(parts) for i, parts in streamed.items()} == {0: free[:first]}, (stop, free)


def _ids(choice: Any, name: str) -> Any:
    """SGLang's (and vLLM's) token id fields, which the openai types do not declare."""
    return (choice.model_extra or {}).get(name)


def test_openai_token_ids_in_and_out(server: Served, tiny64: Path) -> None:
    """``return_token_ids``: each choice's prompt ids (a stream: in its first chunk only) and generated ids
    (a stream: each chunk's new ones), the same streamed or not and the ids /generate returns for the same
    request, with prompts as ids (a batch, 2 samples each) on /v1/completions and as ``input_ids`` on chat
    (the ids chat rendered, from ``return_prompt_token_ids``); usage has OpenAI's cached prompt tokens."""
    client = _openai(server)
    ids = [[5, 6, 7], [8, 9]]
    body: dict[str, Any] = {"model": "m", "prompt": ids, "max_tokens": 6, "n": 2, "seed": 3}
    extra = {"ignore_eos": True, "return_token_ids": True}
    done = client.completions.create(**body, extra_body=extra)
    sampling = {"max_new_tokens": 6, "n": 2, "sampling_seed": 3, "ignore_eos": True}
    direct = server.post("/generate", {"input_ids": ids, "sampling_params": sampling}).json()
    choices = sorted(done.choices, key=lambda c: c.index)
    assert [_ids(c, "prompt_token_ids") for c in choices] == [ids[0], ids[0], ids[1], ids[1]]
    assert [_ids(c, "token_ids") for c in choices] == [d["output_ids"] for d in direct]
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 24)
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens is not None
    _streamed_like(list(client.completions.create(**body, extra_body=extra, stream=True)), choices)

    rendered = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=1, extra_body={"return_prompt_token_ids": True}
    ).choices[0]
    prompt = _ids(rendered, "prompt_token_ids")
    assert _ids(rendered, "token_ids") is None  # not asked for
    assert prompt == _tokenizer(tiny64).encode(_chat_prompt(tiny64, CHAT), add_special_tokens=False)
    chat: dict[str, Any] = {"model": "m", "messages": CHAT, "max_tokens": 8, "temperature": 0}
    chat_extra = {"input_ids": prompt, **extra}
    (reply,) = client.chat.completions.create(**chat, extra_body=chat_extra).choices
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    direct = server.post("/generate", {"input_ids": prompt, "sampling_params": greedy}).json()
    assert (_ids(reply, "prompt_token_ids"), _ids(reply, "token_ids")) == (prompt, direct["output_ids"])
    assert reply.message.content == direct["text"]
    chunks = list(client.chat.completions.create(**chat, extra_body=chat_extra, stream=True))
    _streamed_like(chunks, [reply])


def _streamed_like(chunks: list[Any], choices: list[Any]) -> None:
    """A stream's choices carry what ``choices`` (non-streamed) do: the prompt's ids in its first chunk only,
    the generated ids and the text in pieces."""
    prompts = _by_choice(chunks, lambda c: _ids(c, "prompt_token_ids"))
    assert {i: p[0] for i, p in prompts.items()} == {c.index: _ids(c, "prompt_token_ids") for c in choices}
    assert all(p[1:] == [None] * (len(p) - 1) for p in prompts.values())
    ids = _by_choice(chunks, lambda c: _ids(c, "token_ids"))
    assert {i: [x for part in t for x in part] for i, t in ids.items()} == {
        c.index: _ids(c, "token_ids") for c in choices
    }
    texts = _by_choice(chunks, lambda c: c.text if hasattr(c, "text") else c.delta.content or "")
    want = {c.index: c.text if hasattr(c, "text") else c.message.content for c in choices}
    assert {i: "".join(t) for i, t in texts.items()} == want


def test_chat_errors_name_the_field(server: Served) -> None:
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": CHAT, "max_completion_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens"),
    ]
    for extra, name in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", **extra)
        assert err.value.status_code == 400
        body = err.value.body
        assert isinstance(body, dict) and body.get("field", "").startswith(name), (extra, body)


def test_a_model_without_a_chat_template_is_a_clear_400(tiny64: Path, tmp_path: Path) -> None:
    """In process (no ranks: the answer comes before the engine is needed), through the openai client."""
    import openai
    from fastapi.testclient import TestClient
    from openai import OpenAI
    from rollout_worker.engine.config import EngineConfig
    from rollout_worker.server.app import create_app
    from rollout_worker.server.settings import ServerSettings

    plain = tmp_path / "plain"
    shutil.copytree(tiny64, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    app = create_app(ServerSettings(model=plain), EngineConfig.load(str(plain), 1))
    client = OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=TestClient(app), max_retries=0
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=CHAT)  # type: ignore[arg-type]
    assert err.value.status_code == 400
    assert "has no chat template" in str(err.value) and err.value.body["field"] == "messages"  # type: ignore[index]


def test_a_model_without_a_tokenizer_refuses_stop_strings_and_text(tiny64: Path, tmp_path: Path) -> None:
    """In process (no ranks: the answer comes before the engine is needed): a prompt of token ids needs no
    tokenizer, but a stop string, matched in the text, does: refused naming ``stop``, not ignored; a text
    prompt is refused naming ``prompt``."""
    import openai
    from fastapi.testclient import TestClient
    from openai import OpenAI
    from rollout_worker.engine.config import EngineConfig
    from rollout_worker.server.app import create_app
    from rollout_worker.server.settings import ServerSettings

    bare = tmp_path / "bare"
    shutil.copytree(tiny64, bare)
    (bare / "tokenizer.json").unlink()
    app = create_app(ServerSettings(model=bare), EngineConfig.load(str(bare), 1))
    client = OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=TestClient(app), max_retries=0
    )
    for prompt, stop, field, text in (
        ([1, 2, 3], "ab", "stop", "tokenizer.json"),
        ("hi", None, "prompt", "ids"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt=prompt, stop=stop)
        assert err.value.body["field"] == field and text in str(err.value), err.value.body  # type: ignore[index]
