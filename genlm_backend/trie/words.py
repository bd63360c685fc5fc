"""The words a trie is built over: one per vocabulary item, with the item's lookup key.

A vocabulary item is one of:

* a :class:`~genlm_backend.tokenization.Token`: its bytes; key ``(bytes, token_id)``;
* plain bytes (``bytes``, ``bytearray``, ``memoryview``; deprecated in favour of
  tokens, since two entries with the same bytes cannot be told apart): its
  bytes; key the bytes;
* any other iterable of hashable letters (genlm-control's ``EndOfSequence``
  iterates to itself; a ``str`` iterates to its characters): its letters; key
  the item itself.

Internally a word is ``bytes`` when every item is bytes (the common case, and
the fast one). Otherwise every word is a ``str`` of *letter codes*: a byte
letter (an ``int`` in ``0..255``) is the code point of the same value, any
other letter a code point from 256 on, in order of first appearance. Both
forms slice, hash and sort, which is all the layout needs.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from genlm_backend.tokenization.token import Token

_BYTES_LIKE = (bytes, bytearray, memoryview)
PLAIN_BYTES_WARNING = (
    "Passing plain bytes to TokenCharacterTrie is deprecated: entries with equal bytes cannot be "
    "told apart. Use Token objects (genlm_backend.tokenization.decode_vocab returns them)."
)


@dataclass(frozen=True)
class TrieWords:
    """The words of a vocabulary, in vocabulary order."""

    words: list
    """``list[bytes]``, or ``list[str]`` of letter codes when ``letters`` is set."""
    letters: list | None
    """``letters[code - 256]`` is the letter of a code above 255; ``None``: every word is bytes."""

    def letter(self, code: int):
        """The letter a code stands for (an ``int`` byte, or a non-byte letter)."""
        if code < 256:
            return code
        assert self.letters is not None, "codes above 255 exist only with letters"
        return self.letters[code - 256]

    def decode_word(self, word) -> bytes | tuple:
        """A word as callers see it: ``bytes``, or a tuple of letters when it has a non-byte one."""
        if isinstance(word, bytes):
            return word
        codes = [ord(char) for char in word]
        if all(code < 256 for code in codes):
            return bytes(codes)
        return tuple(map(self.letter, codes))

    def encode_prefix(self, prefix) -> bytes | str | None:
        """``prefix`` (bytes or a sequence of letters) in the words' form; ``None`` if a
        letter occurs in no word."""
        if self.letters is None:
            return bytes(prefix) if isinstance(prefix, _BYTES_LIKE) else _as_bytes_or_none(prefix)
        codes = {letter: 256 + i for i, letter in enumerate(self.letters)}
        chars = []
        for letter in prefix:
            code = letter if _is_byte_letter(letter) else codes.get(letter)
            if code is None:
                return None
            chars.append(chr(code))
        return "".join(chars)


def trie_words(decode: Sequence) -> TrieWords:
    """The words of ``decode`` (see the module docstring).

    Raises:
        TypeError: ``decode`` is not a sequence, or an item is not iterable or
            has an unhashable letter.
        ValueError: ``decode`` is empty.
    """
    if isinstance(decode, str | bytes) or not isinstance(decode, Sequence):
        raise TypeError(f"decode must be a sequence of tokens, got {type(decode).__name__}")
    if len(decode) == 0:
        raise ValueError("decode is empty: a trie needs at least one token")
    if all(isinstance(item, _BYTES_LIKE) for item in decode):
        if not all(type(item) is Token for item in decode):
            _warn_plain_bytes()
        return TrieWords(list(map(bytes, decode)), None)
    return _general_words(decode)


def _general_words(decode: Sequence) -> TrieWords:
    codes: dict[Hashable, int] = {}
    words = []
    warned = False
    for position, item in enumerate(decode):
        if isinstance(item, _BYTES_LIKE):
            if not warned and type(item) is not Token:
                _warn_plain_bytes()
                warned = True
            words.append(bytes(item).decode("latin-1"))  # byte b -> code point b
            continue
        words.append(
            "".join(chr(_code(letter, codes, position)) for letter in _letters(item, position))
        )
    return TrieWords(words, list(codes))


def _warn_plain_bytes() -> None:
    """The deprecation warning, attributed to the first caller outside this package's tries."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 2  # our caller
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
        "genlm_backend.trie"
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(PLAIN_BYTES_WARNING, DeprecationWarning, stacklevel=level)


def _letters(item, position: int):
    try:
        return iter(item)
    except TypeError:
        raise TypeError(
            f"decode[{position}] ({type(item).__name__}) is not iterable; expected a "
            "Token, bytes or an iterable of letters (such as an EndOfSequence)"
        ) from None


def _code(letter, codes: dict, position: int) -> int:
    if _is_byte_letter(letter):
        return letter
    try:
        return codes.setdefault(letter, 256 + len(codes))
    except TypeError:
        raise TypeError(
            f"decode[{position}] has the unhashable letter {letter!r}; trie letters must be hashable"
        ) from None


def _is_byte_letter(letter) -> bool:
    return type(letter) is int and 0 <= letter < 256


def _as_bytes_or_none(prefix) -> bytes | None:
    letters = list(prefix)
    return bytes(letters) if all(map(_is_byte_letter, letters)) else None


def word_key(item):
    """The ``word2leaf`` key of a vocabulary item: ``(bytes, token_id)`` for a Token,
    the bytes for plain bytes, the item itself otherwise."""
    if isinstance(item, Token):
        return (bytes(item), item.token_id)
    if isinstance(item, _BYTES_LIKE):
        return bytes(item)
    return item


def word_keys(decode: Sequence) -> list:
    """``word_key`` of every item.

    Raises:
        ValueError: two items have the same key (``Duplicate word in vocabulary``).
        TypeError: an item is unhashable.
    """
    keys = list(map(word_key, decode))
    try:
        num_distinct = len(set(keys))
    except TypeError as exc:
        raise TypeError(f"every vocabulary item must be hashable: {exc}") from None
    if num_distinct != len(keys):
        seen = set()
        for key in keys:
            if key in seen:
                raise ValueError(f"Duplicate word in vocabulary: {key!r}")
            seen.add(key)
    return keys
