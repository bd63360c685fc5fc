"""The server's own counters (the model's are its ``AsyncLM``'s ``stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeStats:
    """A snapshot of a server's own counters (the model's are its ``AsyncLM``'s ``stats``)."""

    num_requests: int
    """``/v1/logprobs`` requests received (each is one client round trip)."""
    num_rows_served: int
    """Rows sent back."""
    num_rejected: int
    """Requests answered with an error (bad input, over a limit, wrong token, model error)."""
    num_cancelled_by_disconnect: int
    """Requests whose client went away before the answer."""
    num_failed_by_shutdown: int
    """Requests failed because the server was shutting down."""
    num_in_flight: int
    """``/v1/logprobs`` requests read and accepted, not yet answered (held or computing)."""
    num_shared_memory_clients: int = 0
    """Open slab sessions: clients whose rows go through shared memory now."""
    num_rows_in_shared_memory: int = 0
    """Rows written into clients' slabs (the others went in answer bodies)."""
    num_groups: int = 0
    """Groups of requests the step gather let through together."""
    num_waits_given_up: int = 0
    """Times a group went without a client it was waiting for (see ``serve.gather``)."""
