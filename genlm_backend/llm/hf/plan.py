"""Where each row of an HF forward pass finds its keys/values: shared levels and its own part.

A row reuses the cached keys/values of its context's first ``reused``
tokens, which the KV tree holds as a chain of pieces (a shared prompt's
entry, then a particle's own span, ...). The layout splits that chain at
``split``: the pieces before it are *levels*, read in place by the
attention (:mod:`~genlm_backend.llm.hf.attention`) once for every row that
shares them; the pieces after it are copied into the batch's cache, the
row's *own part*, followed by its new tokens. Layout of the batch's cache
(``P`` = longest own past, ``K`` = most new tokens)::

    slot:   0 ........ P-own_i ...... P ........ P+k_i ...... P+K
    row i:  [ unused  | copied pieces | new tokens | padding    ]

A one-token step that extends, in every row, the whole context held by
that row of one block writes into that block in place instead
(:meth:`~genlm_backend.llm.hf.kv_tree.KVPrefixTree.extendable_block`): the
SMC step, with no copy at all.

Before that, :func:`shared_uncached_prefixes` says which prefixes, shared by
several contexts of a batch and not cached yet, are computed once first.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from genlm_backend.llm.hf.attention import Level
from genlm_backend.llm.hf.kv_block import KVBlock, KVEntry

Piece = tuple[KVEntry, int]
"""The first ``n`` slots of an entry's own span."""


@dataclass(frozen=True)
class LevelPolicy:
    """When a cached piece is read in place as a level rather than copied into the rows that read it.

    A level costs one attention call per layer and step, whatever its
    length; a copy costs memory and a copy per reading row. Short pieces
    are copied; a piece read by several rows becomes a level from
    ``min_shared_tokens``, a piece read by one row from
    ``min_unshared_tokens`` (a long prompt behind a single request).
    Contexts of one batch that share more than ``min_prefill_tokens``
    uncached tokens get those computed once first.
    ``enabled=False`` copies everything: the layout for models whose
    attention cannot be split (see
    :func:`~genlm_backend.llm.hf.compat.shared_levels_unsupported`).
    """

    enabled: bool = True
    min_shared_tokens: int = 128
    min_unshared_tokens: int = 512
    min_prefill_tokens: int = 32


@dataclass
class Row:
    """One context of a batch: reuse ``reused`` cached tokens, ``split`` of them as levels; compute the rest."""

    index: int
    context: tuple[int, ...]
    entry: KVEntry | None
    reused: int
    split: int = 0
    levels: list[Piece] = field(default_factory=list)
    own: list[Piece] = field(default_factory=list)
    """Pieces covering ``context[split:reused]``, copied into the batch's cache."""

    @property
    def num_new(self) -> int:
        return len(self.context) - self.reused

    @property
    def num_own_past(self) -> int:
        return self.reused - self.split

    @property
    def parent(self) -> KVEntry | None:
        """The entry serving ``context[:split]``: the new entry's parent."""
        return self.levels[-1][0] if self.levels else None


def plan_in_place(rows: list[Row]) -> None:
    """Layout for rows extending their own entries in place: the entries' parents are the levels."""
    for row in rows:
        entry = row.entry
        assert entry is not None  # extendable_block checked every row
        row.split = entry.offset
        row.levels = entry.parent.pieces(entry.offset) if entry.parent is not None else []
        row.own = []


def plan_copies(rows: list[Row], policy: LevelPolicy) -> None:
    """Layout for a new block: each row's chain split after its last level, the rest copied."""
    chains = [row.entry.pieces(row.reused) if row.entry is not None else [] for row in rows]
    readers = Counter((id(entry), n) for chain in chains for entry, n in chain)
    for row, chain in zip(rows, chains):
        num_levels = 0
        if policy.enabled:
            for i, (entry, n) in enumerate(chain):
                shared = readers[id(entry), n] > 1
                if n >= (policy.min_shared_tokens if shared else policy.min_unshared_tokens):
                    num_levels = i + 1
        row.levels, row.own = chain[:num_levels], chain[num_levels:]
        row.split = sum(n for _, n in row.levels)


