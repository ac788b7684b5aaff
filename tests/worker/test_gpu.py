"""The CUDA path (run on a machine with a GPU; reported as skipped, never as passed, without one):
bfloat16 at TP 1, several ranks sharing one GPU over gloo (losslessly), and the server's tokens/s on small."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from rollout_worker.engine.batch import run_batch
from rollout_worker.engine.bench import ensure_model
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.launcher import run_task
from rollout_worker.engine.measure import probe_logits

from tests.worker.engine_util import requests, run, tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="not run: no CUDA device"),
]


def test_bfloat16_tp1_generates_and_matches_float32_logits(tiny32: Path) -> None:
    cfg = EngineConfig.load(str(tiny32), 1, device="cuda", dtype="bfloat16")
    res = run_batch(cfg, requests(8))
    assert all(o["finish_reason"]["type"] in ("length", "stop") for o in res.outputs)
    prompts = [[1, 2, 3, 4, 5], [200, 100, 7]]
    gpu = run_task(cfg, probe_logits, {"prompts": prompts, "layouts": ["1x1"]})[0]["1x1"]
    cpu = run_task(EngineConfig.load(str(tiny32), 1), probe_logits, {"prompts": prompts, "layouts": ["1x1"]})[
        0
    ]["1x1"]
    diff = (torch.tensor(gpu) - torch.tensor(cpu)).abs().max().item()
    assert diff < 0.1, diff  # bf16 keeps about 3 significant digits


def test_ranks_sharing_one_gpu_are_lossless(tiny64: Path) -> None:
    """Two or four ranks on one GPU (gloo, staged through host memory), float64: a switch alters no token."""
    static = tokens(run(tiny64, 2, "2x1", device="cuda"))
    res = run(tiny64, 2, "2x1", ["10:2:migrate"], device="cuda")
    assert tokens(res) == static and [str(e.dst) for e in res.reconfigs] == ["1x2"]
    res = run(tiny64, 4, "4x1", ["12:2:recompute", "6:4:migrate"], device="cuda")
    assert tokens(res) == tokens(run(tiny64, 4, "4x1", device="cuda"))


def test_server_tokens_per_second_on_small(tmp_path: Path) -> None:
    """Prints the server's tokens/s on small (64 streams); no request may be lost."""
    from rollout_worker.server.bench import _load, make_requests
    from rollout_worker.server.process import start_server, stop_server

    model = ensure_model("small", tmp_path)
    ranks = max(1, torch.cuda.device_count())
    proc, url = start_server(
        model, ["--ranks", str(ranks), "--device", "cuda", "--dtype", "bfloat16"], tmp_path / "log"
    )
    try:
        load = asyncio.run(_load(url, make_requests(256, 32, 128, 4096), 64, None))
    finally:
        stop_server(proc)
    print(f"small on {torch.cuda.get_device_name()} x{ranks}: {load.tps:.0f} tok/s, {len(load.lost)} lost")
    assert not load.lost and load.tps > 0
