"""AutoBatcher: concurrent ``await submit(key)`` calls in, batched calls of a synchronous function out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from genlm_backend.batching.config import BatchingConfig
from genlm_backend.batching.queue import PendingQueue
from genlm_backend.batching.stats import BatcherStats
from genlm_backend.errors import BatcherClosedError, BatcherWorkerDiedError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class AutoBatcher(Generic[K, V]):
    """Batches concurrent ``await submit(key)`` calls into ``process_batch(keys)``.

    One batcher serves one event loop: it is created inside a running loop
    and its worker task lives on that loop. When and how much it dispatches
    is set by a :class:`BatchingConfig`.

    A group of keys from one caller (:meth:`submit_many`) that finds the
    batcher idle, and the loop still idle one pass later, goes as a batch of
    its own at once: it is not queued key by key, and it has one future, not
    one per key (a request for one of its keys joins it). Anything else waits
    in the queue, as do groups that came in the same pass (one batch for all).

    A batcher is closed by :meth:`aclose`, by its loop cancelling its worker,
    or by an unexpected error in the worker's own loop (not in
    ``process_batch``, which fails only its batch). Once closed, pending and
    new requests fail with :class:`~genlm_backend.errors.BatcherClosedError`
    (:class:`~genlm_backend.errors.BatcherWorkerDiedError` when the worker died);
    the owner makes a new batcher (:class:`LoopBatchers` does so on the next request).

    Args:
        process_batch: Synchronous function; gets a list of distinct keys and
            returns one value per key, in order. Runs in ``executor``'s thread.
        config: The batching policy; default: dispatch everything waiting on
            an idle loop, within 20 ms.
        request_tokens: A key's cost in tokens, against ``config.max_batch_tokens``;
            called once per distinct key, at submission. ``None``: 1 per key.
        executor: Where ``process_batch`` runs; ``None`` means the loop's
            default executor.

    Raises:
        RuntimeError: no running event loop.
    """

    def __init__(
        self,
        process_batch: Callable[[list[K]], Sequence[V]],
        config: BatchingConfig | None = None,
        *,
        request_tokens: Callable[[K], int] | None = None,
        executor: Executor | None = None,
    ):
        self._loop = asyncio.get_running_loop()
        self._process_batch = process_batch
        self.config = BatchingConfig() if config is None else config
        self._request_tokens = request_tokens
        self._executor = executor
        self._pending: PendingQueue[K] = PendingQueue()
        self._inflight: dict[K, asyncio.Future] = {}
        self._num_waiters: dict[asyncio.Future, int] = {}  # per computation, not per key
        self._joined: set[asyncio.Future] = set()  # computations a second waiter joined
        self._arrived = asyncio.Event()
        self._group: _Group[K] | None = None  # a caller's keys computing as one batch
        self._num_arrivals = 0  # requests and groups that came, to know whether a group is alone
        self._worker: asyncio.Task | None = None
        self._is_closed = False
        self._worker_error: BaseException | None = None
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
    def worker_error(self) -> BaseException | None:
        """The unexpected error that stopped the worker, ``None`` while it lives or after a normal close."""
        return self._worker_error

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
            num_inflight=len(self._inflight)
            + (0 if self._group is None else len(self._group.keys)),
            num_pending_tokens=self._pending.num_tokens,
        )

    async def submit(self, key: K) -> V:
        """Wait for ``process_batch``'s value for ``key``.

        Raises:
            BatcherClosedError: the batcher is (or gets) closed before the value.
            BatcherWorkerDiedError: the batcher's worker died (a ``BatcherClosedError``).
            Exception: whatever ``process_batch`` raised for this key's batch, or
                ``request_tokens`` raised for this key.
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

    async def submit_many(self, keys: Sequence[K]) -> list[V]:
        """:meth:`submit` for several keys of one caller, without a task per key: their values, in order.

        On an idle batcher, distinct keys that fit one batch go as a batch of
        their own after one pass of the loop (see the class); otherwise every
        key is queued before any waits. Raises what :meth:`submit` would for
        the first key, in order, whose computation failed; a cancellation
        releases every key (a queued computation nobody else waits for is
        dropped before it costs model work; a batch already computing
        finishes, for whoever joined it).
        """
        values, _ = await self.submit_many_owned(keys)
        return values

    async def submit_many_owned(self, keys: Sequence[K]) -> tuple[list[V], bool]:
        """:meth:`submit_many`, and whether this caller alone waited for every value.

        ``True`` when each key started a computation of its own that no other
        waiter joined (nor another key of this call): nobody else was handed
        these values, so the caller may keep them without copying.
        """
        if self._may_go_alone(keys):
            outcome = await self._go_alone(keys)
            if outcome is not None:
                return outcome
        futures: list[asyncio.Future] = []
        try:
            for key in keys:
                future = self._enqueue_nowait(key)
                self._num_waiters[future] = self._num_waiters.get(future, 0) + 1
                futures.append(future)
            for future in futures:
                # One wait per batch the keys went into, not a callback per key: a
                # batch settles all its futures at once. asyncio.wait, unlike
                # awaiting the future, neither cancels it nor raises its error.
                if not future.done():
                    await asyncio.wait((future,))
            values = [future.result() for future in futures]
            owned = all(self._num_waiters[f] == 1 and f not in self._joined for f in futures)
            return values, owned
        except asyncio.CancelledError:
            self._counts["cancelled"] += len(keys)
            raise
        finally:
            for key, future in zip(keys, futures):
                self._release_waiter(key, future)

    def _enqueue_nowait(self, key: K) -> asyncio.Future:
        if self._is_closed:
            raise self._closed_error()
        self._num_arrivals += 1
        future = self._pending.future_of(key)
        if future is None:
            future = self._inflight.get(key)
        if future is None and self._group is not None and key in self._group.positions:
            future = self._group.relay(key, self._loop)
        if future is not None:
            self._counts["requests"] += 1
            self._counts["deduplicated"] += 1
            self._joined.add(future)
            return future
        num_tokens = 1 if self._request_tokens is None else self._request_tokens(key)
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"request_tokens gave {num_tokens!r} for a key; expected an int >= 0")
        self._counts["requests"] += 1
        future = self._loop.create_future()
        self._pending.add(key, future, num_tokens)
        self._arrived.set()
        if self._worker is None:
            self._worker = self._loop.create_task(self._serve(), name="AutoBatcher worker")
        return future

    def _closed_error(self) -> BatcherClosedError:
        if self._worker_error is None:
            return BatcherClosedError("the batcher is closed; create a new one")
        error = BatcherWorkerDiedError(
            f"the batcher's worker stopped on an unexpected error ({self._worker_error!r}); "
            "this batcher serves no more requests, create a new one"
        )
        error.__cause__ = self._worker_error
        return error

    def _release_waiter(self, key: K, future: asyncio.Future) -> None:
        remaining = self._num_waiters[future] - 1
        if remaining:
            self._num_waiters[future] = remaining
            return
        del self._num_waiters[future]
        self._joined.discard(future)
        # Nobody waits for a computation that is still queued: drop it before it costs model work.
        if self._pending.future_of(key) is future and not future.done():
            self._pending.remove(key)
            future.cancel()

    # ------------------------------------------------------------------ a group alone

    def _may_go_alone(self, keys: Sequence[K]) -> bool:
        """Whether ``keys`` may go as a batch of their own: the batcher is idle (nothing
        queued or computing), dispatches on an idle loop, and they are distinct and fit one batch."""
        if self._is_closed or not self.config.flush_on_idle or not self._is_idle():
            return False
        if len(set(keys)) != len(keys):
            return False
        if self._request_tokens is None:
            costs = [1] * len(keys)
        else:
            costs = [self._request_tokens(key) for key in keys]
            if not all(isinstance(cost, int) and cost >= 0 for cost in costs):
                return False  # the queued path raises, for this caller
        return self.config.next_batch_length(costs) == len(keys)

    def _is_idle(self) -> bool:
        return not self._pending and not self._inflight and self._group is None

    async def _go_alone(self, keys: Sequence[K]) -> tuple[list[V], bool] | None:
        """``keys``' values as one batch of their own, and whether nobody joined them; ``None``
        when a request or another group came during the loop's pass (all then go in the queue,
        so that they make one batch)."""
        self._num_arrivals += 1
        arrival = self._num_arrivals
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # one full pass: every ready task has submitted what it had
        if self._num_arrivals != arrival or self._is_closed or not self._is_idle():
            return None  # company came (a request, or another group): all go in the queue
        group = self._group = _Group(list(keys), self._loop.create_future())
        self._counts["requests"] += len(keys)
        self._counts["batches"] += 1
        self._counts["batched_keys"] += len(keys)
        try:
            computing = self._loop.run_in_executor(self._executor, self._process_batch, group.keys)
        except BaseException:  # e.g. an executor shut down: nobody can have joined yet
            self._group = None
            self._counts["failed"] += 1
            raise
        computing.add_done_callback(lambda done: self._settle_group(group, done))
        try:
            await asyncio.wait((group.future,))
        except asyncio.CancelledError:
            self._counts["cancelled"] += len(keys)
            raise
        return group.future.result(), not group.relays

    def _settle_group(self, group: _Group[K], computing: asyncio.Future) -> None:
        if self._group is group:
            self._group = None
        if group.future.done():  # failed by a close
            return
        if computing.cancelled():
            error: BaseException | None = BatcherClosedError("the batcher was closed")
        else:
            error = computing.exception()
        if error is None:
            values = computing.result()
            error = _count_error(values, group.keys)
            if error is None:
                group.future.set_result(list(values))
                return
        self._counts["failed"] += 1
        group.future.set_exception(error)
        group.future.exception()  # retrieved: its waiters may all be gone

    # ------------------------------------------------------------------ worker

    async def _serve(self) -> None:
        try:
            while True:
                await self._wait_for_flush()
                if self._group is not None:
                    # Requests that came while a group computes go after it, together.
                    await asyncio.wait((self._group.future,))
                    continue
                await self._run_batch(self._take_batch())
        except asyncio.CancelledError:
            self._close_worker(None)
            raise
        except Exception as exc:  # noqa: BLE001 - any bug of the loop must close the batcher
            # Not re-raised: nobody awaits this task; the error reaches every caller instead.
            self._close_worker(exc)
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail callers, then propagate
            self._close_worker(exc)
            raise

    def _close_worker(self, error: BaseException | None) -> None:
        """Mark the batcher closed (recording why, if the worker died) and fail every pending request."""
        if not self._is_closed and error is not None:
            self._worker_error = error
        self._is_closed = True
        self._fail_all()

    def _take_batch(self) -> list[K]:
        """The keys of the next batch, in queue order, as the config's limits allow."""
        return self._pending.first_keys(self.config.next_batch_length(self._pending.token_costs()))

    async def _wait_for_flush(self) -> None:
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            if self.config.is_full(len(self._pending), self._pending.num_tokens):
                return
            remaining_s = (
                self._pending.oldest_queued_at() + self.config.timeout_s - time.monotonic()
            )
            if remaining_s <= 0:
                return
            if self.config.flush_on_idle:
                if await self._loop_went_idle():
                    return
                continue  # requests came during the check (new or joining queued ones): again
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining_s)

    async def _loop_went_idle(self) -> bool:
        """True when one full event-loop pass added no request."""
        num_before = self._counts["requests"]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return self._counts["requests"] == num_before and bool(self._pending)

    async def _run_batch(self, keys: list[K]) -> None:
        if not keys:
            return
        futures = [self._pending.remove(key) for key in keys]
        self._inflight.update(zip(keys, futures))
        self._counts["batches"] += 1
        self._counts["batched_keys"] += len(keys)
        try:
            values = await self._loop.run_in_executor(self._executor, self._process_batch, keys)
            error = _count_error(values, keys)
            if error is not None:
                raise error
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

    def _fail_all(self) -> None:
        """Fail every queued and computing request with this batcher's closed error."""
        for key, future in self._pending.drain() + list(self._inflight.items()):
            self._settle([key], [future], error=self._closed_error())
        group, self._group = self._group, None
        if group is not None and not group.future.done():
            group.future.set_exception(self._closed_error())
            group.future.exception()

    # ------------------------------------------------------------------ closing

    async def aclose(self) -> None:
        """Stop serving: fail every pending request with :class:`BatcherClosedError`.

        A batch already computing in the worker thread runs to completion in
        its thread, but its callers get :class:`BatcherClosedError` at once.
        Idempotent.
        """
        if self._is_closed and self._worker is None:
            return
        self._is_closed = True
        worker, self._worker = self._worker, None
        if worker is not None and not worker.done():
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._fail_all()

    async def __aenter__(self) -> AutoBatcher[K, V]:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def _count_error(values: Sequence, keys: Sequence) -> RuntimeError | None:
    """The error of a ``process_batch`` that returned a value count other than one per key."""
    if len(values) == len(keys):
        return None
    return RuntimeError(f"process_batch returned {len(values)} values for {len(keys)} keys")


@dataclass
class _Group(Generic[K]):
    """One caller's distinct keys computing as a batch of their own, with one future for
    their values; a request for one of them gets a relay of its value."""

    keys: list[K]
    future: asyncio.Future
    positions: dict[K, int] = field(init=False)
    relays: dict[K, asyncio.Future] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.positions = {key: i for i, key in enumerate(self.keys)}

    def relay(self, key: K, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future for ``key``'s value (one per key, for every request joining it)."""
        relay = self.relays.get(key)
        if relay is None:
            relay = self.relays[key] = loop.create_future()
            position = self.positions[key]
            self.future.add_done_callback(lambda group: _relay(group, relay, position))
        return relay


def _relay(group: asyncio.Future, relay: asyncio.Future, position: int) -> None:
    if relay.done():
        return
    error = group.exception()
    if error is None:
        relay.set_result(group.result()[position])
    else:
        relay.set_exception(error)
        relay.exception()  # retrieved: its waiters may all be gone
