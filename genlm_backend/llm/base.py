"""The one :class:`AsyncLM`: the contract every backend serves, a thin front on its engine.

A call validates its input and resolves its adapter here, then hands its
requests to the :class:`~genlm_backend.llm.engine.Engine` (``results``;
``results_now`` for the synchronous calls), which batches them with every
other waiting call and runs the backend's runner.
The adapter is resolved once, at the call, and travels in the request: it is
part of the engine's, the output cache's and the KV tree's key.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import marshal
import operator
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np
import torch

from genlm_backend.batching import BatchingConfig, CallFuture, CpuThreads, coroutine_function
from genlm_backend.cache.kv_tree import (
    HASH_BLOCK,
    SAME_OBJECTS_FROM,
    UNTRACKED_LENGTH,
    blocks_digest,
    same_objects,
    untracked,
)
from genlm_backend.cache.output import OutputCache
from genlm_backend.llm.adapters import AdapterRegistry
from genlm_backend.llm.engine import DEFAULT_MAX_BATCH_TOKENS, Engine, EngineStats
from genlm_backend.llm.runner import Request, Runner, ScoreRequest
from genlm_backend.llm.sampling import (
    check_sampling_options,
    make_generator,
    sample_continuation,
    sample_token,
    stream_seeds,
)
from genlm_backend.llm.stats import LMStats

__all__ = ["AsyncLM", "LMStats", "TokenIds", "sample_token", "validate_token_ids"]

DEFAULT_OUTPUT_CACHE_BYTES = 256 << 20  # 256 MiB
OUTPUT_CACHE_INITIAL_BYTES = 32 << 20
"""What the output cache holds at first (and two steps' outputs): it grows into
``output_cache_bytes`` once a request misses a row it evicted (:class:`OutputCache`)."""

DEFAULT_CHUNK_TOKENS = 64
"""Tokens a step in the event loop's thread computes at once (see ``AsyncLM``'s ``chunk_tokens``):
a 64-token chunk of SmolLM2-135M's prefill takes about 60 ms on two CPU cores (BENCHMARKS.md)."""


