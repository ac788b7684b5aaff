"""A Hugging Face checkpoint's parts from a GGUF file (llama.cpp's format), read with the ``gguf`` package:
``config.json`` in transformers' Llama format, the tensors dequantized to float32 in Hugging Face naming with
the Q/K rows un-permuted, and the byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json``).
numpy, gguf and tokenizers only (no torch): ``checkpoint.make_model`` writes the files.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from rollout_worker.errors import UserError

# GGUF tensor names -> Hugging Face's (Llama); ``{i}`` is the layer
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# How llama.cpp splits text before BPE, by ``tokenizer.ggml.pre`` (its llama-vocab.cpp): the byte-level
# GPT-2 regex, after each digit is cut off on its own for the StarCoder-like vocabularies (SmolLM's).
_GPT2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
_PRE_TOKENIZERS: dict[str, list[Any]] = {
    "gpt2": [_GPT2],
    "smollm": [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), _GPT2],
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class _Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memmap: the same parse, several times faster (each of
    the ~1M small views that 100k tokens and merges take would run numpy.memmap's Python hooks)."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py) of Q or K rows: it interleaved each
    head's two rotary halves for its rope; Hugging Face's rope keeps them as halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GgufModel:
    """One Llama-architecture GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = _Reader(path)
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: not a readable GGUF file ({exc})") from exc
        arch = self.value("general.architecture")
        if arch != "llama":
            raise UserError(f"{path}: GGUF architecture {arch!r}; only 'llama' converts")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.heads = int(self.value("llama.attention.head_count"))
        self.kv_heads = int(self.value("llama.attention.head_count_kv", self.heads))

    def value(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise UserError(f"{self.path}: no {key!r} in the GGUF metadata")
            return default
        return field.contents()

    def config(self) -> dict[str, Any]:
        """``config.json`` (transformers' ``LlamaForCausalLM``), dtype aside."""

        def llama(key: str, default: Any = None) -> Any:
            return self.value(f"llama.{key}", default)

        if self.reader.fields.get("llama.rope.scaling.type") is not None:
            raise UserError(f"{self.path}: rope scaling in a GGUF is not supported")
        hidden = int(llama("embedding_length"))
        head_dim = int(llama("attention.key_length", llama("rope.dimension_count", hidden // self.heads)))
        tok = "tokenizer.ggml."
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": hidden,
            "intermediate_size": int(llama("feed_forward_length")),
            "num_hidden_layers": int(llama("block_count")),
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": head_dim,
            "vocab_size": int(llama("vocab_size", len(self.reader.fields[f"{tok}tokens"].data))),
            "max_position_embeddings": int(llama("context_length")),
            "rope_theta": float(llama("rope.freq_base", 10000.0)),
            # stored as float32: written back as the shortest decimal that rounds to it (1e-05, not 9.99e-06)
            "rms_norm_eps": float(str(np.float32(llama("attention.layer_norm_rms_epsilon")))),
            "attention_bias": False,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": int(self.value(f"{tok}bos_token_id")),
            "eos_token_id": int(self.value(f"{tok}eos_token_id")),
            "pad_token_id": int(self.value(f"{tok}padding_token_id", self.value(f"{tok}eos_token_id"))),
        }

    def hf_name(self, name: str) -> str:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        if m and m[2] in _LAYER_NAMES:
            return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
        stem, _, kind = name.rpartition(".")
        if stem in _TOP_NAMES:
            return f"{_TOP_NAMES[stem]}.{kind}"
        raise UserError(f"{self.path}: tensor {name!r} has no Hugging Face Llama counterpart")

    def hf_tensors(self) -> dict[str, gguf.ReaderTensor]:
        """The file's tensors by Hugging Face name."""
        return {self.hf_name(name): t for name, t in self.tensors.items()}

    def dequantized(self, t: gguf.ReaderTensor) -> np.ndarray:
        """One tensor as float32 in Hugging Face's layout (Q/K rows un-permuted), row-major as numpy's."""
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy, writable
        if t.name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute(w, self.heads)
        if t.name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute(w, self.kv_heads)
        return w

    def tokenizer(self) -> Tokenizer:
        """Byte-level BPE from the file's tokens and merges, split as llama.cpp splits for its ``pre`` type;
        control tokens (``<|im_start|>``, ...) special, user-defined ones added whole."""
        kind, pre = self.value("tokenizer.ggml.model"), self.value("tokenizer.ggml.pre", "gpt2")
        if kind != "gpt2":
            raise UserError(f"{self.path}: tokenizer {kind!r}; only byte-level BPE ('gpt2') converts")
        if pre not in _PRE_TOKENIZERS:
            raise UserError(
                f"{self.path}: pre-tokenizer {pre!r} unknown; known: {', '.join(_PRE_TOKENIZERS)}"
            )
        tokens = self.value("tokenizer.ggml.tokens")
        types = self.value("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ")) for m in self.value("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(_PRE_TOKENIZERS[pre])
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
        users = [t for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in users])
        return tok

    def tokenizer_config(self) -> dict[str, Any]:
        """``tokenizer_config.json``: the special tokens, the chat template, the file's add-BOS/EOS flags."""
        tokens = self.reader.fields["tokenizer.ggml.tokens"]
        out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
            if f"tokenizer.ggml.{key}_token_id" in self.reader.fields:
                out[f"{name}_token"] = tokens.contents(int(self.value(f"tokenizer.ggml.{key}_token_id")))
        out["add_bos_token"] = bool(self.value("tokenizer.ggml.add_bos_token", False))
        out["add_eos_token"] = bool(self.value("tokenizer.ggml.add_eos_token", False))
        out["clean_up_tokenization_spaces"] = False
        out["model_max_length"] = int(self.value("llama.context_length"))
        if "tokenizer.chat_template" in self.reader.fields:
            out["chat_template"] = self.value("tokenizer.chat_template")
        return out


@lru_cache(maxsize=2)
def open_gguf(path: Path) -> GgufModel:
    """A parsed GGUF, once per process (its metadata takes a second or more to read)."""
    return GgufModel(path)
