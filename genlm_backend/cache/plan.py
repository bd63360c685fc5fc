"""The batch plan, a value: what each forward pass computes, reads and leaves in the KV tree.

Backend-neutral: the transformers and MLX runners plan their batches here
and execute the plans with their own tensors.

A context reuses the cached keys/values of its first ``reused`` tokens,
which the KV tree holds as a chain of pieces (a shared prompt's entry, then
a particle's own span, ...). A :class:`RowPlan` splits that chain: the
pieces before the split are *levels*, read in place by the attention once
for every row that shares them; the pieces after it are the row's *own
part*, copied into the pass's block, followed by its new tokens. Layout of a
new block (``P`` = longest own past, ``K`` = most new tokens)::

    slot:   0 ........ P-own_i ...... P ........ P+k_i ...... P+K
    row i:  [ unused  | copied pieces | new tokens | padding    ]

A one-token step that extends, in every row, the whole context held by
that row of one block writes into that block in place instead
(:func:`extendable_block`): the SMC step, with no copy at all.

A context that is a prefix of another context of the batch, whose row
computes the position after it, is not a row of its own: its next-token
row is read from the longer row's pass (:attr:`RowPlan.reads`), so scoring
the prefixes of one continuation costs one forward pass.

:func:`plan_batch` decides all of it once per batch, from the tree as it
is; :class:`BatchPlan` is immutable. The runner executes its passes and
commits :meth:`PassPlan.placements` to the tree. Before planning,
:func:`shared_uncached_prefixes` says which prefixes, shared by several
contexts and not cached yet, are computed first, as batches of their own.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from genlm_backend.cache.kv_block import KVBlock, KVEntry, Piece, Placement, Segment


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
    ``block_tokens``: levels only span whole runs of that many tokens at
    fixed positions (``0, b, 2b, ...``), the rest of a cached piece is copied:
    the layout of exact attention (:mod:`~genlm_backend.llm.hf.exact`), whose
    spans must not depend on where the tree holds a key.
    """

    enabled: bool = True
    min_shared_tokens: int = 128
    min_unshared_tokens: int = 512
    min_prefill_tokens: int = 32
    block_tokens: int | None = None


class Lookup(NamedTuple):
    """A context of the batch and what the tree holds of it: ``entry`` serves its first ``reused`` tokens.

    Named tuples, as the rows and placements of a plan: made for every row of every step, and
    a frozen dataclass costs three times as much to make.
    """

    output_row: int
    """The context's row in the batch's output."""
    context: tuple[int, ...]
    entry: KVEntry | None
    reused: int

    @property
    def num_new(self) -> int:
        return len(self.context) - self.reused


class RowPlan(NamedTuple):
    """One row of a forward pass: its levels, its own part, its new tokens, and the rows it yields."""

    context: tuple[int, ...]
    reused: int
    levels: tuple[Piece, ...]
    own: tuple[Piece, ...]
    """Pieces covering ``context[split:reused]``, copied into the pass's block (the first one
    from its slot ``own_start``)."""
    reads: tuple[tuple[int, int], ...]
    """``(output index, new-token position)``: the batch rows this row's logits give."""
    own_start: int = 0
    """Slots of the first own piece that precede ``split`` (a piece cut at a level's end)."""
    found: KVEntry | None = None
    """The entry the lookup found (serving ``context[:reused]``)."""

    @property
    def num_new(self) -> int:
        return len(self.context) - self.reused

    @property
    def split(self) -> int:
        """Tokens read as levels."""
        return sum(n for _, n in self.levels)

    @property
    def num_own_past(self) -> int:
        return self.reused - self.split

    @property
    def parent(self) -> KVEntry | None:
        """The entry serving ``context[:split]``: the new entry's parent."""
        return self.levels[-1][0] if self.levels else None


