"""The rows a server asks its model for: held rows answered at once, the rest computed.

A server decodes each context of a request into a tuple of plain ints. When
the model's output cache holds every context's row (a tuple equal to a key
is that key's context, validated before it was computed), the request is
answered at once, before the step gather; a step to compute is told apart
by its last context alone. Otherwise every context is validated (a context
that extends a recent one by a token is checked at that token, and hashed
from its parent's digest), the held rows taken, the others computed by the
model's engine with whatever else waits.
"""

from __future__ import annotations

import torch

from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.runner import Request


def held_rows(
    lm: AsyncLM, contexts: list[tuple[int, ...]], lora_name: str | None
) -> list[torch.Tensor] | None:
    """Every context's row from the output cache, counted as one call, or ``None`` (nothing
    counted) when it lacks one: the answer to a request that needs no model work.

    Raises:
        ValueError: an unknown ``lora_name``.
        BackendClosedError: the model was closed.
    """
    lm.engine.check_open()
    adapter = lm.adapters.resolve(lora_name)
    cache = lm.output_cache
    # A particles' step is computed, not held: its last context, looked up first, says so
    # (a request made here hashes its whole context).
    if contexts and Request(adapter, contexts[-1]) not in cache:
        return None
    keys = [Request(adapter, context) for context in contexts]
    rows = cache.get_many(keys, count_misses=False)  # batch_rows looks again
    if any(row is None for row in rows):
        return None
    lm.engine.count_requests(keys)
    lm.engine.counts["cache_hits"] += len(keys)
    return rows  # type: ignore[return-value]  # no None left


async def batch_rows(
    lm: AsyncLM, contexts: list[tuple[int, ...]], lora_name: str | None
) -> list[torch.Tensor]:
    """Each context's row, ``[V]``, to be read and never changed: every context validated
    (the front's recent contexts check one that extends a recent one at its last token, and
    hash it from its parent's digest), the held rows as they are, the others computed
    together.

    Raises:
        TypeError, ValueError: an invalid context (the message names its position in
            ``contexts``), or an unknown ``lora_name``.
        BackendClosedError: the model was closed.
    """
    requests = lm.requests(contexts, lora_name, "token_ids_list")
    # The step looks each miss up again and counts it there.
    rows: list[torch.Tensor | None] = lm.output_cache.get_many(requests, count_misses=False)
    missing = [i for i, row in enumerate(rows) if row is None]
    lm.engine.counts["cache_hits"] += len(rows) - len(missing)
    if missing:
        for i, row in zip(missing, await lm.engine.results([requests[i] for i in missing])):
            rows[i] = row
    return rows  # type: ignore[return-value]  # no None left
