"""Byte-level vocabularies: the exact bytes of every token id of a tokenizer."""

from genlm_backend.tokenization.token import Token
from genlm_backend.tokenization.vocab import STR_FALLBACKS, StrFallback, decode_vocab

__all__ = ["STR_FALLBACKS", "StrFallback", "Token", "decode_vocab"]
