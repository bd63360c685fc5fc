"""The engine of an :class:`~genlm_backend.llm.base.AsyncLM`: the calls waiting for the model, a
budget, and a step.

One request's path, each arrow a named call::

    AsyncLM.next_token_logprobs(ids)        validate -> Request
      -> Engine.rows([request])             the output cache; else wait in this loop's queue
      -> Engine._serve (a task per loop)    WaitingCalls.until_flush -> take -> Engine.step -> settle
      -> Engine.step                        within the budget: runner.run / runner.score
                                            -> output cache -> {request: row}
      -> WaitingCalls.settle                each call's future gets its rows

A *call* is one caller's requests (one context for ``next_token_logprobs``, all
of them for a batch call) with one future. Everything that is not the
caller's own is done per step: a step takes every waiting call, finds the
distinct requests they still need, cuts them to the budget, and settles
each call once. With ``BatchingConfig.rounds`` (deterministic backends), the
calls taken together are settled together, once every step they need has
run, in the order they were made. The ``*_now`` methods run the same
computation in the calling thread, for the synchronous API.

Thread model: by default a step runs in the event loop's own thread. A
process whose torch work all runs in one thread keeps one OpenMP team, whose
threads spin between the many small parallel regions of a decode step
instead of sleeping and being woken; a second thread calling torch (a
worker) makes libgomp stop spinning. A step in the loop's thread blocks the
loop while it computes, which costs nothing to particles that all wait for
it. Where a step mostly waits (a server's client) or runs threads of its own
(vLLM), and in a server, which must keep reading requests meanwhile,
:attr:`Engine.compute_in_loop` is ``False`` and steps run in one worker
thread. Spinning threads take the cores from other processes, so a CPU step
in the loop's thread adapts its thread count to the cores it gets
(:class:`CpuThreads`); a row's last bits may then differ from those of the
same row computed with the other count.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from numbers import Real
from typing import Generic, TypeVar

import torch

from genlm_backend.cache.output import OutputCache
from genlm_backend.errors import BackendClosedError, BatcherClosedError, BatcherWorkerDiedError
from genlm_backend.llm.runner import Adapter, Request, Runner, ScoreRequest

K = TypeVar("K", bound=Hashable)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_TOKENS = 1 << 15
"""Tokens per batch for the language-model backends, as their runners count them (the part of
each context they compute): a batch's working memory grows with it."""


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BatchingConfig:
    """When the waiting calls are taken for a step, and how much one step computes. Validated on construction.

    Waiting calls are taken as soon as one of these holds:

    * ``max_batch_size`` requests wait;
    * ``flush_on_idle`` is on and a full pass of the event loop added no call
      (every ready task has had its turn, so waiting only adds latency);
    * the oldest waiting call has waited ``timeout_s`` seconds (never when
      ``timeout_s`` is ``None``: then when steps go depends on the program
      alone, not on the clock, as a reproducible run needs).

    A step computes the distinct requests of the calls taken, in arrival
    order, as many as fit ``max_batch_size`` and ``max_batch_tokens``; the
    rest wait for the next step. A request bigger than ``max_batch_tokens``
    goes alone.

    With ``rounds``, the calls taken together are a *round*: the engine
    computes everything they need, in as many steps as the budget takes, and
    only then settles them, all at once, in the order they were made. A call
    whose rows are all cached joins the next round too, and calls made while
    a round computes wait for the next one. Callers then resume in the order
    they called, whatever the cache held, however the budget cut the steps
    and whatever other callers asked meanwhile: with ``timeout_s=None``, a
    program that draws random numbers as its awaits complete repeats itself.

    Attributes:
        max_batch_size: Most requests per step; ``None`` for no count limit.
        max_batch_tokens: Most tokens per step, by the runner's count (see
            :meth:`~genlm_backend.llm.runner.Runner.request_tokens`); ``None``
            for no budget.
        timeout_s: Most seconds a call waits for company before it is taken;
            ``None``: no limit (needs ``flush_on_idle``).
        flush_on_idle: Take the waiting calls as soon as a full event-loop pass added none.
        rounds: Settle the calls taken together at once, in the order they
            were made, cached ones included (see above).

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

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens"):
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

    def next_batch_length(self, request_tokens: Iterable[int]) -> int:
        """How many of the requests (tokens each, in arrival order) one step takes.

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


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one event loop's waiting calls and the steps that served them."""

    num_requests: int
    """Requests made in calls (before deduplication)."""
    num_deduplicated: int
    """Requests that a step found in another waiting call of the same step."""
    num_batches: int
    """Steps that computed something."""
    num_batched_keys: int
    """Distinct requests computed, over all steps."""
    num_failed_batches: int
    """Steps whose computation raised."""
    num_cancelled: int
    """Calls whose caller was cancelled before their values."""
    num_pending: int
    """Distinct requests the waiting calls need, those computing now aside."""
    num_inflight: int
    """Distinct requests of the calls a step is computing now."""

    @property
    def mean_batch_size(self) -> float:
        return self.num_batched_keys / self.num_batches if self.num_batches else 0.0


