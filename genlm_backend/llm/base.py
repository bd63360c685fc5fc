"""The AsyncLM contract every backend honours.

A backend subclasses :class:`AsyncLM` and implements one synchronous method,
:meth:`AsyncLM._compute_logprobs` (a batch of distinct contexts in, a
``[B, V]`` tensor out). Everything else lives here, once: input validation,
the output cache, the auto-batcher, the sync bridge, sampling and statistics.

The data path of one request::

    next_token_logprobs(ids) -> validate -> output cache -> AutoBatcher
        -> worker thread: _process_batch -> _compute_logprobs -> output cache -> clone
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from genlm_backend.batching import (
    DEFAULT_MAX_BATCH_TOKENS,
    AutoBatcher,
    BatcherStats,
    BatchingConfig,
    LoopBatchers,
)
from genlm_backend.cache.output import OutputCache
from genlm_backend.errors import BackendClosedError
from genlm_backend.llm.sampling import sample_token
from genlm_backend.llm.validation import (
    TokenIds,
    as_list_of_contexts,
    validate_contexts,
    validate_token_ids,
)

__all__ = ["AsyncLM", "LMStats", "TokenIds", "sample_token", "validate_token_ids"]

RequestKey = tuple[Hashable, tuple[int, ...]]  # (cache namespace, context)

DEFAULT_OUTPUT_CACHE_BYTES = 256 << 20  # 256 MiB: ~1,300 rows of a 50k vocabulary


@dataclass(frozen=True)
class LMStats:
    """A snapshot of an :class:`AsyncLM`'s counters."""

    num_requests: int
    """Validated next-token requests (async, sync and batch, one per context)."""
    num_batches: int
    """Batches the model computed (async and sync)."""
    num_contexts_computed: int
    """Contexts sent to the model, over all batches."""
    num_output_cache_hits: int
    """Requests answered from the output cache (identical concurrent requests that share
    one computation are neither hits nor computed contexts)."""
    num_tokens_requested: int
    """Sum of the lengths of all requested contexts: what an uncached model would run."""
    num_tokens_computed: int
    """Tokens the model ran: for ``AsyncTransformer`` exactly (prefix reuse included); for
    other backends the lengths of the contexts sent to the model (vLLM's own prefix cache
    may run fewer). Output-cache hits and deduplicated requests cost none."""
    output_cache_bytes: int
    """Bytes of log-probability rows held by the output cache."""
    kv_cache_bytes: int
    """Bytes of keys/values held for prefix reuse (0 for backends without one)."""

    @property
    def mean_batch_size(self) -> float:
        return self.num_contexts_computed / self.num_batches if self.num_batches else 0.0


