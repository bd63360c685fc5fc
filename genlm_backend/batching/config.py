"""How requests are grouped into batches: one frozen config and the one function that cuts a batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import TypeVar

K = TypeVar("K")

DEFAULT_MAX_BATCH_TOKENS = 1 << 15
"""Context tokens per batch for the language-model backends: 32,768 tokens, e.g. 64
particles of 512 tokens. Their working memory grows with the sum of context lengths."""


@dataclass(frozen=True)
class BatchingConfig:
    """When a batcher dispatches, and how much one batch may hold. Validated on construction.

    A batch is dispatched as soon as one of these holds:

    * a full batch waits: ``max_batch_size`` requests, or ``max_batch_tokens``
      tokens of requests;
    * ``flush_on_idle`` is on and a full pass of the event loop added no
      request (every ready task has had its turn, so waiting only adds latency);
    * the oldest waiting request has waited ``timeout_s`` seconds.

    The batch holds the waiting requests in arrival order, as many as fit both
    limits; a request bigger than ``max_batch_tokens`` on its own goes alone.
    With both limits ``None`` (no count to tune), everything waiting goes at once.

    Attributes:
        max_batch_size: Most requests per batch; ``None`` for no count limit.
        max_batch_tokens: Most tokens per batch, counted by the batcher owner's
            cost function (e.g. context length); ``None`` for no budget.
        timeout_s: Most seconds a request waits for company before its batch
            goes (while no other batch computes).
        flush_on_idle: Dispatch as soon as a full event-loop pass added no request.

    Raises:
        TypeError: a limit that is not an int or ``None``, a ``timeout_s`` that
            is not a number, a ``flush_on_idle`` that is not a bool.
        ValueError: a limit < 1, a ``timeout_s`` < 0 or not finite.
            Either message names the field and the value given.
    """

    max_batch_size: int | None = None
    max_batch_tokens: int | None = None
    timeout_s: float = 0.02
    flush_on_idle: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens"):
            value = getattr(self, name)
            if value is None:
                continue
            if not is_int(value):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
        timeout_s = self.timeout_s
        if not isinstance(timeout_s, Real) or isinstance(timeout_s, bool):
            raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"timeout_s must be finite and >= 0, got {timeout_s!r}")
        object.__setattr__(self, "timeout_s", float(timeout_s))
        if not isinstance(self.flush_on_idle, bool):
            raise TypeError(f"flush_on_idle must be a bool, got {self.flush_on_idle!r}")

    def is_full(self, num_requests: int, num_tokens: int) -> bool:
        """Whether ``num_requests`` waiting requests of ``num_tokens`` tokens fill a batch."""
        return (self.max_batch_size is not None and num_requests >= self.max_batch_size) or (
            self.max_batch_tokens is not None and num_tokens >= self.max_batch_tokens
        )

    def next_batch_length(self, request_tokens: Iterable[int]) -> int:
        """How many of the requests (tokens each, in arrival order) the next batch takes.

        At least one when any request is given, so nothing starves.
        """
        num_taken = num_tokens = 0
        for tokens in request_tokens:
            fits_count = self.max_batch_size is None or num_taken < self.max_batch_size
            fits_budget = (
                self.max_batch_tokens is None or num_tokens + tokens <= self.max_batch_tokens
            )
            if num_taken and not (fits_count and fits_budget):
                break
            num_taken += 1
            num_tokens += tokens
        return num_taken

    def split(
        self, keys: Sequence[K], request_tokens: Callable[[K], int] | None = None
    ) -> list[list[K]]:
        """``keys`` cut into consecutive batches, as a batcher would dispatch them all at once.

        ``request_tokens`` gives a key's cost in tokens (``None``: 1 each).
        """
        costs = [1 if request_tokens is None else request_tokens(key) for key in keys]
        batches, start = [], 0
        while start < len(keys):
            length = self.next_batch_length(costs[start:])
            batches.append(list(keys[start : start + length]))
            start += length
        return batches


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
