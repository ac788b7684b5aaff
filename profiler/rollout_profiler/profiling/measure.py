"""Profiling the real engine into a :class:`Profile`.

Two modes:

* ``measured``: G rank processes run the engine's own measurement tasks (decode steps over a
  layout x batch x context grid, then real reconfigurations between layouts), exactly the code paths
  that generation uses.
* ``shard-equivalent`` (one accelerator, many TP sizes): for each TP size T, one rank runs a model
  whose attention heads, KV heads, MLP width and vocabulary are 1/T of the real one: the per-rank
  compute of a TP-T step. A communication term is added from an all-reduce latency table (given or
  default), and reconfiguration costs are modelled from link bandwidth plus a measured prefill rate.
  The profile's provenance lists what was measured and what was modelled.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollout_worker import __version__
from rollout_worker.config.engine_settings import DTYPE_BYTES, EngineSettings
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.launcher import run_task
from rollout_worker.engine.rank.measure import measure_grid, measure_prefill, measure_reconfig
from rollout_worker.errors import UserError
from rollout_worker.scheduling.head_shards import max_q_heads
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.profile import CostModel, ModelShape, Profile, ReconfigPoint, StepPoint

Echo = Callable[[str], Any]

# All-reduce latency (bytes -> microseconds) on 8 H100 with NVLink, from published figures
# (field.md: 4-8 us up to 32 KB, 20-34 us at 1 MB); beyond 1 MB, bus bandwidth ~ 360 GB/s.
H100_ALLREDUCE_US = [(1024, 5.0), (32768, 8.0), (1 << 20, 27.0), (16 << 20, 27.0 + (15 << 20) / 360e3)]
H100_LINK_BYTES_PER_MS = 450e6 * 0.5  # NVLink 450 GB/s per direction at ~50% efficiency for KV transfers


def _engine(
    model_dir: Path,
    cfg: ModelConfig,
    world: int,
    layouts: list[Layout],
    dtype: str,
    device: str,
    random_weights: bool = False,
    deterministic: bool = False,
) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir),
        model=cfg,
        world=world,
        layout=layouts[0],
        candidates=tuple(layouts),
        dtype=dtype,
        engine=EngineSettings(device=device, collective_timeout_seconds=600.0, deterministic=deterministic),
        random_weights=random_weights,
    )


def profile_measured(
    name: str,
    model_name: str,
    model_dir: Path,
    world: int,
    layouts: list[Layout],
    batches: list[int],
    contexts: list[int],
    dtype: str,
    device: str,
    steps: int,
    echo: Echo,
    deterministic: bool = False,
) -> Profile:
    cfg = ModelConfig.load(model_dir)
    for lay in layouts:
        if lay.world != world:
            raise UserError(f"--layouts: {lay} has {lay.world} ranks, not --ranks {world}")
    layouts = sorted(set(layouts), key=lambda x: x.tp)
    ec = _engine(model_dir, cfg, world, layouts, dtype, device, deterministic=deterministic)
    kernels = ", deterministic kernels" if deterministic else ""
    echo(
        f"profiling {name}: {world} ranks{kernels}, layouts {', '.join(map(str, layouts))}, batch {batches}, "
        f"context {contexts}, {steps} steps per point"
    )
    grid = run_task(
        ec,
        measure_grid,
        {
            "layouts": [str(x) for x in layouts],
            "batches": batches,
            "contexts": contexts,
            "steps": steps,
        },
    )
    points = [
        StepPoint(p["replicas"], p["tp"], p["batch"], p["context"], round(p["ms"], 4))
        for p in grid[0]["points"]
        if p["active"] == "all"
    ]
    echo(f"  step latency: {len(points)} points")
    events: list[dict[str, Any]] = []
    if len(layouts) > 1:
        pairs = [(str(a), str(b)) for a in layouts for b in layouts if a != b]
        rec = run_task(
            ec,
            measure_reconfig,
            {
                "pairs": pairs,
                "methods": ["migrate", "recompute"],
                "batch": min(4, max(batches)),
                "context": max(contexts),
            },
        )
        events = rec[0]["events"]
        echo(f"  reconfiguration: {len(events)} switches measured")
    recs = [
        ReconfigPoint(
            e["src"],
            e["dst"],
            e["method"],
            e["tokens"],
            e.get("kv_bytes_moved", 0),
            round(e["phases"]["total_ms"], 4),
        )
        for e in events
    ]
    return _profile(
        name,
        cfg,
        device,
        world,
        dtype,
        "measured",
        points,
        recs,
        fit_costs(events, cfg.num_layers),
        {
            "measured": ["step_latency", "reconfig_cost", "costs"],
            "modelled": [],
            "notes": f"decode steps timed with the real engine, trimmed mean of {steps} steps per point",
            "kernels": "deterministic" if deterministic else "default",
        },
        model_name,
    )


def _profile(
    name: str,
    cfg: ModelConfig,
    device: str,
    count: int,
    dtype: str,
    method: str,
    points: list[StepPoint],
    recs: list[ReconfigPoint],
    costs: CostModel,
    provenance: dict[str, Any],
    model_name: str,
) -> Profile:
    return Profile(
        name=name,
        model=ModelShape.of(model_name, cfg),
        engine=f"elastic-rollout {__version__}",
        device_kind=device,
        device_count=count,
        device_name=_device_name(device),
        dtype=dtype,
        method=method,
        step_latency=points,
        reconfig_cost=recs,
        costs=costs,
        provenance=provenance,
    )


def fit_costs(events: list[dict[str, Any]], layers: int) -> CostModel:
    """Fit the linear reconfiguration cost model to measured switches (defaults when none)."""

    def med(xs: list[float], default: float) -> float:
        return statistics.median(xs) if xs else default

    mig = [e for e in events if e["method"] == "migrate" and e.get("kv_bytes_moved")]
    rec = [e for e in events if e["method"] == "recompute" and e.get("kv_tokens_recomputed")]
    grow = [
        e["phases"]["reshard_ms"] for e in events if Layout.parse(e["dst"]).tp > Layout.parse(e["src"]).tp
    ]
    shrink = [
        e["phases"]["reshard_ms"] for e in events if Layout.parse(e["dst"]).tp < Layout.parse(e["src"]).tp
    ]
    fixed = [e["phases"]["sync_ms"] + e["phases"]["plan_ms"] + e["phases"]["vote_ms"] for e in events]
    return CostModel(
        migrate_bytes_per_ms=med(
            [e["kv_bytes_moved"] / max(e["phases"]["kv_migrate_ms"], 1e-3) for e in mig], 2e5
        ),
        migrate_fixed_ms=med(fixed, 1.0),
        recompute_tokens_per_ms=med(
            [e["kv_tokens_recomputed"] / max(e["phases"]["kv_recompute_ms"], 1e-3) for e in rec], 20.0
        ),
        recompute_fixed_ms=med(fixed, 1.0),
        reshard_grow_ms=med(grow, 0.0),
        reshard_shrink_ms=med(shrink, 0.0),
        sync_ms=med([e["phases"]["sync_ms"] for e in events], 1.0),
    )


def allreduce_us(table: list[tuple[int, float]], nbytes: float) -> float:
    """Piecewise log-log interpolation of an all-reduce latency table; linear in bytes past its end."""
    xs = [b for b, _ in table]
    if nbytes <= xs[0]:
        return table[0][1]
    if nbytes >= xs[-1]:
        (b0, u0), (b1, u1) = table[-2], table[-1]
        return u1 + (nbytes - b1) * (u1 - u0) / (b1 - b0)
    i = bisect.bisect_left(xs, nbytes)
    (b0, u0), (b1, u1) = table[i - 1], table[i]
    f = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp(math.log(u0) + f * (math.log(u1) - math.log(u0)))


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model the widest rank of a TP-``tp`` replica computes (it sets the step time): its share of the
    heads and KV heads (uneven when the counts do not divide ``tp``), of the MLP and of the vocabulary."""
    why = cfg.tp_problem(tp)
    if why:
        raise UserError(f"--tp-sizes: {why}")
    return replace(
        cfg,
        num_heads=max_q_heads(cfg.num_heads, cfg.num_kv_heads, tp),
        num_kv_heads=cfg.kv_heads_per_rank(tp),
        intermediate_size=-(-cfg.intermediate_size // tp),
        vocab_size=cfg.vocab_size // tp,
    )


def profile_shard_equivalent(
    name: str,
    model_name: str,
    model_dir: Path,
    gpus: int,
    tp_sizes: list[int],
    batches: list[int],
    contexts: list[int],
    dtype: str,
    device: str,
    steps: int,
    comm_table: list[tuple[int, float]],
    comm_source: str,
    echo: Echo,
) -> Profile:
    cfg = ModelConfig.load(model_dir)
    elem = DTYPE_BYTES[dtype]
    points: list[StepPoint] = []
    prefill_rates: list[float] = []
    for tp in sorted(set(tp_sizes)):
        if gpus % tp:
            raise UserError(f"--tp-sizes: {tp} does not divide --gpus {gpus}")
        scfg = shard_config(cfg, tp)
        with tempfile.TemporaryDirectory() as tmp:
            raw = json.loads((model_dir / "config.json").read_text())
            raw.update(
                num_attention_heads=scfg.num_heads,
                num_key_value_heads=scfg.num_kv_heads,
                intermediate_size=scfg.intermediate_size,
                vocab_size=scfg.vocab_size,
                head_dim=cfg.head_dim,
            )
            (Path(tmp) / "config.json").write_text(json.dumps(raw))
            ec = _engine(Path(tmp), scfg, 1, [Layout(1, 1)], dtype, device, random_weights=True)
            echo(f"shard-equivalent TP={tp}: one rank computes 1/{tp} of {name}")
            res = run_task(
                ec,
                measure_grid,
                {"layouts": ["1x1"], "batches": batches, "contexts": contexts, "steps": steps},
            )[0]
            pre = run_task(
                ec,
                measure_prefill,
                {"batch": max(1, min(8, max(batches))), "context": max(contexts)},
            )[0]
        for p in res["points"]:
            comm_ms = 0.0
            if tp > 1:
                act = p["batch"] * cfg.hidden_size * elem
                logits = p["batch"] * cfg.vocab_size * elem
                comm_ms = (
                    2 * cfg.num_layers * allreduce_us(comm_table, act) + allreduce_us(comm_table, logits)
                ) / 1e3
            points.append(StepPoint(gpus // tp, tp, p["batch"], p["context"], round(p["ms"] + comm_ms, 4)))
        prefill_rates.append(pre["tokens_per_ms"])
    kv_token_bytes = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * elem
    weight_bytes = sum(math.prod(s) for s in _shapes(cfg)) * elem
    costs = CostModel(
        migrate_bytes_per_ms=H100_LINK_BYTES_PER_MS,
        migrate_fixed_ms=0.5,
        recompute_tokens_per_ms=statistics.median(prefill_rates) if prefill_rates else 1e3,
        recompute_fixed_ms=0.5,
        reshard_grow_ms=0.1,
        reshard_shrink_ms=weight_bytes / H100_LINK_BYTES_PER_MS / max(1, gpus // 2),
        sync_ms=0.2,
    )
    return _profile(
        name,
        cfg,
        device,
        gpus,
        dtype,
        "shard-equivalent",
        points,
        [],
        costs,
        {
            "measured": [
                "per-rank compute of each TP size (1/T-width shard on one device)",
                "prefill throughput of the shards (costs.recompute_tokens_per_ms: median over TP sizes)",
            ],
            "modelled": [
                f"communication: 2 all-reduces per layer + logits gather, from {comm_source}",
                "KV migration bandwidth and weight re-gather (link bandwidth)",
            ],
            "kv_bytes_per_token": kv_token_bytes,
        },
        model_name,
    )


def _shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    from rollout_worker.engine.model.checkpoint_index import tensor_shapes

    return [s for _, s in tensor_shapes(cfg)]


def _device_name(device: str) -> str:
    import platform

    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
    return f"{platform.machine()} CPU"
