"""Where cached keys/values live: blocks of every layer's, and entries that chain spans of them.

A :class:`KVBlock` holds the keys and values ``[B, H, T, D]`` of every layer
one model batch wrote. A :class:`KVEntry` is one cached context: its last
``length`` tokens sit in one row of a block, and its first ``offset`` tokens
are those of its ``parent`` entry. A long prompt is thus held once, in its
own entry, and every particle behind it holds only its own tokens, with the
prompt's entry as parent. Attention keys/values of a prefix do not depend on
what follows it, so an entry serves every prefix of its context too
(:meth:`KVEntry.pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


class KVBlock:
    """Every layer's keys and values of one batch, in one tensor, shared by the entries of its rows.

    One tensor per block, not two per layer: copying rows between blocks,
    or zeroing slots, is one operation for all layers.

    Args:
        stacked: ``[L, 2, B, H, T, D]``: layer ``l``'s keys are ``stacked[l, 0]``
            and its values ``stacked[l, 1]``.
    """

    def __init__(self, stacked: torch.Tensor):
        self.stacked = stacked
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        """``[(keys, values), ...]`` per layer, each ``[B, H, T, D]``: views of ``stacked``."""
        self._bind(stacked)
        self.nbytes = stacked.numel() * stacked.element_size()
        self.num_live_entries = 0
        self.num_rows: int = stacked.shape[2]
        self.num_slots: int = stacked.shape[4]
        self.row_ends: list[int] = [0] * stacked.shape[2]
        """Per row, the end of its written slots: slots past it are free to write."""

    def _bind(self, stacked: torch.Tensor) -> None:
        self.stacked = stacked
        self.layers = [tuple(layer.unbind(0)) for layer in stacked.unbind(0)]  # type: ignore[misc]

    def move_to(self, stacked: torch.Tensor) -> None:
        """Hold the keys/values in ``stacked`` from now on: a copy of :attr:`stacked`, same shape and dtype.

        The entries of the block are unchanged; its former tensor is left to
        whoever owns it (a captured step reusing its storage).
        """
        if stacked.shape != self.stacked.shape or stacked.dtype != self.stacked.dtype:
            raise ValueError(
                f"a block of {tuple(self.stacked.shape)} {self.stacked.dtype} cannot move to "
                f"{tuple(stacked.shape)} {stacked.dtype}"
            )
        self._bind(stacked)

    @classmethod
    def empty(cls, num_layers: int, shape, dtype: torch.dtype, device) -> KVBlock:
        """A block of ``num_layers`` layers whose keys and values are ``shape`` (``[B, H, T, D]``), not initialized."""
        return cls(torch.empty(num_layers, 2, *shape, dtype=dtype, device=device))

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one row's keys and values at one slot, over all layers."""
        return self.nbytes // max(1, self.num_rows * self.num_slots)

    def copy_in(self, copies: Sequence[tuple[int, int, Segment]]) -> None:
        """Copy each ``(row, slot, segment)``'s keys/values into this block's ``row`` from ``slot`` on.

        Segments at the same slots of the same block, bound for the same
        slots, go in one indexed copy of every layer at once: in an SMC step
        every particle copies a row of the previous batch, so that is usually
        one copy.
        """
        groups: dict[tuple, tuple[KVBlock, int, int, int, list[int], list[int]]] = {}
        for i, target, segment in copies:
            source, start, n = segment.block, segment.start, segment.length
            group = groups.setdefault(
                (id(source), start, n, target), (source, start, n, target, [], [])
            )
            group[4].append(segment.row)
            group[5].append(i)
        device = self.stacked.device
        for source, start, n, target, sources, targets in groups.values():
            _copy_rows(
                self.stacked,
                _as_index(targets, device),
                slice(target, target + n),
                source.stacked,
                _as_source_index(sources, device),
                slice(start, start + n),
            )


def int_tensor(values: list, device: torch.device | str | None = None) -> torch.Tensor:
    """``values``, ints or equal-length lists of ints, as an int64 tensor (on ``device``:
    ``None``, the host).

    Through numpy: ``torch.tensor`` reads a nested list element by element (a pass's
    64 x 32 tokens: 626 us against 69 us; 64 x 1: 65 us against 29 us; a captured step's
    7 x 64 inputs: 3x).
    """
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    return host if device is None else host.to(device)


