"""The kernels a decoder runs, chosen once from the engine's settings, the model, the dtype and the device.

:meth:`Kernels.choose` decides, where the decoder is built, every product and reduction whose kernel the
settings or the machine pick, and measures what must be measured on this CPU then (the deterministic
kernels' row rules), so a CPU without a rule fails there, not in a forward:

- **linear** (column-parallel and replicated products, the logits): oneDNN's product on weights packed
  once (float32 on CPU, ``packed_weights``), else ``F.linear``; with the ``deterministic`` setting padded
  to the CPU's measured row rule (:mod:`~rollout_worker.engine.kernels.row_rules`; on CUDA in fixed row
  blocks), or on the fixed-order kernel where this CPU builds it.
- **row-parallel product** (attention output, MLP down): the backend's all-reduce, or (deterministic) fixed
  chunks added in one fixed tree (:mod:`~rollout_worker.engine.kernels.row_chunks`,
  :mod:`~rollout_worker.engine.kernels.row_parallel`).
- **attention**: torch's (:mod:`~rollout_worker.engine.kernels.torch_attention`), the deterministic one on
  torch's operations (:mod:`~rollout_worker.engine.kernels.deterministic_attention`), or the fixed-order
  kernel's (:func:`~rollout_worker.engine.kernels.fixed_order.attend`); one entry each, same signature.
- **a decode step's attention** with the default kernels: read in place from the pool's pages
  (:mod:`~rollout_worker.engine.kernels.paged_decode`, Triton; the ``paged_attention`` setting) on CUDA in
  float32, bfloat16 or float16, or on CPU under Triton's interpreter; else over keys gathered first.
- **last-token mean** (RMSNorm's): torch's, or on CUDA with the deterministic setting a fixed tree.
- **keys' layout** where a decode step keeps the gathered keys on CPU: rows, or each KV head's [hd, L]
  row-major for the deterministic attention's products.

The fixed-order C++ kernel (``csrc/fixed_order.cpp``) serves CPUs only: there it makes the deterministic
setting nearly free. On CUDA the deterministic setting runs torch's own products in fixed shapes and
chunks, and torch's operations for attention and the sums over a row.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from rollout_worker.config.engine_settings import EngineSettings
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.kernels import deterministic_attention as det_attention
from rollout_worker.engine.kernels import fixed_order, packed_linear, row_parallel, torch_attention, tree_sums
from rollout_worker.engine.kernels import row_rules as rules
from rollout_worker.engine.kernels.row_chunks import Chunks, RowChunks
from rollout_worker.engine.kernels.row_parallel import ChunkedWeight
from rollout_worker.engine.kernels.row_rules import ChunkKernel

LinearKernel = Literal["fixed_order", "onednn", "torch"]  # the fixed-order kernel, oneDNN packed, F.linear
RowProduct = Literal["all_reduce", "fixed_chunks"]
AttentionFamily = Literal["torch", "deterministic", "fixed_order"]
MeanKernel = Literal["torch", "fixed_tree"]
KeysLayout = Literal["rows", "transposed"]  # kept keys: [L, hd] per KV head, or [hd, L] row-major
RowProjection = Literal["attn_out", "mlp_down"]

# a column-parallel or replicated weight: dense, packed for oneDNN, or for the fixed-order kernel
Weight = torch.Tensor | fixed_order.Packed
RowWeight = torch.Tensor | ChunkedWeight  # a row-parallel weight (chunked: deterministic)


class Linear(Protocol):
    """A product as ``F.linear`` takes it: (x, w, b=None), w as :meth:`Kernels.weight` prepared it."""

    def __call__(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None, /) -> torch.Tensor: ...


class Attend(Protocol):
    """An attention family's entry: q [B, S, H, hd] over keys and vals [B, KVh, L, hd] (the keys as
    :meth:`Kernels.keys_of` lays them out) under mask [B, 1, S, L], the keys no row sees at or past
    ``seen``: [B, S, H * hd]."""

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        vals: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        seen: int | None = None,
        /,
    ) -> torch.Tensor: ...


# a decode step's attention over the pool's pages in place (q, k_cache, v_cache, table, lengths, scale):
# :func:`~rollout_worker.engine.kernels.paged_decode.decode`
PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def _mean_last(x: torch.Tensor) -> torch.Tensor:
    return x.mean(-1, keepdim=True)


@dataclass(frozen=True, slots=True)
class FixedChunks:
    """The deterministic row-parallel products: their chunk bounds, and how this machine multiplies each
    product's chunks (:func:`~rollout_worker.engine.kernels.row_parallel.chunk_kernel`; on CUDA the rows)."""

    bounds: RowChunks
    attn_out: ChunkKernel
    mlp_down: ChunkKernel


