"""Speculative decoding as SGLang shows it: a server started with ``--speculative-algorithm ngram`` says so
in ``/get_server_info`` (``speculative_algorithm`` NGRAM, ``avg_spec_accept_length``), a request's
``meta_info`` carries its ``spec_verify_ct``, ``/metrics`` counts verify steps and their tokens, and the
tokens are those of a server without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.server.served import start

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
            tiny64, tmp_path, "--ranks", "1", "--dtype", "float64", "--speculative-algorithm", spec
        )
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
