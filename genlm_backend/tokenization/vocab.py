"""``decode_vocab``: the exact bytes (and a display string) of every token id.

The bytes come from the tokenizer's own description of its vocabulary, never
from per-token ``decode()`` calls (which drop leading spaces, merge byte
pieces into U+FFFD and so lose bytes) and never from reloading anything by name:

* a ``tokenizers``-backed ("fast") tokenizer: the backend's decoder steps are
  replayed on each token string (:mod:`genlm_backend.tokenization.decoders`);
* a Python ("slow") tokenizer with a GPT-2 style ``byte_decoder`` table;
* a Python tokenizer over a SentencePiece model (``sp_model``): ``▁`` -> space,
  byte pieces ``<0xNN>`` -> that byte.

Anything else raises :class:`ByteVocabError` (from :func:`get_byte_vocab`;
:func:`decode_vocab` raises it as a
:class:`~genlm_backend.errors.VocabularyDecodeError`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

from genlm_backend.errors import VocabularyDecodeError
from genlm_backend.tokenization.decoders import (
    UnsupportedDecoderError,
    byte_fallback_byte,
    decode_with_decoder,
)
from genlm_backend.tokenization.token import Token, make_tokens

Byte2StrFallback = Literal[
    "tokenizer", "latin1", "replace", "surrogateescape", "backslashreplace", "strict"
]
BYTE2STR_FALLBACKS: tuple[str, ...] = (
    "tokenizer",
    "latin1",
    "replace",
    "surrogateescape",
    "backslashreplace",
    "strict",
)
# Older names, kept for callers of ``decode_vocab(..., str_fallback=...)``.
StrFallback = Byte2StrFallback
STR_FALLBACKS = BYTE2STR_FALLBACKS


class ByteVocabError(VocabularyDecodeError):
    """:func:`get_byte_vocab` cannot recover the bytes of a tokenizer's tokens."""


def decode_vocab(
    tokenizer,
    byte2str_fallback: Byte2StrFallback = "tokenizer",
    *,
    str_fallback: Byte2StrFallback | None = None,
) -> tuple[list[Token], list[str]]:
    """The bytes and strings of every token of ``tokenizer``.

    Args:
        tokenizer: A transformers tokenizer (``TokenizersBackend``/"fast" or
            ``PythonBackend``/"slow") or a bare ``tokenizers.Tokenizer``. Only the
            object is read; nothing is loaded by name.
        byte2str_fallback: How ``str_vocab`` spells a token whose bytes are not
            valid UTF-8 (a lone byte-fallback piece such as Gemma's ``<0x80>``, or
            half of a multi-byte character in a byte-level BPE):
            ``"tokenizer"`` (default): the token's own string in the tokenizer
            (``convert_ids_to_tokens``, e.g. ``"<0x80>"`` or ``"Ã"``);
            ``"latin1"``: the bytes decoded as latin-1 (one character per byte);
            ``"replace"``: U+FFFD per invalid sequence, as ``tokenizer.decode``
            does; ``"surrogateescape"``: lossless
            (``s.encode("utf-8", "surrogateescape")`` gives the bytes back);
            ``"backslashreplace"``: ``\\x80``; ``"strict"``: raise.
        str_fallback: The same option under its older name; give one or the other.

    Returns:
        ``(byte_vocab, str_vocab)``, both of length ``len(tokenizer)`` (added and
        special tokens included). ``byte_vocab[i]`` is a :class:`Token` holding
        the exact bytes of token id ``i`` and ``token_id == i``;
        ``str_vocab[i]`` is those bytes decoded as UTF-8, or the fallback.
        Special tokens map to the bytes of their text (``b"<|endoftext|>"``).

    Raises:
        ValueError: an unknown ``byte2str_fallback``, or both it and ``str_fallback``.
        VocabularyDecodeError: (a ``ValueError``) the tokenizer's bytes cannot be
            recovered (an unsupported decoder or tokenizer kind, a hole in the id
            range, a token outside the byte table): the message starts
            ``"Could not decode byte representation"`` and names the tokenizer
            class and the first token that failed; or ``"strict"`` met a token
            that is not valid UTF-8.
    """
    fallback = _checked_fallback(byte2str_fallback, str_fallback)
    try:
        byte_strings = get_byte_vocab(tokenizer)
    except ByteVocabError as exc:
        raise VocabularyDecodeError(
            f"Could not decode byte representation of the token vocabulary: {exc}"
        ) from exc
    byte_vocab = make_tokens(byte_strings)
    return byte_vocab, _str_vocab(tokenizer, byte_strings, fallback)


def _checked_fallback(byte2str_fallback: str, str_fallback: str | None) -> str:
    if str_fallback is not None:
        if byte2str_fallback != "tokenizer":
            raise ValueError("give byte2str_fallback or str_fallback (its older name), not both")
        byte2str_fallback = str_fallback
    if byte2str_fallback not in BYTE2STR_FALLBACKS:
        raise ValueError(
            f"Unknown byte2str_fallback strategy: {byte2str_fallback!r}; "
            f"must be one of {BYTE2STR_FALLBACKS}"
        )
    return byte2str_fallback


