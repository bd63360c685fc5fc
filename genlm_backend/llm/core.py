"""The synchronous core of an :class:`~genlm_backend.llm.base.AsyncLM`: requests to rows, no asyncio.

:class:`LMCore` owns what every call path shares: the runner, the output
cache, the adapter registry (:class:`AdapterRegistry`: names of LoRA
adapters, resolved per request), the compute lock and the counters. The async
calls reach :meth:`LMCore.compute` through the batcher's worker thread; the
``*_sync`` calls run it in the calling thread. Every model call holds
:attr:`LMCore.lock`, so the runner is never called concurrently.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import torch

from genlm_backend.batching import BatchingConfig
from genlm_backend.cache.output import OutputCache
from genlm_backend.errors import BackendClosedError
from genlm_backend.llm.runner import Adapter, Request, Runner, ScoreRequest
from genlm_backend.llm.stats import LMStats
from genlm_backend.llm.validation import RecentContexts, TokenIds, validate_continuation


class AdapterRegistry:
    """The adapters a backend has loaded, by name, and the default one.

    ``lora_name=None`` on a request means the default adapter: the base model
    unless :meth:`set_default` chose one.
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


class LMCore:
    """Validation, the output cache, adapters, counters and model calls of one backend.

    Args:
        vocab_size: Length of every row.
        max_context_length: Longest accepted context, ``None`` for no limit.
        output_cache_bytes: Byte budget of the output cache (LRU; 0 disables it).
        batching: How the sync path splits a call into model batches.
        owner: The backend's class name, for error messages.
    """

    runner: Runner
    """What computes batches (set by the backend once built)."""

    def __init__(
        self,
        vocab_size: int,
        max_context_length: int | None,
        output_cache_bytes: int,
        batching: BatchingConfig,
        owner: str,
    ):
        self.vocab_size = vocab_size
        self.max_context_length = max_context_length
        self.output_cache = OutputCache(output_cache_bytes)
        self.contexts = RecentContexts(vocab_size, max_context_length)
        """Contexts validated lately (a context extending one by a token is checked at that token)."""
        self.adapters = AdapterRegistry()
        self.batching = batching
        self.lock = threading.Lock()
        """Held by every model call and every change of the runner's state."""
        self.is_closed = False
        self._owner = owner
        self._num_requests = self._num_tokens_requested = self._num_cache_hits = 0
        self._num_batches = self._num_contexts_computed = 0

    # ------------------------------------------------------------------ requests

    def requests(
        self,
        token_ids_list: list[TokenIds],
        lora_name: str | None,
        argument: str | None,
        positions: list[int] | None = None,
    ) -> list[Request]:
        """Validate the adapter and every context, then count them: a rejected call counts nothing.

        Errors name ``argument[i]``, the bad context's index in the call
        (``positions[i]`` when given: the contexts are some of the call's), or
        just the context when ``argument`` is ``None`` (single-context calls).

        Raises:
            TypeError, ValueError: a bad context or an unknown ``lora_name``.
            BackendClosedError: the backend was closed.
        """
        self.check_open()
        adapter = self.adapters.resolve(lora_name)
        requests = []
        for index, token_ids in enumerate(token_ids_list):
            try:
                context, parent = self.contexts.validate(token_ids)
            except (TypeError, ValueError) as exc:
                if argument is None:
                    raise
                position = index if positions is None else positions[index]
                raise type(exc)(f"{argument}[{position}]: {exc}") from None
            requests.append(Request(adapter, context, parent))
        self.count_requests(requests)
        return requests

    def held_rows(
        self, contexts: list[tuple[int, ...]], lora_name: str | None
    ) -> tuple[list[torch.Tensor | None], list[Request]]:
        """The output cache's rows of ``contexts``, looked up before they are validated; ``None``
        where a context is not held. Also the requests found (to :meth:`count_requests` once
        the call is accepted).

        Only for contexts known to be tuples of plain ints (what a server decodes
        from a request body): a tuple equal to a key of the cache is then that
        key's context, which was validated before it was computed.

        Raises:
            ValueError: an unknown ``lora_name``.
            BackendClosedError: the backend was closed.
        """
        self.check_open()
        adapter = self.adapters.resolve(lora_name)
        keys = [Request(adapter, context) for context in contexts]
        rows = self.output_cache.get_many(keys)
        found = [key for key, row in zip(keys, rows) if row is not None]
        return rows, found

    def count_requests(self, requests: list[Request], num_cache_hits: int = 0) -> None:
        """Count an accepted call's ``requests`` (and those of them its output cache answered)."""
        self._num_requests += len(requests)
        self._num_tokens_requested += sum(len(request.context) for request in requests)
        self._num_cache_hits += num_cache_hits

    def score_requests(
        self,
        context: TokenIds,
        continuations: list[TokenIds],
        lora_name: str | None,
        argument: str | None,
    ) -> list[ScoreRequest]:
        """Validate a context, its continuations and the adapter, then count them.

        Errors name ``argument[i]``, the bad continuation's index (or just
        the continuation when ``argument`` is ``None``).

        Raises:
            TypeError, ValueError: a bad context or continuation (empty, ids
                outside the vocabulary, too long together) or an unknown ``lora_name``.
            BackendClosedError: the backend was closed.
        """
        self.check_open()
        adapter = self.adapters.resolve(lora_name)
        prefix = validate_continuation(context, self.vocab_size, "context")
        requests = []
        for i, continuation in enumerate(continuations):
            name = "continuation" if argument is None else f"{argument}[{i}]"
            tokens = validate_continuation(continuation, self.vocab_size, name)
            if (
                self.max_context_length is not None
                and len(prefix) + len(tokens) > self.max_context_length
            ):
                raise ValueError(
                    f"context and {name} hold {len(prefix) + len(tokens)} tokens together, "
                    f"more than the model's context of {self.max_context_length}"
                )
            requests.append(ScoreRequest(adapter, prefix, tokens))
        self._num_requests += len(requests)
        self._num_tokens_requested += sum(len(r.context) + len(r.continuation) for r in requests)
        return requests

    def request_tokens(self, request: Request | ScoreRequest) -> int:
        """A request's cost against the batch token budget (the runner's estimate)."""
        if isinstance(request, ScoreRequest):
            full = Request(request.adapter, request.context + request.continuation)
            return self.runner.request_tokens(full)
        return self.runner.request_tokens(request)

    def check_open(self) -> None:
        """Raises :class:`BackendClosedError` once the backend is closed."""
        if self.is_closed:
            raise BackendClosedError(f"this {self._owner} is closed")

    def cached(self, request: Request) -> torch.Tensor | None:
        """The output cache's row for ``request`` (counted as a hit), or ``None``."""
        row = self.output_cache.get(request)
        if row is not None:
            self._num_cache_hits += 1
        return row

    def cached_many(self, requests: Sequence[Request]) -> list[torch.Tensor | None]:
        """:meth:`cached` for each of ``requests``, in order."""
        rows = self.output_cache.get_many(requests)
        self._num_cache_hits += sum(row is not None for row in rows)
        return rows

    # ------------------------------------------------------------------ computing

    def compute(self, requests: list[Request | ScoreRequest]) -> list[torch.Tensor | ValueError]:
        """Compute distinct requests (rows and scores, of one adapter or several); rows fill the output cache.

        A request whose adapter was removed or re-registered since the call is
        not computed: its slot holds the ``ValueError`` its caller gets.
        """
        with self.lock:
            self.check_open()
            current = [request for request in requests if self.adapters.is_current(request.adapter)]
            rows = [request for request in current if isinstance(request, Request)]
            if rows and len(rows) == len(requests):  # the usual batch: rows, no adapter replaced
                values = self.runner.run(rows).unbind(0)
                self._count_batch(len(rows))
                self.output_cache.put_many(list(zip(rows, values)))
                return list(values)
            scores = [request for request in current if isinstance(request, ScoreRequest)]
            results: dict[Request | ScoreRequest, torch.Tensor] = {}
            if rows:
                results.update(zip(rows, self.runner.run(rows).unbind(0)))
            if scores:
                results.update(zip(scores, self.runner.score(scores)))
            self._count_batch(len(current))
            self.output_cache.put_many([(request, results[request]) for request in rows])
        return [
            results[request] if request in results else _replaced_adapter_error(request)
            for request in requests
        ]

    def _count_batch(self, num_contexts: int) -> None:
        self._num_batches += 1
        self._num_contexts_computed += num_contexts

    def score_now(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Scores computed in the calling thread, in model batches within the token budget.

        Raises:
            ValueError: a request's adapter was replaced meanwhile.
        """
        results: dict[ScoreRequest, torch.Tensor] = {}
        distinct = list(dict.fromkeys(requests))
        for chunk in self.batching.split(distinct, self.request_tokens):
            for request, scores in zip(chunk, self.compute(list(chunk))):
                if isinstance(scores, ValueError):
                    raise scores
                results[request] = scores
        return [results[request].clone() for request in requests]

    def compute_now(self, requests: Sequence[Request]) -> torch.Tensor:
        """``[len(requests), V]`` rows computed in the calling thread: cached rows, then model batches.

        Raises:
            ValueError: a request's adapter was replaced meanwhile.
        """
        rows = {
            request: row
            for request, row in zip(requests, self.cached_many(requests))
            if row is not None
        }
        missing = [request for request in dict.fromkeys(requests) if request not in rows]
        chunks = self.batching.split(missing, self.request_tokens)
        for chunk in chunks:
            for request, row in zip(chunk, self.compute(list(chunk))):
                if isinstance(row, ValueError):
                    raise row
                rows[request] = row
        ordered = [rows[request] for request in requests]
        # Distinct rows of one runner output, none cached: that output is the caller's alone.
        block = one_block(ordered) if len(chunks) == 1 and len(missing) == len(requests) else None
        return torch.stack(ordered) if block is None else block  # stack copies: caller owns it

    def run_uncached(self, request: Request) -> torch.Tensor:
        """One plain forward pass over the whole context (the reference): ``[V]``."""
        self.check_open()
        with self.lock:
            return self.runner.run_uncached(request)

    # ------------------------------------------------------------------ adapters

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

    # ------------------------------------------------------------------ lifecycle

    def clear(self, rows: bool) -> None:
        """Drop the runner's keys/values, and the cached rows too with ``rows``."""
        with self.lock:
            if rows:
                self.output_cache.clear()
            self.runner.clear()

    def close(self) -> None:
        """Drop the cached rows and release the model, once no batch is computing. Idempotent."""
        self.is_closed = True
        with self.lock:
            self.output_cache.clear()
            self.contexts.clear()
            runner = getattr(self, "runner", None)  # None if the backend failed before building it
            if runner is not None:
                runner.close()

    def wait_idle(self) -> None:
        """Return once no batch is computing (acquires and releases the lock in this thread)."""
        with self.lock:
            pass

    @property
    def stats(self) -> LMStats:
        runner_stats = self.runner.stats
        return LMStats(
            num_requests=self._num_requests,
            num_batches=self._num_batches,
            num_contexts_computed=self._num_contexts_computed,
            num_output_cache_hits=self._num_cache_hits,
            num_tokens_requested=self._num_tokens_requested,
            num_tokens_computed=runner_stats.num_tokens_computed,
            output_cache_bytes=self.output_cache.stats.bytes_held,
            kv_cache_bytes=runner_stats.kv_cache_bytes,
        )


def _replaced_adapter_error(request: Request | ScoreRequest) -> ValueError:
    # adapter None is the base model, which is never replaced; named for completeness
    name = request.adapter.name if request.adapter is not None else None
    return ValueError(
        f"LoRA adapter {name!r} was removed or re-registered while this request waited"
    )


def one_block(rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The ``[len(rows), V]`` tensor whose rows ``rows`` are, all of them and in order; else ``None``.

    A runner returns a fresh tensor per batch, and every other holder of its
    rows copies them (the output cache stores compact copies, single-row
    callers get :func:`own_copy`). So a batch call whose rows were computed
    for it alone, as one runner output, returns that output itself instead
    of a stacked copy of it.
    """
    base = rows[0]._base
    if base is None or base.dim() != 2 or not base.is_contiguous():
        return None
    num_rows, width = base.shape
    if num_rows != len(rows) or rows[0].shape != (width,):
        return None
    start, stride = base.storage_offset(), base.stride(0)
    for index, row in enumerate(rows):
        if (
            row._base is not base
            or row.storage_offset() != start + index * stride
            or row.shape != (width,)
            or row.stride() != (1,)
        ):
            return None
    return base
