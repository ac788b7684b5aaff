"""A byte-level tokenizer for the random checkpoints, and loading a checkpoint's tokenizer.json."""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from rollout_worker.errors import UserError

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """256 byte tokens, then BOS/EOS/PAD, then ``<|extra_i|>`` up to ``vocab_size`` (ids are dense)."""
    if vocab_size < 256 + len(SPECIALS):
        raise UserError(f"vocab_size must be >= {256 + len(SPECIALS)} for the byte-level tokenizer")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_BYTE_OF.__getitem__))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    extras = [f"<|extra_{i}|>" for i in range(vocab_size - 256 - len(SPECIALS))]
    tok.add_special_tokens([*SPECIALS, *extras])
    return tok


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


# ByteLevel maps byte b to a printable character; this recovers b (the byte-level tokenizer's token id)
_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token (SentencePiece)
_WORD_MARKER = "\u2581"  # SentencePiece's mark of a word's start (▁), a space in the text


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise UserError(f"no tokenizer.json in {model_dir} (needed for text prompts)", "model")
    return Tokenizer.from_file(str(path))


class TextCodec:
    """Text <-> token ids for one model: what the server, the CLI and stop strings use."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    @classmethod
    def load(cls, model_dir: str | Path) -> TextCodec | None:
        """The model's codec, or None when the checkpoint has no tokenizer.json (token ids only)."""
        return cls(load_tokenizer(model_dir)) if (Path(model_dir) / "tokenizer.json").exists() else None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens included), as logprob entries show it."""
        return str(self.tok.decode([token], skip_special_tokens=False))

    def token_bytes(self, token: int) -> bytes:
        """One token's raw bytes (OpenAI's logprob ``bytes``): an added token's text, a byte-level BPE
        token's own bytes (part of a character, for a token that splits one), a byte-fallback token's
        (``<0xE4>``) byte, a SentencePiece piece's text with its word marker as the space it stands for
        (``▁Hello``: `` Hello``), else the UTF-8 of its text. For a byte-level tokenizer a sequence's tokens'
        bytes, joined, are the UTF-8 of its text (special tokens included); a SentencePiece decoder also
        strips the text's first space."""
        added = self._added.get(token)
        piece = self.tok.id_to_token(token)
        if added is not None or piece is None:
            return (added or self.token_text(token)).encode()
        if "ByteLevel" in self._decoders and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if "ByteFallback" in self._decoders and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        if self._decoders & {"Metaspace", "Replace"}:  # SentencePiece's word marker: a space
            return piece.replace(_WORD_MARKER, " ").encode()
        return self.token_text(token).encode()

    @cached_property
    def _added(self) -> dict[int, str]:
        """The added tokens' texts (special tokens among them), by id."""
        return {i: t.content for i, t in self.tok.get_added_tokens_decoder().items()}

    @cached_property
    def _decoders(self) -> set[str]:
        """The types of the tokenizer's decoder (of each of its parts, for a sequence of decoders)."""
        decoder = self.tok.decoder  # (its own JSON: the tokenizer's whole would hold the vocabulary)
        d = json.loads(decoder.__getstate__()) if decoder is not None else {}
        parts = d.get("decoders", []) if d.get("type") == "Sequence" else [d]
        return {str(part.get("type")) for part in parts}


class IncrementalText:
    """Cumulative text of a growing id sequence without decoding it all again at every token: only a
    window of the last tokens is decoded, and text is emitted once it no longer ends in a partial
    character. ``final`` decodes everything once, exactly."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self.codec, self.skip = codec, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def extend(self, ids: list[int]) -> str:
        self.ids += ids
        before = self.codec.decode(self.ids[self._prefix : self._read], self.skip)
        now = self.codec.decode(self.ids[self._prefix :], self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text

    def final(self) -> str:
        self.text = self.codec.decode(self.ids, self.skip)
        return self.text