def _as_index(rows: list[int], device) -> slice | torch.Tensor:
    """A slice for consecutive rows (a plain strided copy), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return int_tensor(rows, device)


def _as_source_index(rows: list[int], device) -> slice | torch.Tensor:
    """:func:`_as_index`, and one row read by every target row as a one-row slice, broadcast by
    the copy (a prompt copied into each particle's row: a gather of the same row, repeated,
    measured 12x slower)."""
    first = rows[0]
    if len(rows) > 1 and rows.count(first) == len(rows):
        return slice(first, first + 1)
    return _as_index(rows, device)


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


@dataclass(eq=False)
class KVEntry:
    """Keys/values of one cached context of ``offset + length`` tokens.

    Tokens ``[offset, offset + length)`` are ``block``'s ``row``, slots
    ``[start, start + length)``; tokens ``[0, offset)`` are the first
    ``offset`` tokens of ``parent`` (``None`` when ``offset`` is 0). A parent
    stays cached while it has dependents (see
    :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`).
    """

    block: KVBlock
    row: int
    start: int
    length: int
    offset: int = 0
    parent: KVEntry | None = None
    node: object = field(default=None, repr=False)
    namespace: object = field(default=None, repr=False)
    """The namespace the tree caches it under (set on insertion)."""
    dependents: set[KVEntry] = field(default_factory=set, repr=False)
    """Live entries whose ``parent`` this is."""
    context: object = field(default=None, repr=False)
    """The context tuple the tree last committed it for (its identity finds the entry: see
    :meth:`~genlm_backend.cache.kv_tree.KVPrefixTree.longest_prefix`'s ``parent``)."""

    @property
    def context_length(self) -> int:
        return self.offset + self.length

    def ancestors(self) -> Iterator[KVEntry]:
        """The parent, its parent, and so on."""
        entry = self.parent
        while entry is not None:
            yield entry
            entry = entry.parent

    def pieces(self, num_tokens: int) -> list[tuple[KVEntry, int]]:
        """Where the keys/values of this context's first ``num_tokens`` tokens are, in order.

        Returns ``[(entry, n), ...]``: each piece is the first ``n`` slots of
        ``entry``'s own span; together they cover ``num_tokens`` tokens.
        """
        if not 0 <= num_tokens <= self.context_length:
            raise ValueError(f"{num_tokens} tokens asked of an entry of {self.context_length}")
        pieces = []
        entry: KVEntry | None = self
        while entry is not None and num_tokens > 0:
            if num_tokens > entry.offset:
                pieces.append((entry, num_tokens - entry.offset))
                num_tokens = entry.offset
            entry = entry.parent
        pieces.reverse()
        return pieces

    @property
    def nbytes(self) -> int:
        """Bytes of this entry's own span (its parent's are counted there)."""
        return self.length * self.block.bytes_per_slot


Piece = tuple["KVEntry", int]
"""The first ``n`` slots of an entry's own span."""


@dataclass(frozen=True)
class Segment:
    """Slots ``[start, start + length)`` of ``block``'s ``row``."""

    block: KVBlock
    row: int
    start: int
    length: int


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of a :class:`KVPrefixTree`."""

    num_entries: int
    num_blocks: int
    num_evictions: int
    bytes_held: int
    budget_bytes: int
    bytes_shared: int = 0
    """Bytes of entries that other entries continue (a shared prompt), held once."""


class Placement(NamedTuple):
    """Where :meth:`KVPrefixTree.commit` finds a context's keys/values in a block.

    ``context[offset:]`` is ``row``'s slots from ``start``; ``context[:offset]``
    is ``parent``'s (``None`` when ``offset`` is 0).
    """

    context: Sequence[int]
    row: int
    start: int
    offset: int = 0
    parent: KVEntry | None = None
    found: KVEntry | None = None
    """The entry the context's lookup found, holding its first :attr:`reused` tokens: the tree
    walks from its node, or grows it when the context is its own and a token written in place
    just after it."""
    reused: int = 0
