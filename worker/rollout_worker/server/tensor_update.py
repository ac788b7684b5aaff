"""``update_weights_from_tensor``: the named full tensors a trainer sends, decoded and staged as a checkpoint.

Two forms of ``serialized_named_tensors`` (a list of base64 strings, one per SGLang TP rank: every entry holds
the same full tensors, the first is read):
- safetensors bytes (the safe form, for our own clients): ``safetensors.torch.save(named_tensors)``;
- SGLang's form (VeRL's ``HttpServerAdapter``, slime's colocated path):
  ``MultiprocessingSerializer.serialize``, a torch multiprocessing pickle whose tensors are handles to shared
  memory on the same host, of ``[(name, tensor | LocalSerializedTensor), ...]`` or, with ``load_format:
  "flattened_bucket"``, of a flattened bucket (``rollout_worker.server.flattened_bucket``). Unpickling is
  code execution, so it is read only when the server trusts its key holders (``--trust-pickled-tensors``),
  and then by an unpickler that admits the globals of tensor rebuilds, torch dtypes, plain containers and
  SGLang's two wrapper classes (as stand-ins of ours) and nothing else.

The tensors (Hugging Face names, full shapes, checked against the model) are written to a staging checkpoint
whose index maps them to the new file and every other tensor to where it was; the engine then loads that
checkpoint as it loads one from disk (between steps, every rank its slice of the current layout).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_worker.config.engine_settings import DTYPES
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.engine.model.checkpoint_index import CheckpointIndex, tensor_shapes
from rollout_worker.errors import UserError
from rollout_worker.server.flattened_bucket import BucketEntry, unflatten

if TYPE_CHECKING:  # torch is imported when a trainer first sends tensors: the server process runs without it
    import torch

FIELD = "serialized_named_tensors"
_REBUILDS = {
    ("torch.multiprocessing.reductions", n)
    for n in ("rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_fd")
}
_CONTAINERS = {("builtins", n) for n in ("list", "tuple", "dict", "int", "float", "str", "bool", "bytes")}
_CONTAINERS |= {("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "_reconstructor")}
_TORCH = {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage")}
_FD = {("multiprocessing.resource_sharer", "DupFd"), ("builtins", "object")}


class SerializedTensor:
    """Stands for SGLang's ``LocalSerializedTensor``: one pickled tensor per TP rank in ``values``."""

    values: list[bytes]


# SGLang's classes, by name in any of its modules (they moved between releases), as our stand-ins
_SGLANG: dict[str, type] = {"LocalSerializedTensor": SerializedTensor, "FlattenedTensorMetadata": BucketEntry}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _SGLANG and module.startswith("sglang.srt."):
            return _SGLANG[name]
        if (module, name) in _REBUILDS | _CONTAINERS | _TORCH | _FD or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UserError(f"the pickle names {module}.{name}, which is not a tensor rebuild", FIELD)


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name in _dtype_names()


@functools.cache
def _dtype_names() -> frozenset[str]:
    import torch

    return frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))


def _unpickle(data: bytes) -> Any:
    try:
        return _TensorUnpickler(io.BytesIO(data)).load()
    except UserError:
        raise
    except Exception as exc:  # a truncated or foreign pickle, a shared-memory handle that cannot be opened
        raise UserError(f"cannot read the pickled tensors: {type(exc).__name__}: {exc}", FIELD) from None


def decode(payloads: list[str], trust_pickle: bool, bucket: bool = False) -> dict[str, torch.Tensor]:
    """The named tensors of a request (its first entry), in either form; ``bucket``: a flattened bucket."""
    if not payloads:
        raise UserError("no tensors", FIELD)
    try:
        raw = base64.b64decode(payloads[0], validate=True)
    except (binascii.Error, ValueError):
        raise UserError("not base64", f"{FIELD}.0") from None
    if raw[:1] == b"\x80":  # a pickle (protocol 2+)
        if not trust_pickle:
            raise UserError(
                "pickled tensors are refused: this server does not trust them (--trust-pickled-tensors); "
                "send safetensors bytes instead",
                FIELD,
            )
        return unflatten(_unpickle(raw), f"{FIELD}.0") if bucket else _named(_unpickle(raw))
    if bucket:
        raise UserError("a flattened bucket comes pickled (SGLang's MultiprocessingSerializer)", f"{FIELD}.0")
    try:
        from safetensors.torch import load as load_safetensors

        return dict(load_safetensors(raw))
    except Exception as exc:  # safetensors raises its own error types
        raise UserError(f"neither a pickle nor safetensors bytes ({exc})", f"{FIELD}.0") from None


