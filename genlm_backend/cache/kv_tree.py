"""A prefix tree of reusable keys/values, within a byte budget. Calls no model.

Keys and values live in :class:`KVBlock`\\ s: one block per model batch, the
per-layer tensors ``[B, H, T, D]`` the forward pass wrote. A cached context
is a :class:`KVEntry`: a row of a block and the slot range ``[start, start +
length)`` holding that context's keys/values. Because attention keys/values
of a prefix do not depend on what follows it, an entry also serves every
prefix of its context: a request whose context extends, or branches off, a
cached one reuses the shared part, and inserting an entry retires the
entries of its prefixes (their keys/values are a slice of the new one).

Memory: a block is freed when its last entry is evicted. ``bytes_held`` is
the size of the live blocks, kept at or under ``budget_bytes`` by evicting
least recently used entries (see :meth:`KVPrefixTree.reserve`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch


class KVBlock:
    """Per-layer key/value tensors of one batch, shared by the entries of its rows.

    Args:
        layers: ``[(keys, values), ...]`` per layer, each ``[B, H, T, D]``.
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers = layers
        self.nbytes = sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers
        )
        self.num_live_entries = 0
        num_rows = layers[0][0].shape[0] if layers else 0
        self.row_ends: list[int] = [0] * num_rows
        """Per row, the end of its written slots: slots past it are free to write."""

    @property
    def num_slots(self) -> int:
        return self.layers[0][0].shape[2]

    def keys_values(self, layer: int, row: int, start: int, length: int):
        """Keys and values ``[H, length, D]`` of ``row``'s slots ``[start, start + length)``."""
        keys, values = self.layers[layer]
        return keys[row, :, start : start + length], values[row, :, start : start + length]


@dataclass(eq=False)
class KVEntry:
    """Keys/values of one cached context: ``block``'s ``row``, slots ``[start, start + length)``."""

    block: KVBlock
    row: int
    start: int
    length: int
    node: _Node | None = field(default=None, repr=False)


