"""Validation of user input: contexts of token ids, checked before any model work."""

from __future__ import annotations

import marshal
import threading
from collections.abc import Sequence

import numpy as np
import torch

from genlm_backend.cache.keys import HASHED_TAIL, context_hash

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
_INTEGER_TYPES = (int, np.integer)


def validate_token_ids(
    token_ids: TokenIds, vocab_size: int, max_context_length: int | None = None
) -> tuple[int, ...]:
    """Check one context and return it as a tuple of Python ints.

    Accepts a sequence of ints, a 1-D integer numpy array or a 1-D integer tensor.

    Raises:
        TypeError: not a sequence, or an element is not an integer (bools and
            floats are rejected, even 3.0).
        ValueError: empty, an id < 0 or >= ``vocab_size``, or longer than
            ``max_context_length``.
    """
    ids = _plain_ids_in_range(token_ids, vocab_size)  # the usual case, one pass at C speed
    if ids is None:
        ids = _general_ids(token_ids, vocab_size)
    if max_context_length is not None and len(ids) > max_context_length:
        raise ValueError(
            f"token_ids has {len(ids)} tokens, more than the model's context of "
            f"{max_context_length}"
        )
    return ids


def _general_ids(token_ids: TokenIds, vocab_size: int) -> tuple[int, ...]:
    """:func:`validate_token_ids`'s checks for any input, element by element; errors name the problem."""
    if isinstance(token_ids, torch.Tensor | np.ndarray):
        if token_ids.ndim != 1:
            raise TypeError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype in (torch.bool, np.bool_) or not _is_integer_dtype(token_ids.dtype):
            raise TypeError(f"token_ids must have an integer dtype, got {token_ids.dtype}")
        ids = tuple(int(t) for t in token_ids.tolist())
    elif isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise TypeError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}; "
            "encode text with llm.tokenizer.encode(...) first"
        )
    else:
        for position, t in enumerate(token_ids):
            if not isinstance(t, _INTEGER_TYPES) or isinstance(t, bool | np.bool_):
                raise TypeError(
                    f"token_ids[{position}] is {t!r} of type {type(t).__name__}; "
                    "token ids must be ints"
                )
        ids = tuple(int(t) for t in token_ids)
    if not ids:
        raise ValueError(
            "token_ids is empty: the next-token distribution needs at least one token "
            "of context (e.g. the tokenizer's BOS token)"
        )
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        position, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise ValueError(
            f"token_ids[{position}] = {bad} is outside the vocabulary [0, {vocab_size})"
        )
    return ids


def validate_contexts(
    token_ids_list: Sequence[TokenIds],
    vocab_size: int,
    max_context_length: int | None = None,
    argument: str | None = "token_ids_list",
) -> list[tuple[int, ...]]:
    """:func:`validate_token_ids` for each context of a batch call.

    Args:
        argument: The batch argument's name; an error message starts with
            ``f"{argument}[{index}]: "`` so the caller sees which context is bad.
            ``None`` for a single context (no prefix).

    Raises:
        TypeError, ValueError: as :func:`validate_token_ids`, for the first bad context.
    """
    contexts = []
    for index, token_ids in enumerate(token_ids_list):
        try:
            contexts.append(validate_token_ids(token_ids, vocab_size, max_context_length))
        except (TypeError, ValueError) as exc:
            if argument is None:
                raise
            raise type(exc)(f"{argument}[{index}]: {exc}") from None
    return contexts


def validate_continuation(tokens: TokenIds, vocab_size: int, name: str) -> tuple[int, ...]:
    """Check one continuation to score (as :func:`validate_token_ids`) and return it as a tuple.

    Raises:
        TypeError, ValueError: as :func:`validate_token_ids`, naming ``name``.
    """
    try:
        return validate_token_ids(tokens, vocab_size)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _plain_ids_in_range(token_ids: TokenIds, vocab_size: int) -> tuple[int, ...] | None:
    """``token_ids`` as a tuple if it is a non-empty list or tuple of plain ``int``\\ s in
    ``[0, vocab_size)``; ``None`` otherwise (the caller's general path then names the problem).

    One pass at C speed: ``marshal``'s version-2 format writes each plain
    ``int`` of 32 bits as the byte ``i`` and 4 little-endian bytes, and
    anything else (bools, floats, numpy scalars, ``int`` subclasses, larger
    ints) differently or not at all. So the ids are plain ints exactly when
    the encoding is one ``i``-tagged 5-byte record per id, and the records'
    values give the range check. On a 4,097-token context this takes 125 us
    against 370 us for a set of the ids' types plus ``min`` and ``max`` (2-vCPU
    machine), a cost paid per request by every particle behind a long prompt.
    """
    if not isinstance(token_ids, list | tuple) or not _MARSHAL_INTS_AS_RECORDS:
        return None
    try:
        encoded = marshal.dumps(token_ids, 2)
    except ValueError:  # an unmarshallable element
        return None
    count = len(token_ids)
    if count == 0 or len(encoded) != _HEADER + _RECORD * count:
        return None
    if encoded[_HEADER::_RECORD] != b"i" * count:
        return None
    if count <= _SHORT:  # plain ints now: Python's min and max beat numpy's call overhead
        low, high = min(token_ids), max(token_ids)
    else:
        values = np.ndarray((count,), "<i4", encoded, offset=_HEADER + 1, strides=(_RECORD,))
        low, high = values.min(), values.max()
    if low < 0 or high >= vocab_size:
        return None
    return tuple(token_ids)


