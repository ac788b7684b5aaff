"""The SGLang-native API on a real server (2 gloo ranks, float64): shapes, batches, streaming, logprobs,
stop conditions, and one clear 400 per bad input."""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_worker.api.sglang import MAX_REQUESTS_PER_BODY

from tests.waiting import wait_until
from tests.worker.server.served import Served

pytestmark = pytest.mark.multiproc
GREEDY = {"temperature": 0, "ignore_eos": True}


def gen(server: Served, body: dict[str, Any]) -> Any:
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(server: Served, path: str, body: dict[str, Any]) -> list[Any]:
    """Every ``data:`` payload of a streamed response ("[DONE]" kept as a string)."""
    out = []
    with server.client() as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_single_response_shape(server: Served) -> None:
    body = gen(
        server, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, **GREEDY}, "rid": "one"}
    )
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "one" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6 == len(body["output_ids"])
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta


TWO_SEEDED = {"max_new_tokens": 4, "temperature": 0.8, "top_k": 20, "n": 2, "sampling_seed": 7}


def test_batch_n_and_logprob_triples(server: Served) -> None:
    body = gen(
        server,
        {
            "text": ["Hi", "there"],
            "sampling_params": TWO_SEEDED,
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "rid": "b",
        },
    )
    assert isinstance(body, list) and len(body) == 4
    ids = [b["meta_info"]["id"] for b in body]
    assert ids == ["b_0-0", "b_0-1", "b_1-0", "b_1-1"]
    for b in body:
        lps = b["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in lps] == b["output_ids"] and all(t[0] <= 0 for t in lps)
        assert all(isinstance(t[2], str) for t in lps)
    assert body[0]["output_ids"] != body[1]["output_ids"]  # n samples differ (derived seeds)
    again = gen(
        server,
        {
            "text": "Hi",
            "sampling_params": TWO_SEEDED,
        },
    )
    assert [a["output_ids"] for a in again] == [b["output_ids"] for b in body[:2]]  # reproducible


def test_stream_is_cumulative_and_ends_with_done(server: Served) -> None:
    events = sse(
        server,
        "/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, **GREEDY}, "stream": True},
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 5
    for a, b in itertools.pairwise(chunks):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert b["text"].startswith(a["text"])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    whole = gen(server, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, **GREEDY}})
    assert whole["output_ids"] == chunks[-1]["output_ids"] and whole["text"] == chunks[-1]["text"]


def test_streamed_batch_chunks_carry_index(server: Served) -> None:
    events = sse(
        server,
        "/generate",
        {
            "input_ids": [[1, 2], [3, 4, 5]],
            "sampling_params": {"max_new_tokens": 3, **GREEDY},
            "stream": True,
        },
    )
    assert events[-1] == "[DONE]"
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1} and all(len(c["output_ids"]) == 3 for c in finals.values())


