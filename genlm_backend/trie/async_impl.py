"""AsyncTokenCharacterTrie: concurrent ``await weight_sum(ws)`` calls computed together in batches."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import torch

from genlm_backend.batching import Batcher, BatcherStats, BatchingConfig, StepOutcome
from genlm_backend.errors import BatcherClosedError
from genlm_backend.trie.base import TokenCharacterTrie
from genlm_backend.trie.parallel import ParallelTokenCharacterTrie

_OPS = ("sum", "max", "logsumexp")


class _TrieRequest:
    """One caller's request; hashed by identity, so the batcher never merges two callers."""

    __slots__ = ("op", "ws")

    def __init__(self, op: str, ws):
        self.op = op
        self.ws = ws


class AsyncTokenCharacterTrie:
    """Batches concurrent trie requests of one event loop into ``batch_weight_*`` calls.

    Requests are validated in the caller (a bad input fails only its caller),
    then wait in the running loop's queue (a
    :class:`~genlm_backend.batching.Batcher`, started by the first request or
    by :meth:`start`); a batch runs in one worker thread, grouped by operation. A failing batch fails exactly its requests; a cancelled
    caller leaves the others untouched.

    Lifecycle:

    * :meth:`cleanup` (async) and :meth:`shutdown` (sync) stop the running
      loop's queue: its pending requests raise
      :class:`~genlm_backend.errors.BatcherClosedError`, and the next request
      starts a new one.
    * :meth:`aclose` closes the trie for good: pending and later requests raise
      :class:`~genlm_backend.errors.BatcherClosedError`, and the worker thread stops.

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
        self._batcher: Batcher[_TrieRequest] = Batcher(
            self.batching,
            self._step,
            name="genlm-trie",
            in_loop=False,
            num_worker_threads=torch.get_num_threads(),
        )
        self._is_closed = False

    @classmethod
    def from_vocab(
        cls,
        vocab: Sequence,
        backend: str = "parallel",
        *,
        batch_size: int = 64,
        timeout_s: float = 0.02,
        **trie_kwargs,
    ) -> AsyncTokenCharacterTrie:
        """Build the trie over ``vocab`` and wrap it.

        Args:
            vocab: The vocabulary (see :class:`TokenCharacterTrie`).
            backend: ``"parallel"`` (:class:`ParallelTokenCharacterTrie`, torch) or
                ``"sequential"`` (:class:`TokenCharacterTrie`, float64 numpy).
            **trie_kwargs: Passed to the trie (e.g. ``device=`` for ``"parallel"``).

        Raises:
            ValueError: an unknown ``backend``.
            TypeError: ``trie_kwargs`` the chosen trie does not take.
        """
        trie: TokenCharacterTrie
        if backend == "parallel":
            trie = ParallelTokenCharacterTrie(vocab, **trie_kwargs)
        elif backend == "sequential":
            trie = TokenCharacterTrie(vocab, **trie_kwargs)
        else:
            raise ValueError(
                f"Unknown backend: {backend!r}; must be one of ['sequential', 'parallel']"
            )
        return cls(trie, batch_size=batch_size, timeout_s=timeout_s)

    @property
    def batcher_stats(self) -> BatcherStats | None:
        """The running event loop's counters (``None`` outside a loop or before its first request)."""
        calls = self._batcher.running_calls()
        return None if calls is None else calls.stats()

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    @property
    def is_running(self) -> bool:
        """Whether the running event loop has a started queue (``False`` outside a loop)."""
        return self._batcher.running_calls() is not None

    @property
    def _task(self) -> BatcherStats | None:
        """Truthy while :attr:`is_running`, ``None`` otherwise (the name upstream tests read)."""
        return self.batcher_stats

    async def weight_sum(self, ws):
        """``trie.weight_sum(ws)``, batched with concurrent requests.

        Returns:
            The trie's result type: float64 numpy ``[num_nodes]`` (sequential),
            float32 numpy or tensor ``[num_nodes]`` (parallel, per its ``output``).

        Raises:
            TypeError, ValueError: invalid ``ws`` (raised before queueing).
            BatcherClosedError: the trie was closed, or its queue stopped, before the result.
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
        (value,) = await self._batcher.submit(
            [_TrieRequest(op, self.trie._check(ws, batched=False))]
        )
        return value

    async def _queue_request(self, ws, op: str) -> asyncio.Task:
        """Queue ``op`` (``"sum"``, ``"max"`` or ``"logsumexp"``) on ``ws``; a task to await.

        Raises:
            ValueError: an unknown ``op``.
        """
        if op not in _OPS:
            raise ValueError(f"Unknown operation: {op!r}; must be one of {list(_OPS)}")
        return asyncio.ensure_future(self._submit(op, ws))

    def _step(self, requests: list[_TrieRequest]) -> StepOutcome:
        """Worker thread: the first ``batch_size`` requests computed; an error fails exactly them."""
        batch = requests[: self.batch_size]
        try:
            return StepOutcome(dict(zip(batch, self._compute(batch))))
        except Exception as exc:  # noqa: BLE001 - fails exactly this batch's requests
            return StepOutcome(dict.fromkeys(batch, exc), failed=True)

    def _compute(self, requests: list[_TrieRequest]) -> list:
        """Worker thread: one ``batch_weight_*`` call per operation present in the batch."""
        results: list = [None] * len(requests)
        for op in dict.fromkeys(request.op for request in requests):
            positions = [i for i, request in enumerate(requests) if request.op == op]
            rows = [requests[i].ws for i in positions]  # validated when submitted
            stack = torch.stack if isinstance(rows[0], torch.Tensor) else np.stack
            values = self.trie._output(self.trie._reduce(stack(rows), op))
            for i, row in zip(positions, values):
                # Each caller's row gets its own contiguous memory.
                results[i] = row.clone() if isinstance(row, torch.Tensor) else row.copy()
        return results

    def start(self) -> None:
        """Start the running loop's queue now rather than at the first request.

        Raises:
            RuntimeError: no running event loop.
            BatcherClosedError: the trie was closed with :meth:`aclose`.
        """
        if self._is_closed:
            raise BatcherClosedError("this AsyncTokenCharacterTrie is closed")
        self._batcher.start()

    async def cleanup(self) -> None:
        """Stop the running loop's queue; its pending requests raise
        :class:`BatcherClosedError`. The next request starts a new one. Idempotent."""
        await self._batcher.reset(BatcherClosedError("the trie's queue was closed"))

    def shutdown(self) -> None:
        """Synchronous :meth:`cleanup`, for every loop at once.

        Batches running in the worker thread finish there; pending requests
        raise :class:`BatcherClosedError` once their loop runs again. The next
        request starts afresh. Idempotent.
        """
        self._batcher.close(BatcherClosedError("the trie's queue was closed"))

    async def aclose(self) -> None:
        """Fail this loop's pending requests with :class:`BatcherClosedError`, as all later calls.

        Idempotent.
        """
        self._is_closed = True
        await self.cleanup()
        self.shutdown()

    async def __aenter__(self) -> AsyncTokenCharacterTrie:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