# ---------------------------------------------------------------------- waiting calls


@dataclass(eq=False)
class Call(Generic[K]):
    """One caller's requests, waiting for steps; :attr:`values` fill in as steps compute them."""

    keys: Sequence[K]
    future: asyncio.Future
    queued_at: float
    values: list = field(init=False)
    num_missing: int = field(init=False)
    is_sole: bool = field(init=False, default=False)
    """Set once settled: every value came from one step, to this call alone (nobody else was
    handed them), so the caller may keep them without copying."""

    def __post_init__(self) -> None:
        self.values = [None] * len(self.keys)
        self.num_missing = len(self.keys)

    def missing(self) -> Iterable[K]:
        """The keys without a value yet."""
        if self.num_missing == len(self.keys):
            return self.keys
        return (key for key, value in zip(self.keys, self.values) if value is None)


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
        self._calls: collections.deque[Call[K]] = collections.deque()
        self._num_keys = 0
        self._arrived = asyncio.Event()
        self._num_arrivals = 0
        self.computing: list[Call[K]] = []
        """The calls a step is computing now (failed at once by :meth:`fail_all`)."""
        self.counts = dict.fromkeys(
            ("requests", "deduplicated", "batches", "keys", "failed", "cancelled"), 0
        )

    def add(self, keys: Sequence[K], loop: asyncio.AbstractEventLoop) -> Call[K]:
        """Queue one caller's ``keys`` at the back; the call's future gets their values, in order."""
        call = Call(keys, loop.create_future(), time.monotonic())
        self._calls.append(call)
        self._num_keys += len(keys)
        self._num_arrivals += 1
        self.counts["requests"] += len(keys)
        self._arrived.set()
        return call

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
                num_before = self._num_arrivals
                await asyncio.sleep(0)
                await asyncio.sleep(0)  # one full pass: every ready task has made its calls
                if self._num_arrivals == num_before and self._calls:
                    return
                continue
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining_s)

    def take(self) -> list[Call[K]]:
        """Every waiting call still awaited, oldest first (now :attr:`computing`)."""
        calls = [call for call in self._calls if not call.future.done()]
        self.counts["cancelled"] += len(self._calls) - len(calls)
        self._calls.clear()
        self._num_keys = 0
        self.computing = calls
        return calls

    def settle(self, calls: Sequence[Call[K]], found: dict) -> None:
        """Give each call the values ``found`` has for its keys (an exception fails the call):
        the calls taken, and those that came while they computed (not in rounds: they wait
        for theirs). A call still missing some keys waits; the calls taken go back ahead of
        the others."""
        self.computing = []
        later = [] if self.config.rounds else list(self._calls)
        live = [call for call in [*calls, *later] if not call.future.done()]
        self.counts["cancelled"] += sum(call.future.cancelled() for call in calls)
        receivers = collections.Counter(
            key for call in live for key in call.missing() if key in found
        )
        waiting: list[Call[K]] = []
        for call in live:
            is_whole = call.num_missing == len(call.keys)
            error = _fill(call, found)
            if error is not None:
                call.future.set_exception(error)
                call.future.exception()  # retrieved: its caller may be gone
            elif call.num_missing == 0:
                call.is_sole = is_whole and all(receivers[key] == 1 for key in call.keys)
                call.future.set_result(call.values)
            else:
                waiting.append(call)
        if self.config.rounds:  # the calls made meanwhile wait for their round
            self._calls.extendleft(reversed(waiting))  # none: a round computes all its calls miss
            self._num_keys += sum(call.num_missing for call in waiting)
            return
        self._calls = collections.deque(waiting)
        self._num_keys = sum(call.num_missing for call in waiting)
        if waiting:
            self._arrived.set()

    def missing(self, calls: Sequence[Call[K]]) -> list[K]:
        """The distinct keys ``calls`` still miss, in order of first appearance."""
        missing = [key for call in calls for key in call.missing()]
        distinct = list(dict.fromkeys(missing))
        self.counts["deduplicated"] += len(missing) - len(distinct)
        return distinct

    def count_step(self, outcome: StepOutcome) -> None:
        self.counts["batches"] += 1
        self.counts["keys"] += len(outcome.found)
        self.counts["failed"] += outcome.failed

    def fail_all(self, error: BaseException) -> None:
        """Fail every waiting and computing call with ``error``."""
        for call in [*self._calls, *self.computing]:
            if not call.future.done():
                call.future.set_exception(error)
                call.future.exception()  # retrieved: its caller may be gone
        self._calls.clear()
        self._num_keys = 0
        self.computing = []

    def stats(self) -> EngineStats:
        computing = {key for call in self.computing for key in call.missing()}
        waiting = {key for call in self._calls if not call.future.done() for key in call.missing()}
        c = self.counts
        return EngineStats(
            num_requests=c["requests"],
            num_deduplicated=c["deduplicated"],
            num_batches=c["batches"],
            num_batched_keys=c["keys"],
            num_failed_batches=c["failed"],
            num_cancelled=c["cancelled"] + sum(call.future.cancelled() for call in self._calls),
            num_pending=len(waiting - computing),
            num_inflight=len(computing),
        )


