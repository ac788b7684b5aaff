"""Which of a decode step's kernels round a row differently by the batch it is in, on this GPU (issue 19).

For each kernel, the first row's result computed alone and among other rows (the shapes of Llama-3.1-8B's
layers, bfloat16), compared bitwise; the default torch kernel beside the deterministic one
(``rollout_worker.engine.kernels``: row_rules, row_parallel, tree_sums, deterministic_attention). Prints a
table and writes JSON.
Usage (repository root, on a GPU machine): python3 bench/cuda_invariance.py [OUT.json]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from rollout_worker.engine.kernels import deterministic_attention, row_parallel, row_rules, tree_sums
from rollout_worker.engine.kernels.row_chunks import Chunks

ROWS = (1, 2, 3, 4, 5, 8, 16, 31, 32, 63, 64, 128, 200, 256, 257, 512)
BATCHES = (1, 2, 3, 4, 7, 8, 16, 31, 64)


def differing(fn: Callable[[int], torch.Tensor], sizes: tuple[int, ...]) -> list[int]:
    """The sizes at which row 0 of ``fn(size)`` differs from row 0 at the largest size."""
    ref = fn(max(sizes))[0]
    return [n for n in sizes if not torch.equal(fn(n)[0], ref)]


def _rows_of(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor
) -> Callable[[int], torch.Tensor]:
    return lambda m: fn(x[:m], w)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], torch.Tensor], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / reps


def main(device: str = "cuda") -> None:
    dev, dt = torch.device(device), torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev, dtype=dt) * 0.05

    rows: list[dict[str, object]] = []

    def check(name: str, fn: Callable[[int], torch.Tensor], sizes: tuple[int, ...]) -> None:
        bad = differing(fn, sizes)
        rows.append({"kernel": name, "invariant": not bad, "differs_at": bad})
        print(f"{name:<44} {'yes' if not bad else 'NO':<4} {bad}", flush=True)

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}")
    print(f"{'kernel (row 0 alone and among others)':<44} {'same':<4} differs at")
    x = rand(max(ROWS), 14336)
    for k, n, what in (
        (4096, 6144, "qkv 4096->6144"),
        (4096, 28672, "gate/up 4096->28672"),
        (14336, 4096, "down"),
    ):
        w = rand(n, k)
        check(f"F.linear {what}", _rows_of(F.linear, x[:, :k], w), ROWS)
        check(f"invariant.linear {what}", _rows_of(row_rules.linear, x[:, :k], w), ROWS)
    w_down = rand(4096, 14336)
    chunks = Chunks(1792, (8,), 0)
    check(
        "invariant.partials down (8 x 1792)",
        lambda m: row_parallel.partials(x[:m], row_parallel.ChunkedWeight(w_down, "rows"), chunks).sum(0),
        ROWS,
    )
    h = rand(max(ROWS), 4096).float()
    check("mean(-1) of 4096", lambda m: h[:m].pow(2).mean(-1, keepdim=True), ROWS)
    check("invariant.mean_last of 4096", lambda m: tree_sums.mean_last(h[:m].pow(2)), ROWS)
    e = rand(max(BATCHES), 8, 4, 5, 128).float()
    check("sum(-1) of 128 (softmax chunks)", lambda b: e[:b].sum(-1), BATCHES)
    check("invariant.sum_last of 128", lambda b: tree_sums.sum_last(e[:b]), BATCHES)
    q, kk, vv = (
        rand(max(BATCHES), 1, 32, 128),
        rand(max(BATCHES), 8, 640, 128),
        rand(max(BATCHES), 8, 640, 128),
    )
    mask = torch.ones(max(BATCHES), 1, 1, 640, dtype=torch.bool, device=dev)
    mask[:, :, :, 600:] = False
    check(
        "matmul scores [B,8,4,128]x[B,8,128,640]",
        lambda b: torch.matmul(q[:b].view(b, 8, 4, 128), kk[:b].transpose(-1, -2)),
        BATCHES,
    )
    check(
        "invariant.attend (600 of 640 keys)",
        lambda b: deterministic_attention.attend(q[:b], kk[:b], vv[:b], mask[:b], 0.088),
        BATCHES,
    )
    check(
        "invariant.attend, keys 600 vs 640",
        lambda b: deterministic_attention.attend(
            q[:1],
            kk[:1, :, : 600 + (b % 2) * 40],
            vv[:1, :, : 600 + (b % 2) * 40],
            mask[:1, ..., : 600 + (b % 2) * 40],
            0.088,
        ),
        (1, 2),
    )
    cost = []
    print(f"\n{'product (ms)':<28} {'rows':>5} {'F.linear':>9} {'invariant':>9}")
    for k, n, what in ((4096, 28672, "gate/up 4096->28672"), (14336, 4096, "down")):
        w = rand(n, k)
        for m in (1, 16, 64, 256, 512):
            a = timed(partial(F.linear, x[:m, :k], w))
            b = timed(partial(row_rules.linear, x[:m, :k], w))
            cost.append({"product": what, "rows": m, "f_linear_ms": a, "invariant_ms": b})
            print(f"{what:<28} {m:>5} {a:>9.3f} {b:>9.3f}")
    out = {"device": name, "torch": torch.__version__, "kernels": rows, "cost": cost}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
