"""Modelled (never measured) profiles: a roofline-style decode-step model of one 8 x H100 SXM pod.

Every number comes from a published figure (cited in ``profiles/README.md``), none from a measurement:

* H100 SXM: HBM 3.35 TB/s, bf16 ~790 TFLOP/s dense, NVLink ~450 GB/s per direction, 81,559 MiB per GPU;
* all-reduce: SGLang's custom all-reduce on H100 (TP 2/4/8, 512 B to 1 MB, sgl-project/sglang#2904),
  beyond 1 MB the slope of vLLM's TP4 figures (15/22/29 us at 1/2/4 MB), scaled by 2(T-1)/T;
* decode step at batch 1: vLLM 0.6 on H100 SXM, Meta-Llama-3-8B-Instruct, TP 1/2/4/8 = 7.05 / 4.90 /
  3.54 / 2.92 ms (LambdaLabsML/vllm-benchmark, len 2048);
* growth with batch: SGLang, Llama-3-8B, TP1 batch 1 7.4 ms -> batch 128 11.8 ms.

Step latency of one replica (TP ``t``, batch ``b``, mean context ``c``)::

    step = fixed + per_request * b + L * max(mem_layer, flops_layer) + lm_head + 2 L allreduce(t, b*hidden*2)

* ``mem_layer``: (layer weights / t + b * c * KV bytes per token per layer / min(t, kv_heads))
  / (HBM * bw_eff)
* ``flops_layer``: (2 b layer params + 4 b c q_dim) / t / (peak * flops_eff)
* ``allreduce(t, m)``: the published table, interpolated in log-log; 0 at t = 1.

``fixed`` (per-step overheads that do not shrink with TP: kernel launches, scheduling) and ``bw_eff`` are
fitted by least squares to the four vLLM batch-1 points (step - all-reduces = fixed + weight bytes / (HBM
bw_eff), linear in 1 / bw_eff) at an assumed context of ``REF_CONTEXT`` tokens (the benchmark's prompts and
outputs are short; the KV reads are then < 1% of the step); ``per_request`` (unsharded per-request work:
sampling, bookkeeping) is what the SGLang batch-1 -> batch-128 growth leaves after the model's KV reads.
Qwen3-14B reuses the same constants.

KV capacity per replica (stored in the profile): 81,559 MiB x 0.9 (vLLM's default
``gpu_memory_utilization``) - weights / T - 2 GiB (activations, CUDA graphs, communication buffers).

Regenerate the shipped files: ``python -m rollout_profiler.profiling.modelled profiles/``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rollout_worker.scheduling.head_shards import max_kv_heads, max_q_heads
from rollout_worker.scheduling.layout import Layout

from rollout_profiler.profile import CostModel, KVCapacity, ModelShape, Profile, ReconfigPoint, StepPoint

MB = 1 << 20
GIB = 1 << 30
LAYOUTS = ("8x1", "4x2", "2x4", "1x8")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 24576)
REF_CONTEXT = 512
PREFILL_CONTEXT = 4096  # mean context assumed when pricing a re-prefill (recompute)
# (tp, ms) vLLM 0.6, H100 SXM, Meta-Llama-3-8B-Instruct, batch 1 (LambdaLabsML/vllm-benchmark, len 2048)
BATCH1_POINTS = ((1, 7.05), (2, 4.90), (4, 3.54), (8, 2.92))
# (tp, batch, ms) SGLang, Llama-3-8B, CUDA graphs: the growth of a TP1 step from batch 1 to batch 128
BATCH_GROWTH = ((1, 1, 7.4), (1, 128, 11.8))
# SGLang custom all-reduce on H100 (sgl-project/sglang#2904): bytes -> us for TP 2, 4, 8
ALLREDUCE_US = {
    2: ((512, 3.7), (4096, 3.9), (32768, 4.5), (262144, 7.9), (524288, 12.5), (MB, 19.9)),
    4: ((512, 4.8), (4096, 3.7), (32768, 4.8), (262144, 13.9), (524288, 20.2), (MB, 31.1)),
    8: ((512, 5.9), (4096, 5.7), (32768, 7.8), (262144, 16.7), (524288, 22.1), (MB, 33.8)),
}
ALLREDUCE_TP4_US_PER_MB = (29.0 - 15.0) / 3  # vLLM TP4 on H100: 15 / 22 / 29 us at 1 / 2 / 4 MB
GRAPH_SIZES_AT_SWITCH = 12  # SGLang's capture sizes up to batch 64: 1, 2, 4, 8, 12, ..., 64
GRAPH_CAPTURE_MS_PER_SIZE = 50.0  # vLLM lazy capture logs: ~0.05 s per captured size


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str = "H100 SXM 80GB"
    gpu_bytes: int = 81559 * MB  # what nvidia-smi reports for an H100 80GB HBM3
    peak_flops: float = 790e12
    hbm_bytes_s: float = 3.35e12
    nvlink_bytes_s: float = 450e9
    flops_eff: float = 0.6
    nvlink_eff: float = 0.6  # share of NVLink for KV migration
    mem_fraction: float = 0.9
    reserve_bytes: int = 2 * GIB


@dataclass(frozen=True, slots=True)
class Calibration:
    fixed_ms: float
    per_request_ms: float
    bw_eff: float
    residual_ms: tuple[float, ...]  # fitted - published at the four batch-1 points


LLAMA_31_8B = ModelShape("Llama-3.1-8B", "LlamaForCausalLM", 4096, 32, 32, 8, 128, 14336, 128256)
QWEN3_14B = ModelShape("Qwen3-14B", "Qwen3ForCausalLM", 5120, 40, 40, 8, 128, 17408, 151936)


def _layer_params(m: ModelShape) -> float:
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    return float(attn + 3 * m.hidden_size * m.intermediate_size)


def weight_bytes(m: ModelShape) -> float:
    """bf16 weights: layers, embedding and LM head (not tied)."""
    return (_layer_params(m) * m.num_layers + 2 * m.vocab_size * m.hidden_size) * 2


def allreduce_ms(tp: int, nbytes: float) -> float:
    """One all-reduce of ``nbytes`` on ``tp`` GPUs (log-log in the table, then the vLLM slope)."""
    if tp <= 1:
        return 0.0
    table = ALLREDUCE_US.get(tp) or tuple((b, us * tp / 8) for b, us in ALLREDUCE_US[8])
    xs = [b for b, _ in table]
    if nbytes <= xs[0]:
        return table[0][1] / 1e3
    if nbytes >= xs[-1]:
        slope = ALLREDUCE_TP4_US_PER_MB * (2 * (tp - 1) / tp) / 1.5
        return (table[-1][1] + slope * (nbytes - xs[-1]) / MB) / 1e3
    i = next(k for k, b in enumerate(xs) if b >= nbytes)
    (b0, u0), (b1, u1) = table[i - 1], table[i]
    f = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp(math.log(u0) + f * (math.log(u1) - math.log(u0))) / 1e3


def _comm_ms(m: ModelShape, tp: int, batch: int) -> float:
    return 2 * m.num_layers * allreduce_ms(tp, batch * m.hidden_size * 2)


def _core_ms(m: ModelShape, hw: Hardware, bw_eff: float, tp: int, batch: int, ctx: int) -> float:
    """Layers, LM head and all-reduces (everything but ``fixed`` and ``per_request``). The attention's
    cache reads and FLOPs are the widest rank's (uneven head shards:
    :mod:`rollout_worker.scheduling.head_shards`)."""
    bw = hw.hbm_bytes_s * bw_eff
    fl = hw.peak_flops * hw.flops_eff
    kv_layer = max_kv_heads(m.num_kv_heads, tp) * m.head_dim * 2 * 2  # one rank's K and V, bf16, per token
    q_heads = max_q_heads(m.num_heads, m.num_kv_heads, tp)
    mem = (_layer_params(m) * 2 / tp + batch * ctx * kv_layer) / bw
    flops = (2 * batch * _layer_params(m) / tp + 4 * batch * ctx * q_heads * m.head_dim) / fl
    layers = m.num_layers * max(mem, flops) * 1e3
    head_params = m.vocab_size * m.hidden_size
    head = max(head_params * 2 / tp / bw, 2 * batch * head_params / tp / fl) * 1e3
    return layers + head + _comm_ms(m, tp, batch)


def step_ms(m: ModelShape, hw: Hardware, cal: Calibration, tp: int, batch: int, ctx: int) -> float:
    return cal.fixed_ms + cal.per_request_ms * batch + _core_ms(m, hw, cal.bw_eff, tp, batch, ctx)


def calibrate(hw: Hardware = Hardware(), m: ModelShape = LLAMA_31_8B) -> Calibration:
    """``fixed`` and ``bw_eff`` by least squares on the batch-1 points; ``per_request`` from the growth."""
    # at batch 1 every layer is memory-bound: step - comm = fixed + (bytes read / HBM) x (1 / bw_eff)
    rows, ys = [], []
    for tp, ms in BATCH1_POINTS:
        reads_ms = _core_ms(m, hw, 1.0, tp, 1, REF_CONTEXT) - _comm_ms(m, tp, 1)
        rows.append((1.0, reads_ms))
        ys.append(ms - _comm_ms(m, tp, 1))
    (fixed, inv_eff), *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(ys), rcond=None)
    bw_eff = 1.0 / float(inv_eff)
    (t1, b1, y1), (t2, b2, y2) = BATCH_GROWTH
    grow = (y2 - y1) - (
        _core_ms(m, hw, bw_eff, t2, b2, REF_CONTEXT) - _core_ms(m, hw, bw_eff, t1, b1, REF_CONTEXT)
    )
    cal = Calibration(float(fixed), max(0.0, grow / (b2 - b1)), bw_eff, ())
    residual = tuple(round(step_ms(m, hw, cal, tp, 1, REF_CONTEXT) - ms, 4) for tp, ms in BATCH1_POINTS)
    return Calibration(cal.fixed_ms, cal.per_request_ms, cal.bw_eff, residual)


def kv_capacity(m: ModelShape, hw: Hardware = Hardware()) -> KVCapacity:
    tps = tuple(Layout.parse(s).tp for s in LAYOUTS)
    return KVCapacity.from_memory(
        m,
        2,
        tps,
        gpu_bytes=hw.gpu_bytes,
        fraction=hw.mem_fraction,
        weight_bytes=weight_bytes(m),
        reserve_bytes=hw.reserve_bytes,
    )


def cost_model(m: ModelShape, hw: Hardware, cal: Calibration, world: int = 8) -> CostModel:
    weights = weight_bytes(m)
    link = hw.nvlink_bytes_s * hw.nvlink_eff
    hbm = hw.hbm_bytes_s * cal.bw_eff
    # prefill: 2 flops per parameter per token + attention over a mean context of PREFILL_CONTEXT tokens
    prefill_flops_per_token = 2 * weights / 2 + 4 * PREFILL_CONTEXT * m.num_layers * m.num_heads * m.head_dim
    pool = hw.gpu_bytes * hw.mem_fraction - weights / world - hw.reserve_bytes  # the largest pool (TP8)
    return CostModel(
        migrate_bytes_per_ms=world * link / 1e3,  # pod aggregate: every rank sends at once
        migrate_fixed_ms=5.0,
        recompute_tokens_per_ms=world * hw.peak_flops * 0.5 / prefill_flops_per_token / 1e3,
        recompute_fixed_ms=20.0,
        reshard_grow_ms=round(weights / 2 / hbm * 1e3 + 1.0, 1),  # local slice copy
        reshard_shrink_ms=round(weights * (1 - 1 / world) / link * 1e3 + 2.0, 1),  # all_gather TP8 -> TP1
        sync_ms=10.0,
        graph_capture_ms=GRAPH_SIZES_AT_SWITCH * GRAPH_CAPTURE_MS_PER_SIZE,
        kv_pool_ms=round(pool / hbm * 1e3, 1),  # the new pool written once at HBM speed
    )


def build(m: ModelShape, name: str, hw: Hardware = Hardware(), world: int = 8) -> Profile:
    cal = calibrate(hw)
    points = [
        StepPoint(lay.replicas, lay.tp, b, c, round(step_ms(m, hw, cal, lay.tp, b, c), 4))
        for lay in (Layout.parse(s) for s in LAYOUTS)
        for b in BATCHES
        for c in CONTEXTS
    ]
    costs = cost_model(m, hw, cal, world)
    kv = m.kv_bytes_per_token(2)
    reconfig = []
    for src, dst, tokens in (("8x1", "4x2", 2_000_000), ("4x2", "1x8", 500_000), ("2x4", "4x2", 500_000)):
        ts, td = Layout.parse(src).tp, Layout.parse(dst).tp
        moved = int(tokens * kv * (1 - min(ts, td) / max(ts, td)))
        mig, rec = costs.kv_ms(moved, tokens)
        reconfig.append(
            ReconfigPoint(src, dst, "migrate", tokens, moved, round(costs.base_ms(ts, td) + mig, 3))
        )
        reconfig.append(
            ReconfigPoint(src, dst, "recompute", tokens, 0, round(costs.base_ms(ts, td) + rec, 3))
        )
    return Profile(
        name=name,
        model=m,
        engine="vllm/sglang-like (modelled)",
        device_kind="cuda",
        device_count=world,
        device_name=hw.name,
        dtype="bfloat16",
        method="modelled",
        step_latency=points,
        reconfig_cost=reconfig,
        costs=costs,
        kv_capacity=kv_capacity(m, hw),
        provenance={
            "measured": [],
            "modelled": ["step_latency", "reconfig_cost", "costs", "kv_capacity"],
            "notes": (
                "Every number is modelled from published figures (profiles/README.md), never measured: "
                "roofline decode step (HBM 3.35 TB/s, flops, all-reduce table) with fixed overhead and HBM "
                "efficiency fitted to vLLM H100 Llama-3-8B batch-1 steps TP1/2/4/8 7.05/4.90/3.54/2.92 ms, "
                f"per-request cost from SGLang TP1 batch 1 -> 128 (7.4 -> 11.8 ms), context {REF_CONTEXT}; "
                "KV capacity from 81,559 MiB x 0.9 - weights / T - 2 GiB."
            ),
            "hardware": asdict(hw),
            "calibration": asdict(cal),
            "command": "python -m rollout_profiler.profiling.modelled profiles/",
        },
    )


SHIPPED = {
    "llama-3.1-8b-h100x8-modelled.json": (LLAMA_31_8B, "llama-3.1-8b-h100x8-modelled"),
    "qwen3-14b-h100x8-modelled.json": (QWEN3_14B, "qwen3-14b-h100x8-modelled"),
}


def write_all(out_dir: str | Path, created: str = "2026-11-22T00:00:00+00:00") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fname, (shape, name) in SHIPPED.items():
        prof = build(shape, name)
        prof.created = created  # fixed so that regenerating gives identical files
        prof.to_json(out / fname)
        paths.append(out / fname)
    return paths


if __name__ == "__main__":
    for p in write_all(sys.argv[1] if len(sys.argv) > 1 else "profiles"):
        sys.stdout.write(f"wrote {p}\n")
