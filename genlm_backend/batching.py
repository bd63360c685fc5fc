"""The one auto-batcher: concurrent awaits in, batched calls of a synchronous function out.

Every backend (HF, vLLM) and the async trie use :class:`AutoBatcher`. A request
is a hashable key; the batcher collects concurrent requests, deduplicates them,
and calls ``process_batch(keys)`` in a worker thread so the event loop keeps
accepting requests while a batch computes.

Flush policy. A batch is dispatched as soon as one of these holds:

* ``batch_size`` distinct requests wait;
* ``timeout_s`` seconds have passed since the oldest waiting request queued
  (so no request starves);
* ``flush_on_idle`` is on and a full pass of the event loop added no request:
  every task that was ready to run has had its turn, so waiting longer only
  adds latency. This is what makes N lock-step particles form batches of N
  without paying the timeout at every step.

Guarantees. Each request's future is settled in exactly one place
(:meth:`AutoBatcher._settle`); an exception raised by ``process_batch`` fails
exactly the requests of that batch and the batcher keeps serving; a cancelled
caller never cancels the shared computation of a deduplicated key; requests
pending at :meth:`AutoBatcher.aclose` fail with :class:`BatcherClosedError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from genlm_backend.errors import BatcherClosedError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def check_batching_options(batch_size: int, timeout_s: float) -> None:
    """Raise ``ValueError`` unless ``batch_size`` is a positive int and ``timeout_s`` >= 0."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of an :class:`AutoBatcher`'s counters."""

    num_requests: int
    """Requests submitted (including deduplicated ones)."""
    num_deduplicated: int
    """Requests that joined an identical request already queued or computing."""
    num_batches: int
    """Calls of ``process_batch``."""
    num_batched_keys: int
    """Distinct keys sent to ``process_batch``, over all batches."""
    num_failed_batches: int
    """Batches whose ``process_batch`` raised."""
    num_cancelled: int
    """Requests whose caller was cancelled before the result arrived."""
    num_pending: int
    """Distinct keys queued and not yet dispatched."""
    num_inflight: int
    """Distinct keys in the batch computing now."""

    @property
    def mean_batch_size(self) -> float:
        return self.num_batched_keys / self.num_batches if self.num_batches else 0.0


