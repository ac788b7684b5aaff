"""Float32 products on CPU through oneDNN over weights packed once (the default kernels' linear).

``F.linear`` on CPU runs MKL's ``sgemm``, which repacks the weight into its blocked layout on every call: a
decode step (a few to a few dozen rows) then reads each weight twice and writes it once. oneDNN's linear
over a weight reordered once, when the decoder is built, into the blocked layout its kernels read
(``torch.ops.mkldnn._reorder_linear_weight``, the prepacking inductor's CPU backend uses), reads it once.
Measured with one thread (AMD EPYC, AVX2; ``bench/packed_linear.py``): 2-2.7x faster at 16 and 64 rows,
as fast or faster at 1 row. It costs a second copy of the weights, made in about 0.6 ms per MB at each
decoder build (a layout switch, a weight load).

Only the default kernels use it: its rounding differs from ``sgemm``'s (both are float32 products with
errors of the same size), and the deterministic kernels' guarantee is measured on MKL
(:mod:`~rollout_worker.engine.invariant`). float64 (the lossless tests' dtype) and other dtypes keep
``F.linear``.
"""

from __future__ import annotations

import functools

import torch

ROWS_HINT = 16  # the batch the reorder is tuned for (any row count runs on the packed weight)


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed linear (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packs(w: torch.Tensor) -> bool:
    """Whether the default kernels multiply by ``w`` through a packed copy: float32 on CPU."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and available()


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] reordered once into oneDNN's blocked layout (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` with ``w`` from :func:`pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
