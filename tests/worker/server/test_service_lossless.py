"""Losslessness as a service (float64, 4 real gloo ranks): requests arriving over HTTP at staggered times,
a grow chain by PUT /v1/plan and shrinks by POST /v1/reconfigure, with migrate and recompute, give the
same tokens as the static batch run of the same requests, logprobs within 1e-9; greedy outputs equal
Hugging Face transformers'; logprobs equal an independent float64 computation."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rollout_worker.api.sglang import GenerateRequest
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.server.convert import to_jobs

from tests.waiting import wait_until
from tests.worker.server.served import Served, start

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def server4(tiny64: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(tiny64, tmp_path_factory.mktemp("srv4"), "--ranks", "4", "--dtype", "float64")
    yield s
    s.stop()


def _bodies(seed: int, n: int, long_every: int) -> list[dict[str, Any]]:
    """Mixed greedy / sampled requests (temperature, top-k, top-p, min-p), a long one every few."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sp: dict[str, Any] = {
            "max_new_tokens": rng.randint(250, 330) if i % long_every == 0 else rng.randint(15, 60),
            "ignore_eos": True,
        }
        if i % 2:
            sp |= {
                "temperature": 0.9,
                "top_p": 0.95,
                "top_k": 50 if i % 3 else -1,
                "min_p": 0.01 if i % 5 == 1 else 0.0,
                "sampling_seed": 1000 + seed + i,
            }
        else:
            sp |= {"temperature": 0}
        out.append(
            {
                "input_ids": [rng.randrange(512) for _ in range(rng.randint(3, 14))],
                "sampling_params": sp,
                "rid": f"s{seed}-{i}",
                "return_logprob": True,
            }
        )
    return out


def _post_all(
    server: Served, bodies: list[dict[str, Any]], gap_s: float, results: dict[str, Any]
) -> list[threading.Thread]:
    def one(body: dict[str, Any]) -> None:
        r = server.post("/generate", body, timeout=300)
        assert r.status_code == 200, r.text
        results[body["rid"]] = r.json()

    threads = []
    for body in bodies:
        t = threading.Thread(target=one, args=(body,))
        t.start()
        threads.append(t)
        time.sleep(gap_s)
    return threads


def _events(server: Served) -> list[dict[str, Any]]:
    return server.get("/v1/reconfigurations").json()


def _running(server: Served) -> int:
    return sum(len(r["running"]) for r in server.get("/v1/state").json()["replicas"])


def test_service_is_lossless_across_plans_and_switches(server4: Served, tiny64: Path) -> None:
    first, second = _bodies(1, 16, 4), _bodies(2, 8, 2)
    results: dict[str, Any] = {}
    threads = _post_all(server4, first, 0.0, results)
    wait_until(lambda: _running(server4) >= 8, what="8 requests running", timeout=60)
    plan = {
        "based_on_layout": "4x1",
        "triggers": [
            {"unfinished_at_most": 12, "layout": "2x2", "method": "migrate"},
            {"unfinished_at_most": 5, "layout": "1x4", "method": "recompute"},
        ],
    }
    # refused before the real plan is put: once put, its first trigger can fire before a second PUT
    assert server4.put("/v1/plan", {**plan, "based_on_layout": "2x2"}).status_code == 409
    r = server4.put("/v1/plan", plan)
    assert r.status_code == 200, r.text
    # the chain runs by itself, at the steps its triggers fire
    wait_until(lambda: len(_events(server4)) >= 2, what="both switches of the plan", timeout=60)
    threads += _post_all(server4, second, 0.03, results)  # a second wave arrives on the consolidated pod
    wait_until(lambda: _running(server4) >= 3, what="3 requests running", timeout=60)
    shrink = server4.post("/v1/reconfigure", {"layout": "4x1", "method": "migrate"}).json()
    assert shrink["layout"] == "4x1" and shrink["event"]["outcome"] == "committed"
    # the next switch comes once the pod has decoded at 4x1 (a step reported after the shrink's)
    wait_until(
        lambda: server4.get("/v1/state").json()["step"] > shrink["event"]["step"], what="a step at 4x1"
    )
    grow = server4.post("/v1/reconfigure", {"layout": "2x2", "method": "recompute"}).json()
    assert grow["event"]["outcome"] == "committed"
    for t in threads:
        t.join(300)
    events = _events(server4)
    assert [(e["src"], e["dst"], e["method"]) for e in events] == [
        ("4x1", "2x2", "migrate"),
        ("2x2", "1x4", "recompute"),
        ("1x4", "4x1", "migrate"),
        ("4x1", "2x2", "recompute"),
    ]
    assert all(e["outcome"] == "committed" and e["requests_mid_decode"] > 0 for e in events), events
    assert events[0]["kv_bytes_moved"] > 0 and events[2]["kv_bytes_moved"] > 0
    assert events[1]["kv_tokens_recomputed"] > 0 and events[3]["kv_tokens_recomputed"] > 0
    assert events[0]["reason"].startswith("plan: unfinished")

    # the static batch run of exactly the same requests (the server's own conversion of the bodies)
    specs = [j.spec for body in first + second for j in to_jobs(GenerateRequest.model_validate(body), None)]
    static = run_batch(EngineConfig.load(str(tiny64), 4, dtype="float64"), specs)
    assert len(results) == len(specs) == 24
    for out in static.outputs:
        got = results[out["id"]]
        assert got["output_ids"] == out["output_ids"], out["id"]
        lps = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
        assert np.allclose(lps, out["output_token_logprobs"], rtol=0, atol=1e-9), out["id"]
    spanning = [r for r in results.values() if len(r["meta_info"]["layouts"]) >= 3]
    assert spanning  # long requests ran through several layouts, and the response says which