class AutoBatcher(Generic[K, V]):
    """Batches concurrent ``await submit(key)`` calls into ``process_batch(keys)``.

    One batcher serves one event loop: it is created inside a running loop
    and its worker task lives on that loop.

    Args:
        process_batch: Synchronous function; gets a list of distinct keys and
            returns one value per key, in order. Runs in ``executor``'s thread.
        batch_size: Most keys per batch; a batch is dispatched as soon as this
            many distinct keys wait.
        timeout_s: Most seconds the oldest waiting key waits before its batch
            is dispatched (while no other batch is computing).
        flush_on_idle: Also dispatch when a full event-loop pass added no key.
        executor: Where ``process_batch`` runs; ``None`` means the loop's
            default executor.

    Raises:
        ValueError: ``batch_size`` < 1 or ``timeout_s`` < 0.
    """

    def __init__(
        self,
        process_batch: Callable[[list[K]], Sequence[V]],
        *,
        batch_size: int,
        timeout_s: float,
        flush_on_idle: bool = True,
        executor: Executor | None = None,
    ):
        check_batching_options(batch_size, timeout_s)
        self._process_batch = process_batch
        self.batch_size = batch_size
        self.timeout_s = float(timeout_s)
        self.flush_on_idle = flush_on_idle
        self._executor = executor
        self._loop = asyncio.get_running_loop()
        self._pending: dict[K, asyncio.Future] = {}  # insertion order = queue order
        self._queued_at: dict[K, float] = {}
        self._inflight: dict[K, asyncio.Future] = {}
        self._num_waiters: dict[asyncio.Future, int] = {}  # per computation, not per key
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._is_closed = False
        self._counts = dict.fromkeys(
            ("requests", "deduplicated", "batches", "batched_keys", "failed", "cancelled"), 0
        )

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    @property
    def stats(self) -> BatcherStats:
        c = self._counts
        return BatcherStats(
            num_requests=c["requests"],
            num_deduplicated=c["deduplicated"],
            num_batches=c["batches"],
            num_batched_keys=c["batched_keys"],
            num_failed_batches=c["failed"],
            num_cancelled=c["cancelled"],
            num_pending=len(self._pending),
            num_inflight=len(self._inflight),
        )

    async def submit(self, key: K) -> V:
        """Wait for ``process_batch``'s value for ``key``.

        Raises:
            BatcherClosedError: the batcher is (or gets) closed before the value.
            Exception: whatever ``process_batch`` raised for this key's batch.
        """
        future = self._enqueue_nowait(key)
        self._num_waiters[future] = self._num_waiters.get(future, 0) + 1
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self._counts["cancelled"] += 1
            raise
        finally:
            self._release_waiter(key, future)

    def _enqueue_nowait(self, key: K) -> asyncio.Future:
        if self._is_closed:
            raise BatcherClosedError("the batcher is closed; create a new one")
        self._counts["requests"] += 1
        future = self._pending.get(key) or self._inflight.get(key)
        if future is not None:
            self._counts["deduplicated"] += 1
            return future
        future = self._loop.create_future()
        self._pending[key] = future
        self._queued_at[key] = time.monotonic()
        self._arrived.set()
        if self._worker is None:
            self._worker = self._loop.create_task(self._serve(), name="AutoBatcher worker")
        return future

    def _release_waiter(self, key: K, future: asyncio.Future) -> None:
        remaining = self._num_waiters[future] - 1
        if remaining:
            self._num_waiters[future] = remaining
            return
        del self._num_waiters[future]
        # Nobody waits for a computation that is still queued: drop it before it costs model work.
        if self._pending.get(key) is future and not future.done():
            del self._pending[key]
            del self._queued_at[key]
            future.cancel()

    async def _serve(self) -> None:
        try:
            while True:
                await self._wait_for_flush()
                keys = list(self._pending)[: self.batch_size]
                await self._run_batch(keys)
        except asyncio.CancelledError:
            self._fail_all(BatcherClosedError("the batcher's event loop stopped serving it"))
            raise
        except BaseException as exc:  # pragma: no cover - a bug in the worker itself
            self._fail_all(BatcherClosedError(f"the batcher's worker died: {exc!r}"))
            raise

    async def _wait_for_flush(self) -> None:
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            if len(self._pending) >= self.batch_size:
                return
            deadline = next(iter(self._queued_at.values())) + self.timeout_s  # oldest first
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return
            if self.flush_on_idle and await self._loop_went_idle():
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining_s)
            except TimeoutError:
                pass

    async def _loop_went_idle(self) -> bool:
        """True when one full event-loop pass added no request."""
        num_before = self._counts["requests"]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return self._counts["requests"] == num_before and bool(self._pending)

    async def _run_batch(self, keys: list[K]) -> None:
        if not keys:
            return
        futures = [self._pending.pop(key) for key in keys]
        for key in keys:
            del self._queued_at[key]
        self._inflight.update(zip(keys, futures))
        self._counts["batches"] += 1
        self._counts["batched_keys"] += len(keys)
        try:
            values = await self._loop.run_in_executor(self._executor, self._process_batch, keys)
            if len(values) != len(keys):
                raise RuntimeError(
                    f"process_batch returned {len(values)} values for {len(keys)} keys"
                )
        except asyncio.CancelledError:
            self._settle(keys, futures, error=BatcherClosedError("the batcher was closed"))
            raise
        except BaseException as exc:
            self._counts["failed"] += 1
            self._settle(keys, futures, error=exc)
            if not isinstance(exc, Exception):
                raise
        else:
            self._settle(keys, futures, values=values)

    def _settle(self, keys, futures, *, values=None, error=None) -> None:
        """The one place where request futures get their outcome."""
        for i, (key, future) in enumerate(zip(keys, futures)):
            if self._inflight.get(key) is future:
                del self._inflight[key]
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(values[i])
        # An exception nobody awaited (every waiter cancelled) must not be logged as lost.
        for future in futures:
            if future.done() and not future.cancelled():
                future.exception()

    def _fail_all(self, error: BaseException) -> None:
        pending = list(self._pending.items()) + list(self._inflight.items())
        self._pending.clear()
        self._queued_at.clear()
        self._inflight.clear()
        for _, future in pending:
            if not future.done():
                future.set_exception(error)
                future.exception()

    async def aclose(self) -> None:
        """Stop serving: fail every pending request with :class:`BatcherClosedError`.

        A batch already computing in the worker thread runs to completion in
        its thread, but its callers get :class:`BatcherClosedError` at once.
        Idempotent.
        """
        if self._is_closed:
            return
        self._is_closed = True
        worker, self._worker = self._worker, None
        if worker is not None and not worker.done():
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass
        self._fail_all(BatcherClosedError("the batcher was closed"))

    async def __aenter__(self) -> AutoBatcher[K, V]:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