class _Node:
    __slots__ = ("children", "entry", "parent", "token")

    def __init__(self, parent: _Node | None, token: Hashable):
        self.children: dict[Hashable, _Node] = {}
        self.entry: KVEntry | None = None
        self.parent = parent
        self.token = token


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of a :class:`KVPrefixTree`."""

    num_entries: int
    num_blocks: int
    num_evictions: int
    bytes_held: int
    budget_bytes: int


class KVPrefixTree:
    """Longest-prefix lookup of cached keys/values, LRU-evicted within ``budget_bytes``.

    Contexts live under a namespace (e.g. the active LoRA adapter): keys and
    values computed under one are never served under another. Not
    thread-safe: the backend calls it with its compute lock held.

    Raises:
        ValueError: negative budget.
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._roots: dict[Hashable, _Node] = {}
        self._lru: OrderedDict[int, KVEntry] = OrderedDict()  # id(entry) -> entry
        self._blocks: dict[int, KVBlock] = {}  # id(block) -> live block
        self._bytes_held = 0
        self._num_evictions = 0

    @property
    def bytes_held(self) -> int:
        return self._bytes_held

    @property
    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_entries=len(self._lru),
            num_blocks=len(self._blocks),
            num_evictions=self._num_evictions,
            bytes_held=self._bytes_held,
            budget_bytes=self.budget_bytes,
        )

    def longest_prefix(
        self, context: Sequence[int], namespace: Hashable = None
    ) -> tuple[KVEntry | None, int]:
        """The entry covering the longest prefix of ``context``, and that prefix's length.

        The entry's own context may be shorter (a prefix of ``context``) or
        longer (``context`` or a branch of it shares its first tokens); either
        way its first ``n`` slots hold the keys/values of ``context[:n]``.
        Returns ``(None, 0)`` when nothing is shared. Marks the entry used.
        """
        node = self._roots.get(namespace)
        if node is None:
            return None, 0
        best, best_depth, depth = None, 0, 0
        for token in context:
            child = node.children.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
            if node.entry is not None:
                best, best_depth = node.entry, depth
        if depth > best_depth:
            best, best_depth = self._any_entry_below(node), depth
        if best is not None:
            self._lru.move_to_end(id(best))
        return best, best_depth

    @staticmethod
    def _any_entry_below(node: _Node) -> KVEntry:
        # Every node without an entry has a descendant with one (empty branches are pruned).
        while node.entry is None:
            node = next(iter(node.children.values()))
        return node.entry

    def reserve(self, nbytes: int, pinned: Iterable[KVEntry] = ()) -> bool:
        """Evict least recently used entries until ``nbytes`` more fit in the budget.

        Entries in ``pinned`` (being read right now) are kept. Returns whether
        ``nbytes`` now fit.
        """
        pinned_ids = {id(entry) for entry in pinned}
        for entry_id in list(self._lru):
            if self._bytes_held + nbytes <= self.budget_bytes:
                break
            if entry_id not in pinned_ids:
                self._evict(self._lru[entry_id])
        return self._bytes_held + nbytes <= self.budget_bytes

    def insert(self, context: Sequence[int], entry: KVEntry, namespace: Hashable = None) -> None:
        """Cache ``entry`` as the keys/values of ``context``.

        Entries of prefixes of ``context`` are evicted: the new entry serves
        them too, so in a growing SMC particle only the newest block stays.

        The entry's block starts counting against the budget with its first
        entry; call :meth:`reserve` first to make room.

        Raises:
            ValueError: ``entry.length != len(context)``.
        """
        if entry.length != len(context):
            raise ValueError(f"entry holds {entry.length} slots for a context of {len(context)}")
        node = self._roots.setdefault(namespace, _Node(None, namespace))
        for token in context:
            if node.entry is not None:
                # The new entry's first slots cover this ancestor's context: drop the copy.
                self._evict(node.entry, prune=False)
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(node, token)
            node = child
        if node.entry is not None:
            self._evict(node.entry, prune=False)
        block_id = id(entry.block)
        if block_id not in self._blocks:
            self._blocks[block_id] = entry.block
            self._bytes_held += entry.block.nbytes
        entry.block.num_live_entries += 1
        entry.node = node
        node.entry = entry
        self._lru[id(entry)] = entry

    def _evict(self, entry: KVEntry, prune: bool = True) -> None:
        del self._lru[id(entry)]
        self._num_evictions += 1
        node = entry.node
        assert node is not None, "an entry in the LRU order is in the tree"
        entry.node = node.entry = None
        block = entry.block
        block.num_live_entries -= 1
        if block.num_live_entries == 0:
            del self._blocks[id(block)]
            self._bytes_held -= block.nbytes
        while (
            prune
            and (parent := node.parent) is not None
            and not node.children
            and node.entry is None
        ):
            del parent.children[node.token]
            node = parent

    def commit(
        self,
        block: KVBlock,
        placements: Sequence[tuple[Sequence[int], int, int]],
        namespace: Hashable = None,
    ) -> bool:
        """Keep a computed block: each ``(context, row, start)`` becomes an entry over ``row``'s slots from ``start``.

        A new block is first made room for (see :meth:`reserve`); if it does
        not fit, nothing is kept and ``False`` is returned. Records where each
        row's written slots end, which :meth:`extendable_block` relies on.
        """
        if block.num_live_entries == 0 and not self.reserve(block.nbytes):
            return False
        for context, row, start in placements:
            block.row_ends[row] = start + len(context)
            self.insert(context, KVEntry(block, row, start, len(context)), namespace)
        return True

    @staticmethod
    def extendable_block(steps: Sequence[tuple[KVEntry | None, int]]) -> KVBlock | None:
        """The block a batch of one-token steps may write into in place, or ``None``.

        ``steps[i]`` is ``(entry, reused)`` of batch row ``i``. True when every
        row ``i`` extends, by one token, the whole context held by row ``i`` of
        one block; those contexts all end at the same slot, which is their
        row's last written slot (so the slot written now belongs to no other
        entry), and a free slot is left. That is the SMC step without
        resampling; anything else is copied into a new block.
        """
        first = steps[0][0] if steps else None
        if first is None:
            return None
        block, end = first.block, first.start + first.length
        if len(block.row_ends) != len(steps) or end >= block.num_slots:
            return None
        for i, (entry, reused) in enumerate(steps):
            if (
                entry is None
                or entry.block is not block
                or entry.row != i
                or reused != entry.length
                or entry.start + entry.length != end
                or block.row_ends[i] != end
            ):
                return None
        return block

    def drop_namespace(self, namespace: Hashable) -> int:
        """Evict every entry of ``namespace`` (e.g. an adapter being unloaded); returns how many."""
        root = self._roots.pop(namespace, None)
        if root is None:
            return 0
        doomed = []
        stack = [root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                doomed.append(node.entry)
            stack.extend(node.children.values())
        for entry in doomed:
            self._evict(entry, prune=False)
        return len(doomed)

    def evict_to_budget(self) -> None:
        """Evict least recently used entries until the live blocks fit the budget."""
        while self._bytes_held > self.budget_bytes and self._lru:
            self._evict(next(iter(self._lru.values())))

    def clear(self) -> None:
        """Drop every entry and block."""
        self._roots.clear()
        self._lru.clear()
        self._blocks.clear()
        self._bytes_held = 0

    def __len__(self) -> int:
        return len(self._lru)
