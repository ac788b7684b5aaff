"""Modelled (never measured) profiles: a roofline-style decode-step model of one H100 pod.

Every number here comes from published figures (``shared/notes/field.md``), not from a measurement:
H100 bf16 ~790 TFLOP/s dense, HBM ~3 TB/s, NVLink ~450 GB/s per direction, all-reduce 4-8 us for small
messages and 20-34 us at 1 MB, two all-reduces per layer per step, and three SGLang decode points for
Llama-3-8B (TP1 bs1 7.4 ms, TP1 bs128 11.8 ms, TP8 bs1 3.4 ms).

Step latency of one replica (TP ``t``, batch ``b``, mean context ``c``)::

    step = fixed + per_request * b + L * max(mem_layer, flops_layer, layer_floor) + lm_head + 2 L allreduce

* ``mem_layer``: (layer weights / t + b * c * KV bytes per token per layer / t) / (HBM * bw_eff)
* ``flops_layer``: (2 b layer params + 4 b c q_dim) / t / (peak * flops_eff)
* ``allreduce(t, m)``: piecewise linear in the message ``m = b * hidden * 2`` bytes through
  (0, small_us(t)) and (1 MB, one_mb_us(t)), then at the NVLink bus rate; 0 for t = 1
* ``fixed``, ``per_request`` (scheduler/sampling, not sharded) and ``layer_floor`` (kernel-latency
  floor per layer, dominant at TP8 bs1) are *calibrated* so that the three published Llama points are
  reproduced at an assumed context of 512 tokens (the published context is not given; at 1,024 tokens
  the KV reads alone would exceed 11.8 ms at bs128). Qwen3-14B reuses the same calibration constants.

Regenerate the shipped files: ``python -m rollout_profiler.profiling.modelled profiles/``.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from rollout_worker.api.layout import Layout

from rollout_profiler.profile import CostModel, ModelShape, Profile, ReconfigPoint, StepPoint

MB = 1 << 20
LAYOUTS = ("8x1", "4x2", "2x4", "1x8")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384)
REF_CONTEXT = 512
PREFILL_CONTEXT = 4096  # mean context assumed when pricing a re-prefill (recompute)
# (tp, batch, ms) published SGLang decode points for Llama-3-8B (field.md)
REFERENCE_POINTS = ((1, 1, 7.4), (1, 128, 11.8), (8, 1, 3.4))


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str = "H100 SXM 80GB"
    peak_flops: float = 790e12
    hbm_bytes_s: float = 3.0e12
    nvlink_bytes_s: float = 450e9
    bw_eff: float = 0.85  # achievable share of HBM bandwidth for streaming weights/KV
    flops_eff: float = 0.6
    ar_small_us: tuple[tuple[int, float], ...] = ((2, 4.0), (4, 6.0), (8, 8.0))
    ar_1mb_us: tuple[tuple[int, float], ...] = ((2, 20.0), (4, 27.0), (8, 34.0))
    nvlink_eff: float = 0.6  # share of NVLink for KV migration / large all-reduce


@dataclass(frozen=True, slots=True)
class Calibration:
    fixed_ms: float
    per_request_ms: float
    layer_floor_ms: float


LLAMA_31_8B = ModelShape("Llama-3.1-8B", "LlamaForCausalLM", 4096, 32, 32, 8, 128, 14336, 128256)
QWEN3_14B = ModelShape("Qwen3-14B", "Qwen3ForCausalLM", 5120, 40, 40, 8, 128, 17408, 151936)


def _layer_params(m: ModelShape) -> float:
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    return float(attn + 3 * m.hidden_size * m.intermediate_size)


def allreduce_ms(hw: Hardware, tp: int, nbytes: float) -> float:
    if tp <= 1:
        return 0.0
    small, one = dict(hw.ar_small_us).get(tp), dict(hw.ar_1mb_us).get(tp)
    if small is None or one is None:
        small, one = 8.0 * tp / 8, 34.0 * tp / 8
    if nbytes <= MB:
        return (small + (one - small) * nbytes / MB) / 1e3
    bus = 2 * (tp - 1) / tp * (nbytes - MB)
    return one / 1e3 + bus / (hw.nvlink_bytes_s * hw.nvlink_eff) * 1e3


def _core_ms(m: ModelShape, hw: Hardware, tp: int, batch: int, ctx: int, floor_ms: float) -> float:
    """Everything but ``fixed`` and ``per_request``: layers, LM head, all-reduces."""
    kv_shards = min(tp, m.num_kv_heads)
    bw = hw.hbm_bytes_s * hw.bw_eff
    fl = hw.peak_flops * hw.flops_eff
    kv_layer = m.num_kv_heads * m.head_dim * 2 * 2  # K and V, bf16, per token per layer
    mem = (_layer_params(m) * 2 / tp + batch * ctx * kv_layer / kv_shards) / bw
    flops = (2 * batch * _layer_params(m) + 4 * batch * ctx * m.num_heads * m.head_dim) / tp / fl
    layers = m.num_layers * max(mem * 1e3, flops * 1e3, floor_ms)
    head_params = m.vocab_size * m.hidden_size
    head = max(head_params * 2 / tp / bw, 2 * batch * head_params / tp / fl) * 1e3
    comm = 2 * m.num_layers * allreduce_ms(hw, tp, batch * m.hidden_size * 2)
    return layers + head + comm


def step_ms(m: ModelShape, hw: Hardware, cal: Calibration, tp: int, batch: int, ctx: int) -> float:
    return cal.fixed_ms + cal.per_request_ms * batch + _core_ms(m, hw, tp, batch, ctx, cal.layer_floor_ms)


def calibrate(hw: Hardware = Hardware(), m: ModelShape = LLAMA_31_8B) -> Calibration:
    """Solve fixed, per_request and layer_floor from the three published points (exact at REF_CONTEXT)."""
    (t1, b1, y1), (t2, b2, y2), (t8, b8, y8) = REFERENCE_POINTS
    c1 = _core_ms(m, hw, t1, b1, REF_CONTEXT, 0.0)
    c2 = _core_ms(m, hw, t2, b2, REF_CONTEXT, 0.0)
    per_request = ((y2 - c2) - (y1 - c1)) / (b2 - b1)
    fixed = y1 - c1 - per_request * b1
    lo, hi = 0.0, y8  # bisection on the floor: step is monotone in it
    for _ in range(60):
        mid = (lo + hi) / 2
        if fixed + per_request * b8 + _core_ms(m, hw, t8, b8, REF_CONTEXT, mid) < y8:
            lo = mid
        else:
            hi = mid
    return Calibration(fixed_ms=fixed, per_request_ms=per_request, layer_floor_ms=(lo + hi) / 2)


def cost_model(m: ModelShape, hw: Hardware, world: int = 8) -> CostModel:
    weights = (_layer_params(m) * m.num_layers + 2 * m.vocab_size * m.hidden_size) * 2
    link = hw.nvlink_bytes_s * hw.nvlink_eff
    # prefill: 2 flops per parameter per token + attention over a mean context of PREFILL_CONTEXT tokens
    prefill_flops_per_token = 2 * weights / 2 + 4 * PREFILL_CONTEXT * m.num_layers * m.num_heads * m.head_dim
    return CostModel(
        migrate_bytes_per_ms=world * link / 1e3,  # pod aggregate: every rank sends at once
        migrate_fixed_ms=5.0,
        recompute_tokens_per_ms=world * hw.peak_flops * 0.5 / prefill_flops_per_token / 1e3,
        recompute_fixed_ms=20.0,
        reshard_grow_ms=round(weights / 2 / (hw.hbm_bytes_s * hw.bw_eff) * 1e3 + 1.0, 1),  # local slice copy
        reshard_shrink_ms=round(weights * (1 - 1 / world) / link * 1e3 + 2.0, 1),  # all_gather TP8 -> TP1
        sync_ms=10.0,
    )


def build(m: ModelShape, name: str, hw: Hardware = Hardware(), world: int = 8) -> Profile:
    cal = calibrate(hw)
    points = [
        StepPoint(lay.replicas, lay.tp, b, c, round(step_ms(m, hw, cal, lay.tp, b, c), 4))
        for lay in (Layout.parse(s) for s in LAYOUTS)
        for b in BATCHES
        for c in CONTEXTS
    ]
    costs = cost_model(m, hw, world)
    kv = m.kv_bytes_per_token(2)
    reconfig = []
    for src, dst, tokens in (("8x1", "4x2", 2_000_000), ("4x2", "1x8", 500_000), ("2x4", "4x2", 500_000)):
        ts, td = Layout.parse(src).tp, Layout.parse(dst).tp
        moved = int(tokens * kv * (1 - min(ts, td) / max(ts, td)))
        reshard = costs.reshard_grow_ms if td > ts else costs.reshard_shrink_ms
        ms_mig = costs.sync_ms + reshard + costs.migrate_fixed_ms + moved / costs.migrate_bytes_per_ms
        ms_rec = costs.sync_ms + reshard + costs.recompute_fixed_ms + tokens / costs.recompute_tokens_per_ms
        reconfig.append(ReconfigPoint(src, dst, "migrate", tokens, moved, round(ms_mig, 3)))
        reconfig.append(ReconfigPoint(src, dst, "recompute", tokens, 0, round(ms_rec, 3)))
    return Profile(
        name=name,
        model=m,
        engine="sglang (modelled)",
        device_kind="cuda",
        device_count=world,
        device_name=hw.name,
        dtype="bfloat16",
        method="modelled",
        step_latency=points,
        reconfig_cost=reconfig,
        costs=costs,
        provenance={
            "measured": [],
            "modelled": ["step_latency", "reconfig_cost", "costs"],
            "notes": (
                "Every number is modelled from published figures (shared/notes/field.md), never measured: "
                "roofline decode step (HBM/flops/kernel floor + 2 all-reduces per layer) calibrated to "
                "SGLang "
                f"Llama-3-8B TP1 bs1 7.4 ms, TP1 bs128 11.8 ms, TP8 bs1 3.4 ms at an assumed context of "
                f"{REF_CONTEXT}; costs from NVLink/HBM/flops rates."
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


def write_all(out_dir: str | Path, created: str = "2026-11-21T00:00:00+00:00") -> list[Path]:
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
