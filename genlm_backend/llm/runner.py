"""The seam between :class:`~genlm_backend.llm.base.AsyncLM` and a model: requests in, rows out.

A runner turns a batch of distinct :class:`Request`\\ s into one ``[B, V]``
tensor, synchronously and without asyncio. Each request carries its own
adapter and context, so nothing about a request is read from state that may
change between the call and the batch (e.g. a "current adapter").
Everything else (validation, output cache, batching, sync bridge, sampling)
lives once in ``AsyncLM``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from genlm_backend.cache.kv_tree import context_hash


@dataclass(frozen=True)
class Adapter:
    """One registration of a LoRA adapter: a name bound to weights.

    Registering a name again makes a new ``Adapter`` (a new ``version``), so
    results and keys/values cached under the old weights never match a request
    made under the new ones. ``version`` is unique across all names of one
    backend (vLLM uses it as the adapter's integer id).
    """

    name: str
    version: int
    path: str


class Request:
    """One next-token request: a context, run under ``adapter`` (``None``: the base model).

    Immutable. Hashed once, from the adapter and the context's length and last
    tokens (:func:`~genlm_backend.cache.kv_tree.context_hash`): a request is a
    key of the batcher and the output cache at every step, and Python's hash
    of a long context reads all of it.

    ``parent``, when known, is the context one token shorter as an earlier
    request held it (the same tuple): the KV tree finds its node by it
    without reading the context. Not part of the request's identity.
    """

    __slots__ = ("_hash", "adapter", "context", "parent")

    adapter: Adapter | None
    context: tuple[int, ...]
    parent: tuple[int, ...] | None

    def __init__(
        self,
        adapter: Adapter | None,
        context: tuple[int, ...],
        parent: tuple[int, ...] | None = None,
        *,
        hashed: int | None = None,
    ):
        """``hashed``: ``context_hash(context)``, when the caller has it already."""
        _set(self, "adapter", adapter)
        _set(self, "context", context)
        _set(self, "parent", parent)
        _set(self, "_hash", hash((adapter, context_hash(context) if hashed is None else hashed)))

    def __setattr__(self, name, value):
        raise AttributeError(f"a Request is immutable: cannot set {name!r}")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if type(other) is not Request:
            return NotImplemented
        return (
            self._hash == other._hash
            and self.adapter == other.adapter
            and (self.context is other.context or self.context == other.context)
        )

    def __repr__(self) -> str:
        return f"Request(adapter={self.adapter!r}, context={self.context!r})"

    def __reduce__(self):
        # Rebuilt, not copied: the hash of an adapter's name differs between processes.
        return type(self), (self.adapter, self.context)


_set = object.__setattr__


@dataclass(frozen=True)
class ScoreRequest:
    """A scoring request: the log-probability of each token of ``continuation`` after ``context``.

    Token ``i``'s log-probability is that of ``continuation[i]`` after
    ``context + continuation[:i]``, under ``adapter`` (``None``: the base model).
    """

    adapter: Adapter | None
    context: tuple[int, ...]
    continuation: tuple[int, ...]
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(
            self,
            "_hash",
            hash((self.adapter, context_hash(self.context), context_hash(self.continuation))),
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return type(self), (self.adapter, self.context, self.continuation)

    def prefixes(self) -> list[Request]:
        """The next-token requests whose rows hold this request's scores, in order."""
        full = self.context + self.continuation
        return [Request(self.adapter, full[:end]) for end in range(len(self.context), len(full))]


@dataclass(frozen=True)
class RunnerStats:
    """What a runner reports to :class:`~genlm_backend.llm.base.LMStats`."""

    num_tokens_computed: int
    """Tokens the model ran (see ``LMStats.num_tokens_computed``)."""
    kv_cache_bytes: int
    """Bytes of keys/values held for prefix reuse (0 without such a cache)."""


class Runner(Protocol):
    """What ``AsyncLM`` needs from a model. Called with ``AsyncLM``'s compute lock held, never concurrently."""

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        """Next-token log-probabilities of each (distinct) request.

        Returns:
            ``float32`` ``[len(requests), vocab_size]``, normalized per row, on the backend's device.

        Raises:
            ValueError: a request's adapter is not (or no longer) loaded.
        """

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget (at least 1).

        Called from the event loop while a batch may run: an estimate is fine.
        """

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Each (distinct) request's continuation scored: ``float32`` ``[len(continuation)]`` each.

        Raises:
            ValueError: a request's adapter is not (or no longer) loaded.
        """

    def run_uncached(self, request: Request) -> torch.Tensor:
        """The reference: one plain forward over the whole context, no cache read or written. ``[vocab_size]``."""

    @property
    def stats(self) -> RunnerStats: ...

    def load_adapter(self, adapter: Adapter) -> None:
        """Load ``adapter``'s weights (replacing an adapter of the same name).

        Raises:
            ValueError: this runner cannot serve adapters (the message says why).
        """

    def unload_adapter(self, adapter: Adapter) -> None:
        """Unload ``adapter`` and drop every cache entry computed under it."""

    def clear(self) -> None:
        """Drop every cached key/value (model-side caches); results stay valid."""

    def close(self) -> None:
        """Release the model; later calls are not made."""


def fit_to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V_model]`` logits -> ``[B, vocab_size]`` float32 log-probabilities.

    Columns past the tokenizer's vocabulary are dropped (the rest renormalized);
    missing columns are ``-inf``.
    """
    logits = logits.float()
    num_columns = logits.shape[-1]
    if num_columns > vocab_size:
        logits = logits[:, :vocab_size]
    elif num_columns < vocab_size:
        logits = torch.nn.functional.pad(logits, (0, vocab_size - num_columns), value=float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def group_by_adapter(
    requests: Sequence[Request | ScoreRequest],
) -> dict[Adapter | None, list[int]]:
    """Positions of the requests of each adapter, adapters in order of first appearance."""
    groups: dict[Adapter | None, list[int]] = {}
    for position, request in enumerate(requests):
        groups.setdefault(request.adapter, []).append(position)
    return groups


def score_from_rows(
    run: Callable[[Sequence[Request]], torch.Tensor], requests: Sequence[ScoreRequest]
) -> list[torch.Tensor]:
    """Scores gathered from next-token rows, one row per prefix: for runners without a scoring path of their own.

    ``run`` is the runner's :meth:`Runner.run`; prefixes shared by several
    requests are computed once.
    """
    prefixes = [request.prefixes() for request in requests]
    distinct = list(dict.fromkeys(request for group in prefixes for request in group))
    position = {request: i for i, request in enumerate(distinct)}
    rows = run(distinct)  # [P, V]
    return [
        rows[
            torch.tensor([position[prefix] for prefix in group]),
            torch.tensor(request.continuation),
        ]
        for request, group in zip(requests, prefixes)
    ]
