"""A checkpoint's index, read without torch: which file holds each tensor and with which shape (from the
safetensors headers), checked against the shapes the model's config implies. The driver verifies a
checkpoint with it before starting any rank; the ranks read tensors through ``checkpoint.CheckpointReader``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_worker.config.model_config import ModelConfig
from rollout_worker.errors import UserError


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


class CheckpointIndex:
    def __init__(self, model_dir: str | Path, cfg: ModelConfig) -> None:
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"{index}: not a safetensors index ({type(exc).__name__})", "model") from exc
        elif (self.dir / "model.safetensors").exists():
            self.weight_map = {k: "model.safetensors" for k in read_header(self.dir / "model.safetensors")}
        else:
            raise UserError(f"no model.safetensors or model.safetensors.index.json in {self.dir}", "model")
        self.expected = dict(tensor_shapes(cfg))

    def verify(self) -> None:
        """Every tensor the config implies is present with its shape, every file whole (headers only)."""
        headers: dict[str, dict[str, Any]] = {}
        for name, shape in self.expected.items():
            file = self.weight_map.get(name)
            if file is None:
                raise UserError(f"checkpoint {self.dir}: missing tensor {name!r}")
            if file not in headers:
                headers[file] = read_header(self.dir / file)
            entry = headers[file].get(name)
            if entry is None:
                raise UserError(f"checkpoint {self.dir}: tensor {name!r} is not in {file}")
            got = tuple(entry["shape"])
            if got != shape:
                raise UserError(
                    f"checkpoint {self.dir}: tensor {name!r} has shape {list(got)}, "
                    f"config.json implies {list(shape)}"
                )


def read_header(path: Path) -> dict[str, Any]:
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