class AsyncLM(ABC):
    """Next-token log-probabilities over the whole vocabulary, for many concurrent callers.

    Output contract, for every backend and model:

    * ``float32`` tensor of shape ``[len(byte_vocab)]`` (``[B, len(byte_vocab)]``
      for batch calls) on :attr:`device`;
    * normalized: ``logsumexp == 0`` within 1e-5; logit columns beyond the
      tokenizer's vocabulary are dropped and tokens the model cannot produce
      are ``-inf``;
    * each call returns a fresh tensor: mutating it never changes a later result.

    Input contract: a context is a non-empty sequence of ints in
    ``[0, len(byte_vocab))`` no longer than :attr:`max_context_length`;
    anything else raises ``TypeError``/``ValueError`` for that caller only,
    before any model work (see :func:`validate_token_ids`).

    Concurrency: concurrent ``await``\\ s on one event loop are batched by an
    :class:`~genlm_backend.batching.AutoBatcher`; model work runs in one worker
    thread, so the loop stays responsive. The ``*_sync`` methods compute
    directly in the calling thread and work with or without a running loop
    (scripts, notebooks). An object may serve several ``asyncio.run`` calls in
    turn: each event loop gets its own batcher.

    Args:
        tokenizer: The model's Hugging Face tokenizer.
        batch_size: Most distinct contexts per model batch; ``None`` (default):
            no count limit, a batch takes every waiting context within ``max_batch_tokens``.
        timeout_s: Most seconds a request waits for company before its batch goes.
        max_batch_tokens: Most context tokens (summed lengths) per model batch;
            ``None`` for no budget. A longer context alone goes alone.
        output_cache_bytes: Byte budget of the output cache (LRU; 0 disables it).
        max_context_length: Longest accepted context, ``None`` for no limit.
        device: Where returned tensors live.
        byte_vocab: Precomputed byte vocabulary; decoded from ``tokenizer`` when omitted.
        str_vocab: Precomputed string vocabulary (decoded from ``byte_vocab`` when omitted).
    """

    def __init__(
        self,
        tokenizer,
        *,
        batch_size: int | None = None,
        timeout_s: float = 0.02,
        max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
        max_context_length: int | None = None,
        device: str | torch.device = "cpu",
        byte_vocab: Sequence[bytes] | None = None,
        str_vocab: Sequence[str] | None = None,
    ):
        self.batching = BatchingConfig(
            max_batch_size=batch_size, max_batch_tokens=max_batch_tokens, timeout_s=timeout_s
        )
        self.tokenizer = tokenizer
        if byte_vocab is None:
            from genlm_backend.tokenization import decode_vocab

            byte_vocab, str_vocab = decode_vocab(tokenizer)
        elif str_vocab is None:
            str_vocab = [b.decode("utf-8", errors="replace") for b in byte_vocab]
        self.byte_vocab = list(byte_vocab)
        self.str_vocab = list(str_vocab)
        self.max_context_length = max_context_length
        self.device = torch.device(device)
        self.output_cache = OutputCache(output_cache_bytes)
        self._compute_lock = threading.Lock()
        self._batchers: LoopBatchers[RequestKey, torch.Tensor] = LoopBatchers(
            self._process_batch, self.batching, request_tokens=_context_tokens, thread_name="genlm-model"
        )
        self._is_closed = False
        self._num_requests = 0
        self._num_tokens_requested = 0
        self._num_tokens_sent = 0  # lengths of the contexts sent to the model
        self._num_cache_hits = 0
        self._num_batches = 0
        self._num_contexts_computed = 0

    # ----------------------------------------------------------------- backend hooks

    @abstractmethod
    def _compute_logprobs(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        """Log-probabilities of the next token after each context.

        Called with the compute lock held, never concurrently, from the worker
        thread or a sync caller's thread; never with duplicate contexts.

        Returns:
            ``float32`` tensor ``[len(contexts), len(byte_vocab)]`` on :attr:`device`,
            normalized per row.
        """

    def _cache_namespace(self) -> Hashable:
        """What besides the context determines the output (e.g. the active LoRA adapter)."""
        return None

    def _num_tokens_computed(self) -> int:
        """Tokens run through the model so far: whole contexts, unless a backend reuses prefixes and overrides this."""
        return self._num_tokens_sent

    def _kv_cache_bytes(self) -> int:
        return 0

    def _clear_model_caches(self) -> None:
        """Drop backend-specific caches (KV tree, engine prefix cache)."""

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """``len(byte_vocab)``: the length of every returned row."""
        return len(self.byte_vocab)

    @property
    def batch_size(self) -> int | None:
        """Most distinct contexts per model batch (``None``: no count limit); see :attr:`batching`."""
        return self.batching.max_batch_size

    @property
    def timeout_s(self) -> float:
        """Most seconds a request waits for company; see :attr:`batching`."""
        return self.batching.timeout_s

    @property
    def batcher_stats(self) -> BatcherStats | None:
        """The running event loop's batcher counters (``None`` outside a loop or before its first request)."""
        return self._batchers.stats()

    @property
    def stats(self) -> LMStats:
        return LMStats(
            num_requests=self._num_requests,
            num_batches=self._num_batches,
            num_contexts_computed=self._num_contexts_computed,
            num_output_cache_hits=self._num_cache_hits,
            num_tokens_requested=self._num_tokens_requested,
            num_tokens_computed=self._num_tokens_computed(),
            output_cache_bytes=self.output_cache.stats.bytes_held,
            kv_cache_bytes=self._kv_cache_bytes(),
        )

    # ------------------------------------------------------------------ requests

    def _validate(self, token_ids: TokenIds) -> RequestKey:
        return self._validate_all([token_ids], argument=None)[0]

    def _validate_all(
        self, token_ids_list: list[TokenIds], argument: str | None = "token_ids_list"
    ) -> list[RequestKey]:
        """Validate every context, then count them: a rejected call counts nothing."""
        if self._is_closed:
            raise BackendClosedError(f"this {type(self).__name__} is closed")
        contexts = validate_contexts(
            token_ids_list, self.vocab_size, self.max_context_length, argument
        )
        self._num_requests += len(contexts)
        self._num_tokens_requested += sum(map(len, contexts))
        namespace = self._cache_namespace()
        return [(namespace, ids) for ids in contexts]

    def _cached(self, key: RequestKey) -> torch.Tensor | None:
        row = self.output_cache.get(key)
        if row is not None:
            self._num_cache_hits += 1
        return row

    def _process_batch(self, keys: list[RequestKey]) -> list[torch.Tensor]:
        """Compute distinct keys (all of one namespace or several) and fill the output cache."""
        with self._compute_lock:
            if self._is_closed:
                raise BackendClosedError(f"this {type(self).__name__} is closed")
            rows = self._compute_grouped(keys)
            self._num_batches += 1
            self._num_contexts_computed += len(keys)
            self._num_tokens_sent += sum(len(context) for _, context in keys)
        for key, row in zip(keys, rows):
            self.output_cache.put(key, row)
        return rows

    def _compute_grouped(self, keys: list[RequestKey]) -> list[torch.Tensor]:
        rows: list[torch.Tensor | None] = [None] * len(keys)
        namespaces = dict.fromkeys(namespace for namespace, _ in keys)
        for namespace in namespaces:
            positions = [i for i, (ns, _) in enumerate(keys) if ns == namespace]
            with self._activate_namespace(namespace):
                logprobs = self._compute_logprobs([keys[i][1] for i in positions])
            for i, row in zip(positions, logprobs.unbind(0)):
                rows[i] = row
        return rows

    def _activate_namespace(self, namespace: Hashable):
        """Context manager putting the model in the state ``namespace`` stands for."""
        return nullcontext()

    def _batcher(self) -> AutoBatcher:
        """The running event loop's batcher."""
        return self._batchers.current()

    async def next_token_logprobs(self, token_ids: TokenIds) -> torch.Tensor:
        """Log-probabilities of the token following ``token_ids``.

        Returns:
            ``float32`` tensor ``[len(byte_vocab)]`` on :attr:`device`, normalized.

        Raises:
            TypeError, ValueError: invalid ``token_ids`` (see :func:`validate_token_ids`).
            BackendClosedError: the backend was closed.
            Exception: an error of the model on this request's batch.
        """
        key = self._validate(token_ids)
        return (await self._submit_key(key)).clone()

    async def batch_next_token_logprobs(self, token_ids_list: Sequence[TokenIds]) -> torch.Tensor:
        """Log-probabilities after each context, as one ``[B, len(byte_vocab)]`` tensor.

        Every context is validated before any is computed.
        """
        keys = self._validate_all(as_list_of_contexts(token_ids_list))
        rows = await asyncio.gather(*(self._submit_key(key) for key in keys))
        return torch.stack(rows)

    async def _submit_key(self, key: RequestKey) -> torch.Tensor:
        row = self._cached(key)
        if row is not None:
            return row
        try:
            return await self._batcher().submit(key)
        except Exception as exc:
            # Whatever a closing backend made the batch fail with, the caller should learn why.
            if self._is_closed and not isinstance(exc, BackendClosedError):
                raise BackendClosedError(f"this {type(self).__name__} was closed") from exc
            raise

    def next_token_logprobs_sync(self, token_ids: TokenIds) -> torch.Tensor:
        """Blocking :meth:`next_token_logprobs`; works inside a running event loop too."""
        validate_token_ids(token_ids, self.vocab_size, self.max_context_length)  # errors name token_ids
        return self.batch_next_token_logprobs_sync([token_ids])[0]

    def batch_next_token_logprobs_sync(self, token_ids_list: Sequence[TokenIds]) -> torch.Tensor:
        """Blocking :meth:`batch_next_token_logprobs`; computes in the calling thread."""
        keys = self._validate_all(as_list_of_contexts(token_ids_list))
        rows: dict[RequestKey, torch.Tensor] = {}
        for key in keys:
            row = self._cached(key)
            if row is not None:
                rows[key] = row
        missing = [key for key in dict.fromkeys(keys) if key not in rows]
        for chunk in self.batching.split(missing, _context_tokens):
            rows.update(zip(chunk, self._process_batch(chunk)))
        return torch.stack([rows[key] for key in keys])  # stack copies: caller owns it

    # ------------------------------------------------------------------ sampling

    async def sample(
        self,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[int]:
        """Sample a continuation of ``prompt_token_ids`` token by token.

        Stops after ``max_tokens`` tokens or at the first token in
        ``eos_token_ids`` (which is not returned). With a ``seed`` the result
        is reproducible; sampling happens on the CPU.

        Raises:
            ValueError: ``max_tokens`` < 0 or ``temperature`` <= 0.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        context = list(validate_token_ids(prompt_token_ids, self.vocab_size))
        eos = set(eos_token_ids)
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        generated: list[int] = []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context + generated)
            token = sample_token(logprobs.cpu() / temperature, generator)
            if token in eos:
                break
            generated.append(token)
        return generated

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[TokenIds],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` each prompt concurrently (the model batches their steps).

        With a ``seed``, prompt ``i`` gets its own independent stream derived
        from ``(seed, i)``, so identical prompts give independent samples and
        the whole call is reproducible.
        """
        prompts = as_list_of_contexts(prompt_token_ids_list)
        validate_contexts(prompts, self.vocab_size, argument="prompt_token_ids_list")
        if seed is None:
            seeds = [None] * len(prompts)
        else:
            children = np.random.SeedSequence(seed).spawn(len(prompts))
            seeds = [int(child.generate_state(1, dtype=np.uint64)[0] >> 1) for child in children]
        return list(
            await asyncio.gather(
                *(
                    self.sample(prompt, max_tokens, eos_token_ids, temperature, s)
                    for prompt, s in zip(prompts, seeds)
                )
            )
        )

    # ------------------------------------------------------------------ lifecycle

    def clear_cache(self) -> None:
        """Drop every cached result and reusable prefix; later results are recomputed."""
        with self._compute_lock:
            self.output_cache.clear()
            self._clear_model_caches()

    async def reset_async_queries(self) -> None:
        """Fail every pending request of this event loop and start a fresh batcher."""
        await self._batchers.reset_current()

    async def aclose(self) -> None:
        """Fail pending requests with :class:`BackendClosedError` and release the model.

        Pending callers fail at once; the model is released once a batch
        still computing has finished, without blocking the event loop
        meanwhile. Later calls raise :class:`BackendClosedError`. Idempotent.
        """
        self._is_closed = True
        await self._batchers.reset_current()
        # A batch may still be computing in the worker thread (its callers have
        # already failed): wait for it off the event loop, so those callers and
        # every other task run meanwhile, then release the model.
        await asyncio.to_thread(_wait_until_unlocked, self._compute_lock)
        self.close()

    def close(self) -> None:
        """Synchronous :meth:`aclose` for scripts: later calls raise :class:`BackendClosedError`."""
        self._is_closed = True
        self._batchers.shutdown()
        with self._compute_lock:
            self.output_cache.clear()
            self._clear_model_caches()
            self._release_model()

    def _release_model(self) -> None:
        """Free the model's memory; backends override."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def _wait_until_unlocked(lock: threading.Lock) -> None:
    with lock:  # acquired and released in this thread, even if the awaiting task is cancelled
        pass


def _context_tokens(key: RequestKey) -> int:
    """A request's cost against the batch token budget: its context length."""
    return len(key[1])
