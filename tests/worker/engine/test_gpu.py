"""The CUDA path (run on a machine with a GPU; reported as skipped, never as passed, without one):
bfloat16 at TP 1, several ranks sharing one GPU over gloo (losslessly), CUDA-graph decode steps against
eager ones, and the server's tokens/s on small."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_worker.engine.batch import run_batch
from rollout_worker.engine.bench import ensure_model
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.launcher import run_task
from rollout_worker.engine.measure import probe_logits

from tests.worker.engine.engine_util import requests, run, tokens


def _tiny_on_cuda(dtype: torch.dtype, max_batch: int = 16) -> tuple[Any, Any, list[list[int]]]:
    """A tiny TP=1 decoder with random weights on the GPU and a KV pool whose first ``max_batch`` token-table
    rows each hold pages of 600 tokens of random K/V (returned: decoder, pool, each row's pages)."""
    from rollout_worker.api.model_config import ModelConfig
    from rollout_worker.engine.kvcache import KVPool
    from rollout_worker.engine.model import Decoder
    from rollout_worker.engine.parallel import SINGLE
    from rollout_worker.engine.presets import preset_config
    from rollout_worker.engine.weights import random_shard

    cfg = ModelConfig.from_dict(preset_config("tiny"), where="tiny")
    dev = torch.device("cuda")
    dec = Decoder(cfg, random_shard(cfg, 1, 0, dtype, dev), SINGLE)
    pool = KVPool(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, max_batch * 64, max_batch, 2048, dtype, dev
    )
    rows: list[list[int]] = []
    for b in range(max_batch):
        pages: list[int] = []
        assert pool.reserve(pages, 600)
        pool.bind(b, pages)
        rows.append(pages)
    gen = torch.Generator(device=dev).manual_seed(0)
    for c in (*pool.k, *pool.v):
        c.copy_(torch.randn(c.shape, generator=gen, device=dev, dtype=dtype))
    return dec, pool, rows


def _col(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, device="cuda")[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_is_the_eager_step_bit_for_bit(dtype: torch.dtype) -> None:
    """A replayed graph computes exactly what the eager step computes on the same padded inputs; on the
    unpadded batch (other GEMM shapes) the logits agree to rounding and every argmax is the same."""
    from rollout_worker.engine.cudagraph import DecodeGraphs, pad_step

    dec, pool, rows = _tiny_on_cuda(dtype)
    graphs = DecodeGraphs(16)
    for n in (1, 3, 8, 13, 16):
        toks = [(7 * i + n) % 500 for i in range(n)]
        pos = [(37 * i + 11 * n) % 590 for i in range(n)]
        write = [pool.slot(rows[b], pos[b]) for b in range(n)]
        p = pad_step(toks, pos, graphs.buckets, pool.capacity, write)
        padded = dec.step_logits(_col(p.tokens), _col(p.positions), pool, _col(p.write), p.span)[:n].clone()
        unpadded = dec.step_logits(_col(toks), _col(pos), pool, _col(write), p.span).clone()
        replayed = graphs.decode(dec, pool, toks, pos, write).clone()
        captured = graphs.captures
        again = graphs.decode(dec, pool, toks, pos, write).clone()
        assert graphs.captures == captured  # the second call replays without capturing
        assert torch.equal(replayed, padded), (n, (replayed - padded).abs().max().item())
        assert torch.equal(again, replayed)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert (replayed.float() - unpadded.float()).abs().max().item() < tol * unpadded.float().abs().max()
        assert torch.equal(replayed.argmax(-1), unpadded.argmax(-1))
    assert graphs.captures == len(graphs) >= 4  # one capture per (bucket, key span), never twice


def test_graphs_are_dropped_when_the_pool_or_weights_change() -> None:
    """A grown (reallocated) token table or storage, or a new decoder, invalidates every graph: the next
    step recaptures and still equals the eager step on the new memory."""
    from rollout_worker.engine.cudagraph import DecodeGraphs, key_span
    from rollout_worker.engine.model import Decoder
    from rollout_worker.engine.weights import random_shard

    dec, pool, rows = _tiny_on_cuda(torch.float32)
    graphs = DecodeGraphs(16)
    toks, pos = [1, 2, 3, 4], [5, 50, 500, 10]
    write = [pool.slot(rows[b], pos[b]) for b in range(4)]
    graphs.decode(dec, pool, toks, pos, write)
    assert len(graphs) == 1
    old_table, old_k = pool.table, pool.k[0]
    pool.ensure_table(16, 1500)  # grows the table: a new tensor, old contents copied
    assert pool.table is not old_table
    got = graphs.decode(dec, pool, toks, pos, write)
    assert graphs.captures == 2 and len(graphs) == 1
    eager = dec.step_logits(_col(toks), _col(pos), pool, _col(write), key_span(500, pool.capacity))
    assert torch.equal(got, eager)
    pool.grow_storage(pool.held + 1)  # new K/V storage
    assert pool.k[0] is not old_k
    graphs.decode(dec, pool, toks, pos, write)
    assert graphs.captures == 3
    new = Decoder(dec.cfg, random_shard(dec.cfg, 1, 1, dec.dtype, torch.device("cuda")), dec.ps)
    graphs.decode(new, pool, toks, pos, write)
    assert graphs.captures == 4 and len(graphs) == 1


def test_generation_with_graphs_equals_eager_generation(tiny64: Path) -> None:
    """A whole batch generated with CUDA graphs (TP=1) gives the tokens eager generation gives (float64)."""
    graphs = run_batch(
        EngineConfig.load(str(tiny64), 1, device="cuda", dtype="float64", cuda_graphs=True), requests(24)
    )
    eager = run_batch(
        EngineConfig.load(str(tiny64), 1, device="cuda", dtype="float64", cuda_graphs=False), requests(24)
    )
    assert tokens(graphs) == tokens(eager)
    assert sum(len(t) for t in tokens(graphs).values()) > 24


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
