"""The engine of an :class:`~genlm_backend.llm.base.AsyncLM`: its runner, output cache and adapters
behind one :class:`~genlm_backend.batching.Batcher`.

One request's path, each arrow a named call::

    AsyncLM.next_token_logprobs(ids)        validate -> Request
      -> Engine.result(request, loop)       wait in this loop's queue (Batcher.submit_one)
      -> Batcher._serve (a task per loop)   until_flush -> take -> Engine.step -> settle
      -> Engine.step                        the output cache, then within the budget:
                                            runner.run / runner.score -> output cache
      -> WaitingCalls.settle                each call's future gets its values

Rows are *fresh*: a step hands each caller a view of one ``[B, V]`` tensor
made for that step (the runner's output, or one copy of it when the runner
lends its memory), held by nobody else but the output cache; the rows a
step finds in the output cache are views of one fresh copy of them, and a
second caller of the same row gets a copy of its own. The
output cache drops a row whose step's tensor was written to since
(:class:`~genlm_backend.cache.output.OutputCache` reads torch's version
counter), so a caller's write never reaches another caller or a later
result.

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
(:class:`~genlm_backend.batching.CpuThreads`); a row's last bits may then
differ from those of the same row computed with the other count.
"""

from __future__ import annotations

import asyncio
import operator
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from genlm_backend.batching import (
    Batcher,
    BatcherStats,
    BatchingConfig,
    CallFuture,
    CpuThreads,
    StepOutcome,
)
from genlm_backend.cache.output import OutputCache
from genlm_backend.errors import BackendClosedError, BatcherClosedError
from genlm_backend.llm.adapters import AdapterRegistry
from genlm_backend.llm.runner import Adapter, Request, Runner, ScoreRequest

DEFAULT_MAX_BATCH_TOKENS = 1 << 15
"""Tokens per batch for the language-model backends, as their runners count them (the part of
each context they compute): a batch's working memory grows with it."""

EngineStats = BatcherStats
"""The counters of an engine's running event loop (:class:`~genlm_backend.batching.BatcherStats`)."""

Key = Request | ScoreRequest