def _fill(call: Call, found: dict) -> BaseException | None:
    """Copy ``found``'s values for the call's missing keys into it; the first exception among them."""
    values = call.values
    for i, key in enumerate(call.keys):
        if values[i] is None:
            value = found.get(key)
            if value is None:
                continue
            if isinstance(value, BaseException):
                return value
            values[i] = value
            call.num_missing -= 1
    return None


@dataclass(frozen=True)
class StepOutcome:
    """What one step computed: a value per key of its batch (an exception fails the calls
    that wait for it), and whether the model's computation itself raised."""

    found: dict
    failed: bool = False


@dataclass
class _LoopState:
    """An event loop's waiting calls and the task that serves them."""

    calls: WaitingCalls
    task: asyncio.Task | None = None
    error: BaseException | None = None
    """The unexpected error that stopped the task (then the loop gets a new state)."""


# ---------------------------------------------------------------------- adapters


class AdapterRegistry:
    """The adapters a backend has loaded, by name, and the default one.

    ``lora_name=None`` on a request means the default adapter: the base model
    unless :attr:`default` was set to one.
    """

    def __init__(self):
        self._adapters: dict[str, Adapter] = {}
        self._versions = itertools.count(1)
        self.default: Adapter | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def registered(self) -> dict[str, Adapter]:
        """The registered adapters by name (a copy)."""
        return dict(self._adapters)

    def new_version(self, lora_path, lora_name: str) -> Adapter:
        """A new registration of ``lora_name`` (not yet recorded: see :meth:`record`).

        Raises:
            TypeError: ``lora_name`` is not a string.
        """
        if not isinstance(lora_name, str):
            raise TypeError(f"lora_name must be a str, got {type(lora_name).__name__}")
        return Adapter(lora_name, next(self._versions), str(lora_path))

    def record(self, adapter: Adapter) -> Adapter | None:
        """Make ``adapter`` the one its name means; returns the registration it replaces."""
        old = self._adapters.get(adapter.name)
        self._adapters[adapter.name] = adapter
        if self.default is not None and self.default.name == adapter.name:
            self.default = adapter
        return old

    def forget(self, lora_name: str) -> Adapter:
        """Remove ``lora_name`` (and unset it as the default).

        Raises:
            ValueError: unknown name.
        """
        adapter = self.get(lora_name)
        del self._adapters[lora_name]
        if self.default == adapter:
            self.default = None
        return adapter

    def get(self, lora_name: str) -> Adapter:
        """The adapter registered as ``lora_name``.

        Raises:
            ValueError: unknown name (the message names it and how to register it).
        """
        adapter = self._adapters.get(lora_name) if isinstance(lora_name, str) else None
        if adapter is None:
            known = ", ".join(map(repr, self._adapters)) or "none"
            raise ValueError(
                f"unknown LoRA adapter {lora_name!r} (registered: {known}); register it with add_new_lora()"
            )
        return adapter

    def resolve(self, lora_name: str | None) -> Adapter | None:
        """The adapter a request with ``lora_name`` runs under (``None``: the default)."""
        return self.default if lora_name is None else self.get(lora_name)

    def is_current(self, adapter: Adapter | None) -> bool:
        """Whether results computed under ``adapter`` may be cached (it was not replaced or removed since)."""
        return adapter is None or self._adapters.get(adapter.name) == adapter