@dataclass(frozen=True)
class PassPlan:
    """One forward pass: its rows, the slot its new tokens start at, and the block it writes.

    ``extends`` is the block written in place (a one-token step), or
    ``None``: a new block of ``num_past + num_new`` slots (and spare ones)
    holding each row's own part right-aligned at ``num_past``.
    """

    rows: tuple[RowPlan, ...]
    num_past: int
    num_new: int
    extends: KVBlock | None

    @property
    def reads(self) -> list[tuple[int, int, int]]:
        """``(output index, row, new-token position)`` of every batch row this pass yields."""
        return [(index, i, at) for i, row in enumerate(self.rows) for index, at in row.reads]

    def placements(self) -> list[Placement]:
        """Where the tree finds each row's context in the pass's block (see ``KVPrefixTree.commit``)."""
        placements = []
        num_past = self.num_past
        for i, (context, reused, levels, _, _, _, found) in enumerate(self.rows):
            split = sum(n for _, n in levels) if levels else 0
            parent = levels[-1][0] if levels else None
            placements.append(
                Placement(context, i, num_past - reused + split, split, parent, found, reused)
            )
        return placements


@dataclass(frozen=True)
class BatchPlan:
    """The passes of one batch: one-token steps together, longer computations apart."""

    passes: tuple[PassPlan, ...]
    num_outputs: int


def plan_batch(lookups: Sequence[Lookup], policy: LevelPolicy) -> BatchPlan:
    """The passes that compute every looked-up context's next-token row, decided once from the tree as it is.

    Contexts nested in a longer one's computation become reads of its row.
    """
    return plan_hosts(nest(lookups), len(lookups), policy)


def plan_hosts(hosts: Sequence[Host], num_outputs: int, policy: LevelPolicy) -> BatchPlan:
    """The passes that compute ``hosts``, each yielding its reads (``num_outputs`` rows in all).

    One-token steps go together and longer computations apart, so that they
    do not pad the short ones.
    """
    passes = []
    for group in (
        [host for host in hosts if host[0].num_new == 1],
        [host for host in hosts if host[0].num_new > 1],
    ):
        if group:
            passes.append(_plan_pass(group, policy))
    return BatchPlan(tuple(passes), num_outputs)


Host = tuple[Lookup, tuple[tuple[int, int], ...]]
"""A computed context and the ``(output index, new-token position)`` rows it yields."""


def nest(lookups: Sequence[Lookup]) -> list[Host]:
    """Each computed context with the reads it yields, contexts nested in another's computation folded in.

    A context ``c`` is read from a longer context ``d`` of the batch when
    ``c`` is a prefix of ``d`` and ``d``'s computation covers the position
    after ``c`` (``d.reused <= len(c) - 1``). Only rows computing several
    tokens can hold others, so a batch of one-token steps is left as it is
    without comparing contexts.
    """
    own: list[Host] = [(lookup, ((lookup.output_row, lookup.num_new - 1),)) for lookup in lookups]
    if all(lookup.num_new == 1 for lookup in lookups):
        return own
    order = sorted(range(len(lookups)), key=lambda i: lookups[i].context)
    # In sorted order, the extensions of a context follow it directly: follow each chain up.
    host = list(range(len(lookups)))
    for a, b in itertools.pairwise(reversed(order)):  # b comes before a in sorted order
        shorter, longer = lookups[b].context, lookups[a].context
        if len(shorter) < len(longer) and longer[: len(shorter)] == shorter:
            host[b] = host[a]
    reads: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(lookups))}
    for i, lookup in enumerate(lookups):
        target = lookups[host[i]]
        at = len(lookup.context) - 1 - target.reused
        reads[host[i] if at >= 0 else i].append(
            (lookup.output_row, at if at >= 0 else lookup.num_new - 1)
        )
    return [(lookups[i], tuple(found)) for i, found in reads.items() if found]


def _plan_pass(hosts: Sequence[Host], policy: LevelPolicy) -> PassPlan:
    num_new = max(lookup.num_new for lookup, _ in hosts)
    block = (
        extendable_block([(lookup.entry, lookup.reused) for lookup, _ in hosts])
        if num_new == 1
        else None
    )
    if block is not None:
        # Pass row i writes block row i: the rows in the block's order, each read by its outputs.
        in_block_order = sorted(hosts, key=lambda host: host[0].entry.row)  # type: ignore[union-attr]
        levels_of: dict = {}  # rows behind one parent at one offset share their levels
        rows = tuple(
            in_place_row(lookup.context, lookup.entry, found, levels_of)
            for lookup, found in in_block_order
        )
        first = hosts[0][0].entry
        assert first is not None  # an extendable block is some row's entry's
        if policy.block_tokens is None or all(
            levels_aligned(row.levels, policy.block_tokens) for row in rows
        ):
            return PassPlan(rows, first.start + first.length, 1, block)
    rows = _copied_rows(hosts, policy)
    return PassPlan(rows, max(row.num_own_past for row in rows), num_new, None)


