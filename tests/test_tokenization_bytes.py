"""``get_byte_vocab``, ``check_byte_decoder`` and the errors ``decode_vocab`` raises."""

from __future__ import annotations

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from genlm_backend.errors import VocabularyDecodeError
from genlm_backend.tokenization import ByteVocabError, Token, decode_vocab, get_byte_vocab
from genlm_backend.tokenization.bytes import ByteDecoderError, check_byte_decoder


class _NoVocabulary:
    """Neither a tokenizers backend, nor a byte_decoder, nor a SentencePiece model."""

    def __len__(self) -> int:
        return 1

    def convert_ids_to_tokens(self, ids):
        return ["x" for _ in ids]


def test_get_byte_vocab_is_the_bytes_of_decode_vocab(gpt2_tokenizer):
    byte_strings = get_byte_vocab(gpt2_tokenizer)
    tokens, _ = decode_vocab(gpt2_tokenizer)
    assert all(type(b) is bytes for b in byte_strings)
    assert byte_strings == [token.byte_string for token in tokens]
    assert [token.token_id for token in tokens] == list(range(len(tokens)))
    assert all(type(token) is Token for token in tokens)


def test_undecodable_vocabulary_errors():
    with pytest.raises(ByteVocabError, match="neither ByteLevel nor SentencePiece"):
        get_byte_vocab(_NoVocabulary())
    with pytest.raises(VocabularyDecodeError, match="Could not decode byte representation") as info:
        decode_vocab(_NoVocabulary())
    assert isinstance(info.value, ValueError) and "_NoVocabulary: token id 0 ('x')" in str(
        info.value
    )
    assert isinstance(info.value.__cause__, ByteVocabError)


def test_check_byte_decoder_accepts_the_gpt2_table():
    check_byte_decoder(None, {char: byte for byte, char in bytes_to_unicode().items()})


@pytest.mark.parametrize(
    "table, match",
    [
        ({"a": 999}, "'a' to 999"),
        ({"ab": 1}, "'ab' to 1"),
        ({}, "no character for 256 byte values"),
        ({chr(256 + b): b for b in range(255)}, r"no character for 1 byte values \(first: 255\)"),
        ([("a", 1)], "must be a mapping"),
    ],
)
def test_check_byte_decoder_rejects_incomplete_or_invalid_tables(table, match):
    with pytest.raises(ByteDecoderError, match=match):
        check_byte_decoder(None, table)
