"""Fault isolation (issue 17), found by fuzzing: hypothesis draws ``/generate`` bodies from the request model
itself (every field the API accepts, SGLang's neutral keys included; see tests/worker/web/bodies.py) and
sends each to a real server of one TP-2 replica. Every body is answered 200 or 4xx (4xx in the error
schema); a 200 answer's requests all finish by stop or length (none aborted by a failure of its own) with
logprobs of the documented shape; and the server is healthy and serving at the end."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rollout_worker.api.sglang import NEUTRAL_GENERATE, NEUTRAL_SAMPLING, GenerateRequest, SamplingParams
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.web.errors import ErrorBody

from tests.worker.server.served import Served, start
from tests.worker.web.bodies import body_of

pytestmark = pytest.mark.multiproc
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))  # (set it higher to search longer)
ONE_TOKEN_LOGPROBS = {  # issue 17's crash, always tried: sglang's frontend sends it for gen(return_logprob)
    "text": "x",
    "return_logprob": True,
    "logprob_start_len": 0,
    "sampling_params": {"max_new_tokens": 2},
}

LINE_BREAKS_IN_STREAM = {  # found by this test: JSON leaves them raw, httpx's iter_lines cuts there
    "text": "x",
    "rid": "a\u2028b\u2029c\x85d",
    "stream": True,
    "sampling_params": {"max_new_tokens": 2},
}


@pytest.fixture(scope="module")
def tp2(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(
        tiny64, tmp_path_factory.mktemp("fuzz"), "--ranks", "2", "--layout", "1x2", "--dtype", "float64"
    )
    yield s
    s.stop()


def bodies(vocab: int, inside: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of every field; ``inside``: numbers within their bounds and exactly one prompt field, so
    that most reach the engine."""
    token = st.integers(0 if inside else -1, 8) | st.sampled_from(
        [vocab - 1] if inside else [vocab - 1, vocab]
    )
    ids = st.lists(token, max_size=5)
    prompt = st.lists(token, min_size=1, max_size=3) if inside else ids  # one-token prompts are frequent
    overrides = {
        "text": (st.text(min_size=1, max_size=3) if inside else st.text(max_size=5)) | st.none(),
        "input_ids": prompt | st.lists(prompt, max_size=3),
        "stop_token_ids": st.none() | ids,
        "max_new_tokens": st.integers(0 if inside else -1, 4),  # (absent: 128, kept out for time)
    }
    sampling = body_of(SamplingParams, overrides, NEUTRAL_SAMPLING, inside)
    sampling_field = sampling | st.lists(sampling, max_size=3) | st.none()
    body = body_of(
        GenerateRequest, {**overrides, "sampling_params": sampling_field}, NEUTRAL_GENERATE, inside
    )
    return body.map(_one_prompt) if inside else body


def _one_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """Exactly one of text and input_ids (GenerateRequest's rule)."""
    if body.get("text") is None and body.get("input_ids") is None:
        body["text"] = "hi"
    elif body.get("text") is not None and body.get("input_ids") is not None:
        del body["input_ids"]
    return body


@pytest.mark.timeout(120 + EXAMPLES)
def test_every_generate_body_gets_200_or_4xx_and_the_server_stays_healthy(tp2: Served, tiny64: Path) -> None:
    vocab = ModelConfig.load(tiny64).vocab_size
    seen: dict[tuple[str, int], int] = {}  # (kind of body, status) -> count

    with tp2.client(timeout=60) as client:

        @settings(
            max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(
            drawn=bodies(vocab, inside=True).map(lambda b: ("inside", b))
            | bodies(vocab, inside=False).map(lambda b: ("any", b))
        )
        @example(drawn=("inside", ONE_TOKEN_LOGPROBS))
        @example(drawn=("inside", LINE_BREAKS_IN_STREAM))
        def check(drawn: tuple[str, dict[str, Any]]) -> None:
            kind, body = drawn
            _bounded(body)
            r = client.post("/generate", json=body)
            seen[kind, r.status_code] = seen.get((kind, r.status_code), 0) + 1
            assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
            if r.status_code != 200:
                err = ErrorBody.model_validate(r.json())
                assert err.error.code == r.status_code, r.text
                return
            for out in _outputs(r, bool(body.get("stream"))):
                _check_output(out, body)

        check()
    # The bodies reach the engine, not only the validation: about 65% of those drawn inside their bounds
    # are answered 200 (the rest combine fields the API refuses together); the union's share of each
    # strategy varies from run to run, so the floor is on the inside bodies (the last CI run had 26 of 150
    # bodies answered 200 under a floor over all of them, and failed).
    inside = sum(n for (kind, _), n in seen.items() if kind == "inside")
    assert inside >= EXAMPLES // 5 and seen.get(("inside", 200), 0) >= inside // 3, seen
    assert tp2.get("/health").status_code == 200, tp2.tail()
    r = tp2.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def _bounded(body: dict[str, Any]) -> None:
    """At most a few new tokens (SGLang's default, also for null, is 128: too slow for many examples)."""
    if body.get("sampling_params") is None:
        body["sampling_params"] = {}
    sp = body["sampling_params"]
    for params in sp if isinstance(sp, list) else [sp]:
        if params.get("max_new_tokens") is None:
            params["max_new_tokens"] = 2


def _outputs(r: httpx.Response, stream: bool) -> list[dict[str, Any]]:
    """The final output of every request of the answer (a stream's last chunk of each index)."""
    if not stream:
        got = r.json()
        return got if isinstance(got, list) else [got]
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text
    finals: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        chunk = json.loads(e)
        if "error" in chunk:  # a refusal after the stream started: SGLang's error chunk, no output
            assert chunk["error"]["message"], chunk
            return []
        if chunk["meta_info"]["finish_reason"] is not None:
            finals[chunk.get("index", 0)] = chunk
    return list(finals.values())


def _check_output(out: dict[str, Any], body: dict[str, Any]) -> None:
    meta = out["meta_info"]
    finish = meta["finish_reason"]
    assert finish is not None and finish["type"] in ("stop", "length"), (finish, body)
    ids = out["output_ids"]
    assert meta["completion_tokens"] == len(ids)
    if "output_token_logprobs" not in meta:
        return
    lps = meta["output_token_logprobs"]
    assert [t[1] for t in lps] == ids
    assert all(isinstance(t[0], float) and t[0] <= 1e-9 for t in lps), lps
    inp = meta["input_token_logprobs"]
    if inp:
        assert inp[0][0] is None or inp[0][0] <= 1e-9, inp
        assert all(isinstance(t[0], float) and not math.isnan(t[0]) and t[0] <= 1e-9 for t in inp[1:]), inp
        assert len(inp) <= meta["prompt_tokens"], (inp, meta)