class AsyncLM:
    """Next-token log-probabilities over the whole vocabulary, for many concurrent callers.

    Output contract, for every runner and model:

    * ``float32`` tensor of shape ``[len(byte_vocab)]`` (``[B, len(byte_vocab)]``
      for batch calls) on :attr:`device`;
    * normalized: ``logsumexp == 0`` within 1e-5; logit columns beyond the
      tokenizer's vocabulary are dropped and tokens the model cannot produce are ``-inf``;
    * each call returns a fresh tensor: mutating it never changes a later result.

    Input contract: a context is a non-empty sequence of ints in
    ``[0, len(byte_vocab))`` no longer than :attr:`max_context_length`;
    anything else raises ``TypeError``/``ValueError`` for that caller only,
    before any model work (see :func:`validate_token_ids`). ``lora_name``
    names an adapter registered with :meth:`add_new_lora`; ``None`` means the
    default adapter, which is the base model unless :meth:`set_lora` chose one.

    Concurrency: concurrent ``await``\\ s on one event loop are batched by the
    backend's :class:`~genlm_backend.llm.engine.Engine`, whose steps run in the
    event loop's thread (``compute_in_loop``; see the engine's module for why,
    and for servers), long ones in chunks with the loop running between them. The
    ``*_sync`` methods compute directly in the calling thread and work with or
    without a running loop. An object may serve several ``asyncio.run`` calls in turn.

    ``AsyncTransformer``, ``AsyncVirtualLM`` and ``MockAsyncLM`` build one
    with their runner; ``AsyncLM(tokenizer, runner)`` takes any other. This
    class is the contract: it validates each call and hands its requests to
    :attr:`engine`, which owns the runner, the output cache, the adapters and
    the counters.

    Args:
        tokenizer: The model's Hugging Face tokenizer (``None`` with ``byte_vocab`` given).
        runner: What computes batches; a subclass may attach it after construction.
        batch_size: Most distinct contexts per model batch; ``None`` (default):
            no count limit, a batch takes every waiting context within ``max_batch_tokens``.
        timeout_s: Most seconds a request waits for company before its batch goes
            (``None``: no limit; batches go when the event loop is idle).
        rounds: Calls complete in the order they were made, whatever the
            cache holds and whoever else calls (``rounds`` of
            :class:`~genlm_backend.batching.BatchingConfig`).
        max_batch_tokens: Most tokens per model batch, as the runner counts them
            (the part of each context it computes); ``None`` for no budget. A
            longer context goes alone.
        output_cache_bytes: Byte budget of the output cache (LRU; 0 disables it). The
            cache grows into it: it holds :data:`OUTPUT_CACHE_INITIAL_BYTES` (or two
            steps' outputs) until a request misses a row it evicted.
        compute_in_loop: Steps run in the event loop's thread (the default:
            fastest where the particles all wait for them), blocking the loop
            for at most a chunk at a time; ``False``: in one worker thread, the
            loop free meanwhile (for applications that serve other work on
            the loop). Settable later as ``llm.engine.compute_in_loop``.
        chunk_tokens: Most tokens of one prefill a step in the loop's thread
            computes at once: a longer prefill (a prompt's, a long context's)
            goes in chunks of this many tokens, the loop running between them
            (``None``: whole batches). Many short rows (particles' steps) are
            one pass whatever their total; steps in a worker thread are not cut.
        max_context_length: Longest accepted context, ``None`` for no limit.
        device: Where returned tensors live.
        byte_vocab: Precomputed byte vocabulary; decoded from ``tokenizer`` when omitted.
        str_vocab: Precomputed string vocabulary (decoded from ``byte_vocab`` when omitted).
        cpu_threads: ``"auto"``: CPU steps adapt their torch threads to the cores
            they get (:class:`~genlm_backend.batching.CpuThreads`); ``None``:
            steps keep the thread's own count.
        output_cache_views: The output cache holds each step's output itself (no
            copy; see :class:`~genlm_backend.cache.output.OutputCache`); ``False``:
            compact copies of its rows, for runners whose output is memory lent
            until the callers let go of it (``RemoteLM``'s shared-memory regions).
    """

    def __init__(
        self,
        tokenizer,
        runner: Runner | None = None,
        *,
        batch_size: int | None = None,
        timeout_s: float | None = 0.02,
        rounds: bool = False,
        max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
        compute_in_loop: bool = True,
        chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
        max_context_length: int | None = None,
        device: str | torch.device = "cpu",
        byte_vocab: Sequence[bytes] | None = None,
        str_vocab: Sequence[str] | None = None,
        cpu_threads: str | None = None,
        output_cache_views: bool = True,
    ):
        self.batching = BatchingConfig(
            max_batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            timeout_s=timeout_s,
            rounds=rounds,
            chunk_tokens=chunk_tokens,
        )
        if not isinstance(compute_in_loop, bool):
            raise TypeError(f"compute_in_loop must be a bool, got {compute_in_loop!r}")
        if cpu_threads not in (None, "auto"):
            raise ValueError(f'cpu_threads must be "auto" or None, got {cpu_threads!r}')
        self.tokenizer = tokenizer
        if byte_vocab is None:
            from genlm_backend.tokenization import decode_vocab

            byte_vocab, str_vocab = decode_vocab(tokenizer)
        elif str_vocab is None:
            str_vocab = [b.decode("utf-8", errors="replace") for b in byte_vocab]
        self.byte_vocab = list(byte_vocab)
        self.str_vocab = list(str_vocab)
        self.device = torch.device(device)
        threads = None
        if cpu_threads == "auto" and self.device.type == "cpu":
            threads = CpuThreads(torch.get_num_threads())
        self.engine = Engine(
            self.batching,
            OutputCache(
                output_cache_bytes,
                keep_views=output_cache_views,
                initial_bytes=OUTPUT_CACHE_INITIAL_BYTES,
            ),
            owner=type(self).__name__,
            cpu_threads=threads,
        )
        self.engine.compute_in_loop = compute_in_loop
        """Where every call's requests go: see :class:`~genlm_backend.llm.engine.Engine`."""
        self._max_context_length = max_context_length
        self._contexts = RecentContexts(len(self.byte_vocab), max_context_length)
        if runner is not None:
            self.runner = runner

    # ------------------------------------------------------------------ properties

    @property
    def runner(self) -> Runner:
        """What computes batches (a backend sets it once built)."""
        return self.engine.runner

    @runner.setter
    def runner(self, runner: Runner) -> None:
        self.engine.runner = runner

    @property
    def output_cache(self) -> OutputCache:
        """Result rows by request (LRU within ``output_cache_bytes``)."""
        return self.engine.output_cache

    @property
    def adapters(self) -> AdapterRegistry:
        """The registered LoRA adapters and the default one."""
        return self.engine.adapters

    @property
    def max_context_length(self) -> int | None:
        """Longest accepted context (``None``: no limit)."""
        return self._max_context_length

    @property
    def vocab_size(self) -> int:
        """``len(byte_vocab)``: the length of every returned row."""
        return len(self.byte_vocab)

    @property
    def batch_size(self) -> int | None:
        """Most distinct contexts per model batch (``None``: no count limit); see :attr:`batching`."""
        return self.batching.max_batch_size

    @property
    def timeout_s(self) -> float | None:
        """Most seconds a request waits for company; see :attr:`batching`."""
        return self.batching.timeout_s

    @property
    def batcher_stats(self) -> EngineStats | None:
        """The running event loop's engine counters (``None`` outside a loop or before its first call)."""
        return self.engine.stats()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` or :meth:`aclose` was called (later calls raise :class:`BackendClosedError`)."""
        return self.engine.is_closed

    @property
    def stats(self) -> LMStats:
        """A snapshot of the counters (requests, batches, tokens requested and computed, bytes held)."""
        counts, runner = self.engine.counts, self.runner.stats
        return LMStats(
            num_requests=counts["requests"],
            num_batches=counts["batches"],
            num_contexts_computed=counts["contexts"],
            num_output_cache_hits=counts["cache_hits"],
            num_tokens_requested=counts["tokens_requested"],
            num_tokens_computed=runner.num_tokens_computed,
            output_cache_bytes=self.output_cache.stats.bytes_held,
            kv_cache_bytes=runner.kv_cache_bytes,
        )

    # ------------------------------------------------------------------ requests

    def requests(
        self,
        token_ids_list: Sequence[TokenIds],
        lora_name: str | None = None,
        argument: str | None = "token_ids_list",
        positions: Sequence[int] | None = None,
    ) -> list[Request]:
        """Validate the adapter and every context, then count them: a rejected call counts nothing.

        Errors name ``argument[i]``, the bad context's index in the call
        (``positions[i]`` when given: the contexts are some of the call's), or
        just the context when ``argument`` is ``None`` (single-context calls).

        Raises:
            TypeError, ValueError: a bad context or an unknown ``lora_name``.
            BackendClosedError: the backend was closed.
        """
        self.engine.check_open()
        adapter = self.adapters.resolve(lora_name)
        validate = self._contexts.validate
        requests = []
        for index, token_ids in enumerate(token_ids_list):
            try:
                context, parent, hashed = validate(token_ids)
            except (TypeError, ValueError) as exc:
                if argument is None:
                    raise
                position = index if positions is None else positions[index]
                raise type(exc)(f"{argument}[{position}]: {exc}") from None
            requests.append(Request(adapter, context, parent, hashed=hashed))
        self.engine.count_requests(requests)
        return requests

    def request(self, token_ids: TokenIds, lora_name: str | None = None) -> Request:
        """:meth:`requests` of one context, errors naming just the context: a particle's
        call, the most frequent, in as few steps as it takes."""
        engine = self.engine
        if engine.is_closed:
            engine.check_open()
        adapters = engine.adapters
        adapter = adapters.default if lora_name is None else adapters.get(lora_name)
        context, parent, hashed = self._contexts.validate(token_ids)
        counts = engine.counts
        counts["requests"] += 1
        counts["tokens_requested"] += len(context)
        return Request(adapter, context, parent, hashed=hashed)

    def _score_requests(
        self,
        context: TokenIds,
        continuations: list[TokenIds],
        lora_name: str | None,
        argument: str | None,
    ) -> list[ScoreRequest]:
        """Validate a context, its continuations and the adapter, then count them.

        Errors name ``argument[i]``, the bad continuation's index (or just
        the continuation when ``argument`` is ``None``).
        """
        self.engine.check_open()
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
        self.engine.count_requests(requests)
        return requests

    # ------------------------------------------------------------------ next-token rows

    @coroutine_function
    def next_token_logprobs(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Log-probabilities of the token following ``token_ids``, under adapter ``lora_name``.

        Used as a coroutine function: ``await llm.next_token_logprobs(ids)``. With an event
        loop running in this thread, the request is queued at the call and what comes back
        is its future, which is also a coroutine (:class:`~genlm_backend.batching.CallFuture`):
        await it, gather it, or make a task of it, in this loop. With none running
        (``asyncio.run(llm.next_token_logprobs(ids))``), a coroutine that queues the
        request when it runs.

        Returns:
            ``float32`` tensor ``[len(byte_vocab)]`` on :attr:`device`, normalized.

        Raises (where awaited):
            TypeError, ValueError: invalid ``token_ids`` or unknown ``lora_name``.
            BackendClosedError: the backend was closed.
            Exception: an error of the model on this request's batch.
        """
        loop = asyncio._get_running_loop()
        if loop is None:
            return self._next_token_logprobs_when_run(token_ids, lora_name)
        try:
            request = self.request(token_ids, lora_name)
        except Exception as error:  # noqa: BLE001 (raised where awaited, as by a coroutine)
            return CallFuture.failed(error, loop)
        return self.engine.result(request, loop)

    async def _next_token_logprobs_when_run(
        self, token_ids: TokenIds, lora_name: str | None
    ) -> torch.Tensor:
        """:meth:`next_token_logprobs` made with no event loop running: queued once one runs it."""
        return await self.next_token_logprobs(token_ids, lora_name)

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities after each context, as one ``[B, len(byte_vocab)]`` tensor.

        Every context is validated before any is computed.
        """
        requests = self.requests(as_list_of_contexts(token_ids_list), lora_name)
        rows = await self.engine.results(requests)
        block = as_block(rows)
        rows.clear()  # the future keeps its list until the loop's turn ends: not the rows
        return block

    def next_token_logprobs_sync(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`next_token_logprobs`, computed in the calling thread.

        Works with or without a running event loop (a notebook cell, a callback).
        """
        (row,) = self.engine.results_now((self.request(token_ids, lora_name),))
        return row

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`batch_next_token_logprobs`; computes in the calling thread."""
        requests = self.requests(as_list_of_contexts(token_ids_list), lora_name)
        return as_block(self.engine.results_now(requests))

    def next_token_logprobs_uncached(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        """One plain forward pass over the whole context: no batching, no cache read or written."""
        self.engine.check_open()
        request = Request(
            self.adapters.resolve(lora_name),
            validate_token_ids(token_ids, self.vocab_size, self.max_context_length),
        )
        return self.engine.run_uncached(request).to(self.device)

    def cache_kv(self, prompt_tokens: TokenIds, lora_name: str | None = None) -> None:
        """Run ``prompt_tokens`` now, so later requests extending it start from its keys/values.

        Optional: every evaluated context is cached anyway.
        """
        self.next_token_logprobs_sync(prompt_tokens, lora_name)

    # ------------------------------------------------------------------ scoring

    async def continuation_logprobs(
        self, context: TokenIds, continuation: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        """The log-probability of each token of ``continuation`` after ``context``.

        Entry ``i`` is ``log p(continuation[i] | context + continuation[:i])``;
        ``.sum()`` is lm-evaluation-harness's ``loglikelihood(context,
        continuation)``. Equal to gathering from :meth:`next_token_logprobs`
        of each prefix, without computing or returning those rows where the
        backend can (transformers: one forward pass over the continuation,
        the context's keys/values reused). Batched with concurrent requests.

        Returns:
            ``float32`` tensor ``[len(continuation)]`` on :attr:`device`.

        Raises:
            TypeError, ValueError: an invalid or empty context or continuation,
                ids outside the vocabulary, both together longer than
                :attr:`max_context_length`, or an unknown ``lora_name``.
            BackendClosedError: the backend was closed.
        """
        requests = self._score_requests(context, [continuation], lora_name, None)
        (scores,) = await self.engine.results(requests)
        return scores.to(self.device)

    async def batch_continuation_logprobs(
        self,
        context: TokenIds,
        continuations: Sequence[TokenIds],
        lora_name: str | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`continuation_logprobs` of several continuations of one context, computed together.

        Every continuation is validated before any is computed; the context's
        keys/values are computed once and shared.
        """
        requests = self._score_requests(
            context, as_list_of_contexts(continuations), lora_name, "continuations"
        )
        return [scores.to(self.device) for scores in await self.engine.results(requests)]

    def continuation_logprobs_sync(
        self, context: TokenIds, continuation: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`continuation_logprobs`, computed in the calling thread."""
        requests = self._score_requests(context, [continuation], lora_name, None)
        return self.engine.results_now(requests)[0].to(self.device)

    def batch_continuation_logprobs_sync(
        self,
        context: TokenIds,
        continuations: Sequence[TokenIds],
        lora_name: str | None = None,
    ) -> list[torch.Tensor]:
        """Blocking :meth:`batch_continuation_logprobs`, computed in the calling thread."""
        requests = self._score_requests(
            context, as_list_of_contexts(continuations), lora_name, "continuations"
        )
        return [scores.to(self.device) for scores in self.engine.results_now(requests)]

    # ------------------------------------------------------------------ sampling

    async def sample(
        self,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Sample a continuation of ``prompt_token_ids`` token by token, under adapter ``lora_name``.

        Stops after ``max_tokens`` tokens or at the first token in
        ``eos_token_ids`` (which is not returned). With a ``seed`` the result
        is reproducible; each token is drawn where its row is (the CPU or a CUDA
        device) with a private CPU generator.

        Raises:
            ValueError: ``max_tokens`` < 0, ``temperature`` <= 0 or unknown ``lora_name``.
        """
        check_sampling_options(max_tokens, temperature)
        self.adapters.resolve(lora_name)
        prompt = validate_token_ids(prompt_token_ids, self.vocab_size)

        async def next_logprobs(context: list[int]) -> torch.Tensor:
            return await self.next_token_logprobs(context, lora_name)

        generator = make_generator(seed)
        return await sample_continuation(
            next_logprobs, prompt, max_tokens, eos_token_ids, temperature, generator
        )

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[TokenIds],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` each prompt concurrently (the model batches their steps).

        With a ``seed``, prompt ``i`` gets its own independent stream derived
        from ``(seed, i)``, so identical prompts give independent samples and
        the whole call is reproducible.
        """
        prompts = as_list_of_contexts(prompt_token_ids_list)
        validate_contexts(prompts, self.vocab_size, argument="prompt_token_ids_list")
        seeds = stream_seeds(seed, len(prompts))
        samples = await asyncio.gather(
            *(
                self.sample(prompt, max_tokens, eos_token_ids, temperature, s, lora_name)
                for prompt, s in zip(prompts, seeds)
            )
        )
        return list(samples)

    # ------------------------------------------------------------------ adapters

    def add_new_lora(self, lora_path, lora_name: str = "lora_1") -> None:
        """Load a LoRA adapter from ``lora_path`` as ``lora_name``; select it per call with ``lora_name=``.

        Registering an existing name replaces its weights and drops exactly
        the results and keys/values cached under the old ones.

        Raises:
            TypeError: ``lora_name`` is not a string.
            ValueError: this backend cannot serve adapters (the message says why).
            ImportError: peft is missing (transformers backend).
        """
        self.engine.add_adapter(lora_path, lora_name)

    def remove_lora(self, lora_name: str) -> None:
        """Unload ``lora_name`` and drop exactly its cached results and keys/values.

        Raises:
            ValueError: unknown ``lora_name``.
        """
        self.engine.remove_adapter(lora_name)

    def set_lora(self, lora_path=None, lora_name: str = "lora_1") -> None:
        """Make ``lora_name`` the default adapter: the one calls with ``lora_name=None`` run under.

        Loads it from ``lora_path`` first when given. Calls that pass
        ``lora_name=`` are not affected; requests already made keep the
        adapter they were made under.

        Raises:
            ValueError: ``lora_name`` is unknown and no ``lora_path`` is given.
        """
        if lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        self.adapters.default = self.adapters.get(lora_name)

    def clear_lora(self) -> None:
        """Make the base model the default again (adapters stay loaded)."""
        self.adapters.default = None

    # ------------------------------------------------------------------ lifecycle

    def clear_cache(self) -> None:
        """Drop every cached result and reusable prefix; later results are recomputed."""
        self.engine.clear(rows=True)

    def clear_kv_cache(self) -> None:
        """Drop every retained key/value (results in the output cache stay)."""
        self.engine.clear(rows=False)

    def reset_async_queries(self) -> asyncio.Task | None:
        """Fail every pending request of the running event loop; later requests get a fresh batcher.

        A plain method: call it with or without ``await``. Inside a running
        loop it returns a task that finishes once those requests have failed
        (await it to wait for that); outside a loop nothing is pending and it
        returns ``None``.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return loop.create_task(self.engine.reset())

    async def aclose(self) -> None:
        """Fail pending requests with :class:`BackendClosedError` and release the model.

        Pending callers fail at once; the model is released once a batch
        still computing has finished, without blocking the event loop
        meanwhile. Later calls raise :class:`BackendClosedError`. Idempotent.
        """
        await self.engine.aclose()
        self.close()  # a backend's own resources (the engine's close is done: idempotent)

    def close(self) -> None:
        """Synchronous :meth:`aclose` for scripts: later calls raise :class:`BackendClosedError`. Idempotent."""
        self.engine.close()

    def cleanup(self) -> None:
        """Same as :meth:`close`."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def as_block(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(rows), V]`` for the caller to keep: the tensor whose rows ``rows`` are, all of them
    in order (a step's fresh output, computed for this call alone: see
    :mod:`~genlm_backend.llm.engine`), else a stacked copy."""
    block = one_block(rows)
    return torch.stack(list(rows)) if block is None else block