class Engine:
    """The waiting calls of an ``AsyncLM``, its budget and its step; the runner behind them.

    Owns what every call path shares: the runner, the output cache, the
    adapter registry, the compute lock and the counters. Every model call
    holds :attr:`lock`, so the runner is never called concurrently.

    Args:
        config: When waiting calls are taken and how much a step computes.
        output_cache: Result rows by request; it holds views of each step's rows.
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
        self.output_cache = output_cache
        self.adapters = AdapterRegistry()
        self.lock = threading.Lock()
        """Held by every model call and every change of the runner's state."""
        self.is_closed = False
        self._owner = owner
        self._is_released = False
        self.batcher: Batcher[Key] = Batcher(
            config,
            self.step,
            name="genlm engine",
            share=own_copy,
            num_worker_threads=torch.get_num_threads(),
            cpu_threads=cpu_threads,
        )
        self.result: Callable[[Key, asyncio.AbstractEventLoop], CallFuture[torch.Tensor]] = (
            self.batcher.submit_one
        )
        """:meth:`results` of one request (a particle's call) from the running loop: a future
        of its value alone. The batcher's own method, one call fewer per particle's step; the
        caller checks the engine open (the front's
        :meth:`~genlm_backend.llm.base.AsyncLM.request` does)."""
        self.counts = dict.fromkeys(
            ("requests", "tokens_requested", "cache_hits", "batches", "contexts", "chunks"), 0
        )
        self._chunks_left: int | None = None  # chunk steps the prefill under way may still take

    @property
    def config(self) -> BatchingConfig:
        """When waiting calls are taken and how much a step computes."""
        return self.batcher.config

    @config.setter
    def config(self, config: BatchingConfig) -> None:
        self.batcher.config = config

    @property
    def compute_in_loop(self) -> bool:
        """Whether steps run in the event loop's thread (else in one worker thread; see the module)."""
        return self.batcher.in_loop

    @compute_in_loop.setter
    def compute_in_loop(self, in_loop: bool) -> None:
        self.batcher.in_loop = in_loop

    @property
    def cpu_threads(self) -> CpuThreads | None:
        """Adapts the torch threads of steps in the event loop's thread (``None``: fixed)."""
        return self.batcher.cpu_threads

    @property
    def num_loop_restarts(self) -> int:
        """Serve tasks replaced because they stopped on an unexpected error."""
        return self.batcher.num_loop_restarts

    # ------------------------------------------------------------------ from the front

    def count_requests(self, requests: Sequence[Key]) -> None:
        """Count an accepted call's requests (validated, about to be looked up or computed)."""
        counts = self.counts
        counts["requests"] += len(requests)
        counts["tokens_requested"] += _num_text_tokens(requests)

    def results(self, requests: Sequence[Key]) -> asyncio.Future[list[torch.Tensor]]:
        """A future of each request's value: a row ``float32 [V]`` for a :class:`Request`, scores
        ``float32 [len(continuation)]`` for a :class:`ScoreRequest`; from the output cache or
        computed by a step with whatever else waits. Each value is the caller's own (see the
        module).

        The future's exception, if any: :class:`BackendClosedError` (the backend
        got closed first), :class:`BatcherClosedError` (:meth:`reset` ran while
        the requests waited), ``ValueError`` (a request's adapter was removed or
        replaced meanwhile), or the model's error on the step that computed them.

        Raises:
            BackendClosedError: the backend is closed.
        """
        if self.is_closed:
            raise BackendClosedError(f"this {self._owner} is closed")
        return self.batcher.submit(requests)

    def results_now(self, requests: Sequence[Key]) -> list[torch.Tensor]:
        """:meth:`results`, computed in the calling thread: cached rows, then steps within the budget."""
        todo = list(dict.fromkeys(requests))
        found: dict = {}
        while todo:
            found.update(self.compute(todo).found)
            todo = [key for key in todo if key not in found]
        values = []
        handed: set = set()
        for request in requests:
            value = found[request]
            if isinstance(value, BaseException):
                raise value
            if request in handed:
                value = own_copy(value)
            handed.add(request)
            values.append(value)
        return values

    def check_open(self) -> None:
        """Raises :class:`BackendClosedError` once the backend is closed."""
        if self.is_closed:
            raise BackendClosedError(f"this {self._owner} is closed")

    # ------------------------------------------------------------------ the step

    def step(self, todo: list[Key]) -> StepOutcome:
        """The batcher's step: :meth:`compute`, in chunks of ``chunk_tokens`` while steps run in
        the event loop's thread (:class:`~genlm_backend.batching.BatchingConfig`)."""
        return self.compute(todo, self.config.chunk_tokens if self.batcher.in_loop else None)

    def compute(self, todo: list[Key], chunk_tokens: int | None = None) -> StepOutcome:
        """The values of the first of the distinct requests ``todo`` that one step holds.

        Rows the output cache holds come first (one fresh copy), then a batch within
        the budget is computed; with ``chunk_tokens``, a batch whose contexts
        need a longer prefill (a prompt's) gets a chunk of it computed instead
        (:meth:`~genlm_backend.llm.runner.PrefixCacheRunner.advance`), and
        waits for the next step. Runs in the thread that computes (the
        loop's, the worker, or a synchronous caller's). A model error becomes
        the value of each request of the batch, so that it fails exactly the
        calls that waited for them.
        """
        with self.lock:
            if self.is_closed:
                closed = BackendClosedError(f"this {self._owner} was closed")
                return StepOutcome(dict.fromkeys(todo, closed), failed=True)
            found = self._cached(todo)
            if found:
                todo = [key for key in todo if key not in found]
                if not todo:
                    return StepOutcome(found)
            stale = self._stale(todo)
            if stale:
                found.update(stale)
                todo = [key for key in todo if key not in stale]
                if not todo:
                    return StepOutcome(found)
            batch = todo[:1]  # what a failing cost estimate fails
            try:
                batch = self._within_budget(todo)
                if chunk_tokens is not None and self._chunk(batch, chunk_tokens):
                    return StepOutcome(found)  # the batch waits for its next chunk
                self._chunks_left = None
                found.update(self._compute(batch))
                return StepOutcome(found)
            except Exception as exc:  # noqa: BLE001 - for the calls of this batch
                self._chunks_left = None
                found.update(dict.fromkeys(batch, exc))
                return StepOutcome(found, failed=True)

    def _chunk(self, batch: list[Key], chunk_tokens: int) -> bool:
        """Whether a chunk of the batch's long prefills was computed (lock held).

        A prefill gets at most as many chunk steps as its tokens fill (its
        cost counted at its first chunk, plus one): a KV cache too small for
        it (which evicts one chunk to keep the next) or a batch that changes
        between steps cannot keep chunking forever; past that, the batch runs
        as one pass.
        """
        advance = getattr(self.runner, "advance", None)
        if advance is None or self._chunks_left == 0:
            return False
        computed = advance(batch, chunk_tokens)
        if not computed:
            return False
        if self._chunks_left is None:
            cost = sum(self.runner.request_tokens(_as_request(r)) for r in batch)
            self._chunks_left = (cost + computed) // chunk_tokens + 1
        self._chunks_left -= 1
        self.counts["chunks"] += 1
        return True

    def _cached(self, todo: list[Key]) -> dict:
        """``{request: its row}`` for the rows the output cache holds (lock held): views of one
        fresh copy of them, like a computed step's rows (a batch call whose rows are all
        cached, and nothing else's, gets that copy itself: one copy, not two)."""
        cache = self.output_cache
        if not len(cache):
            return {}
        rows = todo  # the output cache holds rows only: score requests are not looked up
        if set(map(type, todo)) != {Request}:
            rows = [r for r in todo if type(r) is Request]
        held = cache.get_many(rows)
        if all(row is None for row in held):  # a step's new contexts: the common case
            return {}
        hits = [(r, row) for r, row in zip(rows, held) if row is not None]
        self.counts["cache_hits"] += len(hits)
        keys, values = zip(*hits)
        return dict(zip(keys, fresh_block(values).unbind(0)))

    def _within_budget(self, todo: list[Key]) -> list[Key]:
        """The first requests of ``todo`` that one batch holds (lock held: costs read the runner's cache)."""
        config = self.config
        if config.max_batch_tokens is None:
            return todo[: config.max_batch_size]
        # A request costs at most its whole text (Runner.request_tokens): when the texts fit,
        # so do the costs, and none is looked up (a KV tree lookup per request).
        fits_count = config.max_batch_size is None or len(todo) <= config.max_batch_size
        if fits_count and _num_text_tokens(todo) <= config.max_batch_tokens:
            return todo
        costs = (self.runner.request_tokens(_as_request(r)) for r in todo)
        return todo[: config.next_batch_length(costs)]

    def _stale(self, todo: list[Key]) -> dict:
        """``{request: the ValueError its caller gets}`` for the requests whose adapter was
        removed or re-registered since their call: they are not computed."""
        if not any(map(_ADAPTER, todo)):  # the base model (None) is always current
            return {}
        is_current = self.adapters.is_current
        return {r: _replaced_adapter_error(r) for r in todo if not is_current(r.adapter)}

    def _compute(self, batch: list[Key]) -> dict:
        """``{request: value}`` for a batch of distinct rows and scores of current adapters
        (lock held); rows enter the output cache."""
        rows = [r for r in batch if type(r) is Request]
        scores = [r for r in batch if type(r) is ScoreRequest] if len(rows) < len(batch) else []
        found: dict = {}
        if rows:
            block = self._fresh(self.runner.run(rows))
            values = block.unbind(0)
            self.output_cache.put_rows(rows, values, block)
            found.update(zip(rows, values))
        if scores:
            found.update(zip(scores, self.runner.score(scores)))
        self.counts["batches"] += 1
        self.counts["contexts"] += len(rows) + len(scores)
        return found

    def _fresh(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` as a tensor the step's callers may hold and change: itself, unless the
        runner made it in inference mode (whose tensors refuse later writes and keep no
        version counter): then one copy."""
        if block.is_inference():
            with torch.inference_mode(False):
                return block.clone()
        return block

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

    def stats(self) -> EngineStats | None:
        """The running loop's counters, ``None`` outside a loop or before its first call."""
        return self.batcher.stats()

    async def reset(self) -> None:
        """Fail the running loop's waiting and computing calls with :class:`BatcherClosedError`;
        its next call starts afresh."""
        await self.batcher.reset(BatcherClosedError("this loop's queue was closed by a reset"))

    async def aclose(self) -> None:
        """Fail the running loop's calls, wait off the loop for a step still computing, then :meth:`close`."""
        self.is_closed = True
        await self.batcher.reset(BackendClosedError(f"this {self._owner} was closed"))
        await asyncio.to_thread(self.wait_idle)
        self.close()

    def close(self) -> None:
        """Fail every loop's calls with :class:`BackendClosedError` and release the runner,
        once no step is computing. Idempotent."""
        self.is_closed = True
        self.batcher.close(BackendClosedError(f"this {self._owner} was closed"))
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


def own_copy(value: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` for a caller to keep (and change) without touching anyone else's.

    On the CPU the copy runs in this thread (numpy's): torch's starts its
    OpenMP team for a row of a large vocabulary, and on a machine whose cores
    are busy the event loop would then wait for a descheduled thread.
    """
    if value.device.type == "cpu" and value.dtype == torch.float32 and not value.requires_grad:
        return torch.from_numpy(value.numpy().copy())
    with torch.inference_mode(False):
        return value.clone()


def fresh_block(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(rows), V]``: one copy of ``rows`` (of one shape, dtype and device), held by nobody else.

    On the CPU the copy runs in this thread, as :func:`own_copy`'s does.
    """
    first = rows[0]
    if first.device.type == "cpu" and first.dtype == torch.float32 and not first.requires_grad:
        return torch.from_numpy(np.stack([row.numpy() for row in rows]))
    with torch.inference_mode(False):
        return torch.stack(list(rows))


_ADAPTER = operator.attrgetter("adapter")
_CONTEXT = operator.attrgetter("context")
_CONTINUATION = operator.attrgetter("continuation")  # a Request's is empty


def _num_text_tokens(requests: Sequence[Key]) -> int:
    """The tokens of the requests' whole texts (a score request's context and continuation),
    summed at C speed (a Python function per request cost a step 70 ns a request)."""
    return sum(map(len, map(_CONTEXT, requests))) + sum(map(len, map(_CONTINUATION, requests)))


def _as_request(request: Key) -> Request:
    """The next-token request whose cost a request has: a score request's whole text."""
    if type(request) is ScoreRequest:
        return Request(request.adapter, request.context + request.continuation)
    return request  # type: ignore[return-value]


def _replaced_adapter_error(request: Key) -> ValueError:
    name = request.adapter.name if request.adapter is not None else None
    return ValueError(
        f"LoRA adapter {name!r} was removed or re-registered while this request waited"
    )
