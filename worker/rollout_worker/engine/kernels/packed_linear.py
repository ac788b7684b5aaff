"""Float32 products on CPU through oneDNN over weights packed once.

``F.linear`` on CPU runs MKL's ``sgemm``, which copies the weight into its blocked panels on every call.
oneDNN's linear over a weight reordered once, when the decoder is built, into the blocked layout its kernels
read (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking inductor's CPU backend uses) does not:
faster from a few rows on (``bench/packed_linear.py`` measures it; at 1 row, on matrices small enough for
``gemv`` to run from cache, it can be slower). It costs a second copy of the weights, made at each decoder
build (a layout switch, a weight load): the engine setting ``packed_weights`` (:func:`wanted`) packs only
while that fits, or as told.

Its rounding differs from ``sgemm``'s (both are float32 products, its errors against float64 about twice
``sgemm``'s). The deterministic kernels use it too, under its own row rule, measured on the machine
(:func:`~rollout_worker.engine.kernels.row_rules.least_rows`). float64 (the lossless tests'
dtype) and other dtypes keep ``F.linear``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rollout_worker.config.engine_settings import DTYPE_BYTES, PackedWeights
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.machine import machine_memory

ROWS_HINT = 16  # the batch the reorder is tuned for (any row count runs on the packed weight)


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed linear (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def wanted(setting: PackedWeights, model: ModelConfig, ranks: int, memory: int | None = None) -> bool:
    """Whether an engine of ``ranks`` ranks packs its float32 weights (the setting ``packed_weights``):
    ``auto`` packs while two float32 copies of the whole model for every rank (what a TP=1 rank holds
    packed) fit in half of ``memory`` (default: :func:`machine_memory`). It depends on the model, the
    ranks and the machine only, never on the layout, so every rank and every layout of an engine use the
    same kernel (the deterministic kernels' identity across layouts needs it)."""
    if setting != "auto":
        return setting == "on"
    need = 2 * DTYPE_BYTES["float32"] * model.weight_elements * ranks
    return need <= (machine_memory() if memory is None else memory) // 2


def packs(w: torch.Tensor) -> bool:
    """Whether a decoder that packs (:func:`wanted`) multiplies by ``w`` through a packed copy: float32 on
    CPU, with a torch that has oneDNN."""
    return packs_on(w.device.type, w.dtype)


def packs_on(device: str, dtype: torch.dtype) -> bool:
    """:func:`packs` for weights of ``dtype`` on a device of type ``device``."""
    return device == "cpu" and dtype == torch.float32 and available()


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] reordered once into oneDNN's blocked layout (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` with ``w`` from :func:`pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@functools.cache
def mkl_available() -> bool:
    """Whether this torch has MKL's packed GEMM (``cblas_sgemm_pack``/``_compute``, float32)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


@dataclass(frozen=True, slots=True)
class MklPacked:
    """A float32 weight [out, in] packed once for MKL's GEMM, for products of exactly ``rows`` rows: MKL
    computes as its ``sgemm`` does, without copying the weight into its panels on each call, and with a
    a smaller cost per call than oneDNN's product. Its packed
    layout is chosen for the row count, so torch runs it only on that many rows (any other count falls
    back to ``F.linear`` on ``origin``); :func:`mkl_linear` refuses other counts instead."""

    weight: torch.Tensor
    origin: torch.Tensor  # a zero-stride [out, in] of zeros: torch reads only its shape on the packed path
    rows: int


def mkl_pack(w: torch.Tensor, rows: int) -> MklPacked:
    """``w`` [out, in] packed for MKL's GEMM on ``rows`` rows (a copy)."""
    weight = torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), rows)
    if not weight.is_mkldnn:  # torch multiplies by ``origin`` (zeros) unless the weight is MKL's packing
        raise RuntimeError("this torch's MKL reorder returned no packed weight")
    return MklPacked(weight, w.new_zeros(1).expand(w.shape), rows)


def mkl_linear(x: torch.Tensor, w: MklPacked) -> torch.Tensor:
    """``F.linear(x, w)`` for x [w.rows, in]."""
    if x.dim() != 2 or x.shape[0] != w.rows:
        raise ValueError(f"a weight packed for {w.rows} rows multiplied by x of shape {tuple(x.shape)}")
    return torch.ops.mkl._mkl_linear(x, w.weight, w.origin, None, w.rows)
