"""The real model (``make-model --preset smollm2-135m``) against its GGUF and against a second reference,
``transformers``' own GGUF loader: tensors exact, logits within 1e-4, greedy tokens equal on 20 chat prompts,
the tokenizer's ids on 100 strings and the chat template's text equal."""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.config.model_config import ModelConfig
from rollout_worker.data.prompts import ChatTemplate
from rollout_worker.engine.config import EngineConfig
from rollout_worker.engine.driver.fixed_batch import run_batch
from rollout_worker.engine.model.gguf_convert import open_gguf
from rollout_worker.engine.model.presets import GGUF_PRESETS
from rollout_worker.engine.model.tokenizer import TextCodec
from safetensors import safe_open

from tests.worker.engine.engine_util import decoder_logits

pytestmark = pytest.mark.slow  # a conversion and transformers' GGUF load per session: ~20 s of CPU

GGUF = GGUF_PRESETS["smollm2-135m"]
NEW_TOKENS = 16


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), as it wrote Q and K into the GGUF."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def reference() -> Iterator[tuple[Any, Any]]:
    """transformers' model (float32) and tokenizer loaded from the GGUF itself. Its three loads share one
    parse of the file's metadata (gguf.GGUFReader, the already parsed one: tens of seconds saved here)."""
    import transformers

    path = GGUF.path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda *a, **k: open_gguf(path).reader)
        kw: dict[str, Any] = {"gguf_file": path.name}
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
    yield model.eval(), tok


def _conversations() -> list[list[dict[str, str]]]:
    rng = random.Random(0)
    things = ["apples", "marbles", "stickers", "books", "cookies"]
    out = []
    for i in range(20):
        a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(2, 9)
        thing = things[i % len(things)]
        q = (
            f"Sam has {a} {thing} and buys {b} more, then gives away a {c}th of them. How many are left?"
            if i % 2
            else f"What is {a} times {c}, plus {b}? Answer briefly."
        )
        msgs = [{"role": "user", "content": q}]
        if i % 5 == 0:
            msgs.insert(0, {"role": "system", "content": "You are a careful math tutor."})
        out.append(msgs)
    return out


def test_tensors_equal_the_gguf_dequantized(smollm2: Path) -> None:
    """Every tensor, once permuted back as llama.cpp wrote it, equals the GGUF's dequantized (the names are
    the converter's; transformers' own mapping checks them in the logits test)."""
    by_name = open_gguf(GGUF.path()).hf_tensors()
    cfg = ModelConfig.load(smollm2)
    with safe_open(str(smollm2 / "model.safetensors"), framework="numpy") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names and cfg.tie_word_embeddings  # tied, as in the GGUF
        assert sorted(names) == sorted(by_name)
        for name in names:
            ours = f.get_tensor(name)
            t = by_name[name]
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            if ".q_proj." in name:
                ours = _permute(ours, cfg.num_heads)
            elif ".k_proj." in name:
                ours = _permute(ours, cfg.num_kv_heads)
            assert ours.dtype == np.float32 and np.array_equal(ours, want), name


def test_config(smollm2: Path) -> None:
    cfg = ModelConfig.load(smollm2)
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1536, 49152, 8192)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.bos_token_id, cfg.eos_token_ids) == (1e5, 1e-5, 1, (2,))


def test_logits_match_transformers_gguf_load(smollm2: Path, reference: tuple[Any, Any]) -> None:
    model, _ = reference
    codec = TextCodec.load(smollm2)
    template = ChatTemplate.of_model(smollm2)
    assert codec is not None and template is not None
    for msgs in _conversations()[:3]:
        ids = codec.encode(template.render(msgs))
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1]
        ours = decoder_logits(smollm2, ids, torch.float32)
        rel = float((ours - ref).abs().max() / ref.abs().max())
        assert rel < 1e-4, rel


