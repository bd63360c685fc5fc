"""An AutoBatcher's queue: the distinct keys waiting for dispatch, oldest first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class Queued:
    """A distinct key waiting for dispatch."""

    future: asyncio.Future
    queued_at: float
    """``time.monotonic()`` at arrival."""
    num_tokens: int


class PendingQueue(Generic[K]):
    """Keys waiting for dispatch in arrival order, each with its future, arrival time
    and cost in tokens; keeps the total cost (:attr:`num_tokens`). No asyncio inside:
    the batcher owns the waiting and the futures' outcomes."""

    def __init__(self) -> None:
        self._entries: dict[K, Queued] = {}  # insertion order = queue order
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def future_of(self, key: K) -> asyncio.Future | None:
        """The future of ``key`` if it is queued."""
        queued = self._entries.get(key)
        return None if queued is None else queued.future

    def add(self, key: K, future: asyncio.Future, num_tokens: int) -> None:
        """Queue ``key`` (not queued yet) at the back, arriving now."""
        self._entries[key] = Queued(future, time.monotonic(), num_tokens)
        self.num_tokens += num_tokens

    def remove(self, key: K) -> asyncio.Future:
        """Take ``key`` out of the queue; returns its future."""
        queued = self._entries.pop(key)
        self.num_tokens -= queued.num_tokens
        return queued.future

    def oldest_queued_at(self) -> float:
        """Arrival time of the key at the front (the queue is not empty)."""
        return next(iter(self._entries.values())).queued_at

    def token_costs(self) -> Iterator[int]:
        """Each queued key's cost, front to back."""
        return (queued.num_tokens for queued in self._entries.values())

    def first_keys(self, count: int) -> list[K]:
        """The ``count`` keys at the front, in queue order (they stay queued)."""
        return list(self._entries)[:count]

    def drain(self) -> list[tuple[K, asyncio.Future]]:
        """Empty the queue; returns every ``(key, future)`` in queue order."""
        entries = [(key, queued.future) for key, queued in self._entries.items()]
        self._entries.clear()
        self.num_tokens = 0
        return entries
