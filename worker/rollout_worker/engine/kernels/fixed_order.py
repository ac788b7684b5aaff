"""The fixed-order C++ kernel (``csrc/fixed_order.cpp``), built on first use: the deterministic setting's
products and attention on CPUs, where it makes that setting nearly free.

It serves CPUs only (AVX-512 or AVX2): on CUDA the deterministic setting runs torch's own products in fixed
shapes and chunks and torch's operations for attention
(:mod:`~rollout_worker.engine.kernels.row_parallel`,
:mod:`~rollout_worker.engine.kernels.deterministic_attention`). Where it is built,
:class:`~rollout_worker.engine.kernels.choice.Kernels` takes it for a row-parallel weight's chunks
(:func:`partials`), as one chunk for the row-independent products (:func:`linear`: q/k/v, gate/up, the
logits), and for attention (:func:`attend`).

A row-parallel chunk's partial product on MKL or oneDNN has a row rule (a token alone and among others
round alike only from so many rows,
:func:`~rollout_worker.engine.kernels.row_rules.least_rows`), so a decode step of a few tokens pads them,
and MKL copies the weight into its panels on every call. These kernels fix the order themselves, so their
rule is 1 at every width, and they read the weight once per call whatever the tokens. Two forms, one per
weight layout (the engine's ``packed_weights`` chooses, the same on every layout):

- **packed** (where the decoder packs its weights, :func:`pack`): each output is one chain of fused
  multiply-adds over the chunk's inputs in order, a vector's 16 lanes being 16 outputs (no sum across
  lanes), over a weight copied once into blocks of 64 outputs (``bench/fixed_order.py`` compares it with
  the MKL and oneDNN products).
- **dense** (the weight as it is, where copies do not fit: ``medium`` and larger): a vector's 16 lanes are
  16 of an output's inputs, lane ``l`` one chain over inputs ``l, l + 16, ...`` in order, the lanes then
  added in one fixed order; tiles of 4 tokens x 4 outputs (1 to 3 tokens in one pass), the next rows
  prefetched. Over narrow chunks the packed form is the faster (``bench/fixed_order.py --shapes``).

Built for AVX-512 or for AVX2 (with FMA), whichever the CPU runs (:func:`machine_isa`): one source, a vector
being 16 lanes in one AVX-512 register or two AVX2 ones, with the same operation on every lane and the
same pairs in every sum across lanes, so both builds compute the same bits (the kernels' tests compare
them on an AVX-512 CPU, which runs both): an engine on an AVX2 CPU and one on an AVX-512 CPU agree. Built
with the C++ compiler torch's extensions use (``g++``) and ninja (the ``engine`` extra installs it), once
per machine, into torch's extension cache (``TORCH_EXTENSIONS_DIR``; ``make setup`` builds it). Where
either is missing, or the CPU has neither, :func:`kernels` is None and the deterministic kernels use MKL's
products (their other chunk kernels) and torch's operations.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fixed_order.cpp"
# per instruction set: only the FMAs the source spells out
FLAGS = {
    "avx512": ["-O3", "-mavx512f", "-ffp-contract=off"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-ffp-contract=off"],
}
Isa = Literal["avx512", "avx2"]


def machine_isa() -> Isa | None:
    """The kernel's build this CPU runs, by torch's own dispatch level (which checks the OS too, and whose
    AVX2 level includes FMA): AVX-512, else AVX2, else none."""
    level = torch.backends.cpu.get_cpu_capability()
    if level.startswith("AVX512"):
        return "avx512"
    return "avx2" if level == "AVX2" else None


@functools.cache
def kernels() -> ModuleType | None:
    """The kernel module this CPU runs (``pack``, ``partials``, ``dense``, ``attend``), built on the first
    call in the machine's extension cache; None where the CPU has neither AVX-512 nor AVX2, no C++ compiler
    is found or the build fails (logged once)."""
    isa = machine_isa()
    return None if isa is None else build(isa)


@functools.cache
def build(isa: Isa) -> ModuleType | None:
    """The kernel built for ``isa`` (both compute the same bits; a CPU runs the builds its instruction set
    covers), or None with a warning where it cannot be built."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        log.warning("deterministic kernels: no C++ compiler, so MKL's chunk products (slower) are used")
        return None
    if shutil.which("ninja") is None:  # torch's builder runs it: the `ninja` wheel's, off PATH in a venv
        try:
            import ninja
        except ImportError:
            log.warning("deterministic kernels: no ninja to build with, so MKL's chunk products are used")
            return None
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(f"rollout_fixed_order_{isa}", [str(SOURCE)], extra_cflags=FLAGS[isa])
    except Exception as err:  # a compiler or linker error: the other kernels still hold the guarantee
        log.warning(
            "deterministic kernels: building %s failed (%s); MKL's chunk products are used", SOURCE, err
        )
        return None


