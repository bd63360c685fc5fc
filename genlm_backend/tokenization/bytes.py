"""Byte vocabularies under the names of genlm-backend 0.3.1's ``tokenization.bytes`` module.

:func:`get_byte_vocab` and :class:`ByteVocabError` are those of
:mod:`genlm_backend.tokenization.vocab`; :func:`check_byte_decoder` validates a
GPT-2 style character -> byte table.
"""

from __future__ import annotations

from collections.abc import Mapping

from genlm_backend.errors import VocabularyDecodeError
from genlm_backend.tokenization.vocab import ByteVocabError, get_byte_vocab

__all__ = ["ByteDecoderError", "ByteVocabError", "check_byte_decoder", "get_byte_vocab"]


class ByteDecoderError(VocabularyDecodeError):
    """A character -> byte table that is not a complete byte decoder."""


def check_byte_decoder(tokenizer, byte_decoder: Mapping) -> None:
    """Check that ``byte_decoder`` maps single characters onto all 256 byte values.

    Args:
        tokenizer: The tokenizer the table belongs to (named in errors).
        byte_decoder: ``{character: byte}``, as a slow byte-level tokenizer's ``byte_decoder``.

    Raises:
        ByteDecoderError: an entry is not ``str`` of length 1 -> ``int`` in
            ``0..255``, or some byte value has no character.
    """
    name = type(tokenizer).__name__
    if not isinstance(byte_decoder, Mapping):
        raise ByteDecoderError(
            f"{name}: byte_decoder must be a mapping, got {type(byte_decoder).__name__}"
        )
    for char, byte in byte_decoder.items():
        if not (isinstance(char, str) and len(char) == 1 and type(byte) is int and 0 <= byte < 256):
            raise ByteDecoderError(
                f"{name}: byte_decoder maps {char!r} to {byte!r}; expected one character -> a byte 0..255"
            )
    missing = sorted(set(range(256)) - set(byte_decoder.values()))
    if missing:
        raise ByteDecoderError(
            f"{name}: byte_decoder has no character for {len(missing)} byte values "
            f"(first: {missing[0]})"
        )
