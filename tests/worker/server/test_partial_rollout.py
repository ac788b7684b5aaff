"""Partial rollout without losing a token (float64, 2 real gloo ranks, over HTTP): requests aborted
mid-decode (`/abort_request` `abort_all`, as slime ends a step) and sent again later as prompt + partial
output (`input_ids`) with the same `sampling_seed`, after a layout change, give, concatenated, exactly the
tokens and logprobs of the uninterrupted run: the sampler's counter is the token's absolute position."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until
from tests.worker.server.served import Served, start

pytestmark = pytest.mark.multiproc

N = 32
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(tiny64, tmp_path_factory.mktemp("partial"), "--ranks", "2", "--dtype", "float64")
    yield s
    s.stop()


def _batch(prompts: list[list[int]], params: list[dict[str, Any]], tag: str) -> dict[str, Any]:
    return {
        "input_ids": prompts,
        "sampling_params": params,
        "rid": [f"{tag}-{i}" for i in range(len(prompts))],
        "return_logprob": True,
    }


def _generate(server: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = server.post("/generate", body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == len(body["input_ids"])
    return out


def _tokens_and_logprobs(out: dict[str, Any]) -> tuple[list[int], list[float]]:
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    return out["output_ids"], [lp for lp, _, _ in lps]


def _decoding(server: Served) -> list[int] | None:
    """Tokens generated so far by each running request, once all N run and each has generated some."""
    replicas = server.get("/v1/state").json()["replicas"]
    generated = [r["generated"] for rep in replicas for r in rep["running"]]
    return generated if len(generated) == N and min(generated) > 0 else None


def test_aborted_and_resent_requests_lose_no_token(server: Served) -> None:
    rng = random.Random(18)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 14))] for _ in range(N)]
    params = [{**SAMPLED, "max_new_tokens": rng.randint(100, 160), "sampling_seed": 50 + i} for i in range(N)]
    whole = [_tokens_and_logprobs(o) for o in _generate(server, _batch(prompts, params, "whole"))]
    assert all(len(t) == p["max_new_tokens"] for (t, _), p in zip(whole, params, strict=True))

    # the same requests again, aborted mid-decode at the end of the "step"
    first: list[list[dict[str, Any]]] = []
    t = threading.Thread(target=lambda: first.append(_generate(server, _batch(prompts, params, "part"))))
    t.start()
    wait_until(lambda: _decoding(server), what=f"{N} requests decoding", timeout=120, explain=server.tail)
    assert server.post("/abort_request", {"abort_all": True}).json()["aborted"] == N
    t.join(120)
    (partial,) = first
    assert [o["meta_info"]["finish_reason"]["type"] for o in partial] == ["abort"] * N
    cut = [_tokens_and_logprobs(o) for o in partial]
    assert all(0 < len(c) < p["max_new_tokens"] for (c, _), p in zip(cut, params, strict=True))

    # the layout changes between the two steps
    ev = server.post("/v1/reconfigure", {"layout": "1x2", "method": "recompute"}).json()
    assert ev["layout"] == "1x2" and ev["event"]["outcome"] == "committed"

    # sent again as prompt + partial output, the rest of the budget, the same seeds
    again = [p + c for p, (c, _) in zip(prompts, cut, strict=True)]
    rest = [
        {**p, "max_new_tokens": p["max_new_tokens"] - len(c)} for p, (c, _) in zip(params, cut, strict=True)
    ]
    more = _generate(server, _batch(again, rest, "rest"))
    assert all(o["meta_info"]["layouts"] == ["1x2"] for o in more)
    worst = 0.0
    for i, (o, (c, c_lp)) in enumerate(zip(more, cut, strict=True)):
        toks, lps = _tokens_and_logprobs(o)
        assert c + toks == whole[i][0], i  # every token, exactly
        worst = max(worst, *(abs(a - b) for a, b in zip(c_lp + lps, whole[i][1], strict=True)))
    # logprobs to float64 rounding: a TP=2 all-reduce, or another batch's matmul blocking, sums in another
    # order (the uninterrupted run's own logprobs move as much between layouts)
    assert worst < 1e-12, worst
