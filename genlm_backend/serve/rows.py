"""The rows a server asks its model for: held rows looked up before validation, the rest computed.

A server decodes each context of a request into a tuple of plain ints. A
tuple equal to a key of the model's output cache is then that key's context,
which was validated before it was computed: such a context costs a lookup,
not a second check of ids its client checked. Only the others are validated,
then computed by the model's engine with whatever else waits.
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
    """Each context's row, ``[V]``, to be read and never changed: held rows as they are, the
    others validated (every one before any is computed) and computed together.

    Raises:
        TypeError, ValueError: a context not held is invalid (the message names its
            position in ``contexts``), or an unknown ``lora_name``.
        BackendClosedError: the model was closed.
    """
    lm.engine.check_open()
    adapter = lm.adapters.resolve(lora_name)
    rows: list[torch.Tensor | None] = lm.output_cache.get_many(
        [Request(adapter, context) for context in contexts],
        count_misses=False,  # the step looks each miss up again and counts it there
    )
    missing = [i for i, row in enumerate(rows) if row is None]
    requests = lm.requests(
        [contexts[i] for i in missing], lora_name, "token_ids_list", positions=missing
    )
    held = [Request(adapter, context) for context, row in zip(contexts, rows) if row is not None]
    lm.engine.count_requests(held)
    lm.engine.counts["cache_hits"] += len(held)
    if requests:
        for i, row in zip(missing, await lm.engine.results(requests)):
            rows[i] = row
    return rows  # type: ignore[return-value]  # no None left