class LoopBatchers(Generic[K, V]):
    """One :class:`AutoBatcher` per running event loop, all feeding one worker thread.

    For objects that outlive an event loop (a backend used by several
    ``asyncio.run`` calls, a notebook's loop and a script's): each loop gets
    its own batcher on first use, while model work stays serialized on one
    thread.

    Args:
        process_batch: As for :class:`AutoBatcher`.
        batch_size: As for :class:`AutoBatcher`.
        timeout_s: As for :class:`AutoBatcher`.
        thread_name: Prefix of the worker thread's name.
    """

    def __init__(
        self,
        process_batch: Callable[[list[K]], Sequence[V]],
        *,
        batch_size: int,
        timeout_s: float,
        thread_name: str = "genlm-worker",
    ):
        check_batching_options(batch_size, timeout_s)
        self._process_batch = process_batch
        self.batch_size = batch_size
        self.timeout_s = float(timeout_s)
        # The worker runs torch with the intra-op thread count in force when this
        # object was made, whatever the threads that submit work use.
        num_threads = _torch_num_threads()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=thread_name, initializer=_set_torch_num_threads, initargs=(num_threads,)
        )
        self._batchers: dict[asyncio.AbstractEventLoop, AutoBatcher[K, V]] = {}

    def current(self) -> AutoBatcher[K, V]:
        """The running loop's batcher (a new one if it has none or it was closed)."""
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None or batcher.is_closed:
            # A batcher holds its loop, so entries of finished loops are dropped here.
            for old_loop in [old for old in self._batchers if old.is_closed()]:
                del self._batchers[old_loop]
            batcher = AutoBatcher(
                self._process_batch,
                batch_size=self.batch_size,
                timeout_s=self.timeout_s,
                executor=self._executor,
            )
            self._batchers[loop] = batcher
        return batcher

    async def reset_current(self) -> None:
        """Close the running loop's batcher (failing its pending requests); the next request gets a new one."""
        batcher = self._batchers.pop(asyncio.get_running_loop(), None)
        if batcher is not None:
            await batcher.aclose()

    async def aclose(self) -> None:
        """Close the running loop's batcher and stop the worker thread."""
        await self.reset_current()
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the worker thread; a batch already running finishes in it."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> BatcherStats | None:
        """The running loop's batcher's stats, ``None`` outside a loop or before its first request."""
        try:
            batcher = self._batchers.get(asyncio.get_running_loop())
        except RuntimeError:
            return None
        return None if batcher is None else batcher.stats


def _torch_num_threads() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _set_torch_num_threads(num_threads: int | None) -> None:
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
