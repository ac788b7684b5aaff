"""Hugging Face checkpoint directories: writing seeded random ones, and reading one rank's slices.

Reading never loads a whole tensor a rank does not need: ``safe_open(...).get_slice(name)[a:b]``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout_worker.api.errors import UserError
from rollout_worker.api.model_config import ModelConfig
from rollout_worker.engine.presets import preset_config
from rollout_worker.engine.sharding import ShardRange
from rollout_worker.engine.tokenizer import byte_level_tokenizer

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SHARD_BYTES = 2 * 1024**3  # split checkpoints larger than this into model-0000i-of-0000n files


def parse_dtype(name: str, what: str = "dtype") -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}", what)
    return DTYPES[name]


def tensor_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in Hugging Face naming, with its full shape."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    yield "model.embed_tokens.weight", (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        if cfg.attention_bias:
            yield p + "self_attn.q_proj.bias", (q,)
            yield p + "self_attn.k_proj.bias", (kv,)
            yield p + "self_attn.v_proj.bias", (kv,)
        if cfg.qk_norm:
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)
        yield p + "mlp.up_proj.weight", (cfg.intermediate_size, h)
        yield p + "mlp.down_proj.weight", (h, cfg.intermediate_size)
    yield "model.norm.weight", (h,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, h)


def random_tensor(
    name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
    elif name.endswith(".bias"):
        t = 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
    else:
        fan_in = shape[-1] if len(shape) > 1 else 1
        std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(fan_in)
        t = std * torch.randn(shape, generator=gen, dtype=torch.float32)
    return t.to(dtype)


def make_model(preset: str, seed: int, out: str | Path, dtype: str = "float32") -> ModelConfig:
    """Write a seeded random checkpoint of a named preset to ``out``."""
    return write_random_checkpoint(preset_config(preset), seed, out, dtype, where=f"preset {preset}")


def write_random_checkpoint(
    raw: dict[str, Any], seed: int, out: str | Path, dtype: str = "float32", where: str = "config"
) -> ModelConfig:
    """Write config.json, seeded random safetensors and tokenizer.json to ``out`` atomically."""
    raw = {**raw, "torch_dtype": dtype}
    raw.setdefault("rms_norm_eps", 1e-5)
    raw.setdefault("bos_token_id", 256)
    raw.setdefault("eos_token_id", 257)
    raw.setdefault("pad_token_id", 258)
    cfg = ModelConfig.from_dict(raw, where=where)
    tdtype = parse_dtype(dtype)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out: {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".make-model-", dir=out.parent))
    try:
        _write_weights(cfg, tmp, seed, tdtype)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        gen_cfg = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg) + "\n")
        byte_level_tokenizer(cfg.vocab_size).save(str(tmp / "tokenizer.json"))
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "pad_token": "<|pad|>",
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


def _write_weights(cfg: ModelConfig, out: Path, seed: int, dtype: torch.dtype) -> None:
    """Generate tensors in checkpoint order; keep at most one shard (SHARD_BYTES) in memory."""
    gen = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=dtype).element_size()
    parts: list[Path] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, shape in tensor_shapes(cfg):
        nbytes = math.prod(shape) * elem
        if current and size + nbytes > SHARD_BYTES:
            parts.append(_save_part(current, out, len(parts)))
            current, size = {}, 0
        current[name] = random_tensor(name, shape, gen, dtype)
        size += nbytes
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


class CheckpointReader:
    """Reads tensors or slices of tensors from a checkpoint directory (single file or sharded index)."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig) -> None:
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"{index}: not a safetensors index ({type(exc).__name__})", "model") from exc
        elif (self.dir / "model.safetensors").exists():
            self.weight_map = {k: "model.safetensors" for k in _header(self.dir / "model.safetensors")}
        else:
            raise UserError(f"no model.safetensors or model.safetensors.index.json in {self.dir}", "model")
        self.expected = dict(tensor_shapes(cfg))
        self._handles: dict[str, Any] = {}

    def verify(self) -> None:
        """Every tensor the config implies is present with its shape (reads headers only)."""
        for name, shape in self.expected.items():
            file = self.weight_map.get(name)
            if file is None:
                raise UserError(f"checkpoint {self.dir}: missing tensor {name!r}")
            got = tuple(self._handle(file).get_slice(name).get_shape())
            if got != shape:
                raise UserError(
                    f"checkpoint {self.dir}: tensor {name!r} has shape {list(got)}, "
                    f"config.json implies {list(shape)}"
                )

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = self.dir / file
            _header(path)  # a truncated file would crash the process when its pages are read
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


def _header(path: Path) -> dict[str, Any]:
    """The tensor entries of a safetensors file, after checking that the file holds every byte they
    describe. Reading a slice of a truncated file through mmap kills the process with SIGBUS, so this
    check runs before any tensor is read."""
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = path.stat().st_size
            if n <= 0 or 8 + n > size:
                raise UserError(f"{path}: not a safetensors file (bad header length)", "model")
            header = json.loads(f.read(n))
    except FileNotFoundError as exc:
        raise UserError(f"{path}: file not found", "model") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a safetensors file (bad header)", "model") from exc
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if 8 + n + end > size:
        raise UserError(
            f"{path}: truncated ({size} bytes, the header describes {8 + n + end}); re-copy the checkpoint",
            "model",
        )
    return tensors
