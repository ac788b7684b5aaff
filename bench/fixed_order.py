"""The deterministic products on CPU, one thread: the fixed-order kernel (``engine.native``) in both its forms
against the MKL products it replaces (without it: the row-parallel chunks' batched ``sgemm`` form
``chunk_kernel`` picks, the one-chunk products padded to their row rule) and against the default kernels'
whole product (not invariant), float32.

Two sets of weights, as a decoder holds them. ``--shapes small``: ``small``'s and SmolLM2-135M's attention
output and MLP down in their fixed chunks, which an engine packs (the default's product is oneDNN's on a
packed copy; the fixed-order kernel's packed form, and its dense form for comparison); 30 layers' worth are
cycled, so each call reads its weight from memory as a decode step does. ``--shapes medium``: ``medium``'s
q and gate projections (one chunk) and its attention output and MLP down (8 chunks), which an engine does
not pack (the default's product is MKL's ``sgemm``; the fixed-order kernel's dense form); each weight is
larger than the caches, 2 layers cycled. Each point is the median of ``runs`` runs of the layers' calls per
kernel, the kernels alternated within a run. Prints a table, writes JSON.
``--isa avx2`` runs the kernel's AVX2 build where the CPU runs the AVX-512 one (the same bits, other tiles).
Usage (repository root): .venv/bin/python bench/fixed_order.py [--shapes small|medium] [--tokens 1,4,16,64]
[--runs 5] [--isa avx512|avx2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rollout_worker.engine.kernels import fixed_order, packed_linear, row_parallel, row_rules
from rollout_worker.engine.kernels.row_chunks import Chunks

# per set: its layers cycled, and name: (outputs, inputs, chunks), as RowChunks cuts them for 2 ranks
SHAPES: dict[str, tuple[int, dict[str, tuple[int, int, int]]]] = {
    "small": (
        30,
        {
            "small attn_out": (512, 512, 8),
            "small mlp_down": (512, 1536, 8),
            "smollm2 attn_out": (576, 576, 9),
            "smollm2 mlp_down": (576, 1536, 8),
        },
    ),
    "medium": (
        2,
        {
            "medium q": (4096, 4096, 1),
            "medium gate": (11008, 4096, 1),
            "medium attn_out": (4096, 4096, 8),
            "medium mlp_down": (4096, 11008, 8),
        },
    ),
}
Kernel = Callable[[int], object]  # layer i -> its product


def per_call_us(fn: Kernel, layers: int) -> float:
    t0 = time.perf_counter()
    for layer in range(layers):
        fn(layer)
    return (time.perf_counter() - t0) / layers * 1e6


def kernels_of(x: torch.Tensor, ws: list[torch.Tensor], n: int, packs: bool) -> dict[str, Kernel]:
    """Each kernel's product of x by layer i's weight: the default's whole product, the MKL form the
    deterministic kernels take without the fixed-order kernel, and the fixed-order kernel's forms (the one
    a decoder that ``packs`` takes last)."""
    chunks = Chunks(ws[0].shape[1] // n, (n,), 0)
    dense = [row_parallel.row_weight(w, chunks, "dense") for w in ws]
    whole = [packed_linear.pack(w) for w in ws] if packs else ws
    mkl: Kernel
    if n == 1:  # a one-chunk product: padded to its row rule
        one = row_rules.packed_linear if packs else row_rules.linear
        mkl = lambda i: one(x, whole[i])  # noqa: E731
    else:
        form = row_parallel.mkl_form(chunks.width, x.dtype)
        chunked = [row_parallel.row_weight(w, chunks, form) for w in ws]
        mkl = lambda i: row_parallel.partials(x, chunked[i], chunks)  # noqa: E731
    kernels: dict[str, Kernel] = {
        "default": (lambda i: packed_linear.linear(x, whole[i], None))
        if packs
        else (lambda i: F.linear(x, ws[i])),
        "mkl": mkl,
        "dense": lambda i: row_parallel.partials(x, dense[i], chunks),
    }
    if packs:
        fixed = [row_parallel.row_weight(w, chunks, "native") for w in ws]
        kernels["packed"] = lambda i: row_parallel.partials(x, fixed[i], chunks)
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="small")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--isa", choices=["avx512", "avx2"], help="the kernel's build (default: the CPU's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.isa:  # every caller reaches the kernel through fixed_order.kernels()
        built = fixed_order.build(args.isa)
        fixed_order.kernels = lambda: built  # type: ignore[method-assign]
    if fixed_order.kernels() is None:
        raise SystemExit("the fixed-order kernel does not build here (it needs AVX-512 or AVX2 and g++)")
    gen = torch.Generator().manual_seed(0)
    layers, shapes = SHAPES[args.shapes]
    packs = args.shapes == "small"
    taken = "packed" if packs else "dense"
    points = []
    default = "oneDNN (packed copy)" if packs else "MKL sgemm"
    print(f"per call, us (median of runs); default: {default}; ratios: the others' time over the fixed-order")
    print(f"kernel's form a decoder takes here ({taken})")
    cols = ["default", "mkl", "dense", *(["packed"] if packs else [])]
    print(f"{'weight':18s} {'tokens':>6s} " + " ".join(f"{c:>9s}" for c in cols) + "  vs default  vs MKL")
    for name, (out, k, n) in shapes.items():
        ws = [torch.randn(out, k, generator=gen) for _ in range(layers)]
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, k, generator=gen)
            kernels = kernels_of(x, ws, n, packs)
            for fn in kernels.values():  # warm up
                fn(0)
            runs: dict[str, list[float]] = {key: [] for key in kernels}
            for _ in range(args.runs):
                for key, fn in kernels.items():
                    runs[key].append(per_call_us(fn, layers))
            med = {key: statistics.median(v) for key, v in runs.items()}
            points.append({"weight": name, "tokens": tokens, "chunks": n, "median_us": med, "runs_us": runs})
            f = med[taken]
            row = " ".join(f"{med[c]:9.1f}" for c in cols)
            print(f"{name:18s} {tokens:6d} {row}  {med['default'] / f:9.2f}x {med['mkl'] / f:6.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            meta = {
                "shapes": args.shapes,
                "isa": fixed_order.kernels().isa,
                "layers": layers,
                "runs": args.runs,
            }
            json.dump({**meta, "points": points}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
