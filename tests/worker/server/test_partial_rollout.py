"""Partial rollout without losing a token (float64, 2 real gloo ranks, over HTTP): requests aborted
mid-decode (`/abort_request` `abort_all`, as slime ends a step) and sent again later as prompt + partial
output (`input_ids`) with the same `sampling_seed`, after a layout change, give, concatenated, exactly the
tokens and logprobs of the uninterrupted run: the sampler's counter is the token's absolute position.

And exactly one logprob per token (sglang#20724: a retracted request once got more logprobs than tokens,
silently wrong gradients), on a server whose KV pool is small enough to retract, with deterministic kernels
(float32) so that logprobs compare bit for bit: a request retracted under memory pressure, and a request
continued after an abort with its resent part's logprobs asked for."""

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


@pytest.fixture(scope="module")
def tight(tiny32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One rank, a KV pool of 256 tokens in pages of 4, deterministic kernels (bitwise logprobs)."""
    args = [
        "--ranks",
        "1",
        "--dtype",
        "float32",
        "--deterministic",
        "--kv-budget-tokens",
        "256",
        "--page-size",
        "4",
    ]
    s = start(tiny32, tmp_path_factory.mktemp("tight"), *args)
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


def _retracted(s: Served) -> float:
    line = next(
        x for x in s.get("/metrics").text.splitlines() if x.startswith("sglang:num_retracted_requests_total{")
    )
    return float(line.rsplit(" ", 1)[1])


def _input_logprobs(out: dict[str, Any]) -> tuple[list[int], list[float | None]]:
    lps = out["meta_info"]["input_token_logprobs"]
    return [t for _, t, _ in lps], [lp for lp, _, _ in lps]


def test_a_retracted_request_has_one_logprob_per_token(tight: Served) -> None:
    """Eight requests at once in a pool that holds fewer of their tokens than they need: some are retracted
    (back to the queue, re-prefilled from prompt + output later), as the metric says. Each answers exactly
    one output logprob per output token and one input logprob per prompt token from its
    ``logprob_start_len``, and the same tokens and logprobs, bit for bit, as when it runs alone."""
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 8))] for _ in range(8)]
    params = [{**SAMPLED, "max_new_tokens": 48, "sampling_seed": 10 + i} for i in range(8)]
    starts = [i % len(p) for i, p in enumerate(prompts)]  # 0 (the whole prompt) and later positions
    alone = [
        _generate(tight, {**_batch([p], [q], f"alone-{i}"), "logprob_start_len": s})[0]
        for i, (p, q, s) in enumerate(zip(prompts, params, starts, strict=True))
    ]
    before = _retracted(tight)
    together = _generate(tight, {**_batch(prompts, params, "together"), "logprob_start_len": starts})
    assert _retracted(tight) > before  # the pool was too small for all at once
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        toks, lps = _tokens_and_logprobs(t)
        assert len(toks) == len(lps) == t["meta_info"]["completion_tokens"] == 48, i
        assert (toks, lps) == _tokens_and_logprobs(a), i
        ids, ins = _input_logprobs(t)
        assert ids == prompts[i][starts[i] :] and (ids, ins) == _input_logprobs(a), i
        assert (ins[0] is None) == (starts[i] == 0) and None not in ins[1:], i  # only token 0 has none


def test_a_continued_request_has_one_logprob_per_token(tight: Served) -> None:
    """slime's partial rollout: a request aborted mid-decode is sent again as prompt + its partial output,
    the rest of its budget, the same seed, with the logprobs of the resent part asked for
    (``logprob_start_len`` = the prompt's length). The continuation answers exactly one input logprob per
    resent token and one output logprob per new token; together they are the uninterrupted run's (its
    output logprobs bit for bit, the resent ones, which the prompt's code computes, to float rounding), as
    are its tokens."""
    prompt, n = [17, 4, 250, 33, 8], 240
    # sampled from the whole distribution (top_p 1): an output logprob is then the plain log-softmax an
    # input logprob is (with top_p < 1 it is renormalised over the nucleus)
    params = {**SAMPLED, "top_p": 1.0, "max_new_tokens": n, "sampling_seed": 5}
    whole_toks, whole_lps = _tokens_and_logprobs(_generate(tight, _batch([prompt], [params], "whole"))[0])
    first: list[list[dict[str, Any]]] = []
    t = threading.Thread(target=lambda: first.append(_generate(tight, _batch([prompt], [params], "cut"))))
    t.start()
    wait_until(lambda: _generated(tight), what="the request decoding", timeout=120, explain=tight.tail)
    assert tight.post("/abort_request", {"abort_all": True}).json()["aborted"] == 1
    t.join(120)
    (cut,) = first[0]
    assert cut["meta_info"]["finish_reason"]["type"] == "abort"
    part, part_lps = _tokens_and_logprobs(cut)
    k = len(part)
    assert 0 < k < n and (part, part_lps) == (whole_toks[:k], whole_lps[:k])
    rest = {**params, "max_new_tokens": n - k}
    again = {**_batch([prompt + part], [rest], "again"), "logprob_start_len": len(prompt)}
    (cont,) = _generate(tight, again)
    ids, ins = _input_logprobs(cont)
    assert ids == part and len(ins) == k and None not in ins  # one per resent token
    resent = [x for x in ins if x is not None]  # what the first run sampled each with (by other code)
    assert max(abs(a - b) for a, b in zip(resent, part_lps, strict=True)) < 1e-12
    toks, lps = _tokens_and_logprobs(cont)
    assert len(toks) == len(lps) == n - k
    assert (part + toks, part_lps + lps) == (whole_toks, whole_lps)


def _generated(s: Served) -> int | None:
    """Tokens the one running request has generated, once it has some."""
    running = [r for rep in s.get("/v1/state").json()["replicas"] for r in rep["running"]]
    return running[0]["generated"] if running and running[0]["generated"] > 0 else None
