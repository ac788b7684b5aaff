"""Batch- and TP-invariant kernels: the ``deterministic`` setting (issue 19).

With them a token's hidden states, K/V and logits are bitwise the same whatever else is in its batch, where
it sits in a forward (a prefill row or a decode row), the length the batch's keys are padded to, and the TP
size of its replica. So no reconfiguration, batch change, retraction or re-prefill changes a token or a
logprob, in float32 as in float64. Each reduction whose order could change gets one fixed order:

- **Products whose rows are independent** (every column-parallel and replicated projection, the logits):
  a CPU GEMM (MKL's sgemm, or oneDNN's product on packed float32 weights, one thread per rank) computes a
  row the same way in every product of enough rows, at any position and next to any other rows, and a
  column the same way in any slice of the weight's rows; with fewer rows it takes another kernel (a row
  alone: gemv; a few rows: a small-M kernel). How many rows are enough depends on the CPU, the kernel and
  K (measured: MKL on AMD EPYCs, AVX2 and AVX-512, 4 rows for every K; on an AVX-512 Xeon, 3 rows at K =
  64, 6 at 128, 16 from 512; oneDNN's packed product, 2 rows on all three), so :func:`least_rows`
  measures it on the machine, once per kernel, K and dtype, and :func:`linear` and :func:`packed_linear`
  pad a smaller product to it. Where the project's fixed-order kernel is built
  (:mod:`~rollout_worker.engine.kernels.fixed_order`, :func:`native_rule`) the decoder runs them on it
  instead, as one
  chunk: its rule is 1 row, so nothing is padded.
- **Row-parallel products** (attention output, MLP down), whose sum over K is split across ranks: K is cut
  into equal chunks that no layout the model may run at splits (:func:`chunk_bounds`), each chunk's
  partial product is computed alone (:func:`partials`: on the project's fixed-order kernel,
  :mod:`~rollout_worker.engine.kernels.fixed_order`, where it is built, over a packed copy where the decoder
  packs
  and over the weight as it is where not; else one batched product
  over every chunk, the tokens as its columns or its rows as :func:`chunk_kernel` chooses by the CPU's
  rules, and for a few tokens as columns one MKL product over the stacked chunks that computes the same
  bits), each shard adds its
  chunks' whole subtrees of one fixed tree (:func:`tree_sum`, :func:`shard_sums`), the ranks all-gather
  those sums and each adds them up the same tree (:func:`gathered_sum`). The same chunks and the same
  tree on every layout, instead of an all-reduce whose order the backend and the TP size choose.
- **Attention**: on the fixed-order kernel where it is built (:func:`native_attention`), each query row
  on its own in the kernel's orders; else the scores are one product per KV head (their sum runs over the
  head dimension, whatever the number of keys); the softmax's denominator and the weighted values are
  summed per chunk of ``KEY_CHUNK`` keys (query rows padded to both products' :func:`least_rows`), and the
  chunks are added in :func:`tree_sum`'s tree, which a row's masked trailing chunks (exact zeros) do not
  change. The products read only the keys some row sees, rounded up to :func:`key_step` (measured: the
  last chunk's sum over its first keys is the whole chunk's where the rest are zeros). The row's maximum
  is exact in any order.
- RMSNorm's mean, the elementwise functions and the sampler (float64) are already per-row and fixed.

On CUDA, cuBLAS chooses a GEMM kernel (tile shape, split-K) by the product's shape, so a row's rounding
follows the batch size; and torch's reductions pick their thread layout by the number of rows. So on CUDA
every product runs in blocks of exactly ``CUDA_ROWS`` rows (padded with zeros: one shape, one kernel, and a
decode batch of up to ``CUDA_ROWS`` rows costs what one row costs while the weights' reads bound the step),
and the sums over a row (RMSNorm's mean, the softmax's denominator) are fixed pairwise trees of elementwise
adds (:func:`mean_last`, :func:`sum_last`). Measured on a GPU at TP 1 (``tests/worker/engine/test_gpu.py``);
TP > 1 on CUDA is not claimed (a column shard is a product of another width).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels import fixed_order as native
from rollout_worker.engine.kernels import packed_linear as packed
from rollout_worker.scheduling import head_shards as heads
from rollout_worker.scheduling.pages import round_up

CUDA_ROWS = 128  # rows of every product on CUDA: one GEMM shape (still bound by the weights' reads)
KEY_CHUNK = 128  # keys per attention chunk (a multiple of the vector width: no scalar tail in exp)
TP_SIZES = (1, 2, 4, 8)  # chunk bounds cover these TP sizes (and every divisor of the engine's ranks)
# the row counts least_rows compares (the kernels seen switch below 16 rows; a prefill has hundreds)
PROBE_ROWS = (*range(1, 33), 48, 64, 128, 256)
PROBE_COLS = 64  # output columns of a probe (the row rule seen does not depend on them)
KEY_STEPS = (8, 16, 32, 64)  # the multiples of keys attend may cut its products to, finest first (key_step)
# the most rows a stacked chunk product (fuse) runs: its arithmetic grows with the chunks' square; at one
# token it still beat the batched product at 32 chunks (1.1-1.9x, outputs of 576 and 2,048, an AVX-512 Xeon)
FUSED_ROWS = 32

# the products whose row rule least_rows measures, each as its call site lays out its operands
Kernel = Literal["dense", "linear", "native", "packed", "partials", "rows", "scores", "values"]
ChunkKernel = Literal[
    "dense", "native", "partials", "rows"
]  # how a row-parallel weight's chunks are multiplied: see partials
Probe = Callable[[torch.Tensor], list[torch.Tensor]]  # a kernel's products of x, in each variant


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose rows are each bitwise independent of the rest of the batch: always 2-D products of
    at least :func:`least_rows` rows (:func:`_rows`; a 3-D input that does not fold into 2-D by its strides
    would otherwise be multiplied as a batch of 1-row products)."""
    return _row_blocks(F.linear, "linear", x, w, b)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` on a weight packed for oneDNN (:func:`packed.pack`, float32 on CPU)."""
    return _row_blocks(packed.linear, "packed", x, w, b)


def _row_blocks(
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    kernel: Kernel,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
) -> torch.Tensor:
    """``product(x, w, b)`` over :func:`_rows`'s padded 2-D matrix (in row blocks on CUDA), cut back to x's
    rows."""
    if x.numel() == 0:
        return product(x, w, b)
    flat, rows = _rows(x, kernel)
    out = _cat([product(block, w, b) for block in _blocks(flat)], 0)
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


def measure_rules(cfg: ModelConfig, dtype: torch.dtype, packed_weights: bool, widths: Iterable[int]) -> None:
    """:func:`least_rows` of every product a decoder of ``cfg`` runs on CPU (its row-parallel chunks of
    ``widths``: as :func:`chunk_kernel` chooses, with :func:`fused_rows` for the tokens as columns), so a CPU
    without a rule fails when the decoder is built, not in a forward."""
    if not native_rule(cfg.hidden_size, dtype, packed_weights):  # else the fixed-order kernel's
        least_rows("packed" if packed_weights else "linear", cfg.hidden_size, dtype)
    for width in widths:
        if chunk_kernel(width, dtype, packed_weights) == "partials":  # its rules measured
            fused_rows(width, dtype)
    if not native_attention(cfg.head_dim, dtype, cuda=False):
        key_step(cfg.head_dim, dtype)  # and attention's rules (query_rows)


def _probe(kernel: Kernel, k: int, dtype: torch.dtype, gen: torch.Generator) -> Probe:
    """x [rows, k] -> its products [rows, cols] as ``kernel``'s call site computes them, its operands laid
    out as there (a transposed view, a permuted weight, a batch of products), in each variant the call site
    may run (:func:`partials`: a chunk alone, or among 2 or 3 in one batched product)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    if kernel == "linear":
        w = rand(PROBE_COLS, k)
        return lambda x: [F.linear(x, w)]
    if kernel == "packed":  # x itself, and as a strided view at an offset (no longer 64-byte aligned)
        pw = packed.pack(rand(PROBE_COLS, k))
        return lambda x: [packed.linear(v, pw, None) for v in (x, _strided(x))]
    if kernel in ("partials", "rows"):  # partials' batched products: chunk c of width k of 1 to 3 in one
        w = rand(PROBE_COLS, k)
        return lambda x: [_chunk_products(kernel, w.repeat(1, n), x.repeat(1, n), n)[-1] for n in (1, 2, 3)]
    if kernel == "native":  # the last of 1 to 3 chunks, each packed with the others
        w = rand(PROBE_COLS, k)
        packs = {n: native.pack(w.repeat(1, n), n) for n in (1, 2, 3)}
        return lambda x: [native.partials(x.repeat(1, n), packs[n])[-1] for n in (1, 2, 3)]
    if kernel == "dense":  # the last of 1 to 3 chunks of a weight as it is, and of a view of a wider one
        w = rand(PROBE_COLS, k)
        wides = {n: _strided(w.repeat(1, n)) for n in (1, 2, 3)}
        return lambda x: [
            native.partials(x.repeat(1, n), v, n)[-1] for n in (1, 2, 3) for v in (w.repeat(1, n), wides[n])
        ]
    if kernel == "scores":  # attend's q [B, KVh, rows, hd] @ keys_t [B, KVh, hd, L], a slice of a wider one
        keys_t = rand(1, 2, k, 2 * KEY_CHUNK)[..., :KEY_CHUNK]
        return lambda x: [torch.matmul(torch.stack((x, x))[None], keys_t)[0, 1]]
    # values: _chunk_values' product of one chunk, a slice of exp(scores) [B * KVh, rows, L] @ vals [B *
    # KVh, L, hd]
    vals = rand(2, 2 * k, PROBE_COLS)
    return lambda x: [torch.bmm(torch.stack((torch.cat((x, x), 1),) * 2)[:, :, k:], vals[:, k:])[1]]


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] as a view of a wider matrix, at an offset of one element (no longer 64-byte aligned)."""
    wide = x.new_zeros(x.shape[0], 3 * x.shape[1])
    wide[:, 1 : 1 + x.shape[1]] = x
    return wide[:, 1 : 1 + x.shape[1]]


def _chunk_products(kernel: ChunkKernel, dense: torch.Tensor, flat: torch.Tensor, n: int) -> torch.Tensor:
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


def _rows(x: torch.Tensor, kernel: Kernel, k: int | None = None) -> tuple[torch.Tensor, int]:
    """x [*rows, K] as one 2-D matrix of :func:`padded_rows` rows for ``kernel``'s products over ``k``
    (default K; a chunk's width for :func:`partials`), zeros appended; and its row count."""
    width = x.shape[-1]
    rows = x.numel() // width
    flat = x.reshape(rows, width)
    want = padded_rows(rows, x.is_cuda, 0 if x.is_cuda else least_rows(kernel, k or width, x.dtype))
    return _pad_rows(flat, want), rows


def _pad_rows(flat: torch.Tensor, want: int) -> torch.Tensor:
    """flat [rows, K] with rows of zeros appended up to ``want`` rows."""
    if want <= flat.shape[0]:
        return flat
    return torch.cat((flat, flat.new_zeros(want - flat.shape[0], flat.shape[1])))


def _blocks(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The row blocks a padded matrix is multiplied in: ``CUDA_ROWS`` each on CUDA, the whole on CPU."""
    return flat.split(CUDA_ROWS) if flat.is_cuda else (flat,)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in a fixed pairwise tree (``((p0 + p1) + (p2 + p3)) + ...``, odd levels padded with
    zeros), the same for any number of trailing exact zeros."""
    while parts.shape[0] > 1:
        if parts.shape[0] % 2:
            parts = torch.cat((parts, torch.zeros_like(parts[:1])))
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension: torch's on CPU (vectorised the same way for every row), a fixed
    pairwise tree of elementwise adds on CUDA (whose reduction kernels lay out threads by the row count)."""
    return tree_sum(x.movedim(-1, 0)) if x.is_cuda else x.sum(-1)


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """The mean over the last dimension, kept (RMSNorm's), each row's the same whatever the batch."""
    return (sum_last(x) / x.shape[-1])[..., None] if x.is_cuda else x.mean(-1, keepdim=True)


def chunk_bounds(
    shard_bounds: Callable[[int], Iterable[tuple[int, int]]], tps: Iterable[int]
) -> tuple[int, ...]:
    """Equal chunks that no layout splits: multiples of the greatest common divisor of every shard's bounds
    at every TP size in ``tps`` (``shard_bounds(tp)``: the [lo, hi) of each shard of ``tp``). Equal widths
    make a shard's partial products one batched product."""
    cuts: set[int] = set()
    for tp in tps:
        for lo, hi in shard_bounds(tp):
            cuts.update((lo, hi))
    width = math.gcd(*cuts)
    return tuple(range(0, max(cuts) + 1, width))


@dataclass(frozen=True, slots=True)
class Chunks:
    """The fixed K chunks of one row-parallel product, as one shard sees them: their width, and how many
    every shard holds (its own: ``per_shard[shard]``; all: to pick the gathered partials in order)."""

    width: int
    per_shard: tuple[int, ...]
    shard: int

    @property
    def local(self) -> int:
        return self.per_shard[self.shard]

    @property
    def start(self) -> int:
        return self.first(self.shard)

    def first(self, shard: int) -> int:
        """The index, among every shard's, of ``shard``'s first chunk."""
        return sum(self.per_shard[:shard])

    @property
    def total(self) -> int:
        return sum(self.per_shard)

    def nodes(self, shard: int) -> tuple[Node, ...]:
        """``shard``'s chunks as the fewest whole subtrees of :func:`tree_sum`'s tree over every chunk
        (:func:`tree_nodes`): what it adds before the all-gather."""
        lo = self.first(shard)
        return tree_nodes(lo, lo + self.per_shard[shard], self.total)

    @classmethod
    def of(cls, bounds: tuple[int, ...], shards: list[tuple[int, int]], shard: int) -> Chunks:
        width = bounds[1] - bounds[0]
        for lo, hi in shards:
            if lo % width or hi % width:
                raise ValueError(f"shard [{lo}, {hi}) splits a chunk of {width}")
        return cls(width, tuple((hi - lo) // width for lo, hi in shards), shard)


@dataclass(frozen=True, slots=True)
class RowChunks:
    """The chunk bounds of a model's two row-parallel products on an engine of ``world`` ranks: every shard
    bound of every TP size in ``TP_SIZES`` or dividing ``world`` that the model can run at."""

    attn_out: tuple[int, ...]  # in o_proj's input columns (query heads x head_dim)
    mlp_down: tuple[int, ...]  # in down_proj's input columns (the intermediate size)

    @classmethod
    def of(cls, cfg: ModelConfig, world: int) -> RowChunks:
        sizes = set(TP_SIZES) | {d for d in range(1, world + 1) if world % d == 0}
        tps = [t for t in sorted(sizes) if cfg.tp_problem(t) is None]
        return cls(
            chunk_bounds(lambda tp: attn_shards(cfg, tp), tps),
            chunk_bounds(lambda tp: mlp_shards(cfg, tp), tps),
        )


def attn_shards(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """Each shard's columns of o_proj's input at ``tp`` (its query heads)."""
    hd = cfg.head_dim
    return [
        (lo * hd, hi * hd)
        for lo, hi in (heads.q_head_range(cfg.num_heads, cfg.num_kv_heads, tp, s) for s in range(tp))
    ]


def mlp_shards(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """Each shard's columns of down_proj's input at ``tp``."""
    return [heads.split(cfg.intermediate_size, tp, s) for s in range(tp)]


@dataclass(frozen=True, slots=True)
class ChunkedWeight:
    """A row-parallel weight as the deterministic kernels read it (:func:`row_weight`): the shard's dense
    weight [out, K_shard] (the batched products read its chunks as strided views), the kernel
    :func:`partials` runs (:func:`chunk_kernel`), for ``partials`` the chunks packed for MKL as one
    stacked matrix for a few tokens (:func:`fuse`), and for ``native`` the chunks in the fixed-order
    kernel's blocks (:func:`~rollout_worker.engine.kernels.fixed_order.pack`)."""

    dense: torch.Tensor
    kernel: ChunkKernel
    fused: packed.MklPacked | None = None
    blocks: native.Packed | None = None


def chunk_kernel(width: int, dtype: torch.dtype, copies: bool = True) -> ChunkKernel:
    """How a decoder multiplies its row-parallel chunks of ``width`` on this CPU (the same on every layout
    and batch: a rule of the machine, and of the engine's ``packed_weights``).

    Float32 chunks run on the fixed-order kernel (:mod:`~rollout_worker.engine.kernels.fixed_order`) where
    this machine
    builds it and it measures a rule of 1 row (by construction; measured all the same): ``native``, over a
    copy in its blocks, where ``copies`` says the decoder may hold a copy of the weights in a kernel's own
    layout (it packs, :func:`~rollout_worker.engine.kernels.packed_linear.wanted`), on an AVX-512 Xeon
    1.2-2.2x faster
    than the MKL forms at 1 to 64 tokens; else ``dense``, over the weight as it is. Else in the batched
    MKL product (:func:`_chunk_products`) whose form pads a decode step to
    fewer tokens; on a tie the tokens as columns (``partials``, with :func:`fuse`'s stacked product for a
    few tokens, which computes the same bits). Measured: the columns on an AVX-512 Xeon (2 tokens, where
    the rows need 9 for a chunk of 192), the rows on an AVX-512 AMD EPYC (4 tokens, where the columns need
    12). One oneDNN product per packed chunk (a 1-token rule) was slower on both: each call costs 20-40
    us, so on the EPYC ``small``'s 8 attention chunks took 267 us at one token against the rows' 179, and
    576 against 494 at 64 (weights read from memory). A form without a rule is not taken; neither having
    one is an error."""
    if native_rule(width, dtype, copies):
        return "native" if copies else "dense"
    return mkl_form(width, dtype)


def mkl_form(width: int, dtype: torch.dtype) -> ChunkKernel:
    """The batched MKL product's form :func:`chunk_kernel` takes for chunks of ``width`` without the
    fixed-order kernel: the one whose rule pads a decode step to fewer tokens (``partials`` on a tie)."""
    rules: dict[ChunkKernel, int] = {}
    for form in ("partials", "rows"):
        try:
            rules[form] = least_rows(form, width, dtype)
        except RuntimeError:
            continue
    if not rules:
        raise RuntimeError(
            f"deterministic kernels: this CPU's row-parallel chunk products over K={width} ({dtype}) compute "
            f"a row differently with every row count up to {PROBE_ROWS[-1]}; run without --deterministic"
        )
    return min(rules, key=rules.__getitem__)  # the first, partials, on a tie


def native_rule(k: int, dtype: torch.dtype, copies: bool = True) -> bool:
    """Whether products over ``k`` run on the fixed-order kernel
    (:mod:`~rollout_worker.engine.kernels.fixed_order`), over
    a packed copy (``copies``) or over the weight as it is: float32, built on this machine, and measured to
    have the rule it is built for, 1 row."""
    if dtype != torch.float32 or native.kernels() is None:
        return False
    return least_rows("native" if copies else "dense", k, dtype) == 1


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
        return ChunkedWeight(w, "native", blocks=native.pack(w, chunks.local))
    if kernel in ("dense", "rows"):
        return ChunkedWeight(w, kernel)
    return ChunkedWeight(w, "partials", fused=fuse(w, chunks))


def fuse(w: torch.Tensor, chunks: Chunks) -> packed.MklPacked | None:
    """The local chunks of w [out, K_shard] stacked, [chunks * out, width] (chunk c's ``out`` rows, then
    chunk c + 1's), packed for MKL's GEMM on ``max(chunks, fused_rows)`` rows; None where this CPU's MKL
    does not compute the batched product's bits (:func:`fused_rows`), or past ``FUSED_ROWS``. A decode
    step of one token (or a few, ``rows // chunks``) is then one product: its chunks as rows (token t's
    chunk c in row t * n + c), each against every chunk, of which :func:`partials` keeps the block
    diagonal. That is ``chunks`` times the arithmetic of one product, with the weight read once, in one
    call: on an AVX-512 Xeon, at one token, 1.1-1.9x faster than the batched product up to 32 chunks
    (``FUSED_ROWS``)."""
    rows, n, out = stacked_rows(chunks, w.dtype), chunks.local, w.shape[0]
    if rows is None:
        return None
    stacked = w.reshape(out, n, chunks.width).transpose(0, 1).reshape(n * out, chunks.width)
    return packed.mkl_pack(stacked, rows)


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
    """The fewest rows from which MKL's packed product (:func:`fuse`) gives a chunk's row, at any position and
    among other chunks' rows of a stacked weight, the bits of :func:`partials`' batched product, in a product
    of that many rows or more up to ``FUSED_ROWS`` (each count its own packing, as for a decoder); None where
    it does not at ``FUSED_ROWS``, or without MKL's packed GEMM, or not float32. Measured once per process
    (milliseconds). On an AVX-512 Xeon MKL's packed and batched products agree for chunks of up to 512 columns
    and not for 1,792 (Llama-3.1-8B's MLP chunks)."""
    if dtype != torch.float32 or not packed.mkl_available():
        return None
    gen = torch.Generator().manual_seed(width)
    w = torch.randn(PROBE_COLS, width, generator=gen)
    row = torch.randn(width, generator=gen)
    ref = _chunk_products("partials", w, row.expand(least_rows("partials", width, dtype), width), 1)[0, 0]
    stacked = w.repeat(_STACKED, 1)  # the chunk first, in the middle and last among others
    counts = [c for c in PROBE_ROWS if c <= FUSED_ROWS]
    agree = []
    for count in counts:
        x = torch.randn(count, width, generator=gen)
        x[0] = x[-1] = row
        out = packed.mkl_linear(x, packed.mkl_pack(stacked, count))
        blocks = [out[at, c * PROBE_COLS : (c + 1) * PROBE_COLS] for at in (0, -1) for c in _STACKED_AT]
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
      each chunk's ``w_c @ x_c^T`` (:func:`_chunk_products`), the tokens padded to its rule (2 on an
      AVX-512 Xeon, where ``x_c @ w_c^T`` needs 9 rows for a chunk of 192).
    - ``rows``: one batched product of each chunk's ``x_c @ w_c^T``, the rows padded to its rule (4 on an
      AVX-512 AMD EPYC, where ``w_c @ x_c^T`` needs 12 tokens); on CUDA in row blocks (:func:`row_weight`
      takes it there).
    - ``native``: the fixed-order kernel over ``w.blocks``, any number of tokens as they are;
    - ``dense``: the fixed-order kernel over ``w.dense`` as it is, any number of tokens as they are."""
    n, width = chunks.local, chunks.width
    dense, rows = w.dense, x.numel() // x.shape[-1]
    if w.kernel in ("native", "dense"):
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        weight = dense if w.blocks is None else w.blocks
        return native.partials(flat, weight, n).view(n, *x.shape[:-1], dense.shape[0])
    if w.fused is not None and rows * n <= w.fused.rows:
        stacked = _pad_rows(x.reshape(rows * n, width), w.fused.rows)  # token t's chunk c: row t * n + c
        every = packed.mkl_linear(stacked, w.fused)[: rows * n].view(rows, n, n, dense.shape[0])
        return every.diagonal(dim1=1, dim2=2).permute(2, 0, 1).reshape(n, *x.shape[:-1], dense.shape[0])
    flat, rows = _rows(x, w.kernel, width)
    out = _cat([_chunk_products(w.kernel, dense, block, n) for block in _blocks(flat)], 1)
    return out[:, :rows].reshape(n, *x.shape[:-1], dense.shape[0])


Node = tuple[int, int]  # (level, index) in tree_sum's tree: level l's node j adds chunks [j * 2**l, ...)


@functools.cache
def tree_nodes(lo: int, hi: int, n: int) -> tuple[Node, ...]:
    """Chunks [lo, hi) of a tree over ``n`` chunks as the fewest whole subtrees of :func:`tree_sum`'s
    tree, left to right: at each chunk the highest node that starts there and ends by ``hi`` (or, for the
    last shard, holds the tree's right edge: chunk ``n - 1`` and the zeros padding it)."""
    top = max(n - 1, 0).bit_length()  # the root's level
    out: list[Node] = []
    c = lo
    while c < hi:
        level = 0  # up while the parent starts at c too and ends by hi (or at the tree's right edge)
        while level < top and c % (2 << level) == 0 and min(c + (2 << level), n) <= hi:
            level += 1
        out.append((level, c >> level))
        c = min(c + (1 << level), n)
    return tuple(out)


def node_sums(parts: torch.Tensor, lo: int, n: int, nodes: Iterable[Node]) -> torch.Tensor:
    """[len(nodes), ...]: each node's sum of ``parts`` (chunks lo, lo + 1, ... of a tree over ``n``),
    bitwise as :func:`tree_sum` over every chunk computes it: a whole node's chunks in its own tree, then the
    zeros the tree adds to a node at its right edge on the levels above the node's own chunks."""
    sums = []
    for level, j in nodes:
        a = j << level
        b = min(a + (1 << level), n)
        value = tree_sum(parts[a - lo : b - lo])
        for _ in range(level - max(b - a - 1, 0).bit_length()):  # the levels tree_sum(slice) stopped below
            value = value + torch.zeros_like(value)
        sums.append(value)
    return torch.stack(sums)


def shard_sums(parts: torch.Tensor, chunks: Chunks) -> torch.Tensor:
    """What a shard all-gathers: its partials ``parts`` [local, ...] added into its subtrees
    (:meth:`Chunks.nodes`), zeros appended up to the most subtrees any shard has."""
    sums = node_sums(parts, chunks.start, chunks.total, chunks.nodes(chunks.shard))
    most = max(len(chunks.nodes(s)) for s in range(len(chunks.per_shard)))
    if sums.shape[0] < most:
        sums = torch.cat((sums, sums.new_zeros(most - sums.shape[0], *sums.shape[1:])))
    return sums


def gathered_sum(everyone: list[torch.Tensor], chunks: Chunks) -> torch.Tensor:
    """:func:`tree_sum` of every chunk from each shard's :func:`shard_sums` (``everyone``, in shard order)."""
    known = {node: sums[i] for s, sums in enumerate(everyone) for i, node in enumerate(chunks.nodes(s))}
    return tree_root(known, chunks.total)


def tree_root(known: dict[Node, torch.Tensor], n: int) -> torch.Tensor:
    """:func:`tree_sum` of ``n`` chunks from the sums of subtrees that partition them (``known``),
    bitwise: every node above them is its two children's sum, a child past chunk ``n - 1`` a zero."""

    def value(level: int, j: int) -> torch.Tensor:
        got = known.get((level, j))
        if got is not None:
            return got
        if level == 0:
            raise KeyError(f"chunk {j} is in no subtree")
        left = value(level - 1, 2 * j)
        if (2 * j + 1) << (level - 1) >= n:
            return left + torch.zeros_like(left)
        return left + value(level - 1, 2 * j + 1)

    return value(max(n - 1, 0).bit_length(), 0)


@functools.cache
def key_step(hd: int, dtype: torch.dtype) -> int:
    """The multiple of keys :func:`attend`'s products read: the keys any row of a forward sees, rounded up to
    it, instead of to whole ``KEY_CHUNK`` chunks (at a step of 8, a forward at 257 keys reads 264, not 384).
    The finest of ``KEY_STEPS`` at which this CPU's products give every row the bits of whole chunks
    (:func:`_cuts_agree`), else ``KEY_CHUNK``; measured once per process (about 0.1 s). The
    elementwise work and the sums over keys still run over whole chunks (zeros past the cut), as before."""
    least = query_rows(hd, dtype)
    return next((step for step in KEY_STEPS if _cuts_agree(step, hd, dtype, least)), KEY_CHUNK)


def _cuts_agree(step: int, hd: int, dtype: torch.dtype, least: int) -> bool:
    """Whether a product cut to a multiple of ``step`` keys computes what whole chunks do, at query row counts
    from ``least`` to a prefill's 256: each score (a column of ``q @ keys_t``, its sum over ``hd``) the same
    in a product of fewer columns; and a chunk's weighted values (``e @ vals``, the sum over the chunk's keys)
    the same over its first keys as over all ``KEY_CHUNK``, where the row's later keys have ``e`` = 0 (its
    masked keys, or another row's) -- for every count of keys a row sees up to the cut."""
    gen = torch.Generator().manual_seed(step * hd)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    # the cuts a score is checked at: every multiple of the step up to 3 chunks, then a few longer contexts
    cuts = [*range(step, 3 * KEY_CHUNK, step), *(c * KEY_CHUNK + step for c in (8, 16, 32))]
    cap = round_up(cuts[-1], KEY_CHUNK) + 64  # the kept keys' capacity: a multiple of 64, past the span
    keys_t = rand(1, 2, hd, cap)  # [..., :n]: views of a wider matrix, as the kept keys are
    counts = (least, 2 * least + 1, 64, 256)
    weights = rand(8, max(counts), 2 * KEY_CHUNK).abs()
    vals = rand(8, 2 * KEY_CHUNK, hd)[:, KEY_CHUNK:]  # views of wider matrices, as _chunk_values' are
    for rows in counts:
        q = rand(1, 2, rows, hd)
        spans: dict[int, torch.Tensor] = {}
        for n in cuts:
            span = key_span(n)
            if span not in spans:
                spans[span] = torch.matmul(q, keys_t[..., :span])
            if not torch.equal(torch.matmul(q, keys_t[..., :n]), spans[span][..., :n]):
                return False
        for cut in range(step, KEY_CHUNK, step):
            seen = sorted({k for k in (1, 2, 3, step - 1, cut // 2, cut - step + 1, cut - 1, cut) if k >= 1})
            e = weights[: len(seen), :rows].clone()[:, :, KEY_CHUNK:]
            for i, k in enumerate(seen):
                e[i, :, k:] = 0
            v = vals[: len(seen)]
            if not torch.equal(torch.bmm(e[:, :, :cut], v[:, :cut]), torch.bmm(e, v)):
                return False
    return True


def query_rows(hd: int, dtype: torch.dtype) -> int:
    """The fewest query rows :func:`attend`'s two products run on this CPU: both products' row rule."""
    return max(least_rows("scores", hd, dtype), least_rows("values", KEY_CHUNK, dtype))


def key_span(length: int) -> int:
    """Keys a row attends over, rounded up to whole chunks (gather the pool's padding slots rather than pad
    the gathered keys: one copy instead of two)."""
    return max(round_up(length, KEY_CHUNK), KEY_CHUNK)


def native_attention(hd: int, dtype: torch.dtype, cuda: bool) -> bool:
    """Whether :func:`attend` runs on the fixed-order kernel
    (:func:`~rollout_worker.engine.kernels.fixed_order.attend`):
    float32 on a CPU that builds it, heads of a multiple of 16 up to 128 (a rule of the model and the
    machine, so the same on every layout and batch of an engine). On the AVX-512 Xeon, one decode step's
    attention for SmolLM2-135M's heads over 251 keys took 39 us at batch 1, 0.8 ms at 16 and 3.0 ms at 64,
    against SDPA's (the default kernels') 50 us, 0.9 and 3.4 ms (this module's torch operations: 114 us
    and 2.0 ms at 1 and 16)."""
    return not cuda and dtype == torch.float32 and hd % 16 == 0 and hd <= 128 and native.kernels() is not None


def attend(
    q: torch.Tensor,
    keys_t: torch.Tensor,
    vals: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    seen: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, S, H, hd] over keys_t [B, KVh, hd, L] (the keys transposed: on CPU each KV head's
    [hd, L] row-major, as :class:`~rollout_worker.engine.model.kv_cache.GatheredKV` keeps them for these
    kernels)
    and vals [B, KVh, L, hd] under mask [B, 1, S, L] (a query's visible keys): [B, S, H * hd], each query
    row bitwise independent of B, S, L and the other rows. Head ``h`` uses KV head ``h // (H // KVh)``, as
    in grouped-query attention. The scores are one product per (row, KV head) (a score's sum runs over
    ``hd`` whatever L is); the sums over keys run per chunk. ``seen`` (default L): no row sees a key at
    or past it; the products read that many keys, rounded up to :func:`key_step`. Where
    :func:`native_attention` says so, the fixed-order kernel computes it instead, in its own orders."""
    if native_attention(q.shape[-1], q.dtype, q.is_cuda):  # it reads the keys untransposed
        return native.attend(q, keys_t.transpose(-1, -2), vals, mask, scale, seen)
    bsz, seq, heads, hd = q.shape
    kvh, length = keys_t.shape[1], keys_t.shape[3]
    group = heads // kvh
    rows = group * seq
    qg = (q * scale).view(bsz, seq, kvh, group, hd).permute(0, 2, 3, 1, 4).reshape(bsz, kvh, rows, hd)
    vis = mask[:, :, None].expand(bsz, 1, group, seq, length).reshape(bsz, 1, rows, length)  # rows (g, s)
    least = 0 if q.is_cuda else query_rows(hd, q.dtype)
    if rows < least:  # rows of zeros: they fill the products only (no elementwise work, no sums)
        qg = torch.cat((qg, qg.new_zeros(bsz, kvh, least - rows, hd)), dim=2)
    span = key_span(length)
    cut = span  # keys the products read: the keys any row sees, rounded up to key_step (CUDA: whole chunks)
    if not q.is_cuda:
        step = key_step(hd, q.dtype)
        cut = min(max(round_up(length if seen is None else seen, step), step), span)
    if cut > length:
        keys_t = F.pad(keys_t, (0, cut - length))
        vals = F.pad(vals, (0, 0, 0, cut - length))
    vis = F.pad(vis[..., :cut], (0, span - min(cut, length)), value=False)  # no key past the cut counts
    n = span // KEY_CHUNK
    scores = torch.matmul(qg, keys_t[..., :cut])  # [B, KVh, padded rows, cut]
    if cut < span:
        scores = F.pad(scores, (0, span - cut))
    e = scores[:, :, :rows].masked_fill_(~vis, float("-inf"))  # the query rows, in place from here on
    top = e.amax(dim=-1, keepdim=True)  # exact in any order
    e = e.sub_(top).exp_()  # the same bits in place: the same elementwise kernels (L: whole chunks)
    den = tree_sum(sum_last(e.view(bsz, kvh, rows, n, KEY_CHUNK)).movedim(-1, 0))  # [B, KVh, rows]
    num = tree_sum(_chunk_values(scores, vals, n, cut))[:, :, :rows]  # [B, KVh, rows, hd]
    out = num / den[..., None]
    return out.view(bsz, kvh, group, seq, hd).permute(0, 3, 1, 2, 4).reshape(bsz, seq, heads * hd)


def _chunk_values(e: torch.Tensor, vals: torch.Tensor, n: int, cut: int) -> torch.Tensor:
    """[n, B, KVh, rows, hd]: each chunk's weighted values, e [B, KVh, rows, n * C] @ vals [B, KVh, n * C,
    hd] over its C keys. On CPU one batched product per chunk over views of both (vals is a slice of the
    kept K/V, whose rows outrun L: a product over all chunks at once would first copy it, which took longer
    than the products); on CUDA one product over every chunk (one kernel, as measured there)."""
    bsz, kvh, rows, span = e.shape
    hd = vals.shape[-1]
    if e.is_cuda:
        chunked = e.view(bsz, kvh, rows, n, KEY_CHUNK).transpose(2, 3)  # [B, KVh, n, rows, C]
        return torch.matmul(chunked, vals.view(bsz, kvh, n, KEY_CHUNK, hd)).movedim(2, 0)
    ef, vf = e.view(bsz * kvh, rows, span), vals.reshape(bsz * kvh, vals.shape[2], hd)
    parts = [
        torch.bmm(ef[:, :, c : min(c + KEY_CHUNK, cut)], vf[:, c : min(c + KEY_CHUNK, cut)])
        for c in range(0, span, KEY_CHUNK)
    ]
    return torch.stack(parts).view(n, bsz, kvh, rows, hd)
