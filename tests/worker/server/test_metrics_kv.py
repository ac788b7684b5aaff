"""``/metrics`` under KV pressure: retractions counted (``sglang:num_retracted_requests_total``, SGLang's
counter) and the token usage of the pool, on a real server whose pool is far smaller than the batch needs."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.server.served import Served, start

PAGES, PAGE = 48, 4  # a pool of 192 tokens
N, NEW = 12, 32  # prompts of 4 tokens: 12 x 36 = 432 tokens when all are done


@pytest.fixture(scope="module")
def tight(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(
        tiny64,
        tmp_path_factory.mktemp("tight"),
        "--ranks",
        "1",
        "--dtype",
        "float64",
        "--kv-budget-tokens",
        str(PAGES * PAGE),
        "--page-size",
        str(PAGE),
    )
    yield s
    s.stop()


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def test_retractions_and_token_usage_in_metrics(tight: Served) -> None:
    """Before: no retraction, no token in use, the pool's size reported. Twelve requests of 4 + 32 tokens
    sent as one batch into 192 tokens: admission is optimistic (the running ones are charged 0.7 of what
    they have left), every request runs to its cap (EOS ignored), so the pool runs out mid-decode and at
    least one is retracted, then re-prefilled: every request still gets its 32 tokens. (The
    scheduling.admission functions replayed with these numbers retract 1 or 2 whether the requests reach
    the replica together or one every 1, 2 or 3 steps.) While it runs, token_usage is the fraction of the
    pool's tokens held."""
    before = tight.get("/metrics").text
    assert _value(before, "sglang:num_retracted_requests_total") == 0
    assert _value(before, "sglang:max_total_num_tokens") == PAGES * PAGE
    assert _value(before, "sglang:token_usage") == 0
    prompts = [[7 + i, 8, 9, 10 + i] for i in range(N)]
    seen: list[tuple[float, float]] = []  # (token_usage, num_used_tokens) while generating
    done = threading.Event()

    def poll() -> None:
        with tight.client() as c:
            while not done.wait(0.01):
                text = c.get("/metrics").text
                seen.append((_value(text, "sglang:token_usage"), _value(text, "sglang:num_used_tokens")))

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        r = tight.post(
            "/generate",
            {
                "input_ids": prompts,
                "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            },
            timeout=300,
        )
    finally:
        done.set()
        poller.join()
    assert r.status_code == 200, r.text
    busy = [(u, n) for u, n in seen if n]
    assert busy, seen  # the pool was seen in use
    for usage, used in busy:  # the fraction of the pool's tokens held, never above it
        assert 0 < usage <= 1 and usage == pytest.approx(used / (PAGES * PAGE))
    assert [len(o["output_ids"]) for o in r.json()] == [NEW] * N
    assert {o["meta_info"]["finish_reason"]["type"] for o in r.json()} == {"length"}  # none aborted
    after = tight.get("/metrics").text
    retracted = _value(after, "sglang:num_retracted_requests_total")
    assert 1 <= retracted < 100, after  # some, and not a livelock
    assert _value(after, "sglang:token_usage") == 0  # every page back
    assert _value(after, "sglang:num_used_tokens") == 0
