"""``decode_vocab``: the exact bytes (and a display string) of every token id.

The bytes come from the tokenizer's own description of its vocabulary, never
from per-token ``decode()`` calls (which drop leading spaces, merge byte
pieces into U+FFFD and so lose bytes) and never from reloading anything by name:

* a ``tokenizers``-backed ("fast") tokenizer: the backend's decoder steps are
  replayed on each token string (:mod:`genlm_backend.tokenization.decoders`);
* a Python ("slow") tokenizer with a GPT-2 style ``byte_decoder`` table;
* a Python tokenizer over a SentencePiece model (``sp_model``): ``▁`` -> space,
  byte pieces ``<0xNN>`` -> that byte.

Anything else raises :class:`~genlm_backend.errors.VocabularyDecodeError`.
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

StrFallback = Literal["replace", "surrogateescape", "backslashreplace", "strict"]
STR_FALLBACKS: tuple[str, ...] = ("replace", "surrogateescape", "backslashreplace", "strict")


def decode_vocab(
    tokenizer, *, str_fallback: StrFallback = "replace"
) -> tuple[list[Token], list[str]]:
    """The bytes and strings of every token of ``tokenizer``.

    Args:
        tokenizer: A transformers tokenizer (``TokenizersBackend``/"fast" or
            ``PythonBackend``/"slow") or a bare ``tokenizers.Tokenizer``. Only the
            object is read; nothing is loaded by name.
        str_fallback: How ``str_vocab`` spells a token whose bytes are not valid
            UTF-8 (a lone byte-fallback piece such as Gemma's ``<0x80>``, or half of
            a multi-byte character in a byte-level BPE). It is a Python codec
            error handler applied to ``bytes.decode("utf-8", ...)``:
            ``"replace"`` (default) puts U+FFFD per invalid sequence, as
            ``tokenizer.decode`` does; ``"surrogateescape"`` is lossless
            (``s.encode("utf-8", "surrogateescape")`` gives the bytes back);
            ``"backslashreplace"`` writes ``\\x80``; ``"strict"`` raises.

    Returns:
        ``(byte_vocab, str_vocab)``, both of length ``len(tokenizer)`` (added and
        special tokens included). ``byte_vocab[i]`` is a :class:`Token` holding
        the exact bytes of token id ``i`` and ``token_id == i``;
        ``str_vocab[i]`` is those bytes decoded as UTF-8 with ``str_fallback``.
        Special tokens map to the bytes of their text (``b"<|endoftext|>"``).

    Raises:
        ValueError: ``str_fallback`` is not one of :data:`STR_FALLBACKS`.
        VocabularyDecodeError: the tokenizer's bytes cannot be recovered (an
            unsupported decoder or tokenizer kind, a hole in the id range, a
            token outside the byte table), or ``str_fallback="strict"`` met a
            token that is not valid UTF-8. The message names the tokenizer
            class and the first token that failed.
    """
    if str_fallback not in STR_FALLBACKS:
        raise ValueError(f"str_fallback must be one of {STR_FALLBACKS}, got {str_fallback!r}")
    byte_strings = _token_bytes(tokenizer)
    byte_vocab = make_tokens(byte_strings)
    return byte_vocab, _str_vocab(tokenizer, byte_strings, str_fallback)


def _token_bytes(tokenizer) -> list[bytes]:
    backend = _tokenizers_backend(tokenizer)
    if backend is not None:
        return _fast_token_bytes(tokenizer, backend)
    if isinstance(getattr(tokenizer, "byte_decoder", None), dict):
        return _byte_decoder_token_bytes(tokenizer)
    if getattr(tokenizer, "sp_model", None) is not None:
        return _sentencepiece_token_bytes(tokenizer)
    first = _token_strings(tokenizer, 1)[0] if _vocab_size(tokenizer) else None
    raise _error(
        tokenizer, 0, first,
        "it has no tokenizers backend, no byte_decoder table and no SentencePiece model",
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
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return [tokenizer.id_to_token(i) for i in range(num_tokens)]
    return tokenizer.convert_ids_to_tokens(list(range(num_tokens)))


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
            raise _error(tokenizer, token_id, token, "a character is not in its byte_decoder") from None
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


def _str_vocab(tokenizer, byte_strings: Sequence[bytes], str_fallback: str) -> list[str]:
    try:
        return [b.decode("utf-8", str_fallback) for b in byte_strings]
    except UnicodeDecodeError:
        for token_id, token in enumerate(byte_strings):
            try:
                token.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _error(tokenizer, token_id, token, f"str_fallback='strict': {exc}") from None
        raise


def _error(tokenizer, token_id: int, token, reason: str) -> VocabularyDecodeError:
    return VocabularyDecodeError(
        f"cannot decode the vocabulary of {type(tokenizer).__name__}: "
        f"token id {token_id} ({token!r}): {reason}"
    )