# ---------------------------------------------------------------------- CPU threads


class CpuThreads:
    """The intra-op thread count of CPU steps: the process's own while a step gets its cores,
    one while it shares them with other processes.

    Each step's CPU time in the thread that computes it, over its wall time,
    says whether that thread had its core: close to one alone, well under one
    when other processes take the cores (its OpenMP team then spins on cores
    they need). Below :attr:`SHARED` the steps go on one thread; on one
    thread that gets its core, they try the full count again after a number
    of steps that doubles each time the try shows the cores still shared.
    Short steps are judged together: their times add up until they span
    :attr:`MIN_JUDGED_S`.

    Args:
        max_threads: The count while the cores are free (``torch.get_num_threads()``
            of the thread that built the backend).
        adaptive: ``False``: always ``max_threads``.
    """

    SHARED = 0.75
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
            if share < self.SHARED:
                if self._is_trying:
                    self._try_after = min(2 * self._try_after, self.LAST_TRY_AFTER)
                self.num_threads, self._num_free_steps, self._is_trying = 1, 0, False
            elif self._is_trying:
                self._try_after, self._is_trying = self.FIRST_TRY_AFTER, False
            return
        self._num_free_steps = self._num_free_steps + 1 if share >= self.FREE else 0
        if self._num_free_steps >= self._try_after:
            self.num_threads, self._is_trying = self.max_threads, True


# ---------------------------------------------------------------------- the engine


