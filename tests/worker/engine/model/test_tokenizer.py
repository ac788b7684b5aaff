"""A token's raw bytes (OpenAI's chat logprob ``bytes``) for the three kinds of tokenizer a model may ship:
byte-level BPE (a token that splits a character holds part of its UTF-8), SentencePiece with byte fallback
(``<0xE4>`` is one byte, ``▁`` a space), and added tokens."""

from __future__ import annotations

from rollout_worker.engine.model.tokenizer import TextCodec, byte_level_tokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models


def test_byte_level_tokens_hold_their_bytes_and_join_to_the_text() -> None:
    codec = TextCodec(byte_level_tokenizer(512))
    text = "a 你好 🙂!"
    ids = codec.encode(text)
    parts = [codec.token_bytes(t) for t in ids]
    assert b"".join(parts) == text.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in parts)  # a character split over tokens: its bytes


def test_sentencepiece_pieces_mark_spaces_and_fall_back_to_bytes() -> None:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁World": 2, "<0xE4>": 3, "<0xBD>": 4, "<0xA0>": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    codec = TextCodec(tok)
    assert codec.decode([1, 2]) == "Hello World"
    assert [codec.token_bytes(t) for t in (1, 2)] == [b" Hello", b" World"]  # the first space: stripped
    assert [codec.token_bytes(t) for t in (3, 4, 5)] == list(map(bytes, ([0xE4], [0xBD], [0xA0])))
    assert codec.token_bytes(tok.token_to_id("<s>")) == b"<s>"
