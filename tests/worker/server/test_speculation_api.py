"""Speculative decoding as SGLang shows it: a server started with ``--speculative-algorithm ngram`` says so
in ``/get_server_info`` (``speculative_algorithm`` NGRAM, ``avg_spec_accept_length``), a request's
``meta_info`` carries its ``spec_verify_ct``, ``/metrics`` counts verify steps and their tokens, and the
tokens are those of a server without speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.worker.server.served import Served, start

pytestmark = pytest.mark.multiproc


def _body(i: int) -> dict[str, object]:
    return {
        "input_ids": [5, 9, 5, 9, 5, 9, 5, 3 + i],
        "sampling_params": {
            "max_new_tokens": 60,
            "ignore_eos": True,
            "temperature": 0.7 * (i % 2),
            "sampling_seed": i,
        },
        "return_logprob": True,
    }


def test_a_speculating_server_reports_its_verify_steps(tiny64: Path, tmp_path: Path) -> None:
    outs = {}
    for spec in ("none", "ngram"):
        server = start(
            tiny64, tmp_path, "--ranks", "1", "--dtype", "float64", "--speculative-algorithm", spec,
            "--speculative-policy", "always",
        )  # fmt: skip
        try:
            outs[spec] = [server.post("/generate", _body(i), timeout=60).json() for i in range(4)]
            info = server.get("/get_server_info").json()
            metrics = server.get("/metrics").text
        finally:
            server.stop()
        if spec == "none":
            assert info["speculative_algorithm"] is None
            assert info["internal_states"][0]["avg_spec_accept_length"] is None
            assert all("spec_verify_ct" not in o["meta_info"] for o in outs[spec])
    assert [o["output_ids"] for o in outs["ngram"]] == [o["output_ids"] for o in outs["none"]]
    assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == 4
    verifies = [o["meta_info"].get("spec_verify_ct", 0) for o in outs["ngram"]]
    assert sum(verifies) > 0
    accept = info["internal_states"][0]["avg_spec_accept_length"]
    assert accept is not None and accept > 1.0  # drafts accepted: more than one token a verify step
    counts = {  # name{model_name="..."} value
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("elastic_rollout_spec_")
    }
    assert counts["elastic_rollout_spec_verifies_total"] == sum(verifies)
    assert counts["elastic_rollout_spec_tokens_total"] == pytest.approx(accept * sum(verifies))


def _greedy(server: Served, prompts: list[str]) -> list[dict[str, Any]]:
    return [
        server.post(
            "/generate",
            {"text": p, "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}},
            timeout=120,
        ).json()
        for p in prompts
    ]


def _spec_counts(server: Served) -> tuple[float, float]:
    """(requests' verify steps, tokens they emitted) since the server started, from /metrics."""
    got = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in server.get("/metrics").text.splitlines()
        if line.startswith("elastic_rollout_spec_")
    }
    return got["elastic_rollout_spec_verifies_total"], got["elastic_rollout_spec_tokens_total"]


def _tokens_per_step(
    outs: list[dict[str, Any]], before: tuple[float, float], after: tuple[float, float]
) -> float:
    """Decoded tokens per decode-or-verify step of these requests (run one at a time; their first token is a
    prefill's): each verify step emits the tokens the counters say, every other step one."""
    decoded = sum(len(o["output_ids"]) - 1 for o in outs)
    verifies, verified = after[0] - before[0], after[1] - before[1]
    return decoded / (decoded - verified + verifies)


def test_an_external_corpus_of_earlier_outputs_raises_the_accepted_length(
    smollm2: Path, tmp_path: Path
) -> None:
    """SGLang's test of its NGRAM corpus, on the real model: the server's own earlier outputs, added with
    ``/add_external_corpus`` after ``/flush_cache`` emptied the index of its requests, at least double the
    tokens a step emits, and the tokens stay those of plain decoding. Then listing, removing, and the
    400s of a missing or unknown ``corpus_id``. The server starts with a corpus file (SGLang's
    ``--speculative-ngram-external-corpus-path``), listed under its path."""
    prompts = ["The capital of France is", "Water boils at a temperature of", "The largest planet is"]
    startup = tmp_path / "startup.jsonl"
    startup.write_text('"startup corpus alpha beta gamma"\n"startup corpus delta epsilon"\n')
    server = start(
        smollm2, tmp_path, "--ranks", "1", "--dtype", "float32", "--speculative-algorithm", "ngram",
        "--speculative-policy", "always", "--speculative-ngram-external-corpus-path", str(startup),
        timeout=180,
    )  # fmt: skip
    try:
        at_start = server.get("/list_external_corpora").json()["corpus_token_counts"]
        dropped = server.post("/remove_external_corpus", {"corpus_id": str(startup)})
        first = _greedy(server, prompts)
        assert server.post("/flush_cache", {}).status_code == 200
        c0 = _spec_counts(server)
        base = _greedy(server, prompts)  # drafts from each request's own tokens only
        c1 = _spec_counts(server)
        assert server.post("/flush_cache", {}).status_code == 200
        added = server.post(
            "/add_external_corpus", {"corpus_id": "earlier", "documents": [o["text"] for o in first]}
        )
        assert added.status_code == 200, added.text
        body = added.json()
        assert body["success"] and body["corpus_id"] == "earlier" and body["loaded_token_count"] > 0
        listed = server.get("/list_external_corpora").json()
        assert listed == {"success": True, "corpus_token_counts": {"earlier": body["loaded_token_count"]}}
        boosted = _greedy(server, prompts)
        c2 = _spec_counts(server)
        again = server.post("/add_external_corpus", {"corpus_id": "earlier", "documents": ["x"]})
        auto = server.post("/add_external_corpus", {"documents": ["another document"]}).json()
        removed = server.post("/remove_external_corpus", {"corpus_id": "earlier"})
        unknown = server.post("/remove_external_corpus", {"corpus_id": "earlier"})
        missing = server.post("/remove_external_corpus", {})
        left = server.get("/list_external_corpora").json()["corpus_token_counts"]
    finally:
        server.stop()
    assert list(at_start) == [str(startup)] and at_start[str(startup)] > 0 and dropped.status_code == 200
    ids = [o["output_ids"] for o in first]
    assert [o["output_ids"] for o in base] == ids and [o["output_ids"] for o in boosted] == ids
    base_rate, boosted_rate = _tokens_per_step(base, c0, c1), _tokens_per_step(boosted, c1, c2)
    assert boosted_rate >= 2 * base_rate, (base_rate, boosted_rate)
    assert again.status_code == 400 and "corpus_id" in again.text
    assert auto["success"] and auto["corpus_id"] and removed.status_code == 200
    assert unknown.status_code == 400 and missing.status_code == 400
    assert left == {auto["corpus_id"]: auto["loaded_token_count"]}
