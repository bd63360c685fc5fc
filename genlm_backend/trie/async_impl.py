"""AsyncTokenCharacterTrie: concurrent ``await weight_sum(ws)`` calls computed together in batches."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from genlm_backend.errors import BatcherClosedError
from genlm_backend.llm.engine import BatchingConfig, EngineStats, WaitingCalls
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
    then wait in the running loop's queue
    (:class:`~genlm_backend.llm.engine.WaitingCalls`, started by the first
    request or by :meth:`start`); a batch runs in one worker thread, grouped
    by operation. A failing batch fails exactly its requests; a cancelled
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
            :class:`~genlm_backend.llm.engine.BatchingConfig`).
    """

    def __init__(self, trie: TokenCharacterTrie, *, batch_size: int = 64, timeout_s: float = 0.02):
        self.batching = BatchingConfig(max_batch_size=batch_size, timeout_s=timeout_s)
        self.trie = trie
        self.batch_size = batch_size
        self.timeout_s = self.batching.timeout_s
        self._loops: dict[asyncio.AbstractEventLoop, tuple[WaitingCalls, asyncio.Task]] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._num_threads = torch.get_num_threads()
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
    def batcher_stats(self) -> EngineStats | None:
        """The running event loop's counters (``None`` outside a loop or before its first request)."""
        calls = self._running_calls()
        return None if calls is None else calls.stats()

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    @property
    def is_running(self) -> bool:
        """Whether the running event loop has a started queue (``False`` outside a loop)."""
        return self._running_calls() is not None

    @property
    def _task(self) -> EngineStats | None:
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
        request = _TrieRequest(op, self.trie._check(ws, batched=False))
        loop = asyncio.get_running_loop()
        (value,) = await self._calls(loop).add([request], loop).future
        return value

    async def _queue_request(self, ws, op: str) -> asyncio.Task:
        """Queue ``op`` (``"sum"``, ``"max"`` or ``"logsumexp"``) on ``ws``; a task to await.

        Raises:
            ValueError: an unknown ``op``.
        """
        if op not in _OPS:
            raise ValueError(f"Unknown operation: {op!r}; must be one of {list(_OPS)}")
        return asyncio.ensure_future(self._submit(op, ws))

    def _calls(self, loop: asyncio.AbstractEventLoop) -> WaitingCalls:
        """The loop's queue, started (with its serve task) if it has none."""
        entry = self._loops.get(loop)
        if entry is None or entry[1].done():
            for old in [old for old in self._loops if old.is_closed()]:
                del self._loops[old]
            calls: WaitingCalls = WaitingCalls(self.batching)
            entry = self._loops[loop] = (calls, loop.create_task(self._serve(calls)))
        return entry[0]

    def _running_calls(self) -> WaitingCalls | None:
        try:
            entry = self._loops.get(asyncio.get_running_loop())
        except RuntimeError:
            return None
        return None if entry is None or entry[1].done() else entry[0]

    async def _serve(self, calls: WaitingCalls) -> None:
        """Take the waiting requests, compute a batch in the worker thread, settle them."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await calls.until_flush()
                taken = calls.take()
                if not taken:
                    continue
                batch = calls.missing(taken)[: self.batch_size]
                try:
                    computing = loop.run_in_executor(self._worker_thread(), self._compute, batch)
                    found, failed = dict(zip(batch, await computing)), False
                except Exception as exc:  # noqa: BLE001 - fails exactly this batch's requests
                    found, failed = dict.fromkeys(batch, exc), True
                calls.counts["batches"] += 1
                calls.counts["keys"] += len(batch)
                calls.counts["failed"] += failed
                calls.settle(taken, found)
                del taken, batch, found  # results live no longer than their callers
        except asyncio.CancelledError:
            calls.fail_all(BatcherClosedError("the trie's queue was closed"))
            raise

    def _worker_thread(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="genlm-trie",
                initializer=torch.set_num_threads,
                initargs=(self._num_threads,),
            )
        return self._worker

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
        self._calls(asyncio.get_running_loop())

    async def cleanup(self) -> None:
        """Stop the running loop's queue; its pending requests raise
        :class:`BatcherClosedError`. The next request starts a new one. Idempotent."""
        entry = self._loops.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await _stop(*entry)

    def shutdown(self) -> None:
        """Synchronous :meth:`cleanup`, for every loop at once.

        Batches running in the worker thread finish there; pending requests
        raise :class:`BatcherClosedError` once their loop runs again. The next
        request starts afresh. Idempotent.
        """
        entries, self._loops = self._loops, {}
        for loop, (_, task) in entries.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

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

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.shutdown(wait=False)  # stops the worker thread; nothing to await here


async def _stop(calls: WaitingCalls, task: asyncio.Task) -> None:
    calls.fail_all(BatcherClosedError("the trie's queue was closed"))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
