"""SGLang's flattened bucket (``update_weights_from_tensor`` with ``load_format: "flattened_bucket"``,
slime's colocated path): ``{"flattened_tensor": t, "metadata": [FlattenedTensorMetadata, ...]}`` pickled by
SGLang's ``MultiprocessingSerializer``, each metadata entry a tensor's ``name, shape, dtype, start_idx,
end_idx, numel``.

Two generations of ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket`` (older releases: in
``sglang.srt.model_executor.model_runner``) are read:
- element offsets: ``t`` concatenates tensors of one dtype (senders send one bucket per dtype), ``numel``
  counts elements;
- byte offsets (``supports_multi_dtypes = True``): ``t`` is a uint8 buffer of every tensor's bytes, any
  dtypes, ``numel`` counts bytes.
Every entry is checked against the buffer (offsets inside it, the span the shape and dtype need) before its
tensor is copied out; a bad one is a 400 naming the entry's field.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rollout_worker.errors import UserError

if TYPE_CHECKING:
    import torch


class BucketEntry:
    """Stands for SGLang's ``FlattenedTensorMetadata`` (a dataclass: the unpickler sets its fields)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


def unflatten(obj: Any, field: str) -> dict[str, torch.Tensor]:
    """The named tensors of an unpickled bucket, each a copy of its span of the buffer (``field`` names the
    bucket's entry of ``serialized_named_tensors``)."""
    import torch

    if not (isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}):
        raise UserError("not a flattened bucket: a dict of flattened_tensor and metadata", field)
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dim() == 1):
        raise UserError("not a one-dimensional tensor", f"{field}.flattened_tensor")
    if not (isinstance(metadata, list) and all(isinstance(m, BucketEntry) for m in metadata)):
        raise UserError("not a list of FlattenedTensorMetadata", f"{field}.metadata")
    out: dict[str, torch.Tensor] = {}
    for i, meta in enumerate(metadata):
        piece = _piece(flat, meta, f"{field}.metadata.{i}")
        if meta.name in out:
            raise UserError(f"{meta.name!r} is given twice", f"{field}.metadata.{i}.name")
        out[meta.name] = piece
    return out


def _piece(flat: torch.Tensor, meta: BucketEntry, at: str) -> torch.Tensor:
    import torch

    name, shape, dtype = (getattr(meta, k, None) for k in ("name", "shape", "dtype"))
    if not isinstance(name, str):
        raise UserError("not a string", f"{at}.name")
    if not (isinstance(shape, tuple | list) and all(type(d) is int and d >= 0 for d in shape)):
        raise UserError(f"{name!r}: not a shape (a list of sizes)", f"{at}.shape")
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"{name!r}: not a torch dtype", f"{at}.dtype")
    start, end, numel = (_count(meta, k, name, at) for k in ("start_idx", "end_idx", "numel"))
    if not start <= end <= flat.numel():
        raise UserError(
            f"{name!r}: [{start}, {end}) is not inside the flattened tensor's {flat.numel()} elements",
            f"{at}.end_idx",
        )
    if end - start != numel:
        raise UserError(f"{name!r}: end_idx - start_idx is {end - start}, numel says {numel}", f"{at}.numel")
    in_bytes = flat.dtype == torch.uint8 and dtype != torch.uint8  # the byte-offset generation
    if not in_bytes and flat.dtype != dtype:
        raise UserError(
            f"{name!r} is {_plain(dtype)} in a {_plain(flat.dtype)} flattened tensor (element offsets need "
            "one dtype; byte offsets a uint8 tensor)",
            f"{at}.dtype",
        )
    need = math.prod(shape) * (dtype.itemsize if in_bytes else 1)
    if numel != need:
        unit = "bytes" if in_bytes else "elements"
        raise UserError(f"{name!r}: shape {list(shape)} is {need} {unit}, numel says {numel}", f"{at}.shape")
    piece = flat[start:end].clone()  # its own storage: aligned for the view, kept after the sender frees t
    return (piece.view(dtype) if in_bytes else piece).reshape(shape)


def _count(meta: BucketEntry, key: str, name: str, at: str) -> int:
    value = getattr(meta, key, None)
    if type(value) is not int or value < 0:
        raise UserError(f"{name!r}: not a non-negative integer", f"{at}.{key}")
    return value


def _plain(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
