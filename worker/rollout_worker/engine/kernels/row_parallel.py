"""The deterministic kernels' row-parallel products: each fixed chunk's partial product on its own.

A row-parallel weight's chunks (:mod:`~rollout_worker.engine.kernels.row_chunks`) are multiplied as
:func:`chunk_kernel` chooses once per chunk width, a rule of the machine and the engine's
``packed_weights``, the same on every layout and batch:

- on a CPU that builds the fixed-order kernel (:mod:`~rollout_worker.engine.kernels.fixed_order`), on it:
  any number of tokens as they are, over a packed copy (``native``) or over the weight as it is
  (``dense``); this is what makes the deterministic setting nearly free on CPUs;
- on other CPUs, in one batched MKL product over every chunk, the tokens as its columns or its rows
  (whichever form's measured row rule pads a decode step to fewer tokens), and for a few tokens as
  columns one MKL product over the stacked chunks that computes the same bits (:func:`fuse`);
- on CUDA, in that batched product with the tokens as its rows, in fixed row blocks
  (:data:`~rollout_worker.engine.kernels.row_rules.CUDA_ROWS`): torch's own products in fixed shapes.

:func:`chunked_product` then adds the partials up the fixed tree across the shards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from rollout_worker.engine.kernels import fixed_order, packed_linear
from rollout_worker.engine.kernels import row_rules as rules
from rollout_worker.engine.kernels.row_chunks import Chunks, gathered_sum, shard_sums
from rollout_worker.engine.kernels.row_rules import ChunkKernel
from rollout_worker.engine.kernels.tree_sums import tree_sum

# the most rows a stacked chunk product (fuse) runs: its arithmetic grows with the chunks' square
FUSED_ROWS = 32


class Collectives(Protocol):
    """What :func:`chunked_product` needs of a TP group (the model's ``ParallelState``)."""

    @property
    def tp(self) -> int: ...

    def all_gather_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...


def chunked_product(x: torch.Tensor, w: ChunkedWeight, chunks: Chunks, group: Collectives) -> torch.Tensor:
    """The full product of a row-parallel projection: its fixed chunks' partials added in one fixed tree,
    each shard's whole subtrees before the all-gather (SmolLM2's 9 attention chunks at TP 2: 2 + 3 sums,
    not 5 + 4)."""
    parts = partials(x, w, chunks)
    if group.tp == 1:
        return tree_sum(parts)
    mine = shard_sums(parts, chunks)  # each shard adds its whole subtrees of the tree first
    everyone = group.all_gather_cat(mine, dim=0).split(mine.shape[0])
    return gathered_sum(list(everyone), chunks)


@dataclass(frozen=True, slots=True)
class ChunkedWeight:
    """A row-parallel weight as the deterministic kernels read it (:func:`row_weight`): the shard's dense
    weight [out, K_shard] (the batched products read its chunks as strided views), the kernel
    :func:`partials` runs (:func:`chunk_kernel`), for ``partials`` the chunks packed for MKL as one
    stacked matrix for a few tokens (:func:`fuse`), and for ``native`` the chunks in the fixed-order
    kernel's blocks (:func:`~rollout_worker.engine.kernels.fixed_order.pack`)."""

    dense: torch.Tensor
    kernel: ChunkKernel
    fused: packed_linear.MklPacked | None = None
    blocks: fixed_order.Packed | None = None


def chunk_kernel(width: int, dtype: torch.dtype, copies: bool = True) -> ChunkKernel:
    """How a decoder multiplies its row-parallel chunks of ``width`` on this CPU (the same on every layout
    and batch: a rule of the machine, and of the engine's ``packed_weights``).

    Float32 chunks run on the fixed-order kernel (:mod:`~rollout_worker.engine.kernels.fixed_order`) where
    this CPU builds it and it measures a rule of 1 row (by construction; measured all the same):
    ``native``, over a copy in its blocks, where ``copies`` says the decoder may hold a copy of the weights
    in a kernel's own layout (it packs, :func:`~rollout_worker.engine.kernels.packed_linear.wanted`); else
    ``dense``, over the weight as it is. Else in the batched MKL product
    (:func:`~rollout_worker.engine.kernels.row_rules.chunk_products`) whose form pads a decode step to
    fewer tokens; on a tie the tokens as columns (``partials``, with :func:`fuse`'s stacked product for a
    few tokens, which computes the same bits). Which form wins is the CPU's: the columns on some (2 tokens,
    where the rows need 9 for a chunk of 192), the rows on others (4 tokens, where the columns need 12).
    (One oneDNN product per packed chunk, a 1-token rule, was slower: each call has a fixed cost.) A form
    without a rule is not taken; neither having one is an error."""
    if rules.native_rule(width, dtype, copies):
        return "native" if copies else "dense"
    return mkl_form(width, dtype)


def mkl_form(width: int, dtype: torch.dtype) -> ChunkKernel:
    """The batched MKL product's form :func:`chunk_kernel` takes for chunks of ``width`` without the
    fixed-order kernel: the one whose rule pads a decode step to fewer tokens (``partials`` on a tie)."""
    found: dict[ChunkKernel, int] = {}
    for form in ("partials", "rows"):
        try:
            found[form] = rules.least_rows(form, width, dtype)
        except RuntimeError:
            continue
    if not found:
        raise RuntimeError(
            f"deterministic kernels: this CPU's row-parallel chunk products over K={width} ({dtype}) compute "
            f"a row differently with every row count up to {rules.PROBE_ROWS[-1]}; "
            "run without --deterministic"
        )
    return min(found, key=found.__getitem__)  # the first, partials, on a tie


def row_weight(
    w: torch.Tensor, chunks: Chunks, kernel: ChunkKernel | None = None, copies: bool = True
) -> ChunkedWeight:
    """w [out, K_shard] as :func:`partials` reads it with ``kernel`` (default: this CPU's,
    :func:`chunk_kernel`, which ``copies`` may allow a copy in a kernel's layout); on CUDA always the rows,
    in blocks, without measuring a CPU rule."""
    if w.is_cuda:
        return ChunkedWeight(w, "rows")
    kernel = kernel or chunk_kernel(chunks.width, w.dtype, copies)
    if kernel == "native":
        return ChunkedWeight(w, "native", blocks=fixed_order.pack(w, chunks.local))
    if kernel in ("dense", "rows"):
        return ChunkedWeight(w, kernel)
    return ChunkedWeight(w, "partials", fused=fuse(w, chunks))


def fuse(w: torch.Tensor, chunks: Chunks) -> packed_linear.MklPacked | None:
    """The local chunks of w [out, K_shard] stacked, [chunks * out, width] (chunk c's ``out`` rows, then
    chunk c + 1's), packed for MKL's GEMM on ``max(chunks, fused_rows)`` rows; None where this CPU's MKL
    does not compute the batched product's bits (:func:`fused_rows`), or past ``FUSED_ROWS``. A decode
    step of one token (or a few, ``rows // chunks``) is then one product: its chunks as rows (token t's
    chunk c in row t * n + c), each against every chunk, of which :func:`partials` keeps the block
    diagonal. That is ``chunks`` times the arithmetic of one product, with the weight read once, in one
    call (up to ``FUSED_ROWS``, past which the arithmetic outgrows the saving)."""
    rows, n, out = stacked_rows(chunks, w.dtype), chunks.local, w.shape[0]
    if rows is None:
        return None
    stacked = w.reshape(out, n, chunks.width).transpose(0, 1).reshape(n * out, chunks.width)
    return packed_linear.mkl_pack(stacked, rows)


def stacked_rows(chunks: Chunks, dtype: torch.dtype) -> int | None:
    """The rows :func:`fuse` packs a shard's stacked chunks for: ``max(chunks, fused_rows)``, or None."""
    least = fused_rows(chunks.width, dtype)
    if least is None:
        return None
    rows = max(chunks.local, least)
    return rows if rows <= FUSED_ROWS else None


_STACKED, _STACKED_AT = 9, (0, 4, 8)  # fused_rows' probe: chunks stacked, and those it checks


@functools.cache
def fused_rows(width: int, dtype: torch.dtype) -> int | None:
    """The fewest rows from which MKL's packed product (:func:`fuse`) gives a chunk's row, at any position
    and among other chunks' rows of a stacked weight, the bits of :func:`partials`' batched product, in a
    product of that many rows or more up to ``FUSED_ROWS`` (each count its own packing, as for a decoder);
    None where
    it does not at ``FUSED_ROWS``, or without MKL's packed GEMM, or not float32. Measured once per process
    (milliseconds). On some CPUs MKL's packed and batched products agree for chunks of up to 512 columns
    and not for 1,792 (Llama-3.1-8B's MLP chunks)."""
    if dtype != torch.float32 or not packed_linear.mkl_available():
        return None
    gen = torch.Generator().manual_seed(width)
    w = torch.randn(rules.PROBE_COLS, width, generator=gen)
    row = torch.randn(width, generator=gen)
    ref = rules.chunk_products(
        "partials", w, row.expand(rules.least_rows("partials", width, dtype), width), 1
    )[0, 0]
    stacked = w.repeat(_STACKED, 1)  # the chunk first, in the middle and last among others
    counts = [c for c in rules.PROBE_ROWS if c <= FUSED_ROWS]
    agree = []
    for count in counts:
        x = torch.randn(count, width, generator=gen)
        x[0] = x[-1] = row
        out = packed_linear.mkl_linear(x, packed_linear.mkl_pack(stacked, count))
        blocks = [
            out[at, c * rules.PROBE_COLS : (c + 1) * rules.PROBE_COLS] for at in (0, -1) for c in _STACKED_AT
        ]
        agree.append(all(torch.equal(block, ref) for block in blocks))
    first = len(agree)
    while first > 0 and agree[first - 1]:
        first -= 1
    return counts[first] if first < len(agree) else None


def partials(x: torch.Tensor, w: ChunkedWeight, chunks: Chunks) -> torch.Tensor:
    """[chunks, *rows, out]: each local chunk's partial product of x [*rows, K_shard] and w [out, K_shard].

    As ``w.kernel`` says (:func:`chunk_kernel`, a rule of the machine):

    - ``partials``: with a few tokens (``rows * chunks`` up to the rows ``w.fused`` was packed for), one MKL
      product over the stacked chunks, its block diagonal kept (:func:`fuse`); else one batched product of
      each chunk's ``w_c @ x_c^T`` (:func:`~rollout_worker.engine.kernels.row_rules.chunk_products`), the
      tokens padded to its rule.
    - ``rows``: one batched product of each chunk's ``x_c @ w_c^T``, the rows padded to its rule; on CUDA
      in row blocks (:func:`row_weight` takes it there).
    - ``native``: the fixed-order kernel over ``w.blocks``, any number of tokens as they are;
    - ``dense``: the fixed-order kernel over ``w.dense`` as it is, any number of tokens as they are."""
    n, width = chunks.local, chunks.width
    dense, rows = w.dense, x.numel() // x.shape[-1]
    if w.kernel in ("native", "dense"):
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        weight = dense if w.blocks is None else w.blocks
        return fixed_order.partials(flat, weight, n).view(n, *x.shape[:-1], dense.shape[0])
    if w.fused is not None and rows * n <= w.fused.rows:
        stacked = rules.pad_rows(x.reshape(rows * n, width), w.fused.rows)  # token t's chunk c: row t*n + c
        every = packed_linear.mkl_linear(stacked, w.fused)[: rows * n].view(rows, n, n, dense.shape[0])
        return every.diagonal(dim1=1, dim2=2).permute(2, 0, 1).reshape(n, *x.shape[:-1], dense.shape[0])
    flat, rows = rules.padded_matrix(x, w.kernel, width)
    out = rules.cat([rules.chunk_products(w.kernel, dense, block, n) for block in rules.row_blocks(flat)], 1)
    return out[:, :rows].reshape(n, *x.shape[:-1], dense.shape[0])