def _built() -> ModuleType:
    """:func:`kernels`' module, for callers that chose the kernel because it is built."""
    mod = kernels()
    assert mod is not None, "the fixed-order kernel is not built here"
    return mod


@dataclass(frozen=True, slots=True)
class Packed:
    """A float32 weight [out, n * width] as the kernel reads it (:func:`pack`): ``blocks`` [n, ceil(out /
    64), width, 64], each chunk's blocks of 64 outputs, zeros past ``out``."""

    blocks: torch.Tensor
    out: int

    @property
    def chunks(self) -> int:
        return self.blocks.shape[0]


def pack(w: torch.Tensor, n: int = 1) -> Packed:
    """w [out, n * width] (float32) in ``n`` chunks, packed for the kernel (a copy)."""
    mod = _built()
    return Packed(mod.pack(w, n), w.shape[0])


def partials(x: torch.Tensor, w: Packed | torch.Tensor, n: int = 1) -> torch.Tensor:
    """[n, rows, out]: each chunk's product of x [rows, n * width] (rows of unit stride) and ``w``: packed
    (:func:`pack`, its own chunk count), or dense [out, n * width] as it is (rows of unit stride, any row
    stride: lanes over the inputs, see the module's text) in ``n`` chunks."""
    mod = _built()
    if isinstance(w, Packed):
        return mod.partials(x, w.blocks, w.out)
    return mod.dense(x, w, n)


def linear(x: torch.Tensor, w: Packed | torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for x [*rows, in] and a weight packed in one chunk or dense, each output of each
    row in the kernel's one order (the bias added after)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = partials(flat, w)[0]
    if b is not None:
        out = out + b
    return out.view(*x.shape[:-1], out.shape[-1])


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    seen: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, S, H, hd] over keys and vals [B, KVh, L, hd] (each head's vectors of unit stride;
    else copied) under mask [B, 1, S, L] (a query's visible keys): [B, S, H * hd], as
    :func:`~rollout_worker.engine.kernels.deterministic_attention.attend` computes it but in the kernel's
    fixed orders (float32 on CPU, ``hd`` a multiple of 16 up to 128). Each query row on its own: its scores
    (per key, the head dimension's 16 lanes summed over its vectors in order, then the lanes in one
    order), its maximum, its exponentials (the kernel's own polynomial), their sum (a lane per key modulo
    16, then the lanes) and its weighted values (a lane per head dimension, over the keys in order); keys
    past ``seen`` are not read. A row's result depends on nothing else in the batch, on the keys it does
    not see, or on their number."""
    mod = _built()
    bsz, seq, length = q.shape[0], q.shape[1], keys.shape[2]
    keys, vals = (t if t.stride(-1) == 1 else t.contiguous() for t in (keys, vals))
    rows = mask.expand(bsz, 1, seq, mask.shape[-1])[:, 0].contiguous().view(torch.uint8)  # [B, S, L]
    return mod.attend(q, keys, vals, rows, scale, length if seen is None else min(seen, length))