def one_block(rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The ``[len(rows), V]`` tensor whose rows ``rows`` are, all of them and in order; else ``None``.

    Each step's rows are views of one fresh tensor, each handed to one caller
    only (any other receiver gets a copy). So a batch call whose rows were
    computed for it alone, as one step's output, returns that tensor itself
    instead of a stacked copy of it.
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


# ---------------------------------------------------------------------- validation

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
_INTEGER_TYPES = (int, np.integer)


def validate_token_ids(
    token_ids: TokenIds, vocab_size: int, max_context_length: int | None = None
) -> tuple[int, ...]:
    """Check one context and return it as a tuple of Python ints (untracked by the garbage
    collector: :func:`~genlm_backend.cache.kv_tree.untracked`).

    Accepts a sequence of ints, a 1-D integer numpy array or a 1-D integer tensor.

    Raises:
        TypeError: not a sequence, or an element is not an integer (bools and
            floats are rejected, even 3.0).
        ValueError: empty, an id < 0 or >= ``vocab_size``, or longer than
            ``max_context_length``.
    """
    ids = _plain_ids_in_range(token_ids, vocab_size)  # the usual case, one pass at C speed
    if ids is None:
        ids = _general_ids(token_ids, vocab_size)
    if max_context_length is not None and len(ids) > max_context_length:
        raise ValueError(
            f"token_ids has {len(ids)} tokens, more than the model's context of "
            f"{max_context_length}"
        )
    return untracked(ids)  # plain ints: no garbage collection needs to read it


def _general_ids(token_ids: TokenIds, vocab_size: int) -> tuple[int, ...]:
    """:func:`validate_token_ids`'s checks for any input, element by element; errors name the problem."""
    if isinstance(token_ids, torch.Tensor | np.ndarray):
        if token_ids.ndim != 1:
            raise TypeError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype in (torch.bool, np.bool_) or not _is_integer_dtype(token_ids.dtype):
            raise TypeError(f"token_ids must have an integer dtype, got {token_ids.dtype}")
        ids = tuple(int(t) for t in token_ids.tolist())
    elif isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise TypeError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}; "
            "encode text with llm.tokenizer.encode(...) first"
        )
    else:
        for position, t in enumerate(token_ids):
            if not isinstance(t, _INTEGER_TYPES) or isinstance(t, bool | np.bool_):
                raise TypeError(
                    f"token_ids[{position}] is {t!r} of type {type(t).__name__}; "
                    "token ids must be ints"
                )
        ids = tuple(int(t) for t in token_ids)
    if not ids:
        raise ValueError(
            "token_ids is empty: the next-token distribution needs at least one token "
            "of context (e.g. the tokenizer's BOS token)"
        )
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        position, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise ValueError(
            f"token_ids[{position}] = {bad} is outside the vocabulary [0, {vocab_size})"
        )
    return ids


