"""Measurements run inside the ranks (tasks for ``launcher.run_task``): decode-step latency over a
layout x batch x context grid, and the phases of real reconfigurations. The benchmark and the profiler
both use these, so what is profiled is exactly what runs.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.engine.rank.rank_state import RankState
from rollout_worker.engine.rank.reconfigure import reconfigure
from rollout_worker.engine.rank.sequence import Sequence
from rollout_worker.scheduling.layout import Layout
from rollout_worker.scheduling.pages import pages_for

_HEADROOM = 64  # decode steps a measurement may run past its context


def _switch(st: RankState, target: Layout) -> RankState:
    """Move the (emptied) engine to ``target`` through the real reconfiguration path."""
    st.replica.drop_running()
    st.replica.waiting.clear()
    if target == st.layout:
        return st
    new, ev, _ = reconfigure(st, target, "migrate", reason="measurement")
    if ev.outcome != "committed":
        raise RuntimeError(f"switch to {target} failed: {ev.error}")
    return new


def _fake_running(st: RankState, batch: int, context: int, tag: str, seed: int) -> None:
    """``batch`` running requests on this rank's replica with ``context`` cached tokens of random K/V
    (made on the device). The pool's storage is sized for this point alone, so a large grid does not keep
    the largest batch's slots and the longest context's tokens at once."""
    rep = st.replica
    rep.drop_running()
    rep.release_kv()
    if st.device.type == "cuda":
        torch.cuda.empty_cache()
    d = st.replica_index
    rng = random.Random(seed * 1000 + d)
    vocab = st.model.vocab_size
    for i in range(batch):
        spec = RequestSpec(
            f"{tag}-{d}-{i}",
            tuple(rng.randrange(vocab) for _ in range(context)),
            max_new_tokens=_HEADROOM,
            sampling=Sampling(),
            ignore_eos=True,
        )
        rep.running.append(Sequence(spec=spec, output=[rng.randrange(vocab)]))
    pool = rep.pool
    pool.grow_storage(batch * pages_for(context + _HEADROOM, pool.page_size) + 1)  # one allocation
    pool.ensure_table(batch, context + _HEADROOM)
    rep.hold_running_kv()
    gen = torch.Generator(device=st.device).manual_seed(seed)
    for cache in (*pool.k, *pool.v):
        cache.copy_(torch.randn(cache.shape, generator=gen, device=st.device, dtype=cache.dtype))
    pool.version += 1  # written behind the decoder's back


def kv_fits(st: RankState, batch: int, context: int) -> bool:
    """Whether ``batch`` x ``context`` tokens of KV (the pages :func:`_fake_running` takes) fit in the
    device's free memory with a 10% margin. Always true on CPU (the caller keeps the grid small there). On
    CUDA the pool is released first, so that its memory counts as free."""
    if st.device.type != "cuda":
        return True
    rep = st.replica
    m = st.model
    per_token = 2 * m.num_layers * rep.pool.kv_heads * m.head_dim  # this rank's KV heads
    per_token *= torch.empty((), dtype=st.dtype).element_size()
    tokens = batch * pages_for(context + _HEADROOM, rep.pool.page_size) * rep.pool.page_size
    rep.drop_running()
    rep.release_kv()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(st.device)
    return tokens * per_token < 0.9 * free


def trimmed_mean(xs: list[float], cut: float = 0.2) -> float:
    """Mean without the lowest and highest ``cut`` fraction: the expected step time (what a rollout
    sums) without the rare stalls of processes sharing cores."""
    s = sorted(xs)
    k = int(len(s) * cut)
    kept = s[k : len(s) - k] or s
    return sum(kept) / len(kept)


def _timed_steps(st: RankState, steps: int, warmup: int, active: bool) -> list[float]:
    """Decode steps timed as the serving loop runs them: the group's inbox sync + the replica's step.
    Replicas run concurrently (each at its own pace); a barrier only aligns the start of each step."""
    out = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        if active:
            if st.layout.tp > 1:
                st.group_sync(0)
            st.replica.decode()
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def step_breakdown(st: RankState, steps: int) -> dict[str, float]:
    """Where a CUDA decode step's time goes (torch profiler over ``steps`` steps, after the timed ones):
    wall time, GPU kernel time, kernel launches (graph replays count as launches), host time inside the
    CUDA runtime's launch calls, and the rest of the host's time (Python, sampling, synchronisation)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            st.replica.decode()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    kernel_us = launch_us = 0.0
    kernels = launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += ev.device_time
            kernels += 1
        elif ev.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch"):
            launch_us += ev.cpu_time_total
            launches += 1
    gpu = kernel_us / 1e3 / steps
    return {
        "wall_ms": wall,
        "gpu_kernels_ms": gpu,
        "gpu_idle_ms": max(wall - gpu, 0.0),
        "kernels_per_step": kernels / steps,
        "launches_per_step": launches / steps,
        "launch_api_ms": launch_us / 1e3 / steps,
    }


