"""Named tensors as a trainer sends them to SGLang's ``update_weights_from_tensor``: SGLang's
``MultiprocessingSerializer`` form (a torch multiprocessing pickle, tensors as shared-memory handles), made
without SGLang. Shared by the tests of the route and of VeRL's HTTP adapter."""

from __future__ import annotations

import io
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

SGLANG_MODULE = "sglang.srt.model_executor.model_runner"


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
    """``MultiprocessingSerializer.serialize(obj)``: a torch multiprocessing pickle."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


class LocalSerializedTensor:  # SGLang's wrapper (one pickled tensor per TP rank), pickled by its name
    def __init__(self, values: list[bytes]) -> None:
        self.values = values


LocalSerializedTensor.__module__ = SGLANG_MODULE


def per_rank(tensors: dict[str, torch.Tensor], tp: int = 2) -> list[bytes]:
    """What SGLang's ``weight_sync.utils.update_weights`` hands the engine (VeRL's path) for a TP group of
    ``tp`` ranks: one serialized list of ``(name, LocalSerializedTensor)`` per rank."""
    named = [(name, LocalSerializedTensor([serialize(t)] * tp)) for name, t in tensors.items()]
    module = types.ModuleType(SGLANG_MODULE)
    module.LocalSerializedTensor = LocalSerializedTensor  # type: ignore[attr-defined]
    sys.modules[SGLANG_MODULE] = module  # (pickle finds a class through its module)
    try:
        payload = serialize(named)
    finally:
        del sys.modules[SGLANG_MODULE]
    return [payload] * tp