def validate_contexts(
    token_ids_list: Sequence[TokenIds],
    vocab_size: int,
    max_context_length: int | None = None,
    argument: str | None = "token_ids_list",
) -> list[tuple[int, ...]]:
    """:func:`validate_token_ids` for each context of a batch call.

    Args:
        argument: The batch argument's name; an error message starts with
            ``f"{argument}[{index}]: "`` so the caller sees which context is bad.
            ``None`` for a single context (no prefix).

    Raises:
        TypeError, ValueError: as :func:`validate_token_ids`, for the first bad context.
    """
    contexts = []
    for index, token_ids in enumerate(token_ids_list):
        try:
            contexts.append(validate_token_ids(token_ids, vocab_size, max_context_length))
        except (TypeError, ValueError) as exc:
            if argument is None:
                raise
            raise type(exc)(f"{argument}[{index}]: {exc}") from None
    return contexts


def validate_continuation(tokens: TokenIds, vocab_size: int, name: str) -> tuple[int, ...]:
    """Check one continuation to score (as :func:`validate_token_ids`) and return it as a tuple.

    Raises:
        TypeError, ValueError: as :func:`validate_token_ids`, naming ``name``.
    """
    try:
        return validate_token_ids(tokens, vocab_size)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _plain_ids_in_range(token_ids: TokenIds, vocab_size: int) -> tuple[int, ...] | None:
    """``token_ids`` as a tuple if it is a non-empty list or tuple of plain ``int``\\ s in
    ``[0, vocab_size)``; ``None`` otherwise (the caller's general path then names the problem).

    One pass at C speed: ``marshal``'s version-2 format writes each plain
    ``int`` of 32 bits as the byte ``i`` and 4 little-endian bytes, and
    anything else (bools, floats, numpy scalars, ``int`` subclasses, larger
    ints) differently or not at all. So the ids are plain ints exactly when
    the encoding is one ``i``-tagged 5-byte record per id, and the records'
    values give the range check: no Python-level loop over the ids, a cost
    paid per request by every particle behind a long prompt.
    """
    if not isinstance(token_ids, list | tuple) or not _MARSHAL_INTS_AS_RECORDS:
        return None
    try:
        encoded = marshal.dumps(token_ids, 2)
    except ValueError:  # an unmarshallable element
        return None
    count = len(token_ids)
    if count == 0 or len(encoded) != _HEADER + _RECORD * count:
        return None
    if encoded[_HEADER::_RECORD] != b"i" * count:
        return None
    if count <= _SHORT:  # plain ints now: Python's min and max beat numpy's call overhead
        low, high = min(token_ids), max(token_ids)
    else:
        values = np.ndarray((count,), "<i4", encoded, offset=_HEADER + 1, strides=(_RECORD,))
        low, high = values.min(), values.max()
    if low < 0 or high >= vocab_size:
        return None
    return tuple(token_ids)


