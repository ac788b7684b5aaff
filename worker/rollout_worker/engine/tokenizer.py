"""A byte-level tokenizer for the random checkpoints, and loading a checkpoint's tokenizer.json."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from rollout_worker.api.errors import UserError

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """256 byte tokens, then BOS/EOS/PAD, then ``<|extra_i|>`` up to ``vocab_size`` (ids are dense)."""
    if vocab_size < 256 + len(SPECIALS):
        raise UserError(f"vocab_size must be >= {256 + len(SPECIALS)} for the byte-level tokenizer")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    extras = [f"<|extra_{i}|>" for i in range(vocab_size - 256 - len(SPECIALS))]
    tok.add_special_tokens([*SPECIALS, *extras])
    return tok


def _byte_of(ch: str) -> int:
    """ByteLevel maps byte b to a printable char; recover b so that token id == byte value."""
    table = _bytes_to_unicode()
    return next(b for b, c in table.items() if c == ch)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise UserError(f"--model: no tokenizer.json in {model_dir} (needed for text prompts)")
    return Tokenizer.from_file(str(path))
