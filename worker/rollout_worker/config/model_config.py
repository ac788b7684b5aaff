"""Model configuration read from a Hugging Face ``config.json`` (Llama 3.x, Qwen2, Qwen3)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_worker.data.files import read_text
from rollout_worker.errors import UserError
from rollout_worker.scheduling.head_shards import max_kv_heads
from rollout_worker.scheduling.layout import Layout, candidate_layouts, tp_problem

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UserError(
                f"{where}: unknown architecture {archs!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        family = ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in raw:
                raise UserError(f"{where}: missing field {key!r}")
            return raw[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = raw.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        )
        cfg = cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        cfg.validate(where)
        return cfg

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise UserError(f"{model_dir} is not a directory", "model")
        if not path.exists():
            raise UserError(f"no config.json in {model_dir}", "model")
        try:
            raw = json.loads(read_text(path, "model", "model config"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        return cls.from_dict(raw, where=str(path))

    @property
    def weight_elements(self) -> int:
        """Elements of the whole model's weights (every layer's projections and norms, the embedding, the
        LM head unless tied, the final norm): what one TP=1 rank holds."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * h * self.intermediate_size + 2 * h + (2 * hd if self.qk_norm else 0)
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * layer + heads * self.vocab_size * h + h

    def validate(self, where: str = "config.json") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise UserError(f"{where}: {name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise UserError(f"{where}: rope_scaling type {kind!r} is not supported (llama3, linear)")

    def tp_problem(self, tp: int) -> str | None:
        """Why this model cannot run at TP size ``tp``, or None."""
        return tp_problem(tp, self.num_heads, self.vocab_size)

    def candidate_layouts(self, world: int) -> list[Layout]:
        """Every layout of ``world`` ranks this model can run (heads and vocabulary), smallest TP first."""
        return candidate_layouts(world, self.num_heads, self.vocab_size)

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads of the widest shard of a TP-``tp`` replica (shards may differ: :mod:`~.heads`)."""
        return max_kv_heads(self.num_kv_heads, tp)
