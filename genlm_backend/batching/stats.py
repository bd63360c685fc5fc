"""BatcherStats: a frozen snapshot of an AutoBatcher's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of an :class:`AutoBatcher`'s counters."""

    num_requests: int
    """Requests submitted (including deduplicated ones)."""
    num_deduplicated: int
    """Requests that joined an identical request already queued or computing."""
    num_batches: int
    """Calls of ``process_batch``."""
    num_batched_keys: int
    """Distinct keys sent to ``process_batch``, over all batches."""
    num_failed_batches: int
    """Batches whose ``process_batch`` raised."""
    num_cancelled: int
    """Requests whose caller was cancelled before the result arrived."""
    num_pending: int
    """Distinct keys queued and not yet dispatched."""
    num_inflight: int
    """Distinct keys in the batch computing now."""
    num_pending_tokens: int
    """Tokens (by the owner's cost function) of the keys queued and not yet dispatched."""

    @property
    def mean_batch_size(self) -> float:
        return self.num_batched_keys / self.num_batches if self.num_batches else 0.0
