"""Measurements run inside the ranks (tasks for ``launcher.run_ranks``): decode-step latency over a
layout x batch x context grid, and the phases of real reconfigurations. The benchmark and the profiler
both use these, so what is profiled is exactly what runs.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rollout_worker.api.layout import Layout
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import SamplingParams
from rollout_worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from rollout_worker.engine.rank import RankEngine


def _switch(eng: RankEngine, target: Layout) -> None:
    """Move the (empty) engine to ``target`` through the real reconfiguration path."""
    from rollout_worker.engine.reconfig import reconfigure

    eng.replica.running.clear()
    eng.replica.waiting.clear()
    if target != eng.layout:
        ev = reconfigure(eng, target, "migrate", reason="measurement")
        if ev["outcome"] != "committed":
            raise RuntimeError(f"switch to {target} failed: {ev.get('error')}")


def _fake_running(eng: RankEngine, batch: int, context: int, tag: str, seed: int) -> None:
    """``batch`` running requests per replica with ``context`` cached tokens of random K/V.

    Every rank registers every replica's requests (a reconfiguration looks them all up by id).
    """
    rep = eng.replica
    rep.running.clear()
    mine = eng.layout.replica_of(eng.rank)
    for d in range(eng.layout.replicas):
        rng = random.Random(seed * 1000 + d)
        for i in range(batch):
            rid = f"{tag}-{d}-{i}"
            spec = RequestSpec(
                rid,
                tuple(rng.randrange(eng.model.vocab_size) for _ in range(context)),
                max_new_tokens=eng.capacity - context,
                sampling=SamplingParams(),
                ignore_eos=True,
            )
            eng.specs[rid] = spec
            if d == mine:
                rep.running.append(Sequence(spec=spec, output=[rng.randrange(eng.model.vocab_size)]))
    gen = torch.Generator().manual_seed(seed)
    for cache in (*rep.slab.k, *rep.slab.v):
        cache[:batch, :, :context].copy_(torch.randn(cache[:batch, :, :context].shape, generator=gen))


def trimmed_mean(xs: list[float], cut: float = 0.2) -> float:
    """Mean without the lowest and highest ``cut`` fraction: the expected step time (what a rollout
    sums) without the rare stalls of processes sharing cores."""
    s = sorted(xs)
    k = int(len(s) * cut)
    kept = s[k : len(s) - k] or s
    return sum(kept) / len(kept)


def _timed_steps(eng: RankEngine, steps: int, warmup: int, active: bool) -> list[float]:
    """Decode steps timed as the generation loop runs them: replica step + the global sync."""
    out = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        if active:
            eng.replica.decode()
        eng.global_unfinished()
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_grid(eng: RankEngine, args: dict[str, Any]) -> dict[str, Any]:
    """Median decode-step ms per (layout, batch, context), all replicas busy; for layouts with several
    replicas also with only replica 0 busy ("one"), which is the latency of a lone replica."""
    layouts = [Layout.parse(x) for x in args["layouts"]]
    steps, warmup = int(args["steps"]), int(args.get("warmup", 2))
    eng.capacity = max(args["contexts"]) + warmup + steps + 2
    eng.replica = eng.make_replica(eng.layout, eng.weights)
    points = []
    for lay in layouts:
        _switch(eng, lay)
        for batch in args["batches"]:
            if batch > eng.cfg.max_batch:
                continue
            for ctx in args["contexts"]:
                modes = ["all", "one"] if lay.replicas > 1 else ["all"]
                for mode in modes:
                    _fake_running(eng, batch, ctx, f"g{lay}{batch}x{ctx}", seed=batch * 7 + ctx)
                    active = mode == "all" or lay.replica_of(eng.rank) == 0
                    ms = _timed_steps(eng, steps, warmup, active)
                    points.append(
                        {
                            "layout": str(lay),
                            "replicas": lay.replicas,
                            "tp": lay.tp,
                            "batch": batch,
                            "context": ctx,
                            "active": mode,
                            "ms": trimmed_mean(ms),
                            "ms_median": statistics.median(ms),
                            "ms_min": min(ms),
                            "ms_max": max(ms),
                        }
                    )
        eng.replica.running.clear()
    return {"points": points}


def measure_reconfig(eng: RankEngine, args: dict[str, Any]) -> dict[str, Any]:
    """Real reconfigurations between layout pairs, ``batch`` requests per replica of ``context`` tokens."""
    from rollout_worker.engine.reconfig import reconfigure

    pairs = [(Layout.parse(a), Layout.parse(b)) for a, b in args["pairs"]]
    batch, ctx = int(args["batch"]), int(args["context"])
    eng.capacity = ctx + 4
    eng.replica = eng.make_replica(eng.layout, eng.weights)
    events = []
    for src, dst in pairs:
        for method in args["methods"]:
            _switch(eng, src)
            _fake_running(eng, batch, ctx, f"r{src}{dst}{method}", seed=ctx)
            ev = reconfigure(eng, dst, method, reason="measurement")
            if ev["outcome"] != "committed":
                raise RuntimeError(f"{src} -> {dst} ({method}) failed: {ev.get('error')}")
            ev["tokens"] = batch * src.replicas * ctx
            events.append(ev)
    _switch(eng, eng.cfg.layout)
    return {"events": events}


def probe_logits(eng: RankEngine, args: dict[str, Any]) -> dict[str, Any]:
    """Next-token logits of fixed prompts under each layout (prefill, then one decode step), for checking
    that every TP size computes the same function."""
    rows: list[list[int]] = args["prompts"]
    eng.capacity = max(len(r) for r in rows) + 2
    eng.replica = eng.make_replica(eng.layout, eng.weights)
    out: dict[str, Any] = {}
    for name in args["layouts"]:
        _switch(eng, Layout.parse(name))
        rep = eng.replica
        seqs = [
            Sequence(spec=RequestSpec(f"p{i}", tuple(r[:-1]), 2, SamplingParams()), output=[r[-1]])
            for i, r in enumerate(rows)
        ]
        rep.prefill(seqs, sample_fresh=False)
        dev = rep.decoder.embed.device
        logits = rep.decoder.forward(
            torch.tensor([[r[-1]] for r in rows], device=dev),
            torch.tensor([[len(r) - 1] for r in rows], device=dev),
            rep.slab,
            torch.zeros(len(rows), dtype=torch.long, device=dev),
        )
        out[name] = logits.cpu().to(torch.float64).tolist()
        rep.running.clear()
    return out


def measure_prefill(eng: RankEngine, args: dict[str, Any]) -> dict[str, Any]:
    """Prefill throughput (tokens/ms) of one batched prefill of ``batch`` prompts of ``context`` tokens."""
    batch, ctx, runs = int(args["batch"]), int(args["context"]), int(args.get("runs", 3))
    eng.capacity = ctx + 2
    eng.replica = eng.make_replica(eng.layout, eng.weights)
    rng = random.Random(0)
    rates = []
    for i in range(runs + 1):
        seqs = [
            Sequence(
                spec=RequestSpec(
                    f"pf{i}-{j}",
                    tuple(rng.randrange(eng.model.vocab_size) for _ in range(ctx)),
                    1,
                    SamplingParams(),
                )
            )
            for j in range(batch)
        ]
        eng.replica.running.clear()
        dist.barrier()
        t0 = time.perf_counter()
        eng.replica.prefill(seqs, sample_fresh=False)
        eng.global_unfinished()
        if i:  # the first is a warm-up
            rates.append(batch * ctx / ((time.perf_counter() - t0) * 1e3))
    eng.replica.running.clear()
    return {"tokens_per_ms": statistics.median(rates)}