def measure_grid(st: RankState, args: dict[str, Any]) -> dict[str, Any]:
    """Median decode-step ms per (layout, batch, context), all replicas busy; for layouts with several
    replicas also with only replica 0 busy ("one"), which is the latency of a lone replica. Points whose
    KV cache does not fit the device are listed under ``skipped``. With ``breakdown`` (CUDA), each point
    also says where its step's time goes (:func:`step_breakdown`)."""
    layouts = [Layout.parse(x) for x in args["layouts"]]
    steps, warmup = int(args["steps"]), int(args.get("warmup", 2))
    breakdown = bool(args.get("breakdown")) and st.device.type == "cuda"
    points: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for lay in layouts:
        st = _switch(st, lay)
        for batch in args["batches"]:
            if batch > st.cfg.engine.max_batch:
                continue
            for ctx in args["contexts"]:
                if not kv_fits(st, batch, ctx):
                    skipped.append({"layout": str(lay), "batch": batch, "context": ctx, "why": "KV > memory"})
                    continue
                modes = ["all", "one"] if lay.replicas > 1 else ["all"]
                for mode in modes:
                    _fake_running(st, batch, ctx, f"g{lay}{batch}x{ctx}", seed=batch * 7 + ctx)
                    active = mode == "all" or lay.replica_of(st.rank) == 0
                    ms = _timed_steps(st, steps, warmup, active)
                    point = {
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
                    if breakdown and active:
                        point["breakdown"] = step_breakdown(st, min(steps, 10))
                    points.append(point)
        st.replica.drop_running()
    return {"points": points, "skipped": skipped}


def measure_reconfig(st: RankState, args: dict[str, Any]) -> dict[str, Any]:
    """Real reconfigurations between layout pairs, ``batch`` requests per replica of ``context`` tokens.
    Each event is a ``ReconfigEvent`` as JSON, plus ``tokens`` (KV tokens the pod held)."""
    pairs = [(Layout.parse(a), Layout.parse(b)) for a, b in args["pairs"]]
    batch, ctx = int(args["batch"]), int(args["context"])
    events = []
    for src, dst in pairs:
        for method in args["methods"]:
            st = _switch(st, src)
            _fake_running(st, batch, ctx, f"r{src}{dst}{method}", seed=ctx)
            st, ev, _ = reconfigure(st, dst, method, reason="measurement")
            if ev.outcome != "committed":
                raise RuntimeError(f"{src} -> {dst} ({method}) failed: {ev.error}")
            events.append({**ev.model_dump(mode="json"), "tokens": batch * src.replicas * ctx})
    _switch(st, st.cfg.layout)
    return {"events": events}


def probe_logits(st: RankState, args: dict[str, Any]) -> dict[str, Any]:
    """Next-token logits of fixed prompts under each layout (prefill, then one decode step), for checking
    that every TP size computes the same function."""
    rows: list[list[int]] = args["prompts"]
    out: dict[str, Any] = {}
    for name in args["layouts"]:
        st = _switch(st, Layout.parse(name))
        rep = st.replica
        seqs = [
            Sequence(spec=RequestSpec(f"p{i}", tuple(r[:-1]), 2, Sampling()), output=[r[-1]])
            for i, r in enumerate(rows)
        ]
        rep.prefill(seqs, sample_fresh=False)
        logits = rep.step_logits()
        out[name] = logits.cpu().to(torch.float64).tolist()
        rep.drop_running()
    return out


def measure_prefill(st: RankState, args: dict[str, Any]) -> dict[str, Any]:
    """Prefill throughput (tokens/ms) of one batched prefill of ``batch`` prompts of ``context`` tokens."""
    batch, ctx, runs = int(args["batch"]), int(args["context"]), int(args.get("runs", 3))
    rng = random.Random(0)
    rates = []
    for i in range(runs + 1):
        seqs = [
            Sequence(
                spec=RequestSpec(
                    f"pf{i}-{j}",
                    tuple(rng.randrange(st.model.vocab_size) for _ in range(ctx)),
                    1,
                    Sampling(),
                )
            )
            for j in range(batch)
        ]
        st.replica.drop_running()
        dist.barrier()
        t0 = time.perf_counter()
        if st.layout.tp > 1:
            st.group_sync(0)
        st.replica.prefill(seqs, sample_fresh=False)
        if i:  # the first is a warm-up
            rates.append(batch * ctx / ((time.perf_counter() - t0) * 1e3))
    st.replica.drop_running()
    return {"tokens_per_ms": statistics.median(rates)}
