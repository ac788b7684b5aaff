"""One TP=1 decoder's decode step on CPU, the default kernels against the deterministic ones, float32: a
``Decoder`` of a preset's shape with random weights, a KV pool of random K/V, and decode steps at a
context that grows by one each step, the K/V kept between steps as the engine keeps them
(``GatheredKV``). No ranks, no scheduler: the kernels alone, in one process on one thread. Each point is
the median of ``steps`` steps (after 3 warm-up steps), both kernels in the same run; the run is repeated
``runs`` times and the medians of the runs are reported. Prints a table and writes JSON; ``--profile``
also prints a torch profile of 2 steps of the last batch size, after the warm-up steps. To compare two
versions, run it from each checkout in turn, alternating.
Usage (repository root): .venv/bin/python bench/decoder_step.py [--preset small] [--batch 1,16,64]
[--context 250] [--steps 12] [--runs 3] [--pack on|off] [--json OUT] [--profile default|deterministic]
``--pack off`` builds both decoders as an engine does where its weights' packed copies do not fit
(``packed_weights``: ``medium`` on most machines).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels.choice import Kernels
from rollout_worker.engine.model.decoder import Decoder
from rollout_worker.engine.model.kv_cache import GatheredKV, KVPool
from rollout_worker.engine.model.parallel import SINGLE
from rollout_worker.engine.model.presets import preset_config
from rollout_worker.engine.model.weights import random_shard
from torch.profiler import ProfilerActivity, profile

WARMUP = 3
PAGE = 16


def steps_ms(
    dec: Decoder, cfg: ModelConfig, batch: int, context: int, steps: int, prof: profile | None = None
) -> list[float]:
    """Milliseconds of each of ``steps`` decode steps of ``batch`` rows from ``context`` on (``prof``:
    a profiler started after the warm-up steps)."""
    cpu = torch.device("cpu")
    per_row = context + steps + WARMUP + PAGE
    pool = KVPool(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, PAGE, batch * (per_row // PAGE + 2), batch,
        2 * per_row, torch.float32, cpu,
    )  # fmt: skip
    rows = []
    for b in range(batch):
        pages: list[int] = []
        if not pool.reserve(pages, per_row):
            raise RuntimeError("the pool is too small")
        pool.bind(b, pages)
        rows.append(pages)
    gen = torch.Generator().manual_seed(0)
    for cache in (*pool.k, *pool.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    kept, out = GatheredKV(), []
    tokens = torch.tensor([7 * b % cfg.vocab_size for b in range(batch)])[:, None]
    for i in range(WARMUP + steps):
        p = context + i
        write = torch.tensor([pool.slot(rows[b], p) for b in range(batch)])[:, None]
        if i == WARMUP and prof is not None:
            prof.start()
        t0 = time.perf_counter()
        dec.step_logits(tokens, torch.full((batch, 1), p), pool, write, p + 1, kept)
        if i >= WARMUP:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pack", choices=["on", "off"], default="on", help="packed weights (default on)")
    ap.add_argument("--json")
    ap.add_argument("--profile", choices=["default", "deterministic"], help="print a torch profile too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig.from_dict(preset_config(args.preset), where=args.preset)
    cpu, pack = torch.device("cpu"), args.pack == "on"
    weights = random_shard(cfg, 1, 0, torch.float32, cpu)
    kernels = {
        name: Kernels.of(cfg, torch.float32, cpu, deterministic=det, pack=pack, world=2)
        for name, det in (("default", False), ("deterministic", True))
    }
    decoders = {name: Decoder(cfg, weights, SINGLE, k) for name, k in kernels.items()}
    batches = [int(b) for b in args.batch.split(",")]
    runs: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in decoders}
    for _ in range(args.runs):
        for b in batches:
            for name, dec in decoders.items():
                runs[name][b].append(statistics.median(steps_ms(dec, cfg, b, args.context, args.steps)))
    print(f"{args.preset}, one TP=1 decoder, packed {args.pack}, context {args.context}", end="")
    print(f", median of {args.runs} runs (ms):")
    print(" batch  default  determ.  tok/s ratio")
    points = []
    for b in batches:
        d, det = (statistics.median(runs[k][b]) for k in decoders)
        points.append({"batch": b, "default_ms": d, "deterministic_ms": det, "ratio": d / det,
                       "runs": {k: runs[k][b] for k in decoders}})  # fmt: skip
        print(f"{b:6d} {d:8.2f} {det:8.2f}  {d / det:.3f}")
    if args.profile:
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        steps_ms(decoders[args.profile], cfg, batches[-1], args.context, 2, prof)
        prof.stop()
        table = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=15
        )
        print(table)
    if args.json:
        with open(args.json, "w") as f:
            out = {"preset": args.preset, "pack": args.pack, "context": args.context, "points": points}
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