def _named(obj: Any) -> dict[str, torch.Tensor]:
    import torch

    if isinstance(obj, dict) and "flattened_tensor" in obj:
        raise UserError(
            "the pickle is a flattened bucket: send load_format 'flattened_bucket'", "load_format"
        )
    if not isinstance(obj, list | tuple) or not all(isinstance(x, tuple) and len(x) == 2 for x in obj):
        raise UserError("the pickle is not a list of (name, tensor) pairs", FIELD)
    out = {}
    for name, value in obj:
        if isinstance(value, SerializedTensor):
            value = _unpickle(value.values[0]) if getattr(value, "values", None) else None
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise UserError(f"item {name!r} is not a (name, tensor) pair", FIELD)
        out[name] = value
    return out


def check(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Every tensor is one of the model's, with its full shape."""
    shapes = dict(tensor_shapes(cfg))
    for name, t in tensors.items():
        if name not in shapes:
            raise UserError(f"{name!r} is not a tensor of this model", FIELD)
        if tuple(t.shape) != shapes[name]:
            raise UserError(f"{name!r} has shape {list(t.shape)}, the model's is {list(shapes[name])}", FIELD)
        if not t.is_floating_point():
            raise UserError(f"{name!r} is {t.dtype}, not a floating-point tensor", FIELD)


def check_announced(
    names: list[str], dtypes: list[str], shapes: list[list[int]], cfg: ModelConfig
) -> list[str]:
    """The tensors a trainer will broadcast (``update_weights_from_distributed``), checked against the model
    before anything is received; returns the dtypes by their plain names (``torch.float32``: ``float32``)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise UserError(
            f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes: give one of each", "names"
        )
    model = dict(tensor_shapes(cfg))
    seen: set[str] = set()
    out = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if name not in model:
            raise UserError(f"{name!r} is not a tensor of this model", f"names.{i}")
        if name in seen:
            raise UserError(f"{name!r} is given twice", f"names.{i}")
        seen.add(name)
        if tuple(shape) != model[name]:
            raise UserError(f"{name!r} has shape {shape}, the model's is {list(model[name])}", f"shapes.{i}")
        plain = dtype.removeprefix("torch.")
        if plain not in DTYPES:
            raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}", f"dtypes.{i}")
        out.append(plain)
    return out


class Staging:
    """Checkpoints made of the served one plus the tensors sent so far, in a private directory."""

    def __init__(self) -> None:
        self._root: Path | None = None  # made on first use
        self.count = 0

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="rollout-weights-"))
        return self._root

    def stage(self, current: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Path:
        """A new checkpoint directory: ``tensors`` in a file of their own, the rest as in ``current``."""
        out, file = self.stage_index(current, cfg, list(tensors))
        from safetensors.torch import save_file

        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(file))
        return out

    def stage_index(self, current: Path, cfg: ModelConfig, names: list[str]) -> tuple[Path, Path]:
        """A new checkpoint directory whose index reads ``names`` from its ``update.safetensors`` (which
        the caller writes) and the rest as ``current`` does: (directory, file)."""
        index = CheckpointIndex(current, cfg)
        weight_map = {k: str((index.dir / f).resolve()) for k, f in index.weight_map.items()}
        self.count += 1
        out = self.root / f"update-{self.count}"
        out.mkdir()
        file = out / "update.safetensors"
        weight_map.update(dict.fromkeys(names, str(file)))
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
        return out, file

    def forget_except(self, keep: Path) -> None:
        """Remove staged checkpoints that ``keep`` (the one being served) no longer reads from."""
        index = (
            json.loads((keep / "model.safetensors.index.json").read_text())
            if keep.is_relative_to(self.root)
            else {"weight_map": {}}
        )
        used = {Path(f).parent for f in index["weight_map"].values()} | {keep}
        for d in self.root.iterdir():
            if d not in used:
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
