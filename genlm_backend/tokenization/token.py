"""``Token``: the bytes of one vocabulary entry, tagged with its token id."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import repeat


class Token(bytes):
    """The exact bytes of a token, carrying the token's id: ``Token(token_id, byte_string)``.

    A ``Token`` is a ``bytes``: it can be joined, sliced, searched, decoded and
    written like any byte string. Operations that build new bytes (slicing,
    ``+``, ``join``) return plain ``bytes``; :attr:`byte_string` is the token's
    bytes as a plain ``bytes``.

    Identity is the id:

    * ``Token == Token`` compares ``token_id`` only, and ``hash(token) ==
      hash(token.token_id)``. Two vocabulary entries with the same bytes and
      different ids (Gemma and CodeLlama have such pairs) are different set
      members and dict keys. ``<``, ``<=``, ``>``, ``>=`` between tokens order
      by id too, so ``sorted(tokens)`` is id order.
    * Against plain ``bytes`` the ``bytes`` comparisons apply:
      ``Token(7, b"a") == b"a"`` and ``Token(7, b"a") < b"b"``.

    The hash follows the id, not the bytes, so a plain ``bytes`` key does not
    find a token with the same bytes in a set or dict (nor the reverse), although
    the two compare equal. Keep hashed containers to one kind, and convert with
    :meth:`as_bytes` where a caller may pass either.

    Tokens are immutable (``token_id`` cannot be reassigned, since the hash
    depends on it); they pickle and copy with their id.

    ``token_id`` is the token's id (its position in the vocabulary) and
    ``byte_string`` its bytes (a ``bytes``, or a ``Token``).

    Raises:
        TypeError: ``token_id`` is not an ``int`` (``bool`` included), or
            ``byte_string`` is not ``bytes``.
    """

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TypeError(f"token_id must be an int, got {type(token_id).__name__}")
        if not isinstance(byte_string, bytes):
            raise TypeError(f"byte_string must be bytes, got {type(byte_string).__name__}")
        token = bytes.__new__(cls, byte_string)
        object.__setattr__(token, "token_id", token_id)
        return token

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as a plain ``bytes`` object."""
        return bytes(self)

    @staticmethod
    def as_bytes(item):
        """``item.byte_string`` for a ``Token``; any other object unchanged."""
        return bytes(item) if isinstance(item, Token) else item

    @staticmethod
    def is_plain_bytes(item) -> bool:
        """Whether ``item`` is a ``bytes`` that is not a ``Token``."""
        return isinstance(item, bytes) and not isinstance(item, Token)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id
        return NotImplemented  # plain bytes: Python falls back to bytes.__eq__

    def __ne__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id != other.token_id
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.token_id)

    def __lt__(self, other: object) -> bool:
        return self.token_id < other.token_id if isinstance(other, Token) else NotImplemented

    def __le__(self, other: object) -> bool:
        return self.token_id <= other.token_id if isinstance(other, Token) else NotImplemented

    def __gt__(self, other: object) -> bool:
        return self.token_id > other.token_id if isinstance(other, Token) else NotImplemented

    def __ge__(self, other: object) -> bool:
        return self.token_id >= other.token_id if isinstance(other, Token) else NotImplemented

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Token is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Token is immutable; cannot delete {name!r}")

    def __reduce__(self):
        return (Token, (self.token_id, bytes(self)))

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={bytes.__repr__(self)})"


def make_tokens(byte_strings: Iterable[bytes]) -> list[Token]:
    """``[Token(i, b) for i, b in enumerate(byte_strings)]``, built in C loops.

    Faster than calling the constructor per token, which matters for
    250k-entry vocabularies; ids are the positions, so no validation is
    needed. Each ``Token`` owns an attribute dict, so the cyclic garbage
    collector tracks it: building 150k of them would trigger full-heap
    collections that take most of the time, hence the pause.
    """
    with gc_paused():
        tokens = list(map(bytes.__new__, repeat(Token), byte_strings))
        for _ in map(object.__setattr__, tokens, repeat("token_id"), range(len(tokens))):
            pass
    return tokens


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector for the block (restored after, even on error)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
