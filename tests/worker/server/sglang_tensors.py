"""Named tensors as a trainer sends them to SGLang's ``update_weights_from_tensor``: SGLang's
``MultiprocessingSerializer`` form (a torch multiprocessing pickle, tensors as shared-memory handles), made
without SGLang, with SGLang's classes pickled by SGLang's names. Shared by the tests of the route, of VeRL's
HTTP adapter and of slime's colocated path (its stubs of SGLang are these classes).

Two payloads: ``(name, LocalSerializedTensor)`` pairs (``per_rank``: SGLang's
``weight_sync.utils.update_weights``, VeRL's path) and flattened buckets (``flattened_buckets``, for
``load_format: "flattened_bucket"``: what slime's ``_send_to_colocated_engine`` sends, and what SGLang's
``Engine.update_weights_from_tensor`` passes on as it is), in both generations of SGLang's
``FlattenedTensorBucket``.
"""

from __future__ import annotations

import base64
import io
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

SGLANG_MODULE = "sglang.srt.model_executor.model_runner"  # LocalSerializedTensor; the older bucket classes
TENSOR_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"  # the current bucket classes


@contextmanager
def file_system_sharing() -> Iterator[None]:
    """Tensors pickled as handles another process can open (shared memory by name), as on a trainer."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def serialize(obj: Any) -> bytes:
    """``MultiprocessingSerializer.serialize(obj)``: a torch multiprocessing pickle of ``obj``, whose SGLang
    classes pickle by SGLang's names."""
    buf = io.BytesIO()
    with _sglang_modules():
        ForkingPickler(buf).dump(obj)
    return buf.getvalue()


class MultiprocessingSerializer:  # sglang.srt.utils (what slime's stub of SGLang hands out)
    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        data = serialize(obj)
        return base64.b64encode(data).decode() if output_str else data


class LocalSerializedTensor:  # SGLang's wrapper (one pickled tensor per TP rank)
    def __init__(self, values: list[bytes]) -> None:
        self.values = values


@dataclass
class FlattenedTensorMetadata:  # SGLang's, field for field
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """SGLang's current bucket (``supports_multi_dtypes``): every tensor's bytes back to back in a uint8
    tensor, offsets and ``numel`` in bytes."""

    supports_multi_dtypes = True
    metadata_class: type = FlattenedTensorMetadata

    def __init__(
        self,
        named_tensors: list[tuple[str, torch.Tensor]] | None = None,
        flattened_tensor: torch.Tensor | None = None,
        metadata: list[Any] | None = None,
    ) -> None:
        if named_tensors is None:
            assert flattened_tensor is not None and metadata is not None
            self.flattened_tensor, self.metadata = flattened_tensor, metadata
            return
        if not named_tensors:
            raise ValueError("Cannot create empty tensor bucket")
        flat = [self._flat(t) for _, t in named_tensors]
        ends = [sum(f.numel() for f in flat[: i + 1]) for i in range(len(flat))]
        self.metadata = [
            self.metadata_class(name, t.shape, t.dtype, end - f.numel(), end, f.numel())
            for (name, t), f, end in zip(named_tensors, flat, ends, strict=True)
        ]
        self.flattened_tensor = torch.cat(flat)

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.flatten().view(torch.uint8)

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[Any]:
        return self.metadata


@dataclass
class OlderFlattenedTensorMetadata(FlattenedTensorMetadata):  # the same class in an older SGLang module
    pass


class OlderFlattenedTensorBucket(FlattenedTensorBucket):
    """SGLang's older bucket (no ``supports_multi_dtypes``): tensors of one dtype concatenated, offsets and
    ``numel`` in elements; senders send one bucket per dtype."""

    supports_multi_dtypes = False
    metadata_class = OlderFlattenedTensorMetadata

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.flatten()


# SGLang's names for these classes (pickle finds a class through its module and name)
LocalSerializedTensor.__module__ = SGLANG_MODULE
FlattenedTensorMetadata.__module__ = FlattenedTensorBucket.__module__ = TENSOR_BUCKET_MODULE
OlderFlattenedTensorMetadata.__module__ = OlderFlattenedTensorBucket.__module__ = SGLANG_MODULE
OlderFlattenedTensorMetadata.__name__ = OlderFlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
OlderFlattenedTensorBucket.__name__ = OlderFlattenedTensorBucket.__qualname__ = "FlattenedTensorBucket"
SGLANG_CLASSES = {
    SGLANG_MODULE: {
        "LocalSerializedTensor": LocalSerializedTensor,
        "FlattenedTensorMetadata": OlderFlattenedTensorMetadata,
        "FlattenedTensorBucket": OlderFlattenedTensorBucket,
    },
    TENSOR_BUCKET_MODULE: {
        "FlattenedTensorMetadata": FlattenedTensorMetadata,
        "FlattenedTensorBucket": FlattenedTensorBucket,
    },
}


@contextmanager
def _sglang_modules() -> Iterator[None]:
    """SGLang's modules holding these classes, in ``sys.modules`` while pickling (unless a process has its
    own, as slime's stubs do)."""
    added = [name for name in SGLANG_CLASSES if name not in sys.modules]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(SGLANG_CLASSES[name])
    try:
        yield
    finally:
        for name in added:
            del sys.modules[name]


def per_rank(tensors: dict[str, torch.Tensor], tp: int = 2) -> list[bytes]:
    """What SGLang's ``weight_sync.utils.update_weights`` hands the engine (VeRL's path) for a TP group of
    ``tp`` ranks: one serialized list of ``(name, LocalSerializedTensor)`` per rank."""
    named = [(name, LocalSerializedTensor([serialize(t)] * tp)) for name, t in tensors.items()]
    return [serialize(named)] * tp


def flattened_buckets(
    tensors: dict[str, torch.Tensor], tp: int = 2, older: bool = False
) -> list[list[bytes]]:
    """The ``serialized_named_tensors`` of each ``load_format: "flattened_bucket"`` request a sender makes
    for a TP group of ``tp`` ranks, as slime's ``_send_to_colocated_engine`` builds them: one request of every
    tensor (the current bucket) or, with ``older``, one request per dtype; in each, one serialized
    ``{"flattened_tensor", "metadata"}`` per rank."""
    kind = OlderFlattenedTensorBucket if older else FlattenedTensorBucket
    groups: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        groups.setdefault(t.dtype if older else "all", []).append((name, t))
    out = []
    for named in groups.values():
        bucket = kind(named_tensors=named)
        data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        out.append([serialize(data)] * tp)
    return out