def in_place_row(
    context: tuple[int, ...],
    entry: KVEntry | None,
    reads: tuple[tuple[int, int], ...],
    levels_of: dict,
) -> RowPlan:
    """A row extending ``entry``, which holds ``context[:-1]``, in place: the entry's
    ancestors are its levels (``levels_of``: the levels found so far, by parent and offset)."""
    assert entry is not None  # extendable_block checked every row
    parent = entry.parent
    levels: tuple[Piece, ...] = ()
    if parent is not None:
        key = (id(parent), entry.offset)
        levels = levels_of.get(key) or levels_of.setdefault(key, tuple(parent.pieces(entry.offset)))
    return RowPlan(context, len(context) - 1, levels, (), reads, found=entry)


def _copied_rows(hosts: Sequence[Host], policy: LevelPolicy) -> tuple[RowPlan, ...]:
    """Rows of a new block: each chain split after its last level, the rest copied."""
    chains = [
        lookup.entry.pieces(lookup.reused) if lookup.entry is not None and lookup.reused else []
        for lookup, _ in hosts
    ]
    readers = Counter((id(entry), n) for chain in chains for entry, n in chain)
    rows = []
    for (lookup, found), chain in zip(hosts, chains):
        num_levels = 0
        if policy.enabled:
            for i, (entry, n) in enumerate(chain):
                shared = readers[id(entry), n] > 1
                if n >= (policy.min_shared_tokens if shared else policy.min_unshared_tokens):
                    num_levels = i + 1
        if policy.block_tokens is None:
            levels, own, own_start = tuple(chain[:num_levels]), tuple(chain[num_levels:]), 0
        else:
            levels, own, own_start = _block_aligned(chain, num_levels, policy.block_tokens)
        rows.append(
            RowPlan(lookup.context, lookup.reused, levels, own, found, own_start, lookup.entry)
        )
    return tuple(rows)


def _block_aligned(
    chain: list[Piece], num_levels: int, block_tokens: int
) -> tuple[tuple[Piece, ...], tuple[Piece, ...], int]:
    """``(levels, own, own_start)`` for a chain whose first ``num_levels`` pieces could be levels,
    each level starting and ending at a multiple of ``block_tokens``."""
    levels: list[Piece] = []
    for entry, n in chain[:num_levels]:
        if entry.offset % block_tokens:
            break
        end = entry.offset + n
        cut = end - end % block_tokens
        if cut > entry.offset:
            levels.append((entry, cut - entry.offset))
        if cut < end:
            break
    split = sum(n for _, n in levels)
    for k, (entry, n) in enumerate(chain):
        if entry.offset <= split < entry.offset + n:
            return tuple(levels), tuple(chain[k:]), split - entry.offset
    return tuple(levels), (), 0


def levels_aligned(levels: Sequence[Piece], block_tokens: int) -> bool:
    """Whether every level starts and ends at a multiple of ``block_tokens``."""
    return all(entry.offset % block_tokens == 0 and n % block_tokens == 0 for entry, n in levels)


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


# ---------------------------------------------------------------------- a pass's inputs


@dataclass(frozen=True)
class PassInputs:
    """What an executor hands the model for one pass, read off its plan once.

    Plain lists: an executor makes each one tensor (operations per row would
    cost a batch of 64 particles hundreds of small operations).
    """

    tokens: list[list[int]]
    """Each row's new tokens, ``[B][num_new]``, padded after its own."""
    positions: list[list[int]]
    """The positions of each row's new tokens, ``[B][num_new]`` (see :func:`positions`)."""
    row_starts: list[int]
    """The slot of each row's first own token in the pass's block (what its mask starts at)."""
    copies: list[tuple[int, int, Segment]]
    """``(row, slot, segment)``: each row's own pieces, right-aligned at slot ``num_past`` of
    a new block (see :meth:`~genlm_backend.cache.kv_block.KVBlock.copy_in`); unused when the
    pass extends a block in place."""
    levels: list[tuple[Piece, list[int]]]
    """The pass's distinct levels, each with the rows that read it (:func:`level_readers`)."""