def test_prefill_only_with_prompt_logprobs(server: Served) -> None:
    """What the frontend's select() sends: max_new_tokens 0 and prompt logprobs from a start position."""
    body = gen(
        server,
        {
            "input_ids": [[10, 11, 12, 13], [10, 11, 14]],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    for b, prompt in zip(body, [[10, 11, 12, 13], [10, 11, 14]], strict=True):
        meta = b["meta_info"]
        assert b["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
        inp = meta["input_token_logprobs"]
        assert [t[1] for t in inp] == prompt and inp[0][0] is None and all(t[0] < 0 for t in inp[1:])
    # the shared prefix has the same logprobs in both
    a, b = body[0]["meta_info"]["input_token_logprobs"][1], body[1]["meta_info"]["input_token_logprobs"][1]
    assert a[1:] == b[1:] and a[0] == pytest.approx(b[0], abs=1e-12)
    late = gen(
        server,
        {
            "input_ids": [10, 11, 12, 13],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 2,
        },
    )
    got = late["meta_info"]["input_token_logprobs"]
    want = body[0]["meta_info"]["input_token_logprobs"][2:]
    assert [t[1] for t in got] == [t[1] for t in want]
    assert [t[0] for t in got] == pytest.approx([t[0] for t in want], abs=1e-12)


def test_a_one_token_prompt_with_logprobs_from_0_is_answered_as_sglang_does(server: Served) -> None:
    """What sglang's frontend sends for gen(..., return_logprob=True) on a one-token prompt (it failed
    rank 0 and took the server down): SGLang answers input_token_logprobs [[null, token, text]] (the
    first token has no logprob) and the output's logprobs as usual."""
    body = {
        "text": "x",
        "sampling_params": {"max_new_tokens": 3, **GREEDY},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    one = gen(server, body)
    meta = one["meta_info"]
    tok = meta["input_token_logprobs"][0][1]
    assert meta["prompt_tokens"] == 1 and meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["input_token_logprobs"] == [[None, tok, "x"]] and meta["input_top_logprobs"] == [None]
    plain = gen(server, {"text": "x", "sampling_params": {"max_new_tokens": 3, **GREEDY}})
    assert one["output_ids"] == plain["output_ids"]  # asking for logprobs changes no token
    # the first output token's logprob is the logprob of that token after "x" as a prompt scores it
    first = one["output_ids"][0]
    scored = gen(
        server,
        {
            "input_ids": [tok, first],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )["meta_info"]["input_token_logprobs"]
    assert scored[0] == [None, tok, None] and scored[1][1] == first
    assert meta["output_token_logprobs"][0][0] == pytest.approx(scored[1][0], abs=1e-12)
    assert meta["output_top_logprobs"][0][0][:2] == meta["output_token_logprobs"][0][:2]  # greedy: the top
    ids = gen(server, {**body, "text": None, "input_ids": [tok]})  # the same by ids, and the server serves on
    assert ids["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
    assert server.get("/health").status_code == 200


def test_stop_token_and_stop_string(server: Served) -> None:
    base = gen(server, {"input_ids": [9, 9, 9], "sampling_params": {"max_new_tokens": 12, **GREEDY}})
    ids = base["output_ids"]
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    by_tok = gen(
        server,
        {
            "input_ids": [9, 9, 9],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_tok]},
        },
    )
    assert by_tok["output_ids"] == ids[: first + 1]
    assert by_tok["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # a stop string: the text of two consecutive generated tokens (byte-level tokenizer)
    text = base["text"]
    with_min = gen(
        server,
        {
            "input_ids": [9, 9, 9],
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0,
                "stop_token_ids": [stop_tok],
                "min_new_tokens": first + 2,
            },
        },
    )
    assert len(with_min["output_ids"]) >= first + 2  # the stop token was masked until min_new_tokens
    assert isinstance(text, str)


def test_stop_strings_trim_unless_no_stop_trim(server: Served) -> None:
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 60, **GREEDY}}
    full = gen(server, body)
    # the byte-level tokenizer: a token id below 128 is that ASCII character
    ascii_at = [i for i, t in enumerate(full["output_ids"]) if 33 <= t < 127 and i >= 2]
    assert ascii_at, f"no printable ASCII token in {full['output_ids']}"
    i = ascii_at[0]
    piece = chr(full["output_ids"][i])
    sp = {**body["sampling_params"], "stop": [piece]}
    stopped = gen(server, {**body, "sampling_params": sp})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
    assert stopped["output_ids"] == full["output_ids"][: i + 1]  # generated up to the matching token
    assert stopped["text"] == full["text"][: full["text"].index(piece)]  # the stop string trimmed
    kept = gen(server, {**body, "sampling_params": {**sp, "no_stop_trim": True}})
    assert kept["output_ids"] == stopped["output_ids"] and kept["text"].endswith(piece)


def test_neutral_sglang_keys_are_accepted(server: Served) -> None:
    """What sglang's frontend and slime send besides the fields we implement."""
    body = {
        "text": "Hi",
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 0,
            "regex": None,
            "json_schema": None,
            "stop": [],
            "stop_token_ids": [],
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        },
        "image_data": None,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    assert gen(server, body)["meta_info"]["completion_tokens"] == 2


BAD = [
    ({"sampling_params": {"max_new_tokens": 2}}, "body", "exactly one of text or input_ids"),
    ({"text": "a", "input_ids": [1], "sampling_params": {}}, "body", "exactly one of text or input_ids"),
    ({"text": "", "sampling_params": {}}, "text", "empty"),
    ({"input_ids": [], "sampling_params": {}}, "input_ids", "empty"),
    # issue 35: an error of one prompt of a batch names it
    ({"input_ids": [[1], [2], []]}, "input_ids.2", "empty"),
    ({"text": ["a", ""]}, "text.1", "empty"),
    ({"input_ids": [[1], [2, 99999]]}, "input_ids.1", "out of range"),
    (
        {"input_ids": [[1], [1] * 9], "sampling_params": {"max_new_tokens": 2040}},
        "max_new_tokens",
        "(prompt 1 of",
    ),
    ({"input_ids": [1, 99999]}, "input_ids", "out of range"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", ""),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens", "context length"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature", ""),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p", ""),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", ""),
    ({"input_ids": [1], "sampling_params": {"top_k": -2}}, "sampling_params.top_k", ""),
    ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "sampling_params.temprature", "Extra inputs"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "sampling_params.regex", "not supported"),
    (
        {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
        "sampling_params.frequency_penalty",
        "not supported",
    ),
    (
        {"input_ids": [1], "sampling_params": {"stop_token_ids": [70000]}},
        "sampling_params.stop_token_ids",
        "out of range",
    ),
    ({"input_ids": [1], "lora_path": "x"}, "lora_path", "not supported"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid", "1 rid(s) for 2 prompt(s)"),
    # issue 15: strict types as SGLang's msgspec, lone surrogates, min above max
    (
        {"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}},
        "sampling_params.max_new_tokens",
        "integer",
    ),
    ({"input_ids": [1], "sampling_params": {"temperature": True}}, "sampling_params.temperature", "number"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos", "boolean"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob", "boolean"),
    # issue 17: as SGLang, prompt logprobs cannot start at or past the prompt's end
    (
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
        "logprob_start_len",
        "not below the prompt's length (2 tokens)",
    ),
    (
        {"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
        "sampling_params.min_new_tokens",
        "above max_new_tokens (4)",
    ),
    (
        {"input_ids": [[1]], "sampling_params": [{"min_new_tokens": 200}]},
        "sampling_params.0.min_new_tokens",
        "above max_new_tokens (128)",
    ),
    ({"text": "\ud800"}, "text", "not Unicode text"),
    ({"text": ["a", "b\udfff"]}, "text.1", "not Unicode text"),
    (
        {"input_ids": [1], "sampling_params": {"stop": ["\ud800"]}},
        "sampling_params.stop.0",
        "not Unicode text",
    ),
    ({"input_ids": [1], "rid": "\udc00"}, "rid", "not Unicode text"),
    # issue 35: out of SGLang's range (-1: no prompt logprobs), an empty batch, more requests than a body may
    # ask for (the 16 KB body asked for 128,000), an id given twice in one body
    ({"input_ids": [1], "top_logprobs_num": -1}, "top_logprobs_num", "greater than or equal to 0"),
    ({"input_ids": [[1], [2]], "top_logprobs_num": [0, -1]}, "top_logprobs_num.1", "greater than or equal"),
    ({"input_ids": [1], "logprob_start_len": -(2**70)}, "logprob_start_len", "greater than or equal to -1"),
    ({"input_ids": [1], "logprob_start_len": -2}, "logprob_start_len", "greater than or equal to -1"),
    ({"text": []}, "text", "empty batch"),
    (
        {"input_ids": [[1, 2]] * 2000, "sampling_params": {"n": 64, "max_new_tokens": 1}},
        "input_ids",
        f"2000 prompt(s) and their samples (n) ask for 128000 requests, more than the "
        f"{MAX_REQUESTS_PER_BODY}",
    ),
    (
        {"text": ["a"] * 17, "sampling_params": [{"n": 64}] * 17},
        "text",
        f"ask for 1088 requests, more than the {MAX_REQUESTS_PER_BODY}",
    ),
    ({"input_ids": [[1]] * (MAX_REQUESTS_PER_BODY + 1)}, "input_ids", "several bodies"),
    ({"input_ids": [[1], [2]], "rid": ["d", "d"]}, "rid", "'d' is given to more than one request"),
    (
        {"input_ids": [[1], [2]], "rid": ["e", "e-1"], "sampling_params": [{"n": 2}, {"n": 1}]},
        "rid",
        "'e-1' is given to more than one request",
    ),
]


def post_raw(server: Served, path: str, body: Any) -> httpx.Response:
    """POST ``body`` as JSON escaped to ASCII (httpx's own encoding cannot carry a lone surrogate)."""
    with server.client() as c:
        return c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize(("body", "field", "text"), BAD)
def test_bad_input_is_a_400_naming_the_field(
    server: Served, body: dict[str, Any], field: str, text: str
) -> None:
    r = post_raw(server, "/generate", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == field and text in err["message"], err


@pytest.mark.parametrize(
    ("path", "body", "field", "text"),
    [
        ("/v1/completions", {"model": "m", "prompt": "\ud800"}, "prompt", "not Unicode text"),
        ("/v1/completions", {"model": "m", "prompt": ["a", "\ud800"]}, "prompt.1", "not Unicode text"),
        ("/v1/completions", {"model": "\ud800", "prompt": "a"}, "model", "not Unicode text"),
        ("/v1/completions", {"model": "m", "prompt": "a", "stop": ["\ud800"]}, "stop.0", "not Unicode text"),
        ("/v1/completions", {"model": "m", "prompt": "a", "stop": ""}, "stop", "must not be empty"),
        ("/v1/completions", {"model": "m", "prompt": "a", "min_tokens": 20}, "min_tokens", "above max_"),
        ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": "5"}, "max_tokens", "integer"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]},
            "messages.0.content",
            "not Unicode text",
        ),
        ("/update_weights_from_disk", {"model_path": "/tmp/m\u0000/x"}, "model_path", "NUL"),
        ("/update_weights_from_disk", {"model_path": "/tmp/\ud800"}, "model_path", "not Unicode text"),
    ],
)  # fmt: skip
def test_text_a_tokenizer_or_a_path_cannot_take_is_a_400_naming_the_field(
    server: Served, path: str, body: dict[str, Any], field: str, text: str
) -> None:
    r = post_raw(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == field and text in err["message"], err


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
_PLAIN = {"model": "m", "prompt": "a", "max_tokens": 1}


@pytest.mark.parametrize(
    ("path", "body", "field", "text"),
    [
        ("/v1/chat/completions", {**_CHAT, "max_tokens": 10**9}, "max_tokens", "exceeds the context length"),
        ("/v1/chat/completions", {**_CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens", "new"),
        ("/v1/chat/completions", {**_CHAT, "seed": 2**64}, "seed", "less than"),
        ("/v1/completions", {**_PLAIN, "seed": 2**64}, "seed", "less than"),
        ("/v1/completions", {"model": "m", "prompt": ""}, "prompt", "empty"),
        ("/v1/completions", {"model": "m", "prompt": []}, "prompt", "empty"),
        ("/v1/completions", {"model": "m", "prompt": ["a", "b", "c", ""]}, "prompt.3", "empty"),
        ("/v1/completions", {"model": "m", "prompt": [[1], [2], [3], [99999]]}, "prompt.3", "out of range"),
        (
            "/v1/completions",
            {"model": "m", "prompt": [[1], [2], [3], [1] * 9], "max_tokens": 2040},
            "max_tokens",
            "(prompt 3 of the batch)",
        ),
        ("/v1/completions", {**_PLAIN, "stop_token_ids": [99999]}, "stop_token_ids", "out of range"),
        ("/v1/chat/completions", {**_CHAT, "input_ids": [1, 99999]}, "input_ids", "out of range"),
        (
            "/v1/chat/completions",
            {**_CHAT, "messages": [{"role": "user", "content": "a"}] * 2 + [{"role": "user", "content": 5}]},
            "messages.2.content",
            "string",
        ),
        (
            "/v1/chat/completions",
            {**_CHAT, "stream": True, "stream_options": {"include_usage": True, "chunk_size": 1}},
            "stream_options.chunk_size",
            "Extra inputs",
        ),
        (
            "/v1/completions",
            {**_PLAIN, "stream": True, "stream_options": {"x": 1}},
            "stream_options.x",
            "Extra inputs",
        ),
    ],
)  # fmt: skip
def test_openai_errors_name_the_field_the_user_sent(
    server: Served, path: str, body: dict[str, Any], field: str, text: str
) -> None:
    """Issue 35: never /generate's name for it (``max_new_tokens``, ``sampling_params.SamplingParams.
    sampling_seed``, ``text``, ``input_ids``), and the prompt of a batch by its place."""
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"].startswith(f"{field}: ") and text in err["message"], err
    assert not any(name in err["message"] for name in ("max_new_tokens", "sampling_")), err


def test_malformed_json_and_body_limit(server: Served) -> None:
    with server.client() as c:
        r = c.post("/generate", content=b'{"text": "a", ', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        for body, message in [(b'{"text": "\xff"}', "not UTF-8"), (b"[" * 100_000, "JSON nested too deeply")]:
            r = c.post("/generate", content=body, headers={"content-type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["field"] == "body" and err["code"] == 400, r.text
            assert err["message"].startswith(f"body: {message}"), err
        r = c.post("/generate", content=b"x" * (17 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_abort_of_an_unknown_rid_is_a_no_op(server: Served) -> None:
    r = server.post("/abort_request", {"rid": "no-such-request"})
    assert r.status_code == 200 and r.json()["aborted"] == 0


def test_info_endpoints(server: Served) -> None:
    info = server.get("/get_server_info").json()
    assert (info["tp_size"], info["dp_size"], info["layout"]) == (1, 2, "2x1")
    assert isinstance(info["internal_states"], list) and info["version"]
    # no KV budget: one replica's pool holds max_batch (64) requests of context_length + 1 tokens, pages of 1
    assert info["page_size"] == 1 and info["max_total_num_tokens"] == 64 * (info["context_length"] + 1)
    assert info["enable_deterministic_inference"] is False
    assert server.get("/server_info").json()["tp_size"] == 1
    model = server.get("/get_model_info").json()
    assert model["model_path"] and model["is_generation"] is True
    assert server.get("/model_info").json() == model
    load = server.get("/get_load").json()
    assert [x["dp_rank"] for x in load] == [0, 1]
    loads = server.get("/v1/loads").json()
    assert loads["num_accelerators"] == 2 and len(loads["loads"]) == 2
    assert server.get("/health_generate").status_code == 200
    text = server.get("/metrics").text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:gen_throughput",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_bucket",
        "elastic_rollout_tp_size",
        'elastic_rollout_layout{layout="2x1"} 1.0',
    ):
        assert name in text, name


def test_openapi_documents_every_route(server: Served) -> None:
    paths = set(server.get("/openapi.json").json()["paths"])
    assert {
        "/generate",
        "/abort_request",
        "/v1/state",
        "/v1/plan",
        "/v1/reconfigure",
        "/v1/completions",
        "/v1/chat/completions",
    } <= paths


def test_state_lists_running_and_finished(server: Served) -> None:
    before = server.get("/v1/state").json()
    gen(server, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 7, **GREEDY}})
    after = server.get("/v1/state", params={"since_step": before["step"]}).json()
    assert after["layout"] == "2x1" and after["ranks_ready"] == [True, True]
    assert 7 in after["finished"]["lengths"] and after["finished"]["total"] > before["finished"]["total"]
    assert all(not r["running"] and not r["waiting"] for r in after["replicas"])
    bad = httpx.get(server.url + "/v1/state", params={"since_step": -1})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "since_step"


def _main_thread(pid: int) -> tuple[str, int, int]:
    """A rank's main thread (the one serving the inbox): its state (S: asleep), the CPU ticks it has used and
    how many times it has gone to sleep of its own accord. Its other threads (gloo's) wake on their own."""
    task = Path(f"/proc/{pid}/task/{pid}")
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    slept = re.search(r"^voluntary_ctxt_switches:\s+(\d+)$", (task / "status").read_text(), re.M)
    assert slept is not None
    return fields[0], int(fields[11]) + int(fields[12]), int(slept[1])


def test_an_idle_engine_blocks_instead_of_spinning(server: Served) -> None:
    """An idle rank sleeps in its inbox read: its main thread neither uses CPU nor wakes while nothing comes.
    A rank that spun would use a CPU tick every 10 ms; one that polled would wake (and sleep again) at each
    poll. Once asleep, 20 looks 50 ms apart (1 s: a hundred ticks of spinning, a wake-up of any poll up to
    1 s) must each see the very same counters; a blocked thread never changes them, so the test cannot fail
    for a slow machine."""
    pids = server.get("/get_server_info").json()["rank_pids"]
    before: list[tuple[str, int, int]] = []

    def settled() -> list[tuple[str, int, int]] | None:  # asleep, and nothing changed since the last look
        now = [_main_thread(p) for p in pids]
        same, before[:] = now == before, now
        return now if same and all(state == "S" for state, _, _ in now) else None

    asleep = wait_until(
        settled, what="every rank asleep", explain=lambda: f"(state, CPU ticks, sleeps): {before}"
    )
    for _ in range(20):
        time.sleep(0.05)  # bounded: see the docstring
        assert [_main_thread(p) for p in pids] == asleep