@pytest.mark.long
@pytest.mark.multiproc
def test_greedy_matches_transformers_on_20_chat_prompts(smollm2: Path, reference: tuple[Any, Any]) -> None:
    model, _ = reference
    codec = TextCodec.load(smollm2)
    template = ChatTemplate.of_model(smollm2)
    assert codec is not None and template is not None
    prompts = [codec.encode(template.render(m)) for m in _conversations()]
    specs = [RequestSpec(f"p{i}", tuple(p), NEW_TOKENS, Sampling()) for i, p in enumerate(prompts)]
    ours = run_batch(EngineConfig.load(str(smollm2), 1), specs).tokens()
    width = max(map(len, prompts))  # left-padded batch, as transformers generates a batch
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    for i, row in enumerate(out[:, width:].tolist()):
        theirs = row[: row.index(2) + 1] if 2 in row else row  # EOS ends it (then padding)
        assert ours[f"p{i}"] == theirs, (i, codec.decode(ours[f"p{i}"]), codec.decode(theirs))
    assert sum(o[-1] == 2 for o in ours.values()) >= 1  # some answers end with EOS within 16 tokens


def _strings() -> list[str]:
    rng = random.Random(1)
    words = ["the", "Apple", "naïve", "café", "日本語", "🙂", "don't", "it's", "x", "HTTP", "résumé", "λ"]
    fixed = [
        "",
        " ",
        "   leading spaces",
        "a  1",
        "tabs\tand\nnewlines\n\n",
        "12345678901234567890",
        "3.14159 and 2,718",
        "#### 72",
        "<|im_start|>user\nHi<|im_end|>\n",
        "def f(x):\n    return x ** 2  # square",
        "Price: $1,299.99 (-15%)",
        "ünïcödé ñ 中文 العربية עברית",
    ]
    out = list(fixed)
    while len(out) < 100:
        parts = [rng.choice(words) if rng.random() < 0.7 else str(rng.randint(0, 10 ** rng.randint(1, 6)))]
        for _ in range(rng.randint(1, 12)):
            sep = rng.choice([" ", " ", " ", "  ", ", ", ". ", "\n", "-", "'", ""])
            tok = rng.choice(words) if rng.random() < 0.7 else str(rng.randint(0, 10 ** rng.randint(1, 6)))
            parts += [sep, tok]
        out.append("".join(parts))
    return out


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2: Path, reference: tuple[Any, Any]) -> None:
    """Equal ids on 100 strings. transformers' GGUF tokenizer lacks llama.cpp's ``smollm`` pre-tokenizer
    (each digit split off before the GPT-2 regex), so where a run of blanks precedes a digit it keeps the
    blanks apart (``a  1``: a, Ġ, Ġ, 1; llama.cpp and ours: a, ĠĠ, 1): those strings are compared with the
    split given to it."""
    import transformers
    from tokenizers import Regex, pre_tokenizers

    _, theirs = reference
    codec = TextCodec.load(smollm2)
    assert codec is not None
    converted = transformers.AutoTokenizer.from_pretrained(str(smollm2))  # the files load in transformers
    split = copy.deepcopy(theirs)
    split.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), split.backend_tokenizer.pre_tokenizer]
    )
    strings = _strings()
    assert len(set(strings)) == 100
    blanks_digit = [s for s in strings if re.search(r"\s\s\d", s)]
    assert 0 < len(blanks_digit) <= 15
    for s in strings:
        ids = codec.encode(s)
        ref = split if s in blanks_digit else theirs
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert ids == converted.encode(s, add_special_tokens=False), s
        assert codec.decode(ids, skip_special_tokens=False) == s
    assert codec.encode("a  1") == [81, 256, 33] != theirs.encode("a  1", add_special_tokens=False)
    # special tokens are whole and special: skipped when decoding
    assert codec.encode("<|im_start|>hi<|im_end|>")[::2] == [1, 2]
    assert codec.decode(codec.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_chat_template_renders_as_transformers(smollm2: Path, reference: tuple[Any, Any]) -> None:
    _, theirs = reference
    template = ChatTemplate.of_model(smollm2)
    codec = TextCodec.load(smollm2)
    assert template is not None and codec is not None
    convs = _conversations()[:5]
    convs.append([*convs[1], {"role": "assistant", "content": "12"}, {"role": "user", "content": "Why?"}])
    for msgs in convs:
        text = template.render(msgs)
        assert text == theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