def get_byte_vocab(tokenizer) -> list[bytes]:
    """The exact bytes of every token id of ``tokenizer`` (see the module docstring).

    Raises:
        ByteVocabError: the bytes cannot be recovered; the message names the
            tokenizer class and the first token that failed.
    """
    backend = _tokenizers_backend(tokenizer)
    if backend is not None:
        return _fast_token_bytes(tokenizer, backend)
    if isinstance(getattr(tokenizer, "byte_decoder", None), dict):
        return _byte_decoder_token_bytes(tokenizer)
    if getattr(tokenizer, "sp_model", None) is not None:
        return _sentencepiece_token_bytes(tokenizer)
    first = _token_strings(tokenizer, 1)[0] if _vocab_size(tokenizer) else None
    raise _error(
        tokenizer,
        0,
        first,
        "its decoder is neither ByteLevel nor SentencePiece (no tokenizers backend, "
        "no byte_decoder table, no SentencePiece model)",
    )


def _tokenizers_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer``, or ``None``."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for name in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


def _vocab_size(tokenizer) -> int:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.get_vocab_size(with_added_tokens=True)
    return len(tokenizer)


def _token_strings(tokenizer, num_tokens: int) -> list[str | None]:
    """Token strings by id as the tokenizer spells them (added tokens: their text)."""
    return _token_strings_at(tokenizer, list(range(num_tokens)))


def _token_strings_at(tokenizer, token_ids: list[int]) -> list[str | None]:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return [tokenizer.id_to_token(i) for i in token_ids]
    return tokenizer.convert_ids_to_tokens(token_ids)


def _checked_token_strings(tokenizer, backend=None) -> list[str]:
    num_tokens = _vocab_size(tokenizer)
    if backend is not None:
        tokens = list(map(backend.id_to_token, range(num_tokens)))
    else:
        tokens = _token_strings(tokenizer, num_tokens)
    for token_id, token in enumerate(tokens):
        if not isinstance(token, str):
            raise _error(tokenizer, token_id, token, "the id has no token string")
    return tokens


def _fast_token_bytes(tokenizer, backend) -> list[bytes]:
    tokens = _checked_token_strings(tokenizer, backend)
    decoder = backend.decoder
    description = None if decoder is None else json.loads(decoder.__getstate__())
    try:
        return decode_with_decoder(description, tokens)
    except UnsupportedDecoderError as exc:
        raise _error(tokenizer, 0, tokens[0] if tokens else None, str(exc)) from None


def _added_token_ids(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "added_tokens_decoder", {}) or {})


def _byte_decoder_token_bytes(tokenizer) -> list[bytes]:
    """Slow byte-level BPE: every regular token must spell bytes in ``byte_decoder``;
    added tokens are their text (as the slow tokenizer decodes them)."""
    table = tokenizer.byte_decoder
    added = _added_token_ids(tokenizer)
    result = []
    for token_id, token in enumerate(_checked_token_strings(tokenizer)):
        if token_id in added:
            result.append(token.encode("utf-8"))
            continue
        try:
            result.append(bytes([table[char] for char in token]))
        except (KeyError, ValueError, TypeError):
            raise _error(
                tokenizer, token_id, token, "a character is not in its byte_decoder"
            ) from None
    return result


def _sentencepiece_token_bytes(tokenizer) -> list[bytes]:
    """Slow SentencePiece: byte pieces are their byte, ``▁`` is a space, added
    and control tokens are their text."""
    sp_model = tokenizer.sp_model
    added = _added_token_ids(tokenizer)
    result = []
    for token_id, token in enumerate(_checked_token_strings(tokenizer)):
        byte = None if token_id in added else byte_fallback_byte(token)
        if byte is not None and sp_model.is_byte(sp_model.piece_to_id(token)):
            result.append(byte)
        else:
            result.append(token.replace("\u2581", " ").encode("utf-8"))
    return result


def _str_vocab(tokenizer, byte_strings: Sequence[bytes], fallback: str) -> list[str]:
    if fallback in ("tokenizer", "latin1"):
        return _str_vocab_with(tokenizer, byte_strings, fallback)
    try:
        return [b.decode("utf-8", fallback) for b in byte_strings]
    except UnicodeDecodeError:
        for token_id, token in enumerate(byte_strings):
            try:
                token.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise VocabularyDecodeError(
                    f"{type(tokenizer).__name__}: token id {token_id} ({token!r}) is not "
                    f"valid UTF-8 and byte2str_fallback='strict': {exc}"
                ) from None
        raise


def _str_vocab_with(tokenizer, byte_strings: Sequence[bytes], fallback: str) -> list[str]:
    """UTF-8, and for the tokens that are not: latin-1 or the tokenizer's token string."""
    strings = []
    for token_id, token in enumerate(byte_strings):
        try:
            strings.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            if fallback == "latin1":
                strings.append(token.decode("latin-1"))
            else:
                strings.append(_token_string(tokenizer, token_id, token))
    return strings


def _token_string(tokenizer, token_id: int, token: bytes) -> str:
    """The tokenizer's own spelling of ``token_id`` (U+FFFD replacement if it has none)."""
    spelled = _token_strings_at(tokenizer, [token_id])[0]
    return spelled if isinstance(spelled, str) else token.decode("utf-8", "replace")


def _error(tokenizer, token_id: int, token, reason: str) -> ByteVocabError:
    return ByteVocabError(f"{type(tokenizer).__name__}: token id {token_id} ({token!r}): {reason}")