class Engine:
    """The waiting calls of an ``AsyncLM``, its budget and its step; the runner behind them.

    Owns what every call path shares: the runner, the output cache, the
    adapter registry, the compute lock and the counters. Every model call
    holds :attr:`lock`, so the runner is never called concurrently.

    Args:
        config: When waiting calls are taken and how much a step computes.
        output_cache: Result rows by request.
        owner: The backend's class name, for error messages.
        cpu_threads: Adapts the intra-op threads of CPU steps (``None``: fixed).
    """

    runner: Runner
    """What computes batches (set by the backend once built)."""

    def __init__(
        self,
        config: BatchingConfig,
        output_cache: OutputCache,
        *,
        owner: str,
        cpu_threads: CpuThreads | None = None,
    ):
        self.config = config
        self.output_cache = output_cache
        self.adapters = AdapterRegistry()
        self.lock = threading.Lock()
        """Held by every model call and every change of the runner's state."""
        self.is_closed = False
        self.compute_in_loop = True
        """Whether steps run in the event loop's thread (else in one worker thread; see the module)."""
        self.cpu_threads = cpu_threads
        self._owner = owner
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._num_worker_threads = torch.get_num_threads()
        self._is_released = False
        self.num_loop_restarts = 0
        """Serve tasks replaced because they stopped on an unexpected error."""
        self.counts = dict.fromkeys(
            ("requests", "tokens_requested", "cache_hits", "batches", "contexts"), 0
        )

    # ------------------------------------------------------------------ from the front

    def count_requests(self, requests: Sequence[Request | ScoreRequest]) -> None:
        """Count an accepted call's requests (validated, about to be looked up or computed)."""
        self.counts["requests"] += len(requests)
        self.counts["tokens_requested"] += sum(
            len(r.context) + len(getattr(r, "continuation", ())) for r in requests
        )

    def cached_rows(self, requests: Sequence[Request]) -> list[torch.Tensor | None]:
        """The output cache's row of each request (``None`` where it has none), counted as hits."""
        rows = self.output_cache.get_many(requests)
        self.counts["cache_hits"] += sum(row is not None for row in rows)
        return rows

    async def rows(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        """Each request's row, ``float32 [V]``, to be read and never changed: from the output
        cache, else computed by a step with whatever else waits.

        Raises:
            BackendClosedError: the backend is (or gets) closed first.
            BatcherClosedError: :meth:`reset` ran while the requests waited.
            ValueError: a request's adapter was removed or replaced meanwhile.
            Exception: the model's error on the step that computed them.
        """
        rows = self.cached_rows(requests)
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing or self.config.rounds:
            computed = await self.computed([requests[i] for i in missing])
            for i, row in zip(missing, computed):
                rows[i] = row
        return rows  # type: ignore[return-value]  # no None left

    async def computed(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        """:meth:`rows` without looking in the output cache first (the caller did)."""
        rows, _ = await self._wait(requests)
        return rows

    async def rows_owned(self, requests: Sequence[Request]) -> tuple[list[torch.Tensor], bool]:
        """:meth:`rows`, and whether they were all computed together for this call alone (no
        cached row, no other caller handed them): the caller may then keep them uncopied."""
        rows = self.cached_rows(requests)
        missing = [i for i, row in enumerate(rows) if row is None]
        if not missing and not self.config.rounds:
            return rows, False  # type: ignore[return-value]  # no None left
        computed, is_sole = await self._wait([requests[i] for i in missing])
        for i, row in zip(missing, computed):
            rows[i] = row
        return rows, is_sole and len(missing) == len(rows) > 0  # type: ignore[return-value]

    async def scores(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Each request's scores, ``float32 [len(continuation)]``, computed by a step; as :meth:`rows`."""
        scores, _ = await self._wait(requests)
        return scores

    def rows_now(self, requests: Sequence[Request]) -> tuple[list[torch.Tensor], bool]:
        """:meth:`rows_owned`, computed in the calling thread: cached rows, then batches within the budget."""
        rows = self.cached_rows(requests)
        missing = list(dict.fromkeys(r for r, row in zip(requests, rows) if row is None))
        found, num_batches = self._compute_now(missing)
        owned = num_batches == 1 and len(missing) == len(requests)
        return [found[r] if row is None else row for r, row in zip(requests, rows)], owned

    def scores_now(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """:meth:`scores`, computed in the calling thread."""
        found, _ = self._compute_now(list(dict.fromkeys(requests)))
        return [found[request] for request in requests]

    def _compute_now(self, todo: list) -> tuple[dict, int]:
        """``{request: value}`` for distinct requests, and how many batches computed them."""
        found: dict = {}
        num_batches = 0
        with self.lock:
            while todo:
                self.check_open()
                batch = self._within_budget(todo)
                found.update(self._compute(batch))
                todo = todo[len(batch) :]
                num_batches += 1
        for value in found.values():
            if isinstance(value, BaseException):
                raise value
        return found, num_batches

    def check_open(self) -> None:
        """Raises :class:`BackendClosedError` once the backend is closed."""
        if self.is_closed:
            raise BackendClosedError(f"this {self._owner} is closed")

    # ------------------------------------------------------------------ the loop

    async def _wait(self, keys: Sequence[Request | ScoreRequest]) -> tuple[list, bool]:
        """The keys' values once the running loop's steps computed them, and whether this call
        alone was handed them (see :attr:`Call.is_sole`)."""
        self.check_open()
        loop = asyncio.get_running_loop()
        state = self._loop_state(loop)
        call = state.calls.add(keys, loop)
        if state.task is None:
            state.task = loop.create_task(self._serve(state), name="genlm engine")
        try:
            return await call.future, call.is_sole
        except Exception as exc:
            if self.is_closed and not isinstance(exc, BackendClosedError):
                raise BackendClosedError(f"this {self._owner} was closed") from exc
            raise

    def _loop_state(self, loop: asyncio.AbstractEventLoop) -> _LoopState:
        state = self._loops.get(loop)
        if state is None or state.error is not None:
            if state is not None:
                self.num_loop_restarts += 1
                logger.warning("restarting an engine loop that stopped: %r", state.error)
            for old in [old for old in self._loops if old.is_closed()]:
                del self._loops[old]  # a state holds its loop: drop those of finished loops
            state = self._loops[loop] = _LoopState(WaitingCalls(self.config))
        return state

    async def _serve(self, state: _LoopState) -> None:
        """Take the waiting calls, step, settle; until the loop ends or :meth:`reset`."""
        calls = state.calls
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
                    calls.count_step(outcome)
                    found.update(outcome.found)
                    del outcome
                    if not self.config.rounds:
                        break  # the rest wait for the next step, with whatever came meanwhile
                    todo = [key for key in todo if key not in found]
                calls.settle(taken, found)
                # Rows (lent memory, say) live no longer than their callers.
                del taken, todo, found
        except asyncio.CancelledError:
            calls.fail_all(BatcherClosedError("this loop's queue was closed"))
            raise
        except Exception as exc:  # noqa: BLE001 - a bug of the loop: every caller learns of it
            state.error = exc
            calls.fail_all(_died(exc))
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail callers, then propagate
            state.error = exc
            calls.fail_all(_died(exc))
            raise

    async def _step(self, todo: list[Request | ScoreRequest]) -> StepOutcome:
        """:meth:`step`, in the loop's thread or the worker's (:attr:`compute_in_loop`)."""
        if self.compute_in_loop:
            return self.step(todo)
        return await asyncio.get_running_loop().run_in_executor(
            self._worker_thread(), self.step, todo
        )

    def step(self, todo: list[Request | ScoreRequest]) -> StepOutcome:
        """Compute the first of the distinct requests ``todo`` that one batch holds.

        Runs in the thread that computes (the loop's, or the worker). A
        model error becomes the value of each request of the batch, so that
        it fails exactly the calls that waited for them.
        """
        with self.lock:
            if self.is_closed:
                closed = BackendClosedError(f"this {self._owner} was closed")
                return StepOutcome(dict.fromkeys(todo, closed), failed=True)
            batch = todo[:1]  # what a failing cost estimate fails
            try:
                batch = self._within_budget(todo)
                return StepOutcome(self._compute(batch, in_loop=self.compute_in_loop))
            except Exception as exc:  # noqa: BLE001 - for the calls of this batch
                return StepOutcome(dict.fromkeys(batch, exc), failed=True)

    def _within_budget(self, todo: list) -> list:
        """The first requests of ``todo`` that one batch holds (lock held: costs read the runner's cache)."""
        config = self.config
        if config.max_batch_tokens is None:
            return todo[: config.max_batch_size]
        costs = (self.runner.request_tokens(_as_request(r)) for r in todo)
        return todo[: config.next_batch_length(costs)]

    def _compute(self, batch: list, in_loop: bool = False) -> dict:
        """``{request: value}`` for a batch of distinct rows and scores (lock held); rows enter the output cache.

        A request whose adapter was removed or re-registered since its call
        is not computed: its value is the ``ValueError`` its caller gets.
        ``in_loop``: a step in the event loop's thread, whose torch threads
        :attr:`cpu_threads` adapts (a worker's, or a synchronous caller's, keep theirs).
        """
        is_current = self.adapters.is_current
        rows = [r for r in batch if type(r) is Request and is_current(r.adapter)]
        scores = [r for r in batch if type(r) is ScoreRequest and is_current(r.adapter)]
        threads = self.cpu_threads if in_loop else None
        start = threads.apply() if threads is not None else None
        found: dict = {}
        try:
            if rows:
                values = self.runner.run(rows).unbind(0)
                self.output_cache.put_many(list(zip(rows, values)))
                found.update(zip(rows, values))
            if scores:
                found.update(zip(scores, self.runner.score(scores)))
        finally:
            if threads is not None and start is not None:
                threads.observe(start)
        self.counts["batches"] += 1
        self.counts["contexts"] += len(rows) + len(scores)
        if len(found) < len(batch):
            for request in batch:
                if request not in found:
                    found[request] = _replaced_adapter_error(request)
        return found

    def _worker_thread(self) -> ThreadPoolExecutor:
        if self._worker is None:
            # The worker runs torch with the intra-op thread count of the thread that built the engine.
            self._worker = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="genlm-model",
                initializer=torch.set_num_threads,
                initargs=(self._num_worker_threads,),
            )
        return self._worker

    def stats(self) -> EngineStats | None:
        """The running loop's counters, ``None`` outside a loop or before its first call."""
        try:
            state = self._loops.get(asyncio.get_running_loop())
        except RuntimeError:
            return None
        return None if state is None else state.calls.stats()

    # ------------------------------------------------------------------ adapters, lifecycle

    def add_adapter(self, lora_path, lora_name: str) -> None:
        """Load ``lora_path`` as ``lora_name``, dropping what was cached under an old registration."""
        adapter = self.adapters.new_version(lora_path, lora_name)
        with self.lock:
            self.check_open()
            if lora_name in self.adapters:
                self._drop_adapter(self.adapters.get(lora_name))
            self.runner.load_adapter(adapter)
            self.adapters.record(adapter)

    def remove_adapter(self, lora_name: str) -> None:
        """Unload ``lora_name`` and drop exactly its cached rows and keys/values."""
        with self.lock:
            self._drop_adapter(self.adapters.forget(lora_name))

    def _drop_adapter(self, adapter: Adapter) -> None:
        self.output_cache.discard_if(
            lambda request: isinstance(request, Request) and request.adapter == adapter
        )
        self.runner.unload_adapter(adapter)

    def clear(self, rows: bool) -> None:
        """Drop the runner's keys/values, and the cached rows too with ``rows``."""
        with self.lock:
            if rows:
                self.output_cache.clear()
            self.runner.clear()

    def run_uncached(self, request: Request) -> torch.Tensor:
        """One plain forward pass over the whole context (the reference): ``[V]``."""
        with self.lock:
            self.check_open()
            return self.runner.run_uncached(request)

    async def reset(self) -> None:
        """Fail the running loop's waiting and computing calls with :class:`BatcherClosedError`;
        its next call starts afresh."""
        state = self._loops.pop(asyncio.get_running_loop(), None)
        if state is None:
            return
        state.calls.fail_all(BatcherClosedError("this loop's queue was closed by a reset"))
        if state.task is not None and not state.task.done():
            state.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await state.task

    async def aclose(self) -> None:
        """Fail the running loop's calls, wait off the loop for a step still computing, then :meth:`close`."""
        self.is_closed = True
        await self.reset()
        await asyncio.to_thread(self.wait_idle)
        self.close()

    def close(self) -> None:
        """Fail every loop's calls with :class:`BackendClosedError` and release the runner,
        once no step is computing. Idempotent."""
        self.is_closed = True
        error = BackendClosedError(f"this {self._owner} was closed")
        for loop, state in list(self._loops.items()):
            if loop.is_closed():
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                state.calls.fail_all(error)
            else:
                loop.call_soon_threadsafe(state.calls.fail_all, error)
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            if self._is_released:
                return
            self._is_released = True
            self.output_cache.clear()
            runner = getattr(self, "runner", None)  # None if the backend failed before building it
            if runner is not None:
                runner.close()

    def wait_idle(self) -> None:
        """Return once no step is computing (acquires and releases the lock in this thread)."""
        with self.lock:
            pass


def _as_request(request: Request | ScoreRequest) -> Request:
    """The next-token request whose cost a request has: a score request's whole text."""
    if type(request) is ScoreRequest:
        return Request(request.adapter, request.context + request.continuation)
    return request  # type: ignore[return-value]


def _replaced_adapter_error(request: Request | ScoreRequest) -> ValueError:
    name = request.adapter.name if request.adapter is not None else None
    return ValueError(
        f"LoRA adapter {name!r} was removed or re-registered while this request waited"
    )


def _died(error: BaseException) -> BatcherWorkerDiedError:
    died = BatcherWorkerDiedError(
        f"the engine's loop stopped on an unexpected error ({error!r}); "
        "the next call starts a new one"
    )
    died.__cause__ = error
    return died
