"""The default kernels' products on CPU: MKL's ``sgemm`` (``F.linear``) against oneDNN over weights packed
once (``rollout_worker.engine.kernels.packed_linear``), one thread, float32, on the projections of a preset's
layer and
its logits. Each point is the median of ``runs`` runs (each the mean of many calls, both kernels
alternated in the same run). Also says whether the two agree with a float64 reference equally well.
Prints a table and writes JSON.
Usage (repository root): .venv/bin/python bench/packed_linear.py [--preset small] [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels import packed_linear
from rollout_worker.engine.model.presets import preset_config

ROWS = (1, 4, 16, 64)


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of one layer's projections and the logits."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "q": (cfg.num_heads * hd, h),
        "k/v": (cfg.num_kv_heads * hd, h),
        "o": (h, cfg.num_heads * hd),
        "gate/up": (i, h),
        "down": (h, i),
        "logits": (cfg.vocab_size, h),
    }


def mean_ms(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not packed_linear.available():
        raise SystemExit("this torch has no oneDNN packed linear")
    torch.set_num_threads(1)
    cfg = ModelConfig.from_dict(preset_config(args.preset))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (out, k) in shapes(cfg).items():
        w = torch.randn(out, k, generator=gen) / k**0.5
        t0 = time.perf_counter()
        wp = packed_linear.pack(w)
        pack_ms = (time.perf_counter() - t0) * 1e3
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            ref = x.double() @ w.double().T
            err = [
                float((y.double() - ref).abs().max()) for y in (F.linear(x, w), packed_linear.linear(x, wp))
            ]
            ours, theirs = partial(packed_linear.linear, x, wp), partial(F.linear, x, w)
            runs = [(mean_ms(theirs), mean_ms(ours)) for _ in range(args.runs)]
            sgemm, onednn = (statistics.median(r[j] for r in runs) for j in (0, 1))
            rows.append({
                "product": name, "out": out, "in": k, "rows": m, "sgemm_ms": sgemm, "packed_ms": onednn,
                "speedup": sgemm / onednn, "max_err_sgemm": err[0], "max_err_packed": err[1],
                "pack_ms": pack_ms, "runs": [list(r) for r in runs],
            })  # fmt: skip
    print(f"preset {args.preset}, float32, 1 thread, median of {args.runs} runs")
    print("| product | out x in | rows | sgemm ms | packed ms | speed-up | max error sgemm / packed |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['product']} | {r['out']} x {r['in']} | {r['rows']} | {r['sgemm_ms']:.3f} | "
            f"{r['packed_ms']:.3f} | {r['speedup']:.2f}x | "
            f"{r['max_err_sgemm']:.1e} / {r['max_err_packed']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "runs": args.runs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