_HEADER, _RECORD = 5, 5  # a list's or tuple's type byte and length; an int's type byte and value
_SHORT = 128
"""Up to this many ids, the range check is Python's ``min`` and ``max`` (26 ids: 1.1 us against
4.3 us for numpy's on a view of the encoding; 2-vCPU machine)."""
_MARSHAL_INTS_AS_RECORDS = marshal.dumps([7, -2], 2) == b"[\x02\0\0\0i\x07\0\0\0i\xfe\xff\xff\xff"
"""Whether this Python's marshal writes ints as :func:`_plain_ids_in_range` reads them (else it is skipped)."""


def _is_integer_dtype(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex
    return np.issubdtype(dtype, np.integer)


def as_list_of_contexts(token_ids_list) -> list:
    """The contexts of a batch call as a list.

    Raises:
        TypeError: not a sequence of contexts.
        ValueError: empty.
    """
    if isinstance(token_ids_list, str | bytes) or not isinstance(
        token_ids_list, Sequence | np.ndarray | torch.Tensor
    ):
        raise TypeError(f"expected a list of contexts, got {type(token_ids_list).__name__}")
    contexts = list(token_ids_list)
    if not contexts:
        raise ValueError("the list of contexts is empty")
    return contexts


class RecentContexts:
    """Contexts validated lately: one that extends a recent context by a token is checked at that token.

    Particles extend their last context by one token at every step.
    Checking a 4,097-token context element by element costs about 25 us
    (:func:`validate_token_ids`, 2-vCPU machine) on every step; finding its
    first tokens among the recent contexts (hashed by length and last tokens,
    :func:`~genlm_backend.cache.keys.context_hash`) and comparing them at C
    speed costs a few. The context returned is then the recent one plus the
    new token: its earlier tokens are that context's plain ints, also where
    the caller's were equal to them in value only (``3.0 == 3``).

    Holds at most ``max_tokens`` tokens of contexts (the least recently
    validated are forgotten first); safe to use from several threads.

    Args:
        vocab_size: As :func:`validate_token_ids`'s.
        max_context_length: As :func:`validate_token_ids`'s.
        max_tokens: Most tokens of the contexts held (8 bytes each, shared with
            the requests that hold the same contexts).
    """

    def __init__(
        self, vocab_size: int, max_context_length: int | None, max_tokens: int = 1 << 21
    ) -> None:
        self.vocab_size = vocab_size
        self.max_context_length = max_context_length
        self.max_tokens = max_tokens
        self._by_hash: dict[int, tuple[int, ...]] = {}
        self._num_tokens = 0
        self._lock = threading.Lock()

    def validate(self, token_ids: TokenIds) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """``token_ids`` as :func:`validate_token_ids` returns it, and the recent context it
        extends by one token (``None`` if none).

        Raises:
            TypeError, ValueError: as :func:`validate_token_ids`.
        """
        extended = self._extend_recent(token_ids)
        if extended is None:
            context = validate_token_ids(token_ids, self.vocab_size, self.max_context_length)
            parent = None
        else:
            context, parent = extended
        self._remember(context)
        return context, parent

    def _extend_recent(self, token_ids: TokenIds) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(recent + (last,), recent)`` for the recent context equal to ``token_ids[:-1]``, if
        ``token_ids`` is a plain list or tuple whose last token is valid; else ``None``."""
        if type(token_ids) is not list and type(token_ids) is not tuple:
            return None
        length = len(token_ids)
        if length < 2 or (self.max_context_length is not None and length > self.max_context_length):
            return None
        last = token_ids[-1]
        if type(last) is not int or not 0 <= last < self.vocab_size:
            return None
        # Elements of any kind may come here (the full check names a bad one): one that
        # cannot be hashed or compared (an array, a list) sends the context to that check.
        try:
            tail = tuple(token_ids[-HASHED_TAIL - 1 : -1])
            parent = self._by_hash.get(hash((length - 1, tail)))
            if parent is None or len(parent) != length - 1:
                return None
            # Two copies and a comparison at C speed (identical elements compare by identity).
            context = parent + (last,)
            if context != tuple(token_ids):
                return None
        except (TypeError, ValueError):
            return None
        return context, parent

    def _remember(self, context: tuple[int, ...]) -> None:
        key = context_hash(context)
        with self._lock:
            old = self._by_hash.pop(key, None)
            if old is not None:
                self._num_tokens -= len(old)
            self._by_hash[key] = context
            self._num_tokens += len(context)
            while self._num_tokens > self.max_tokens and len(self._by_hash) > 1:
                self._num_tokens -= len(self._by_hash.pop(next(iter(self._by_hash))))

    def clear(self) -> None:
        with self._lock:
            self._by_hash.clear()
            self._num_tokens = 0
