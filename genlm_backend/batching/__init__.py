"""The one auto-batcher: concurrent awaits in, batched calls of a synchronous function out.

Every backend (HF, vLLM) and the async trie use :class:`AutoBatcher` (through
:class:`LoopBatchers`, one batcher per event loop). A request is a hashable
key; the batcher collects concurrent requests, deduplicates them, and calls
``process_batch(keys)`` in a worker thread so the event loop keeps accepting
requests while a batch computes.

Policy (:class:`BatchingConfig`, one frozen object validated once). By
default there is no count to tune: when a full pass of the event loop adds no
request, everything waiting goes in one batch, bounded by a token budget the
owner counts with its own cost function (the language models count context
tokens); ``timeout_s`` bounds how long a request waits for company. An
explicit ``max_batch_size`` caps the count as well.

Guarantees. Each request's future is settled in one place
(``AutoBatcher._settle``); an exception raised by ``process_batch`` fails
exactly the requests of that batch and the batcher keeps serving; a cancelled
caller never cancels the shared computation of a deduplicated key; requests
pending when a batcher closes (:meth:`AutoBatcher.aclose`, or its worker dying
on an unexpected error) fail with :class:`~genlm_backend.errors.BatcherClosedError`,
and so does every later request to it.
"""

from genlm_backend.batching.batcher import AutoBatcher
from genlm_backend.batching.config import DEFAULT_MAX_BATCH_TOKENS, BatchingConfig
from genlm_backend.batching.loops import LoopBatchers
from genlm_backend.batching.stats import BatcherStats

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "AutoBatcher",
    "BatcherStats",
    "BatchingConfig",
    "LoopBatchers",
]