@dataclass(frozen=True, slots=True)
class Kernels:
    """Which kernel runs each of a decoder's products and reductions (see the module's text)."""

    dtype: torch.dtype
    device: str  # the device's type: cpu, cuda
    deterministic: bool  # batch- and TP-invariant kernels (the ``deterministic`` setting)
    packed: bool  # the weights are copied once into a kernel's layout (oneDNN's or the fixed-order kernel's)
    linear: LinearKernel
    row_product: RowProduct
    attention: AttentionFamily
    mean: MeanKernel
    keys: KeysLayout
    chunks: FixedChunks | None = None  # with row_product "fixed_chunks"
    paged_decode: bool = False  # a decode step's attention reads the pool's pages in place (Triton)

    def __post_init__(self) -> None:
        if (self.row_product == "fixed_chunks") != (self.chunks is not None):
            raise ValueError(f"row product {self.row_product} with chunks {self.chunks}")

    @classmethod
    def choose(
        cls,
        settings: EngineSettings,
        model: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        world: int,
    ) -> Kernels:
        """The kernels an engine of ``world`` ranks with ``settings`` runs ``model`` on, in ``dtype`` on
        ``device`` (the same on every layout: packing depends on the model, the ranks and the machine)."""
        pack = packed_linear.wanted(settings.packed_weights, model, world)
        return cls.of(
            model,
            dtype,
            device,
            deterministic=settings.deterministic,
            pack=pack,
            world=world,
            paged=settings.paged_attention,
        )

    @classmethod
    def of(
        cls,
        model: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        *,
        deterministic: bool = False,
        pack: bool = True,
        world: int = 1,
        paged: bool = False,
    ) -> Kernels:
        """The kernels for ``model`` in ``dtype`` on ``device``: the deterministic ones (their chunks cover
        every layout of ``world`` ranks) or the default ones; ``pack``: float32 weights on CPU are copied
        once into a kernel's layout; ``paged``: decode attention reads the pages in place where it runs
        (:func:`paged_decode_runs`). On CPU the deterministic kernels' rules are measured here."""
        cuda = device.type == "cuda"
        packs = pack and packed_linear.packs_on(device.type, dtype)
        if not deterministic:
            linear: LinearKernel = "onednn" if packs else "torch"
            in_place = paged and paged_decode_runs(dtype, cuda)
            return cls(
                dtype,
                device.type,
                False,
                packs,
                linear,
                "all_reduce",
                "torch",
                "torch",
                "rows",
                None,
                in_place,
            )
        fixed_linear = not cuda and rules.native_rule(model.hidden_size, dtype, packs)
        fixed_attention = _fixed_order_attention(model.head_dim, dtype, cuda)
        bounds = RowChunks.of(model, world)
        widths = (bounds.attn_out[1] - bounds.attn_out[0], bounds.mlp_down[1] - bounds.mlp_down[0])
        kinds: tuple[ChunkKernel, ChunkKernel] = ("rows", "rows")  # on CUDA, in row blocks
        if not cuda:  # each product's row rule, before the first forward needs it
            _measure_rules(model, dtype, packs, widths)
            kinds = (
                row_parallel.chunk_kernel(widths[0], dtype, packs),
                row_parallel.chunk_kernel(widths[1], dtype, packs),
            )
        return cls(
            dtype,
            device.type,
            True,
            packs,
            "fixed_order" if fixed_linear else "onednn" if packs else "torch",
            "fixed_chunks",
            "fixed_order" if fixed_attention else "deterministic",
            "fixed_tree" if cuda else "torch",  # on CPU torch's mean is already the same for every row
            "rows" if cuda or fixed_attention else "transposed",
            FixedChunks(bounds, *kinds),
        )

    def product(self) -> Linear:
        """The column-parallel and replicated products (on weights from :meth:`weight`)."""
        if self.linear == "fixed_order":
            return fixed_order.linear
        if self.linear == "onednn":
            return rules.packed_linear if self.deterministic else packed_linear.linear
        return rules.linear if self.deterministic else F.linear

    def weight(self, w: torch.Tensor) -> Weight:
        """A column-parallel or replicated weight as :meth:`product` reads it (packed: a copy in oneDNN's
        layout, or in the fixed-order kernel's; else as it is)."""
        if not self.packed:
            return w
        return fixed_order.pack(w) if self.linear == "fixed_order" else packed_linear.pack(w)

    def row_weight(self, w: torch.Tensor, chunks: Chunks | None, projection: RowProjection) -> RowWeight:
        """A row-parallel weight as the decoder's row-parallel product reads it: for the all-reduce as for
        :meth:`product` (packed for oneDNN, never for the fixed-order kernel); in fixed chunks (``chunks``:
        this shard's) as :attr:`chunks` says, a copy in the fixed-order kernel's layout only where the
        weights are packed."""
        if self.chunks is None or chunks is None:
            return packed_linear.pack(w) if self.packed else w
        kernel = self.chunks.attn_out if projection == "attn_out" else self.chunks.mlp_down
        return row_parallel.row_weight(w, chunks, kernel, copies=self.packed)

    def paged_decode_entry(self) -> PagedDecode | None:
        """The paged decode kernel's entry where :attr:`paged_decode` (imported here: Triton is needed only
        then), else None."""
        if not self.paged_decode:
            return None
        from rollout_worker.engine.kernels import paged_decode

        return paged_decode.decode

    def attention_entry(self) -> Attend:
        """The attention family's one entry."""
        if self.attention == "fixed_order":
            return fixed_order.attend
        if self.attention == "deterministic":
            return det_attention.attend
        return torch_attention.attend

    def mean_last(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The mean over the last dimension, kept (RMSNorm's)."""
        return tree_sums.mean_last if self.mean == "fixed_tree" else _mean_last

    def keys_of(self, gathered: torch.Tensor) -> torch.Tensor:
        """Keys gathered from the pool [B, L, KVh, hd] as the attention entry takes them, [B, KVh, L, hd]:
        with transposed keys (:attr:`keys`) a transposed view of each KV head's [hd, L] row-major (the
        deterministic attention's products read them so: one layout, one kernel), else a view as they
        are (the fixed-order kernel reads them so, and the kept keys' writes of a step are then
        contiguous)."""
        if self.keys == "rows":
            return gathered.transpose(1, 2)
        return gathered.permute(0, 2, 3, 1).contiguous().transpose(2, 3)

    def read_keys(self, seen: int) -> int:
        """How many keys' slots a forward reads where its rows see ``seen``: the deterministic attention's
        products read whole key chunks (the pool's padding slots, masked, rather than padded keys)."""
        return det_attention.key_span(seen) if self.attention == "deterministic" else seen

    def kv_major(self, seq: int) -> bool:
        """Whether a forward of ``seq`` positions per row gathers its keys KV-head-major (torch's attention
        on CUDA, a decode step: :func:`~rollout_worker.engine.kernels.torch_attention.attend_kv_major`)."""
        return (
            self.attention == "torch"
            and not self.paged_decode
            and torch_attention.kv_major(seq, self.device == "cuda")
        )


def paged_decode_runs(dtype: torch.dtype, cuda: bool) -> bool:
    """Whether the paged decode kernel runs here: Triton installed, float32, bfloat16 or float16, on CUDA
    or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return (
        dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (cuda or os.environ.get("TRITON_INTERPRET", "0") == "1")
        and importlib.util.find_spec("triton") is not None
    )


def _fixed_order_attention(hd: int, dtype: torch.dtype, cuda: bool) -> bool:
    """Whether the deterministic attention runs on the fixed-order kernel: float32 on a CPU that builds it,
    heads of a multiple of 16 up to 128 (a rule of the model and the machine, so the same on every layout
    and batch of an engine)."""
    return (
        not cuda
        and dtype == torch.float32
        and hd % 16 == 0
        and hd <= 128
        and fixed_order.kernels() is not None
    )


def _measure_rules(model: ModelConfig, dtype: torch.dtype, packs: bool, widths: tuple[int, ...]) -> None:
    """The row rule of every product a deterministic decoder of ``model`` runs on CPU (its row-parallel
    chunks of ``widths``: as :func:`~rollout_worker.engine.kernels.row_parallel.chunk_kernel` chooses, with
    the stacked product's rows for the tokens as columns; attention's key step), measured once per process
    so a CPU without a rule fails when the decoder is built."""
    if not rules.native_rule(model.hidden_size, dtype, packs):  # else the fixed-order kernel's
        rules.least_rows("packed" if packs else "linear", model.hidden_size, dtype)
    for width in widths:
        if row_parallel.chunk_kernel(width, dtype, packs) == "partials":  # its rules measured
            row_parallel.fused_rows(width, dtype)
    if not _fixed_order_attention(model.head_dim, dtype, cuda=False):
        det_attention.key_step(model.head_dim, dtype)  # and attention's rules (query_rows)
