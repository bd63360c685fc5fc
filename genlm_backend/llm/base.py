"""The one :class:`AsyncLM`: contract, validation, output cache, batcher, stats.

Its blocking calls live in :mod:`~genlm_backend.llm.sync`, sampling in
:mod:`~genlm_backend.llm.sampling`, adapters and the lifecycle in their own
modules, each a mixin of :class:`AsyncLM`.

Model work is delegated to a :class:`~genlm_backend.llm.runner.Runner`
(HF, vLLM or mock). The data path of one request::

    next_token_logprobs(ids, lora_name) -> validate -> Request(adapter, context)
        -> output cache -> AutoBatcher -> worker thread: _process_batch
        -> runner.run(requests) -> output cache -> clone

The adapter is resolved once, at the call, and travels in the request: it is
part of the batcher's, the output cache's and the KV tree's key.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

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
from genlm_backend.llm.adapters import AdapterMethods, AdapterRegistry
from genlm_backend.llm.lifecycle import LifecycleMethods
from genlm_backend.llm.runner import Request, Runner
from genlm_backend.llm.sampling import SamplingMethods, sample_token
from genlm_backend.llm.stats import LMStats
from genlm_backend.llm.sync import SyncMethods
from genlm_backend.llm.validation import (
    TokenIds,
    as_list_of_contexts,
    validate_contexts,
    validate_token_ids,
)

__all__ = ["AsyncLM", "LMStats", "TokenIds", "sample_token", "validate_token_ids"]

DEFAULT_OUTPUT_CACHE_BYTES = 256 << 20  # 256 MiB: ~1,300 rows of a 50k vocabulary


class AsyncLM(SamplingMethods, SyncMethods, AdapterMethods, LifecycleMethods):
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

    Concurrency: concurrent ``await``\\ s on one event loop are batched by an
    :class:`~genlm_backend.batching.AutoBatcher`; model work runs in one worker
    thread, so the loop stays responsive. The ``*_sync`` methods compute
    directly in the calling thread and work with or without a running loop.
    An object may serve several ``asyncio.run`` calls in turn.

    ``AsyncTransformer``, ``AsyncVirtualLM`` and ``MockAsyncLM`` build one
    with their runner; ``AsyncLM(tokenizer, runner)`` takes any other.

    Args:
        tokenizer: The model's Hugging Face tokenizer (``None`` with ``byte_vocab`` given).
        runner: What computes batches; a subclass may attach it after construction.
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

    runner: Runner
    """What computes batches (set by the constructor, or by a subclass after it)."""

    def __init__(
        self,
        tokenizer,
        runner: Runner | None = None,
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
        if runner is not None:
            self.runner = runner
        self.max_context_length = max_context_length
        self.device = torch.device(device)
        self.output_cache = OutputCache(output_cache_bytes)
        self.adapters = AdapterRegistry()
        self._compute_lock = threading.Lock()
        self._batchers: LoopBatchers[Request, torch.Tensor | ValueError] = LoopBatchers(
            self._process_batch,
            self.batching,
            request_tokens=self._request_tokens,
            thread_name="genlm-model",
        )
        self._is_closed = False
        self._num_requests = self._num_tokens_requested = self._num_cache_hits = 0
        self._num_batches = self._num_contexts_computed = 0

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

    # ------------------------------------------------------------------ requests

    def _requests(
        self,
        token_ids_list: list[TokenIds],
        lora_name: str | None,
        argument: str | None = "token_ids_list",
    ) -> list[Request]:
        """Validate the adapter and every context, then count them: a rejected call counts nothing.

        Errors name ``argument[i]``, the bad context's index in the call (or
        just the context when ``argument`` is ``None``: single-context calls).
        """
        self._check_open()
        adapter = self.adapters.resolve(lora_name)
        contexts = validate_contexts(
            token_ids_list, self.vocab_size, self.max_context_length, argument
        )
        self._num_requests += len(contexts)
        self._num_tokens_requested += sum(map(len, contexts))
        return [Request(adapter, context) for context in contexts]

    def _check_open(self) -> None:
        if self._is_closed:
            raise BackendClosedError(f"this {type(self).__name__} is closed")

    def _cached(self, request: Request) -> torch.Tensor | None:
        row = self.output_cache.get(request)
        if row is not None:
            self._num_cache_hits += 1
        return row

    def _process_batch(self, requests: list[Request]) -> list[torch.Tensor | ValueError]:
        """Compute distinct requests (of one adapter or several) and fill the output cache.

        A request whose adapter was removed or re-registered since the call is
        not computed: its slot holds the ``ValueError`` its caller gets.
        """
        with self._compute_lock:
            self._check_open()
            current = [request for request in requests if self.adapters.is_current(request.adapter)]
            rows = dict(zip(current, self.runner.run(current).unbind(0))) if current else {}
            self._num_batches += 1
            self._num_contexts_computed += len(current)
            for request, row in rows.items():
                self.output_cache.put(request, row)
        return [
            rows[request] if request in rows else _replaced_adapter_error(request)
            for request in requests
        ]

    async def _submit(self, request: Request) -> torch.Tensor:
        cached = self._cached(request)
        if cached is not None:
            return cached
        try:
            row = await self._batchers.current().submit(request)
        except Exception as exc:
            # Whatever a closing backend made the batch fail with, the caller should learn why.
            if self._is_closed and not isinstance(exc, BackendClosedError):
                raise BackendClosedError(f"this {type(self).__name__} was closed") from exc
            raise
        if isinstance(row, ValueError):
            raise row
        return row

    def _batcher(self) -> AutoBatcher:
        """The running event loop's batcher."""
        return self._batchers.current()

    async def next_token_logprobs(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the token following ``token_ids``, under adapter ``lora_name``.

        Returns:
            ``float32`` tensor ``[len(byte_vocab)]`` on :attr:`device`, normalized.

        Raises:
            TypeError, ValueError: invalid ``token_ids`` or unknown ``lora_name``.
            BackendClosedError: the backend was closed.
            Exception: an error of the model on this request's batch.
        """
        (request,) = self._requests([token_ids], lora_name, argument=None)
        return (await self._submit(request)).clone()

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities after each context, as one ``[B, len(byte_vocab)]`` tensor.

        Every context is validated before any is computed.
        """
        requests = self._requests(as_list_of_contexts(token_ids_list), lora_name)
        return torch.stack(await asyncio.gather(*map(self._submit, requests)))

    def _request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: the runner's estimate, else its context length."""
        estimate = getattr(self.runner, "request_tokens", None)
        return estimate(request) if estimate is not None else len(request.context)


def _replaced_adapter_error(request: Request) -> ValueError:
    # adapter None is the base model, which is never replaced; named for completeness
    name = request.adapter.name if request.adapter is not None else None
    return ValueError(
        f"LoRA adapter {name!r} was removed or re-registered while this request waited"
    )
