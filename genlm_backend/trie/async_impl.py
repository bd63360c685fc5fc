"""AsyncTokenCharacterTrie: concurrent ``await weight_sum(ws)`` calls batched by the AutoBatcher."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from genlm_backend.batching import AutoBatcher, BatcherStats, BatchingConfig, LoopBatchers
from genlm_backend.errors import BatcherClosedError
from genlm_backend.trie.base import TokenCharacterTrie
from genlm_backend.trie.parallel import ParallelTokenCharacterTrie


class _TrieRequest:
    """One caller's request; hashed by identity, so the batcher never merges two callers."""

    __slots__ = ("op", "ws")

    def __init__(self, op: str, ws):
        self.op = op
        self.ws = ws


class AsyncTokenCharacterTrie:
    """Batches concurrent trie requests of one event loop into ``batch_weight_*`` calls.

    Requests are validated in the caller (a bad input fails only its caller),
    then queued on an :class:`~genlm_backend.batching.AutoBatcher` (one per
    running event loop); a batch runs in one worker thread, grouped by
    operation. Cancellation, errors and closing behave as in that batcher: a
    failing batch fails exactly its requests, a cancelled caller leaves the
    others untouched, and requests pending at :meth:`aclose` raise
    :class:`~genlm_backend.errors.BatcherClosedError`.

    Args:
        trie: The :class:`TokenCharacterTrie` or :class:`ParallelTokenCharacterTrie` to run.
        batch_size: Most requests per batch.
        timeout_s: Most seconds a request waits for company before its batch goes.

    Raises:
        ValueError: ``batch_size`` or ``timeout_s`` out of range (see
            :class:`~genlm_backend.batching.BatchingConfig`).
    """

    def __init__(self, trie: TokenCharacterTrie, *, batch_size: int = 64, timeout_s: float = 0.02):
        self.batching = BatchingConfig(max_batch_size=batch_size, timeout_s=timeout_s)
        self.trie = trie
        self.batch_size = batch_size
        self.timeout_s = self.batching.timeout_s
        self._batchers: LoopBatchers[_TrieRequest, object] = LoopBatchers(
            self._process_batch, self.batching, thread_name="genlm-trie"
        )
        self._is_closed = False

    @classmethod
    def from_vocab(
        cls, vocab: Sequence, backend: str = "parallel", *, batch_size: int = 64,
        timeout_s: float = 0.02, **trie_kwargs,
    ) -> AsyncTokenCharacterTrie:
        """Build the trie over ``vocab`` and wrap it.

        Args:
            vocab: The byte vocabulary (index = token id).
            backend: ``"parallel"`` (:class:`ParallelTokenCharacterTrie`, torch) or
                ``"sequential"`` (:class:`TokenCharacterTrie`, float64 numpy).
            **trie_kwargs: Passed to the trie (e.g. ``device=`` for ``"parallel"``).

        Raises:
            ValueError: an unknown ``backend``.
            TypeError: ``trie_kwargs`` the chosen trie does not take.
        """
        if backend == "parallel":
            trie = ParallelTokenCharacterTrie(vocab, **trie_kwargs)
        elif backend == "sequential":
            trie = TokenCharacterTrie(vocab, **trie_kwargs)
        else:
            raise ValueError(f"backend must be 'parallel' or 'sequential', got {backend!r}")
        return cls(trie, batch_size=batch_size, timeout_s=timeout_s)

    @property
    def batcher_stats(self) -> BatcherStats | None:
        """The running event loop's batcher counters (``None`` outside a loop or before its first request)."""
        return self._batchers.stats()

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    async def weight_sum(self, ws):
        """``trie.weight_sum(ws)``, batched with concurrent requests.

        Returns:
            The trie's result type: float64 numpy ``[num_nodes]`` (sequential) or
            float32 tensor ``[num_nodes]`` on the trie's device (parallel).

        Raises:
            TypeError, ValueError: invalid ``ws`` (raised before queueing).
            BatcherClosedError: the trie was closed before the result.
        """
        return await self._submit("sum", ws)

    async def weight_max(self, ws):
        """``trie.weight_max(ws)``, batched; same contract as :meth:`weight_sum`."""
        return await self._submit("max", ws)

    async def weight_logsumexp(self, ws):
        """``trie.weight_logsumexp(ws)``, batched; same contract as :meth:`weight_sum`."""
        return await self._submit("logsumexp", ws)

    async def _submit(self, op: str, ws):
        if self._is_closed:
            raise BatcherClosedError("this AsyncTokenCharacterTrie is closed")
        request = _TrieRequest(op, self.trie._check(ws, batched=False))
        return await self._batcher().submit(request)

    def _batcher(self) -> AutoBatcher:
        """The running event loop's batcher."""
        return self._batchers.current()

    def _process_batch(self, requests: list[_TrieRequest]) -> list:
        """Worker thread: one ``batch_weight_*`` call per operation present in the batch."""
        results: list = [None] * len(requests)
        for op in dict.fromkeys(request.op for request in requests):
            positions = [i for i, request in enumerate(requests) if request.op == op]
            rows = [requests[i].ws for i in positions]  # validated when submitted
            stack = torch.stack if isinstance(rows[0], torch.Tensor) else np.stack
            values = self.trie._reduce(stack(rows), op)
            for i, row in zip(positions, values):
                results[i] = row.clone() if isinstance(row, torch.Tensor) else row.copy()  # own memory, contiguous
        return results

    async def aclose(self) -> None:
        """Fail this loop's pending requests with :class:`BatcherClosedError`, as all later calls.

        Idempotent.
        """
        self._is_closed = True
        await self._batchers.aclose()

    async def __aenter__(self) -> AsyncTokenCharacterTrie:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
