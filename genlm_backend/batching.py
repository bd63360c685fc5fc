"""Concurrent calls of one event loop, gathered into steps: used by the language-model engine and the trie.

Also where a step runs: in the event loop's thread (its torch threads adapted
to the cores it gets: :class:`CpuThreads`) or in one worker thread.

A *call* is one caller's keys (one context for ``next_token_logprobs``, all
of them for a batch call) with one future. A :class:`Batcher` keeps each
event loop's waiting calls (:class:`WaitingCalls`) and a task that serves
them: it waits until they should be taken (:class:`BatchingConfig`), takes
them, hands the distinct keys they miss to a *step* function, and settles
each call once its values are known. The step runs in the event loop's
thread or in one worker thread; it never touches asyncio.

Everything that is not a caller's own is done per step: a step takes every
waiting call, finds the distinct keys they still need, and settles each
call once. A value goes as it is to the first call that receives it; any
other call waiting for the same key gets ``share(value)`` (a copy, for
values their receivers may change).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import itertools
import logging
import math
import time
from collections.abc import Callable, Coroutine, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from numbers import Real
from typing import Any, Generic, TypeVar

import torch

from genlm_backend.errors import BatcherClosedError, BatcherWorkerDiedError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

logger = logging.getLogger(__name__)


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BatchingConfig:
    """When the waiting calls are taken for a step, and how much one step computes. Validated on construction.

    Waiting calls are taken as soon as one of these holds:

    * ``max_batch_size`` keys wait;
    * ``flush_on_idle`` is on and a full pass of the event loop added no call
      (every ready task has had its turn, so waiting only adds latency);
    * the oldest waiting call has waited ``timeout_s`` seconds (never when
      ``timeout_s`` is ``None``: then when steps go depends on the program
      alone, not on the clock, as a reproducible run needs).

    A step computes the distinct keys of the calls taken, in arrival order,
    as many as fit ``max_batch_size`` and ``max_batch_tokens``; the rest wait
    for the next step. A key bigger than ``max_batch_tokens`` goes alone.

    With ``rounds``, the calls taken together are a *round*: everything they
    need is computed, in as many steps as the budget takes, and only then are
    they settled, all at once, in the order they were made. A call whose
    values are all cached joins the next round too, and calls made while a
    round computes wait for the next one. Callers then resume in the order
    they called, whatever the cache held, however the budget cut the steps
    and whatever other callers asked meanwhile: with ``timeout_s=None``, a
    program that draws random numbers as its awaits complete repeats itself.

    Attributes:
        max_batch_size: Most keys per step; ``None`` for no count limit.
        max_batch_tokens: Most tokens per step, by the step's own count (a
            language model's runner counts the part of each context it
            computes); ``None`` for no budget.
        timeout_s: Most seconds a call waits for company before it is taken;
            ``None``: no limit (needs ``flush_on_idle``).
        flush_on_idle: Take the waiting calls as soon as a full event-loop pass added none.
        rounds: Settle the calls taken together at once, in the order they
            were made, cached ones included (see above).
        chunk_tokens: Most tokens of one context's prefill a step computes while
            the event loop waits for it (a step in the loop's thread): a longer
            prefill (a prompt's) goes in chunks of this many tokens, the loop
            running between them; ``None``: a step computes its whole batch.

    Raises:
        TypeError: a limit that is not an int or ``None``, a ``timeout_s`` that
            is not a number, a ``flush_on_idle`` or ``rounds`` that is not a bool.
        ValueError: a limit < 1, a ``timeout_s`` < 0 or not finite, or ``None``
            without ``flush_on_idle``. Either message names the field and the value given.
    """

    max_batch_size: int | None = None
    max_batch_tokens: int | None = None
    timeout_s: float | None = 0.02
    flush_on_idle: bool = True
    rounds: bool = False
    chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "chunk_tokens"):
            value = getattr(self, name)
            if value is None:
                continue
            if not is_int(value):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
        for name in ("flush_on_idle", "rounds"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        timeout_s = self.timeout_s
        if timeout_s is None:
            if not self.flush_on_idle:
                raise ValueError(
                    "timeout_s=None needs flush_on_idle=True (a call could wait forever)"
                )
            return
        if not isinstance(timeout_s, Real) or isinstance(timeout_s, bool):
            raise TypeError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"timeout_s must be finite and >= 0, got {timeout_s!r}")
        object.__setattr__(self, "timeout_s", float(timeout_s))

    def next_batch_length(self, key_tokens: Iterable[int]) -> int:
        """How many of the keys (tokens each, in arrival order) one step takes.

        At least one when any key is given, so nothing starves.
        """
        num_taken = num_tokens = 0
        for tokens in key_tokens:
            fits_count = self.max_batch_size is None or num_taken < self.max_batch_size
            fits_budget = (
                self.max_batch_tokens is None or num_tokens + tokens <= self.max_batch_tokens
            )
            if num_taken and not (fits_count and fits_budget):
                break
            num_taken += 1
            num_tokens += tokens
        return num_taken


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of one event loop's waiting calls and the steps that served them."""

    num_requests: int
    """Keys asked for in calls (before deduplication)."""
    num_deduplicated: int
    """Keys that a step found in another waiting call of the same step."""
    num_batches: int
    """Steps that computed something."""
    num_batched_keys: int
    """Distinct keys computed, over all steps."""
    num_failed_batches: int
    """Steps whose computation raised."""
    num_cancelled: int
    """Calls whose caller was cancelled before their values."""
    num_pending: int
    """Distinct keys the waiting calls need, those computing now aside."""
    num_inflight: int
    """Distinct keys of the calls a step is computing now."""

    @property
    def mean_batch_size(self) -> float:
        return self.num_batched_keys / self.num_batches if self.num_batches else 0.0


@dataclass(frozen=True)
class StepOutcome:
    """What one step computed: a value per key of its batch (an exception fails the calls
    that wait for it), and whether the computation itself raised."""

    found: dict
    failed: bool = False


# ---------------------------------------------------------------------- waiting calls


class CallFuture(asyncio.Future[T], Coroutine[Any, Any, T]):
    """A call's future that is also a coroutine: what ``next_token_logprobs`` returns while an
    event loop runs. Awaited, gathered or waited for, it is the future itself (no task
    around it); ``asyncio.create_task``, ``TaskGroup`` and ``asyncio.iscoroutine`` take it as
    a coroutine that returns the future's result.

    Its call is queued when the future is made, not when it is first awaited. Closing it,
    or throwing into it, cancels the call if it still waits.
    """

    __slots__ = ()

    def send(self, value: Any) -> Any:
        """One step of ``await self``: yield the future while it waits, then its result."""
        if not self.done():
            self._asyncio_future_blocking = True
            return self
        raise StopIteration(self.result())

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        """End the coroutine with ``val`` (or ``typ``), cancelling the call if it waits."""
        if not self.done():
            self.cancel()
        error = typ if val is None else val
        if isinstance(error, type):
            error = error()
        raise error.with_traceback(tb) if tb is not None else error

    def close(self) -> None:
        """Cancel the call if it still waits."""
        if not self.done():
            self.cancel()

    @classmethod
    def failed(cls, error: Exception, loop: asyncio.AbstractEventLoop) -> CallFuture:
        """A call refused before it was queued: awaiting it raises ``error``."""
        future = cls(loop=loop)
        future.set_exception(error)
        return future


def coroutine_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function``, which returns a coroutine or a :class:`CallFuture`, as a coroutine
    function, as ``async def`` would (``unittest.mock`` then makes an ``AsyncMock`` of it)."""
    if hasattr(inspect, "markcoroutinefunction"):  # Python 3.12 and later
        return inspect.markcoroutinefunction(function)
    function._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
    return function  # Python 3.11: asyncio.iscoroutinefunction reads this marker


class Call(Generic[K]):
    """One caller's keys, waiting for steps; :attr:`values` fill in as steps compute them."""

    __slots__ = ("future", "keys", "num_missing", "queued_at", "values")

    def __init__(self, keys: Sequence[K], future: asyncio.Future, queued_at: float):
        self.keys = keys
        self.future = future
        self.queued_at = queued_at
        self.values: list = [None] * len(keys)
        self.num_missing = len(keys)

    def missing(self) -> Iterable[K]:
        """The keys without a value yet."""
        if self.num_missing == len(self.keys):
            return self.keys
        return (key for key, value in zip(self.keys, self.values) if value is None)


class OneCall(Generic[K]):
    """One caller's one key (a particle's step), waiting for a step; its future's result is
    the key's value itself."""

    __slots__ = ("future", "key", "queued_at")

    num_missing = 1  # settled as soon as its value is known

    def __init__(self, key: K, future: asyncio.Future, queued_at: float):
        self.key = key
        self.future = future
        self.queued_at = queued_at

    @property
    def keys(self) -> tuple[K]:
        return (self.key,)

    def missing(self) -> Iterable[K]:
        """The call's key (it waits only while its value is unknown)."""
        return (self.key,)


class WaitingCalls(Generic[K]):
    """The calls of one event loop waiting for a step, oldest first, and when to take them.

    Used on its loop only. The owner's serve task waits for :meth:`until_flush`,
    takes the calls (:meth:`take`), computes what they need, and hands the
    outcome to :meth:`settle`: the one place a call's future gets its result.
    A cancelled call is dropped at the next :meth:`take` (its keys are then not
    computed unless another call needs them).
    """

    def __init__(self, config: BatchingConfig):
        self.config = config
        self._calls: collections.deque[Call[K] | OneCall[K]] = collections.deque()
        self._num_keys = 0
        self._arrived = asyncio.Event()
        self._shared_keys = False  # whether the calls last taken wait for a key more than once
        self.computing: list[Call[K] | OneCall[K]] = []
        """The calls a step is computing now (failed at once by :meth:`fail_all`)."""
        self._num_requests = self._num_deduplicated = self._num_cancelled = 0
        self._num_batches = self._num_batched_keys = self._num_failed = 0

    def add(self, keys: Sequence[K], loop: asyncio.AbstractEventLoop) -> Call[K]:
        """Queue one caller's ``keys`` at the back; the call's future gets their values, in order."""
        call = Call(keys, loop.create_future(), time.monotonic())
        self._calls.append(call)
        self._num_keys += len(keys)
        self._num_requests += len(keys)
        self._arrived.set()
        return call

    def add_one(self, key: K, loop: asyncio.AbstractEventLoop) -> CallFuture:
        """Queue one caller's one ``key`` at the back: :meth:`add` of ``(key,)``, in fewer steps
        (a particle's call). The future's result is the value itself."""
        future: CallFuture = CallFuture(loop=loop)
        self._calls.append(OneCall(key, future, time.monotonic()))
        self._num_keys += 1
        self._num_requests += 1
        if not self._arrived.is_set():
            self._arrived.set()
        return future

    def __len__(self) -> int:
        return len(self._calls)

    async def until_flush(self) -> None:
        """Return once the waiting calls should be taken (see :class:`BatchingConfig`)."""
        config = self.config
        while True:
            while not self._calls:
                self._arrived.clear()
                await self._arrived.wait()
            if config.max_batch_size is not None and self._num_keys >= config.max_batch_size:
                return
            remaining_s = (
                math.inf
                if config.timeout_s is None
                else self._calls[0].queued_at + config.timeout_s - time.monotonic()
            )
            if remaining_s <= 0:
                return
            if config.flush_on_idle:
                num_before = self._num_requests  # counts every call's keys (at least one)
                await asyncio.sleep(0)
                await asyncio.sleep(0)  # one full pass: every ready task has made its calls
                if self._num_requests == num_before and self._calls:
                    return
                continue
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining_s)

    def take(self) -> list[Call[K] | OneCall[K]]:
        """Every waiting call still awaited, oldest first (now :attr:`computing`)."""
        calls = [call for call in self._calls if not call.future.done()]
        self._num_cancelled += len(self._calls) - len(calls)
        self._calls.clear()
        self._num_keys = 0
        self.computing = calls
        return calls

    def missing(self, calls: Sequence[Call[K] | OneCall[K]]) -> list[K]:
        """The distinct keys ``calls`` still miss, in order of first appearance."""
        missing: list[K] = []
        for call in calls:
            if type(call) is OneCall:
                missing.append(call.key)
            else:
                missing.extend(call.missing())
        distinct = list(dict.fromkeys(missing))
        self._num_deduplicated += len(missing) - len(distinct)
        self._shared_keys = len(distinct) < len(missing)
        return distinct

    def settle(
        self,
        calls: Sequence[Call[K] | OneCall[K]],
        found: dict,
        share: Callable[[Any], Any] | None = None,
    ) -> None:
        """Give each call the values ``found`` has for its keys (an exception fails the call):
        the calls taken, and those that came while they computed (not in rounds: they wait
        for theirs). A call still missing some keys waits; the calls taken go back ahead of
        the others.

        Each value goes as it is to the first call that receives it, and as
        ``share(value)`` to every later one (``share=None``: as it is to all).
        Values handed are told apart by identity (an ``int`` set: a key's own
        ``__hash__`` may be Python code, called per lookup).
        """
        self.computing = []
        later = [] if self.config.rounds else list(self._calls)
        # Values go to more than one call only where calls share a key.
        sharing = share is not None and (self._shared_keys or bool(later))
        handed: set | None = set() if sharing else None
        waiting: list[Call[K] | OneCall[K]] = []
        num_cancelled = 0
        for call in itertools.chain(calls, later):
            future = call.future
            if future.done():  # cancelled while it waited
                num_cancelled += future.cancelled()
                continue
            if isinstance(call, OneCall):  # a particle's call: the common case
                value = found.get(call.key)
                if value is None:
                    waiting.append(call)
                elif isinstance(value, BaseException):
                    future.set_exception(value)
                    future.exception()  # retrieved: its caller may be gone
                else:
                    if handed is not None:
                        if id(value) in handed:
                            value = share(value)  # type: ignore[misc]
                        else:
                            handed.add(id(value))
                    future.set_result(value)
                continue
            error = _fill(call, found, handed, share)
            if error is not None:
                call.future.set_exception(error)
                call.future.exception()  # retrieved: its caller may be gone
            elif call.num_missing == 0:
                call.future.set_result(call.values)
            else:
                waiting.append(call)
        self._num_cancelled += num_cancelled
        if self.config.rounds:  # the calls made meanwhile wait for their round
            self._calls.extendleft(reversed(waiting))  # none: a round computes all its calls miss
            self._num_keys += sum(call.num_missing for call in waiting)
            return
        self._calls = collections.deque(waiting)
        self._num_keys = sum(call.num_missing for call in waiting)
        if waiting:
            self._arrived.set()

    def record_step(self, outcome: StepOutcome) -> None:
        """Count a step's outcome (:class:`BatcherStats`)."""
        self._num_batches += 1
        self._num_batched_keys += len(outcome.found)
        self._num_failed += outcome.failed

    def fail_all(self, error: BaseException) -> None:
        """Fail every waiting and computing call with ``error``."""
        for call in [*self._calls, *self.computing]:
            if not call.future.done():
                call.future.set_exception(error)
                call.future.exception()  # retrieved: its caller may be gone
        self._calls.clear()
        self._num_keys = 0
        self.computing = []

    def stats(self) -> BatcherStats:
        computing = {key for call in self.computing for key in call.missing()}
        waiting = {key for call in self._calls if not call.future.done() for key in call.missing()}
        return BatcherStats(
            num_requests=self._num_requests,
            num_deduplicated=self._num_deduplicated,
            num_batches=self._num_batches,
            num_batched_keys=self._num_batched_keys,
            num_failed_batches=self._num_failed,
            num_cancelled=self._num_cancelled
            + sum(call.future.cancelled() for call in self._calls),
            num_pending=len(waiting - computing),
            num_inflight=len(computing),
        )


def _fill(
    call: Call, found: dict, handed: set | None, share: Callable[[object], object] | None
) -> BaseException | None:
    """Put ``found``'s values for the call's missing keys into it (a value already handed to
    another call, by identity in ``handed``, as ``share(value)``); the first exception among them."""
    values = call.values
    for i, key in enumerate(call.keys):
        if values[i] is None:
            value = found.get(key)
            if value is None:
                continue
            if isinstance(value, BaseException):
                return value
            if handed is not None:
                if id(value) in handed:
                    value = share(value)  # type: ignore[misc]
                else:
                    handed.add(id(value))
            values[i] = value
            call.num_missing -= 1
    return None


# ---------------------------------------------------------------------- CPU threads


class CpuThreads:
    """The intra-op thread count of CPU steps: the process's own while a step gets its cores,
    one while it shares them with other processes.

    Each step's CPU time in the thread that computes it, over its wall time,
    says whether that thread had its core: close to one alone, well under one
    when other processes take the cores (its OpenMP team then spins on cores
    they need). After :attr:`SHARED_IN_A_ROW` judgements in a row below
    :attr:`SHARED` the steps go on one thread: one slow step (a first forward
    faulting its weights in, a collection) is no sign of another process, and
    would otherwise halve the speed of the steps until the next try. On one
    thread that gets its core, they try the full count again after a number
    of steps that doubles each time the try shows the cores still shared (a
    try ends at its first judgement below :attr:`SHARED`). Short steps are
    judged together: their times add up until they span :attr:`MIN_JUDGED_S`.

    Args:
        max_threads: The count while the cores are free (``torch.get_num_threads()``
            of the thread that built the backend).
        adaptive: ``False``: always ``max_threads``.
    """

    SHARED = 0.75
    SHARED_IN_A_ROW = 2
    FREE = 0.9
    MIN_JUDGED_S = 0.002
    FIRST_TRY_AFTER = 8
    LAST_TRY_AFTER = 1024

    def __init__(self, max_threads: int, adaptive: bool = True):
        self.max_threads = max_threads
        self.adaptive = adaptive and max_threads > 1
        self.num_threads = max_threads
        self._try_after = self.FIRST_TRY_AFTER
        self._num_free_steps = 0
        self._is_trying = False
        self._num_shared = 0  # judgements in a row below SHARED on the full count
        self._pending_cpu_s = 0.0
        self._pending_wall_s = 0.0

    def apply(self) -> tuple[int, float, float]:
        """Set this thread's torch threads for a step; returns what :meth:`observe` needs: the
        thread's own count, and the step's start on the thread's CPU clock and the wall clock."""
        own = torch.get_num_threads()
        if own != self.num_threads:
            torch.set_num_threads(self.num_threads)
        return own, time.thread_time(), time.perf_counter()

    def observe(self, start: tuple[int, float, float]) -> None:
        """Give the thread its own count back, and judge the step begun at ``start`` (see the class)."""
        own, cpu_start_s, wall_start_s = start
        if own != self.num_threads:
            torch.set_num_threads(own)
        if not self.adaptive:
            return
        self.record(time.thread_time() - cpu_start_s, time.perf_counter() - wall_start_s)

    def record(self, cpu_s: float, wall_s: float) -> None:
        """A step's CPU time in its thread and its wall time, judged once the steps since
        the last judgement span :attr:`MIN_JUDGED_S`."""
        self._pending_cpu_s += cpu_s
        self._pending_wall_s += wall_s
        if self._pending_wall_s >= self.MIN_JUDGED_S:
            share = self._pending_cpu_s / self._pending_wall_s
            self._pending_cpu_s = self._pending_wall_s = 0.0
            self.judge(share)

    def judge(self, share: float) -> None:
        """One step's CPU share: the next steps' thread count."""
        if self.num_threads > 1:
            if share >= self.SHARED:
                self._num_shared = 0
                if self._is_trying:
                    self._try_after, self._is_trying = self.FIRST_TRY_AFTER, False
                return
            self._num_shared += 1
            if self._is_trying:
                self._try_after = min(2 * self._try_after, self.LAST_TRY_AFTER)
            elif self._num_shared < self.SHARED_IN_A_ROW:
                return
            self.num_threads, self._num_free_steps, self._is_trying = 1, 0, False
            self._num_shared = 0
            return
        self._num_free_steps = self._num_free_steps + 1 if share >= self.FREE else 0
        if self._num_free_steps >= self._try_after:
            self.num_threads, self._is_trying = self.max_threads, True


# ---------------------------------------------------------------------- the serving loop


@dataclass
class _LoopState:
    """An event loop's waiting calls and the task that serves them."""

    calls: WaitingCalls
    task: asyncio.Task | None = None
    error: BaseException | None = None
    """The unexpected error that stopped the task (then the loop gets a new state)."""


class Batcher(Generic[K]):
    """Each event loop's waiting calls and the task that serves them with a step function.

    ``step(keys)`` computes the values of the first of the distinct ``keys``
    that one step holds (at least one) and returns them as a
    :class:`StepOutcome`, an error being the value of each key it fails (an
    error it raises is a bug: it stops the serve task and fails every call).
    It runs in the event loop's thread while :attr:`in_loop` is true, else in
    one worker thread (torch threads: ``num_worker_threads``). In
    :attr:`BatchingConfig.rounds`, the task steps until the round's keys are
    all known; otherwise once per taking, the rest waiting with whatever came
    meanwhile.

    Args:
        config: When waiting calls are taken.
        step: Computes keys' values, synchronously.
        name: Names the serve tasks, the worker thread and the errors.
        in_loop: Whether steps run in the event loop's thread at first.
        share: How a value goes to a second call waiting for the same key
            (see :meth:`WaitingCalls.settle`).
        num_worker_threads: The worker thread's torch thread count (``None``: unchanged).
        cpu_threads: Adapts the torch threads of steps in the event loop's thread
            (``None``: they keep the thread's own).
    """

    def __init__(
        self,
        config: BatchingConfig,
        step: Callable[[list[K]], StepOutcome],
        *,
        name: str,
        in_loop: bool = True,
        share: Callable[[Any], Any] | None = None,
        num_worker_threads: int | None = None,
        cpu_threads: CpuThreads | None = None,
    ):
        self.config = config
        self.cpu_threads = cpu_threads
        self.step = step
        self.name = name
        self.in_loop = in_loop
        """Whether steps run in the event loop's thread (else in one worker thread)."""
        self.share = share
        self.num_loop_restarts = 0
        """Serve tasks replaced because they stopped on an unexpected error."""
        self._num_worker_threads = num_worker_threads
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._worker: ThreadPoolExecutor | None = None

    def submit(self, keys: Sequence[K]) -> asyncio.Future:
        """A future of the values of ``keys``, in order, once the running loop's steps computed them.

        Its exception, if any: :class:`BatcherClosedError` (:meth:`reset` or
        :meth:`close` ran first, or the error they were given),
        :class:`BatcherWorkerDiedError` (the serve task stopped on an
        unexpected error), or the error a step gave one of the keys.

        Raises:
            RuntimeError: no running event loop.
        """
        loop = asyncio.get_running_loop()
        return self._served_calls(loop).add(keys, loop).future

    def submit_one(self, key: K, loop: asyncio.AbstractEventLoop) -> CallFuture:
        """:meth:`submit` of ``(key,)`` (a particle's call, in fewer steps) from ``loop``, the
        running loop: a :class:`CallFuture` of the key's value alone."""
        state = self._loops.get(loop)
        if state is None or state.task is None or state.error is not None:
            return self._served_calls(loop).add_one(key, loop)
        return state.calls.add_one(key, loop)  # the loop's served calls, at once

    def _served_calls(self, loop: asyncio.AbstractEventLoop) -> WaitingCalls:
        """The loop's waiting calls, its serve task started (it first runs when the caller
        yields, after the caller's call is queued)."""
        state = self._loops.get(loop)
        if state is None or state.error is not None:
            state = self._state(loop)
        if state.task is None:
            state.task = loop.create_task(self._serve(state), name=self.name)
        return state.calls

    def start(self) -> None:
        """Start the running loop's serve task now rather than at the first call.

        Raises:
            RuntimeError: no running event loop.
        """
        loop = asyncio.get_running_loop()
        state = self._state(loop)
        if state.task is None or state.task.done():
            if state.task is not None:  # stopped by a reset of another loop's close
                state = self._loops[loop] = _LoopState(WaitingCalls(self.config))
            state.task = loop.create_task(self._serve(state), name=self.name)

    def _state(self, loop: asyncio.AbstractEventLoop) -> _LoopState:
        """The loop's state: its own, or a new one if it has none or its task died."""
        old = self._loops.get(loop)
        if old is not None and old.error is None:
            return old
        if old is not None:
            self.num_loop_restarts += 1
            logger.warning("restarting a %s loop that stopped: %r", self.name, old.error)
        for closed in [closed for closed in self._loops if closed.is_closed()]:
            del self._loops[closed]  # a state holds its loop: drop those of finished loops
        state = self._loops[loop] = _LoopState(WaitingCalls(self.config))
        return state

    def running_calls(self) -> WaitingCalls | None:
        """The running loop's waiting calls while its serve task runs (``None`` outside a loop)."""
        try:
            state = self._loops.get(asyncio.get_running_loop())
        except RuntimeError:
            return None
        if state is None or state.task is None or state.task.done():
            return None
        return state.calls

    def stats(self) -> BatcherStats | None:
        """The running loop's counters, ``None`` outside a loop or before its first call."""
        try:
            state = self._loops.get(asyncio.get_running_loop())
        except RuntimeError:
            return None
        return None if state is None else state.calls.stats()

    async def _serve(self, state: _LoopState) -> None:
        """Take the waiting calls, step, settle; until the loop ends or :meth:`reset`."""
        calls = state.calls
        rounds = self.config.rounds
        try:
            while True:
                await calls.until_flush()
                taken = calls.take()
                if not taken:
                    continue
                todo = calls.missing(taken)
                found: dict = {}
                while todo:
                    outcome = await self._step(todo)
                    calls.record_step(outcome)
                    found.update(outcome.found)
                    del outcome
                    if not rounds:
                        break  # the rest wait for the next step, with whatever came meanwhile
                    todo = [key for key in todo if key not in found]
                    if todo and self.in_loop:
                        await breathe()  # the loop runs between a round's steps
                calls.settle(taken, found, self.share)
                # Values (lent memory, say) live no longer than their callers.
                del taken, todo, found
                if len(calls) and self.in_loop:
                    await breathe()  # calls left for the next step: the loop runs first
        except asyncio.CancelledError:
            calls.fail_all(BatcherClosedError(f"this loop's {self.name} queue was closed"))
            raise
        except Exception as exc:  # noqa: BLE001 - a bug of the loop: every caller learns of it
            state.error = exc
            calls.fail_all(_died(self.name, exc))
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail callers, then propagate
            state.error = exc
            calls.fail_all(_died(self.name, exc))
            raise

    async def _step(self, todo: list[K]) -> StepOutcome:
        """:attr:`step`, in the loop's thread (on :attr:`cpu_threads`' thread count) or the
        worker's (:attr:`in_loop`)."""
        if self.in_loop:
            threads = self.cpu_threads
            if threads is None:
                return self.step(todo)
            start = threads.apply()
            try:
                return self.step(todo)
            finally:
                threads.observe(start)
        return await asyncio.get_running_loop().run_in_executor(
            self._worker_thread(), self.step, todo
        )

    def _worker_thread(self) -> ThreadPoolExecutor:
        if self._worker is None:
            if self._num_worker_threads is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
            else:
                self._worker = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix=self.name,
                    initializer=torch.set_num_threads,
                    initargs=(self._num_worker_threads,),
                )
        return self._worker

    async def reset(self, error: BaseException) -> None:
        """Fail the running loop's waiting and computing calls with ``error`` and stop its
        serve task; its next call starts afresh."""
        state = self._loops.pop(asyncio.get_running_loop(), None)
        if state is None:
            return
        state.calls.fail_all(error)
        if state.task is not None and not state.task.done():
            state.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await state.task

    def close(self, error: BaseException) -> None:
        """Fail every loop's calls with ``error`` (each in its own loop's thread), stop their
        serve tasks and the worker thread. A step running in the worker finishes there."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        states, self._loops = self._loops, {}
        for loop, state in states.items():
            if loop.is_closed():
                continue
            if running is loop:
                state.calls.fail_all(error)
                if state.task is not None:
                    state.task.cancel()
            else:
                loop.call_soon_threadsafe(_fail_and_stop, state, error)
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.shutdown(wait=False)  # stops the worker thread; nothing to await here


async def breathe() -> None:
    """Let everything the event loop has due run before going on: callbacks of timers that
    expired and of sockets that became ready while a step held the loop.

    ``asyncio.sleep(0)`` would not do: it puts this task back at the end of the ready
    queue, ahead of the callbacks that expired timers only put there afterwards, so the
    next step would start before them. A timer due at once comes after every timer due
    earlier, and their callbacks run first.
    """
    await asyncio.sleep(_BREATH_S)


_BREATH_S = 1e-6
"""A sleep this short ends at the next turn of the loop."""


def _fail_and_stop(state: _LoopState, error: BaseException) -> None:
    state.calls.fail_all(error)
    if state.task is not None:
        state.task.cancel()


def _died(name: str, error: BaseException) -> BatcherWorkerDiedError:
    died = BatcherWorkerDiedError(
        f"the {name} loop stopped on an unexpected error ({error!r}); "
        "the next call starts a new one"
    )
    died.__cause__ = error
    return died
