"""Counters of an :class:`~genlm_backend.llm.base.AsyncLM`, as a frozen snapshot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LMStats:
    """A snapshot of an :class:`~genlm_backend.llm.base.AsyncLM`'s counters."""

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