def test_greedy_matches_transformers(server4: Served, tiny64: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny64, torch_dtype=torch.float64)
    prompts = [[5, 17, 250, 3], [100, 200, 300, 400, 7, 9], [1, 1, 2, 3, 5, 8, 13]]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
    }
    ours = [b["output_ids"] for b in server4.post("/generate", body).json()]
    for prompt, got in zip(prompts, ours, strict=True):
        hf = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=24,
        )
        assert got == hf[0, len(prompt) :].tolist()


def _reference_logprob(
    logits: np.ndarray, token: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> float:
    """The sampled token's log-probability under temperature, top-k, top-p and min-p, renormalised
    (numpy float64, written independently of the engine's torch code)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = order[:top_k] if top_k > 0 else order
    cum = np.cumsum(p[keep])
    keep = keep[: int(np.searchsorted(cum, top_p)) + 1] if top_p < 1 else keep
    keep = keep[p[keep] >= min_p * p[keep[0]]]
    assert token in keep
    return float(np.log(p[token] / p[keep].sum()))


def _logits64(model_dir: Path, ids: list[int]) -> np.ndarray:
    """Float64 logits at every position from one in-process TP-1 decoder (no ranks, no server, no sampler).
    transformers is no float64 reference here: its RMSNorm computes in float32 whatever the dtype."""
    from rollout_worker.config.model_config import ModelConfig
    from rollout_worker.engine.model.checkpoint import CheckpointReader
    from rollout_worker.engine.model.decoder import Decoder
    from rollout_worker.engine.model.kv_cache import KVPool, single_row
    from rollout_worker.engine.model.parallel import SINGLE
    from rollout_worker.engine.model.weights import load_shard

    cfg = ModelConfig.load(model_dir)
    w = load_shard(CheckpointReader(model_dir, cfg), cfg, 1, 0, torch.float64, torch.device("cpu"))
    dec = Decoder(cfg, w, SINGLE)
    n = len(ids)
    pool = KVPool(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, n, 1, n, torch.float64, torch.device("cpu")
    )
    table = single_row(pool, n)
    with torch.no_grad():
        x = dec.hidden(torch.tensor([ids]), torch.arange(n)[None], pool, table, table)
        return dec.logits(x[0]).numpy()


def test_logprobs_equal_an_independent_float64_computation(server4: Served, tiny64: Path) -> None:
    cases = [(0.7, 40, 0.9, 0.0), (1.3, -1, 1.0, 0.05), (0.0, -1, 1.0, 0.0)]
    prompt = [12, 34, 56, 78]
    for temp, top_k, top_p, min_p in cases:
        sp = {
            "max_new_tokens": 16,
            "temperature": temp,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "ignore_eos": True,
            "sampling_seed": 3,
        }
        out = server4.post(
            "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}
        ).json()
        ids = out["output_ids"]
        logits = _logits64(tiny64, prompt + ids)
        for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            row = logits[len(prompt) - 1 + i]
            if temp == 0:
                ref = float(row[tok] - row.max() - np.log(np.exp(row - row.max()).sum()))
                assert tok == int(np.argmax(row))
            else:
                ref = _reference_logprob(row, tok, temp, top_k, top_p, min_p)
            assert abs(lp - ref) < 1e-9, (temp, i, lp, ref)
