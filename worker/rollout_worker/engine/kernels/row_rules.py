"""The deterministic kernels' measured row rules, and the row-independent products padded to them.

A product whose rows are independent (every column-parallel and replicated projection, the logits) gives
a row the same bits in every product of enough rows, at any position and next to any other rows, and a
column the same bits in any slice of the weight's rows: on CPU a GEMM (MKL's sgemm, or oneDNN's product on
packed float32 weights, one thread per rank) takes another kernel with fewer rows (a row alone: gemv; a
few rows: a small-M kernel). How many rows are enough depends on the CPU, the kernel and K, so
:func:`least_rows` measures it on the machine, once per kernel, K and dtype, and :func:`linear` and
:func:`packed_linear` pad a smaller product to it. The fixed-order kernel
(:mod:`~rollout_worker.engine.kernels.fixed_order`, CPUs only) has a rule of 1 row by construction, which
:func:`native_rule` checks before the engine takes it.

On CUDA, cuBLAS chooses a GEMM kernel (tile shape, split-K) by the product's shape, so a row's rounding
follows the batch size: there every product runs in blocks of exactly ``CUDA_ROWS`` rows (padded with
zeros: one shape, one kernel; a decode batch of up to ``CUDA_ROWS`` rows costs what one row costs while
the weights' reads bound the step), and no CPU rule is measured.

Part of the ``deterministic`` setting (issue 19), with :mod:`~rollout_worker.engine.kernels.row_chunks`,
:mod:`~rollout_worker.engine.kernels.row_parallel`, :mod:`~rollout_worker.engine.kernels.tree_sums` and
:mod:`~rollout_worker.engine.kernels.deterministic_attention`;
:mod:`~rollout_worker.engine.kernels.choice` decides where each runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from rollout_worker.engine.kernels import fixed_order
from rollout_worker.engine.kernels import packed_linear as onednn
from rollout_worker.scheduling.pages import round_up

CUDA_ROWS = 128  # rows of every product on CUDA: one GEMM shape (still bound by the weights' reads)
KEY_CHUNK = 128  # keys per attention chunk (a multiple of the vector width: no scalar tail in exp)
# the row counts least_rows compares (the kernels seen switch below 16 rows; a prefill has hundreds)
PROBE_ROWS = (*range(1, 33), 48, 64, 128, 256)
PROBE_COLS = 64  # output columns of a probe (the row rule seen does not depend on them)

# the products whose row rule least_rows measures, each as its call site lays out its operands
Kernel = Literal["dense", "linear", "native", "packed", "partials", "rows", "scores", "values"]
ChunkKernel = Literal[
    "dense", "native", "partials", "rows"
]  # how a row-parallel weight's chunks are multiplied: see row_parallel.partials
Probe = Callable[[torch.Tensor], list[torch.Tensor]]  # a kernel's products of x, in each variant


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose rows are each bitwise independent of the rest of the batch: always 2-D products of
    at least :func:`least_rows` rows (:func:`padded_matrix`; a 3-D input that does not fold into 2-D by its
    strides would otherwise be multiplied as a batch of 1-row products)."""
    return _padded_product(F.linear, "linear", x, w, b)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` on a weight packed for oneDNN (:func:`onednn.pack`, float32 on CPU)."""
    return _padded_product(onednn.linear, "packed", x, w, b)


def _padded_product(
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    kernel: Kernel,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
) -> torch.Tensor:
    """``product(x, w, b)`` over :func:`padded_matrix`'s padded 2-D matrix (in row blocks on CUDA), cut back
    to x's rows."""
    if x.numel() == 0:
        return product(x, w, b)
    flat, rows = padded_matrix(x, kernel)
    out = cat([product(block, w, b) for block in row_blocks(flat)], 0)
    return out[:rows].reshape(*x.shape[:-1], w.shape[0])


@functools.cache
def least_rows(kernel: Kernel, k: int, dtype: torch.dtype) -> int:
    """The fewest rows from which ``kernel`` computes a row of a product over ``k`` the same way in every
    product of as many rows or more, at any position, on this machine's CPU (one thread). Measured once per
    process (milliseconds; about 0.2 s at K = 4096): a fixed row, first and last among each count of
    :data:`PROBE_ROWS` rows, in each of the call site's variants (:func:`_probe`: e.g. a batch of 1, 2 or
    3 chunks), which must all agree; the answer is the smallest count from which every larger count gives
    that row the same bits. A kernel whose row still changes at the largest count has no such rule: that
    is an error, not a guess."""
    gen = torch.Generator().manual_seed(k)
    probe = _probe(kernel, k, dtype, gen)
    row = torch.randn(k, generator=gen, dtype=torch.float64).to(dtype)
    seen: list[bytes | None] = []  # per count: the row's bits, None where its positions or variants differ
    for count in PROBE_ROWS:
        x = torch.randn(count, k, generator=gen, dtype=torch.float64).to(dtype)
        x[0] = x[-1] = row
        bits = {out[at].float().numpy().tobytes() for out in probe(x) for at in (0, -1)}
        seen.append(bits.pop() if len(bits) == 1 else None)
    stable = len(seen)
    while stable > 0 and seen[stable - 1] == seen[-1] and seen[-1] is not None:
        stable -= 1
    if stable == len(seen) or PROBE_ROWS[stable] == PROBE_ROWS[-1]:
        raise RuntimeError(
            f"deterministic kernels: this CPU's {kernel} product over K={k} ({dtype}) computes a row "
            f"differently with every row count up to {PROBE_ROWS[-1]}; run without --deterministic"
        )
    return PROBE_ROWS[stable]


def _probe(kernel: Kernel, k: int, dtype: torch.dtype, gen: torch.Generator) -> Probe:
    """x [rows, k] -> its products [rows, cols] as ``kernel``'s call site computes them, its operands laid
    out as there (a transposed view, a permuted weight, a batch of products), in each variant the call site
    may run (:func:`~rollout_worker.engine.kernels.row_parallel.partials`: a chunk alone, or among 2 or 3
    in one batched product)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    if kernel == "linear":
        w = rand(PROBE_COLS, k)
        return lambda x: [F.linear(x, w)]
    if kernel == "packed":  # x itself, and as a strided view at an offset (no longer 64-byte aligned)
        pw = onednn.pack(rand(PROBE_COLS, k))
        return lambda x: [onednn.linear(v, pw, None) for v in (x, _strided(x))]
    if kernel in ("partials", "rows"):  # partials' batched products: chunk c of width k of 1 to 3 in one
        w = rand(PROBE_COLS, k)
        return lambda x: [chunk_products(kernel, w.repeat(1, n), x.repeat(1, n), n)[-1] for n in (1, 2, 3)]
    if kernel == "native":  # the last of 1 to 3 chunks, each packed with the others
        w = rand(PROBE_COLS, k)
        packs = {n: fixed_order.pack(w.repeat(1, n), n) for n in (1, 2, 3)}
        return lambda x: [fixed_order.partials(x.repeat(1, n), packs[n])[-1] for n in (1, 2, 3)]
    if kernel == "dense":  # the last of 1 to 3 chunks of a weight as it is, and of a view of a wider one
        w = rand(PROBE_COLS, k)
        wides = {n: _strided(w.repeat(1, n)) for n in (1, 2, 3)}
        return lambda x: [
            fixed_order.partials(x.repeat(1, n), v, n)[-1]
            for n in (1, 2, 3)
            for v in (w.repeat(1, n), wides[n])
        ]
    if kernel == "scores":  # attention's q [B, KVh, rows, hd] @ keys_t [B, KVh, hd, L], a wider one's slice
        keys_t = rand(1, 2, k, 2 * KEY_CHUNK)[..., :KEY_CHUNK]
        return lambda x: [torch.matmul(torch.stack((x, x))[None], keys_t)[0, 1]]
    # values: deterministic_attention's product of one chunk, a slice of exp(scores) [B * KVh, rows, L] @
    # vals [B * KVh, L, hd]
    vals = rand(2, 2 * k, PROBE_COLS)
    return lambda x: [torch.bmm(torch.stack((torch.cat((x, x), 1),) * 2)[:, :, k:], vals[:, k:])[1]]


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] as a view of a wider matrix, at an offset of one element (no longer 64-byte aligned)."""
    wide = x.new_zeros(x.shape[0], 3 * x.shape[1])
    wide[:, 1 : 1 + x.shape[1]] = x
    return wide[:, 1 : 1 + x.shape[1]]


def chunk_products(kernel: ChunkKernel, dense: torch.Tensor, flat: torch.Tensor, n: int) -> torch.Tensor:
    """[n, rows, out]: each of ``n`` equal chunks' product of flat [rows, K] and dense [out, K], in one
    batched product over strided views of both (no copy of the weight). ``partials``: each chunk's
    ``w_c @ x_c^T``, read back transposed (the chunk's ``out`` rows, the same in every batch, are the
    product's rows, so the tokens' rule is the columns'); ``rows``: each chunk's ``x_c @ w_c^T``."""
    out, width = dense.shape[0], flat.shape[1] // n
    xc = flat.view(flat.shape[0], n, width).transpose(0, 1)  # [n, rows, width]
    if kernel == "rows":
        return torch.bmm(xc, dense.view(out, n, width).permute(1, 2, 0))
    xt = xc.transpose(1, 2).contiguous()  # [n, width, rows]
    return torch.bmm(dense.view(out, n, width).transpose(0, 1), xt).transpose(1, 2)


def padded_rows(rows: int, cuda: bool, least: int) -> int:
    """The rows a product of ``rows`` rows is computed with: at least ``least`` on CPU (the kernel's
    :func:`least_rows`); a multiple of ``CUDA_ROWS`` on CUDA."""
    if cuda:
        return max(round_up(rows, CUDA_ROWS), CUDA_ROWS)
    return max(rows, least)


def padded_matrix(x: torch.Tensor, kernel: Kernel, k: int | None = None) -> tuple[torch.Tensor, int]:
    """x [*rows, K] as one 2-D matrix of :func:`padded_rows` rows for ``kernel``'s products over ``k``
    (default K; a chunk's width for :func:`~rollout_worker.engine.kernels.row_parallel.partials`), zeros
    appended; and its row count."""
    width = x.shape[-1]
    rows = x.numel() // width
    flat = x.reshape(rows, width)
    want = padded_rows(rows, x.is_cuda, 0 if x.is_cuda else least_rows(kernel, k or width, x.dtype))
    return pad_rows(flat, want), rows


def pad_rows(flat: torch.Tensor, want: int) -> torch.Tensor:
    """flat [rows, K] with rows of zeros appended up to ``want`` rows."""
    if want <= flat.shape[0]:
        return flat
    return torch.cat((flat, flat.new_zeros(want - flat.shape[0], flat.shape[1])))


def row_blocks(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The row blocks a padded matrix is multiplied in: ``CUDA_ROWS`` each on CUDA, the whole on CPU."""
    return flat.split(CUDA_ROWS) if flat.is_cuda else (flat,)


def cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``parts`` joined along ``dim`` (a single part as it is, not copied)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def native_rule(k: int, dtype: torch.dtype, copies: bool = True) -> bool:
    """Whether products over ``k`` run on the fixed-order kernel
    (:mod:`~rollout_worker.engine.kernels.fixed_order`), over a packed copy (``copies``) or over the weight
    as it is: float32, built on this CPU, and measured to have the rule it is built for, 1 row."""
    if dtype != torch.float32 or fixed_order.kernels() is None:
        return False
    return least_rows("native" if copies else "dense", k, dtype) == 1