def shared_uncached_prefixes(
    contexts: Sequence[tuple[int, ...]],
    cached_length: Callable[[tuple[int, ...]], int],
    min_tokens: int,
) -> list[list[tuple[int, ...]]]:
    """Prefixes that several contexts share with ``min_tokens`` or more uncached, in rounds (shorter first).

    Computing each once before the contexts leaves it in the tree as the
    contexts' shared level: 32 particles arriving together behind a new
    prompt compute the prompt once, not 32 times. Sorted contexts share
    prefixes with their neighbours, so neighbours give every branch point.
    ``cached_length(prefix)`` says how much of a prefix is cached already.
    """
    ordered = sorted(contexts)
    prefixes = set()
    for a, b in itertools.pairwise(ordered):
        n = min(_common_prefix_length(a, b), len(a) - 1, len(b) - 1)
        if n - cached_length(a[:n]) >= min_tokens:
            prefixes.add(a[:n])
    rounds = []
    while prefixes:
        first = {
            p for p in prefixes if not any(len(q) < len(p) and p[: len(q)] == q for q in prefixes)
        }
        rounds.append(sorted(first))
        prefixes -= first
    return rounds


def group_levels(rows: list[Row], device: torch.device) -> list[Level]:
    """The distinct levels of a batch, each with the rows that read it."""
    readers: dict[tuple[int, int], tuple[KVEntry, int, list[int]]] = {}
    for i, row in enumerate(rows):
        for entry, n in row.levels:
            readers.setdefault((id(entry), n), (entry, n, []))[2].append(i)
    return [
        Level(
            entry.block,
            entry.row,
            entry.start,
            n,
            None if len(indices) == len(rows) else torch.tensor(indices, device=device),
        )
        for entry, n, indices in readers.values()
    ]


def copy_own_parts(rows: list[Row], num_past: int, block: KVBlock) -> None:
    """Copy each row's own pieces into ``block``'s rows, right-aligned at slot ``num_past``.

    Rows whose pieces sit at the same slots of the same block, bound for the
    same slots, go in one indexed copy of every layer at once: in an SMC step
    every particle copies a row of the previous batch, so that is usually one
    copy.
    """
    groups: dict[tuple, tuple[KVBlock, int, int, int, list[int], list[int]]] = {}
    for i, row in enumerate(rows):
        target = num_past - row.num_own_past
        for entry, n in row.own:
            key = (id(entry.block), entry.start, n, target)
            group = groups.setdefault(key, (entry.block, entry.start, n, target, [], []))
            group[4].append(entry.row)
            group[5].append(i)
            target += n
    device = block.stacked.device
    for source, start, n, target, sources, targets in groups.values():
        _copy_rows(
            block.stacked,
            _as_index(targets, device),
            slice(target, target + n),
            source.stacked,
            _as_index(sources, device),
            slice(start, start + n),
        )


def inputs(
    rows: list[Row], num_new: int, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``position_ids`` ``[B, num_new]``: each row's new tokens at its own positions.

    Built as Python lists and made tensors once: tensor operations per row
    would cost a batch of 64 particles hundreds of small operations.
    """
    input_ids = [[*row.context[row.reused :], *[0] * (num_new - row.num_new)] for row in rows]
    position_ids = [_positions(row.reused, num_new, max_positions) for row in rows]
    return (
        torch.tensor(input_ids, dtype=torch.long).to(device),
        torch.tensor(position_ids, dtype=torch.long).to(device),
    )


def _positions(first: int, count: int, max_positions: int) -> list[int]:
    """``first, first + 1, ...`` (``count`` of them), held at the model's last position past it (padding)."""
    end = max(first, min(first + count, max_positions))
    return [*range(first, end), *[max_positions - 1] * (first + count - end)]


def own_part_mask(
    rows: list[Row], num_past: int, num_new: int, num_slots: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """Additive mask ``[B, 1, num_new, num_slots]``: each row sees its own past and its causal new tokens."""
    slots = torch.arange(num_slots)
    queries = torch.arange(num_new)[:, None] + num_past  # slot of each query
    first = torch.tensor([num_past - row.num_own_past for row in rows])[:, None, None]
    visible = (slots[None, None, :] >= first) & (slots[None, None, :] <= queries[None])
    mask = torch.zeros(len(rows), 1, num_new, num_slots, dtype=dtype)
    mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    return mask.to(device)


def _as_index(rows: list[int], device) -> slice | torch.Tensor:
    """A slice for consecutive rows (a plain strided copy), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _copy_rows(
    target, target_rows, target_slots: slice, source, source_rows, source_slots: slice
) -> None:
    """Rows and slots of ``[..., B, H, T, D]`` tensors: ``target[..., target_rows, :, target_slots, :] =
    source[..., source_rows, :, source_slots, :]``, without temporaries where possible."""
    into = (..., target_rows, slice(None), target_slots, slice(None))
    taken = source[..., source_rows, :, source_slots, :]
    if isinstance(target_rows, slice):
        target[into].copy_(taken)
    else:
        target[into] = taken


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
