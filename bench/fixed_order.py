"""The row-parallel chunk products on CPU, one thread: the fixed-order kernel (``engine.native``) against the
MKL chunk products it replaces (the batched ``sgemm`` form ``chunk_kernel`` picks without it) and against
the default kernels' whole product (oneDNN on a packed weight, not invariant), float32. The weights are
``small``'s and SmolLM2-135M's attention output and MLP down, in their fixed chunks; 30 layers' worth are
cycled, so each call reads its weight from memory as a decode step does. Each point is the median of
``runs`` runs of 30 calls per kernel, the kernels alternated within a run. Prints a table, writes JSON.
Usage (repository root): .venv/bin/python bench/fixed_order.py [--tokens 1,4,16,64] [--runs 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from rollout_worker.engine import invariant, native, packed

LAYERS = 30
# name: (outputs, inputs, chunks), as RowChunks cuts them for an engine of 2 ranks
SHAPES = {
    "small attn_out": (512, 512, 8),
    "small mlp_down": (512, 1536, 8),
    "smollm2 attn_out": (576, 576, 9),
    "smollm2 mlp_down": (576, 1536, 8),
}


def per_call_us(fn: Callable[[int], object]) -> float:
    t0 = time.perf_counter()
    for layer in range(LAYERS):
        fn(layer)
    return (time.perf_counter() - t0) / LAYERS * 1e6


def kernels_of(
    x: torch.Tensor,
    whole: list[torch.Tensor],
    mkl: list[invariant.ChunkedWeight],
    fixed: list[invariant.ChunkedWeight],
    chunks: invariant.Chunks,
) -> dict[str, Callable[[int], object]]:
    """Each kernel's product of x by layer i's weight."""
    return {
        "onednn_whole": lambda i: packed.linear(x, whole[i], None),
        "mkl_chunks": lambda i: invariant.partials(x, mkl[i], chunks),
        "fixed_order": lambda i: invariant.partials(x, fixed[i], chunks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native.kernels() is None:
        raise SystemExit("the fixed-order kernel does not build here (it needs AVX-512 and a C++ compiler)")
    gen = torch.Generator().manual_seed(0)
    points = []
    print("per call, us (median of runs); ratios: the others' time over the fixed-order kernel's")
    head = ("weight", "tokens", "oneDNN whole", "MKL chunks", "fixed order")
    print("{:18s} {:>6s} {:>12s} {:>10s} {:>11s}  vs oneDNN  vs MKL".format(*head))
    for name, (out, k, n) in SHAPES.items():
        chunks = invariant.Chunks(k // n, (n,), 0)
        ws = [torch.randn(out, k, generator=gen) for _ in range(LAYERS)]
        whole = [packed.pack(w) for w in ws]
        mkl = [invariant.row_weight(w, chunks, copies=False) for w in ws]
        fixed = [invariant.row_weight(w, chunks, "native") for w in ws]
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, k, generator=gen)
            kernels = kernels_of(x, whole, mkl, fixed, chunks)
            for fn in kernels.values():  # warm up
                fn(0)
            runs: dict[str, list[float]] = {key: [] for key in kernels}
            for _ in range(args.runs):
                for key, fn in kernels.items():
                    runs[key].append(per_call_us(fn))
            med = {key: statistics.median(v) for key, v in runs.items()}
            points.append({"weight": name, "tokens": tokens, "median_us": med, "runs_us": runs,
                           "mkl_kernel": mkl[0].kernel})  # fmt: skip
            d, m, f = med["onednn_whole"], med["mkl_chunks"], med["fixed_order"]
            print(f"{name:18s} {tokens:6d} {d:12.1f} {m:10.1f} {f:11.1f}  {d / f:8.2f}x {m / f:6.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"layers": LAYERS, "runs": args.runs, "points": points}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