_HEADER, _RECORD = 5, 5  # a list's or tuple's type byte and length; an int's type byte and value
_SHORT = 128
"""Up to this many ids, the range check is Python's ``min`` and ``max``, cheaper than numpy's
call on a view of the encoding for short contexts."""
_MARSHAL_INTS_AS_RECORDS = marshal.dumps([7, -2], 2) == b"[\x02\0\0\0i\x07\0\0\0i\xfe\xff\xff\xff"
"""Whether this Python's marshal writes ints as :func:`_plain_ids_in_range` reads them (else it is skipped)."""


def _is_integer_dtype(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex
    return np.issubdtype(dtype, np.integer)


def as_list_of_contexts(token_ids_list) -> list:
    """The contexts of a batch call as a list.

    Raises:
        TypeError: not a sequence of contexts.
        ValueError: empty.
    """
    if isinstance(token_ids_list, str | bytes) or not isinstance(
        token_ids_list, Sequence | np.ndarray | torch.Tensor
    ):
        raise TypeError(f"expected a list of contexts, got {type(token_ids_list).__name__}")
    contexts = list(token_ids_list)
    if not contexts:
        raise ValueError("the list of contexts is empty")
    return contexts


RECENT_TAIL = 8
"""Last tokens that, with its length, key a context :class:`RecentContexts` holds. Fewer than
the KV tree's :data:`~genlm_backend.cache.kv_tree.HASHED_TAIL`: a particle's call reads two
such tails (its parent's, to find it, and its own), at 170 ns each from a list against 490 ns
for 32 tokens; contexts alike in them are told apart by their whole hash."""


def _evict_at(limit: int) -> int:
    """Contexts :class:`RecentContexts` holds before it forgets down to ``limit``: a quarter more."""
    return limit + (limit >> 2)


_CONTEXT_OF = operator.itemgetter(0)
"""A held entry's context (entries are ``(context, its blocks_digest)``)."""


class RecentContexts:
    """Contexts validated lately: one that extends a recent context by a token is checked at that token.

    Particles extend their last context by one token at every step.
    Checking a long context element by element (:func:`validate_token_ids`)
    on every step would cost each particle its whole context; finding its
    first tokens among the recent contexts (hashed by length and last
    :data:`RECENT_TAIL` tokens) and comparing them at C
    speed costs a copy and a comparison. The context returned is then the recent one plus the
    new token: its earlier tokens are that context's plain ints, also where
    the caller's were equal to them in value only (``3.0 == 3``). Its whole
    hash (:func:`~genlm_backend.cache.kv_tree.context_hash`) continues the
    recent one's block digest: a slice's hash, not the context's.

    Contexts alike in length and last tokens (particles in one repetition
    loop) take each other's place; one whose place is taken stays held by its
    whole hash, by which a context is looked up when its last-tokens hash
    finds another: a whole hash a context, not a comparison with every
    other particle.

    Holds at most ``max_tokens`` tokens of contexts and a limit of contexts,
    which it may pass by a quarter before it forgets down to it (the least
    recently validated first, all at once); safe to use from several
    threads. A particle extends a context of the last step (its own, or its
    parent's after a resampling): a few steps' contexts serve it.
    Holding more costs the cyclic garbage collector: each context held is two
    objects that outlive the step, and until the oldest go, every step's
    survivors count towards the next young collection (64 particles of short
    contexts with no model work, 200 steps: 61 young collections holding
    every context under the token limit, 23 holding 4,096, 2 to 6 holding
    256). So the limit starts at ``initial_contexts`` and grows as the
    workload shows a need, as the output cache's does: the tail hashes of
    contexts forgotten for the count (not for ``max_tokens``) are remembered
    (ints), and a context whose recent one
    was forgotten among them doubles the limit, up to ``max_contexts`` (more
    particles than a few steps of the limit hold; contexts forgotten before a
    doubling no longer count, so the misses of contexts forgotten together double
    it once).

    Args:
        vocab_size: As :func:`validate_token_ids`'s.
        max_context_length: As :func:`validate_token_ids`'s.
        max_tokens: Most tokens of the contexts held (8 bytes each, shared with
            the requests that hold the same contexts).
        max_contexts: Most contexts held after an eviction (a quarter more before one).
        initial_contexts: The limit of contexts held at first (see above).
    """

    def __init__(
        self,
        vocab_size: int,
        max_context_length: int | None,
        max_tokens: int = 1 << 21,
        max_contexts: int = 1 << 12,
        initial_contexts: int = 1 << 8,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_context_length = max_context_length
        self.max_tokens = max_tokens
        self.max_contexts = max_contexts
        self.limit = min(initial_contexts, max_contexts)
        """Most contexts held after an eviction: grows towards ``max_contexts`` (see above)."""
        self._evict_at = _evict_at(self.limit)
        # Tail hashes of contexts forgotten under the limit, oldest first: as many as
        # max_contexts beyond the limit would hold.
        self._ghosts: collections.OrderedDict[int, None] = collections.OrderedDict()
        # (context, its blocks_digest) by the hash of its length and last RECENT_TAIL tokens
        # (an int) and, for contexts whose place another of that hash took, by
        # (hash(context),) (a 1-tuple; Python's hash of a whole tuple: C speed). Oldest
        # first (a dict keeps its insertion order; evictions take the oldest in batches, so
        # each scans past the slots earlier evictions left once, not once a context).
        self._by_hash: dict[int | tuple[int], tuple[tuple[int, ...], int]] = {}
        self._num_tokens = 0
        self._num_wholes = 0  # contexts held by their whole hash
        self._lock = threading.Lock()

    def validate(self, token_ids: TokenIds) -> tuple[tuple[int, ...], tuple[int, ...] | None, int]:
        """``token_ids`` as :func:`validate_token_ids` returns it, the recent context it
        extends by one token (``None`` if none), and its
        :func:`~genlm_backend.cache.kv_tree.context_hash`.

        Raises:
            TypeError, ValueError: as :func:`validate_token_ids`.
        """
        extended = self._extend_recent(token_ids)
        if extended is None:
            context = validate_token_ids(token_ids, self.vocab_size, self.max_context_length)
            parent, digest = None, blocks_digest(context)
            length = len(context)
            last_block = length - length % HASH_BLOCK
        else:  # a particle's step, the common case
            context, parent, digest = extended
            length = len(context)
            last_block = length - length % HASH_BLOCK
            if last_block == length:  # a block completed: the digest takes it in
                digest = hash((digest, context[-HASH_BLOCK:]))
        # Held by its tail's hash, and its context_hash returned, both written out (the
        # latter is tested to be context_hash's): this method is a particle call's largest
        # share, about 3 us, of which a function call would be 70 ns.
        key = hash((length, context[-RECENT_TAIL:]))
        self._lock.acquire()  # half the time of a ``with`` block
        try:
            held = self._by_hash
            old = held.pop(key, None)
            if old is not None:
                self._num_tokens -= len(old[0])
                if old[0] != context:  # another context of its tail: findable by its whole hash
                    self._hold((hash(old[0]),), old)
            held[key] = (context, digest)
            self._num_tokens += length
            if len(held) > self._evict_at or self._num_tokens > self.max_tokens:
                self._forget_oldest()
        finally:
            self._lock.release()
        return context, parent, hash((length, digest, context[last_block:]))

    def _extend_recent(
        self, token_ids: TokenIds
    ) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """``(recent + (last,), recent, recent's blocks_digest)`` for the recent context equal
        to ``token_ids[:-1]``, if ``token_ids`` is a plain list or tuple whose last token is
        valid; else ``None``."""
        if type(token_ids) is not list and type(token_ids) is not tuple:
            return None
        length = len(token_ids)
        if length < 2 or (self.max_context_length is not None and length > self.max_context_length):
            return None
        last = token_ids[-1]
        if type(last) is not int or not 0 <= last < self.vocab_size:
            return None
        # Elements of any kind may come here (the full check names a bad one): one that
        # cannot be hashed or compared (an array, a list) sends the context to that check.
        try:
            key = hash((length - 1, tuple(token_ids[-RECENT_TAIL - 1 : -1])))
            held = self._by_hash
            found = held.get(key)  # of another length only by a collision: told below
            if found is None and key in self._ghosts:  # forgotten too soon: hold more
                self._grow(key)
            if found is None and not self._num_wholes:
                return None
            whole = tuple(token_ids)  # one copy, at C speed: no other thread changes it now
            if found is not None:
                recent = found[0]
                if (
                    length > SAME_OBJECTS_FROM
                    and len(recent) == length - 1
                    and same_objects(whole, recent)
                ):
                    # The recent context's own objects: equal, no token compared.
                    return untracked(whole), recent, found[1]
                # A second copy and a comparison at C speed (identical elements compare by
                # identity; a recent context of another length compares unequal): the
                # context is the recent one's plain ints.
                context = recent + (last,)
                if length >= UNTRACKED_LENGTH:  # a shorter one is left as it is: no call
                    untracked(context)
                if context == whole:
                    return context, recent, found[1]
                if not self._num_wholes:
                    return None
            # Another context of its length and last tokens took its place: by its whole hash.
            found = held.get((hash(whole[:-1]),))
            if found is None or len(found[0]) != length - 1:
                return None
            context = untracked(found[0] + (last,))
            if context != whole:
                return None
        except (TypeError, ValueError):
            return None
        return context, found[0], found[1]

    def _forget_oldest(self) -> None:
        """Forget the least recently validated contexts (lock held): once more than
        :attr:`limit` and a quarter are held, all but the newest :attr:`limit` at once
        (the keys popped at C speed: a particle's call pays a share of one eviction,
        not one of its own), and then the oldest, found in one pass, until at most
        ``max_tokens`` tokens are held (the newest always is)."""
        held, ghosts = self._by_hash, self._ghosts
        if len(held) > self._evict_at:
            keys = list(itertools.islice(held, len(held) - self.limit))
            dropped = list(map(held.pop, keys))
            self._num_tokens -= sum(map(len, map(_CONTEXT_OF, dropped)))
            tails = [key for key in keys if type(key) is int]
            self._num_wholes -= len(keys) - len(tails)
            if self.limit < self.max_contexts:  # forgotten for the count: remembered
                ghosts.update(dict.fromkeys(tails))
            surplus = len(ghosts) - (self.max_contexts - self.limit)
            if surplus > 0:
                collections.deque(map(ghosts.pop, list(itertools.islice(ghosts, surplus))), 0)
        if len(held) > 1 and self._num_tokens > self.max_tokens:
            keys, excess = [], self._num_tokens - self.max_tokens
            for key, (context, _) in held.items():  # oldest first, never the newest
                if excess <= 0 or len(keys) == len(held) - 1:
                    break
                keys.append(key)
                excess -= len(context)
            dropped = list(map(held.pop, keys))
            self._num_tokens -= sum(map(len, map(_CONTEXT_OF, dropped)))
            self._num_wholes -= sum(type(key) is tuple for key in keys)

    def _grow(self, key: int) -> None:
        """Double :attr:`limit`, up to ``max_contexts``: the recent context of tail hash ``key``
        was forgotten under it. The contexts forgotten under the old limit are then
        forgotten as such (the others of its step would double it again, for one need)."""
        with self._lock:
            if key in self._ghosts:
                self.limit = min(self.max_contexts, 2 * self.limit)
                self._evict_at = _evict_at(self.limit)
                self._ghosts.clear()

    def _hold(self, key: int | tuple[int], kept: tuple[tuple[int, ...], int]) -> None:
        """Hold ``kept``, a context and its digest, under ``key`` as the newest (lock held)."""
        held = self._by_hash
        old = held.pop(key, None)
        if old is not None:
            self._num_tokens -= len(old[0])
            self._num_wholes -= type(key) is tuple
        held[key] = kept
        self._num_tokens += len(kept[0])
        self._num_wholes += type(key) is tuple

    def clear(self) -> None:
        with self._lock:
            self._by_hash.clear()
            self._ghosts.clear()
            self._num_tokens = self._num_wholes = 0
