"""Byte-level vocabularies: the exact bytes of every token id of a tokenizer."""

from genlm_backend.tokenization.token import Token
from genlm_backend.tokenization.vocab import (
    BYTE2STR_FALLBACKS,
    STR_FALLBACKS,
    Byte2StrFallback,
    ByteVocabError,
    StrFallback,
    decode_vocab,
    get_byte_vocab,
)

__all__ = [
    "BYTE2STR_FALLBACKS",
    "STR_FALLBACKS",
    "Byte2StrFallback",
    "ByteVocabError",
    "StrFallback",
    "Token",
    "decode_vocab",
    "get_byte_vocab",
]