def pass_inputs(plan: PassPlan, max_positions: int) -> PassInputs:
    """The pass's inputs (``max_positions``: the model's longest sequence)."""
    num_past, num_new, rows = plan.num_past, plan.num_new, plan.rows
    if num_new == 1:  # a particles' step: each row's last token, at its own position
        tokens = [[row.context[-1]] for row in rows]
        last = max_positions - 1
        at = [[row.reused if row.reused < max_positions else last] for row in rows]
    else:
        tokens = new_tokens(plan)
        at = [positions(row.reused, num_new, max_positions) for row in rows]
    return PassInputs(
        tokens=tokens,
        positions=at,
        row_starts=[num_past - row.num_own_past for row in rows],
        copies=own_part_copies(plan) if plan.extends is None else [],
        levels=level_readers(rows),
    )


def own_part_copies(plan: PassPlan) -> list[tuple[int, int, Segment]]:
    """``(row, slot, segment)``: each row's own pieces, right-aligned at slot ``plan.num_past``
    of the pass's new block (see :meth:`~genlm_backend.cache.kv_block.KVBlock.copy_in`)."""
    copies = []
    for i, row in enumerate(plan.rows):
        target = plan.num_past - row.num_own_past
        skip = row.own_start
        for entry, n in row.own:
            copies.append(
                (i, target, Segment(entry.block, entry.row, entry.start + skip, n - skip))
            )
            target += n - skip
            skip = 0
    return copies


def new_tokens(plan: PassPlan) -> list[list[int]]:
    """Each row's new tokens, ``[B][num_new]``, padded after its own."""
    num_new = plan.num_new
    return [[*row.context[row.reused :], *[0] * (num_new - row.num_new)] for row in plan.rows]


def positions(first: int, count: int, max_positions: int) -> list[int]:
    """``first, first + 1, ...`` (``count`` of them), held at the model's last position past it (padding)."""
    end = max(first, min(first + count, max_positions))
    return [*range(first, end), *[max_positions - 1] * (first + count - end)]


def level_readers(rows: Sequence[RowPlan]) -> list[tuple[Piece, list[int]]]:
    """The distinct levels of a pass's rows, each with the rows that read it, in order of first reading."""
    readers: dict[tuple[int, int], tuple[Piece, list[int]]] = {}
    for i, row in enumerate(rows):
        for entry, n in row.levels:
            readers.setdefault((id(entry), n), ((entry, n), []))[1].append(i)
    return list(readers.values())


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def spare_slots(num_past: int) -> int:
    """Slots a new block of one-token rows keeps free after its ``num_past + 1`` for the
    next steps to write in place (:func:`extendable_block`): a quarter of its length, at
    least 16.

    A block out of room makes the particles' next step a new block: looked up,
    planned, its own parts copied and committed, over three times the host
    work of a step in place (BENCHMARKS.md). Behind a long prompt read as a
    level the own parts are short, and the floor decides how often that comes.
    """
    return max(16, num_past // 4)


def extendable_block(steps: Sequence[tuple[KVEntry | None, int]]) -> KVBlock | None:
    """The block a batch of one-token steps may write into in place, or ``None``.

    ``steps[i]`` is ``(entry, reused)`` of batch row ``i``. True when the
    rows extend, by one token each, the whole contexts of the entries held
    by every row of one block, in any order (a server gathers its clients'
    requests in the order they come); those entries' spans all end at the
    same slot, which is their row's last written slot (so the slot written
    now belongs to no other entry), and a free slot is left. That is the SMC
    step without resampling; anything else is copied into a new block.
    """
    first = steps[0][0] if steps else None
    if first is None:
        return None
    block, end = first.block, first.start + first.length
    if block.num_rows != len(steps) or end >= block.num_slots:
        return None
    row_ends = block.row_ends
    taken = bytearray(len(steps))
    for entry, reused in steps:
        if (
            entry is None
            or entry.block is not block
            or taken[entry.row]
            or reused != entry.offset + entry.length
            or entry.start + entry.length != end
            or row_ends[entry.row] != end
        ):
            return None
        taken[entry.row] = 1
    return block
