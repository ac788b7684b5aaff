"""``load_format`` of SGLang's three weight updates: the values each route reads, and a reason for every
other value SGLang defines. A refused or unknown value is a 400 naming ``load_format`` that lists what is
supported.

- ``/update_weights_from_disk``: SGLang's ``LoadFormat`` (``configs/load_config.py``), how a checkpoint
  directory is read. The engine reads a Hugging Face safetensors checkpoint as it is: null, ``auto`` and
  ``safetensors`` (``fastsafetensors`` reads the same files through another reader).
- ``/update_weights_from_tensor``: null (``(name, tensor)`` pairs) or ``flattened_bucket`` (one flat tensor
  and per-tensor metadata, ``rollout_worker.server.flattened_bucket``). ``direct`` and custom loaders (an
  import path SGLang's ``--custom-weight-loader`` registers, e.g. VeRL's delta loader) are refused.
- ``/update_weights_from_distributed``: null (one broadcast per tensor) or ``flattened_bucket`` (one
  broadcast of every tensor's bytes back to back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import AfterValidator

BUCKET = "flattened_bucket"
_QUANTIZES = "quantizes the weights as it loads them; this engine serves the checkpoint's weights as they are"
_REMOTE = "fetches the weights from elsewhere; give a checkpoint directory below --weights-root"
_PICKLES = "reads PyTorch .bin files (pickles); this engine reads safetensors checkpoints"


@dataclass(frozen=True)
class Formats:
    """The values of ``load_format`` a route reads (null always), and why it reads no other SGLang defines."""

    accepted: tuple[str, ...]
    refused: Mapping[str, str] = field(default_factory=dict)
    loaders: bool = False  # an import path names one of SGLang's custom weight loaders

    def check(self, value: str | None) -> str | None:
        if value is None or value in self.accepted:
            return value
        supported = ", ".join(["null", *(repr(v) for v in self.accepted)])
        if value in self.refused:
            reason = self.refused[value]
        elif self.loaders and "." in value:
            reason = (
                "names a custom weight loader (SGLang's --custom-weight-loader: code run inside the engine); "
                "this engine runs none"
            )
        else:
            reason = "is not one of SGLang's load formats for this update"
        raise ValueError(f"{value!r} {reason}. Supported: {supported}")


DISK = Formats(
    ("auto", "safetensors", "fastsafetensors"),
    {
        "pt": _PICKLES,
        "npcache": _PICKLES,
        "dummy": "makes random weights (for profiling) instead of reading the checkpoint",
        "sharded_state": "reads SGLang's per-rank shards; this engine slices a whole checkpoint itself",
        "gguf": "reads a GGUF file; convert it to a safetensors checkpoint",
        "mistral": "reads Mistral's consolidated files; use the Hugging Face (safetensors) checkpoint",
        "jax": "reads Flax weights; use the safetensors checkpoint",
        "bitsandbytes": _QUANTIZES,
        "layered": _QUANTIZES,
        "flash_rl": _QUANTIZES,
        "remote": _REMOTE,
        "remote_instance": _REMOTE,
        "rdma": _REMOTE,
        "local_cached": _REMOTE,
        "runai_streamer": _REMOTE,
        "private": "is a loader of SGLang's own builds",
    },
)
TENSOR = Formats(
    (BUCKET,),
    {
        "direct": (
            "writes SGLang's own parameters (fused, one shard per TP rank) by their names; this engine takes "
            "Hugging Face tensors"
        )
    },
    loaders=True,
)
DISTRIBUTED = Formats((BUCKET,))

DiskFormat = Annotated[str | None, AfterValidator(DISK.check)]
TensorFormat = Annotated[str | None, AfterValidator(TENSOR.check)]
DistributedFormat = Annotated[str | None, AfterValidator(DISTRIBUTED.check)]
