"""A prefix tree of reusable keys/values, within a byte budget. Calls no model.

Keys and values live in :class:`~genlm_backend.cache.kv_block.KVBlock`\\ s,
one per model batch; a cached context is a
:class:`~genlm_backend.cache.kv_block.KVEntry`, which may continue a parent
entry (a shared prompt is then held once). Because attention keys/values of
a prefix do not depend on what follows it, an entry also serves every prefix
of its context: a request whose context extends, or branches off, a cached
one reuses the shared part, and inserting an entry retires the entries of
its prefixes that nothing depends on (the new entry serves them).

Memory: a block is freed when its last entry is evicted. ``bytes_held`` is
the size of the live blocks, kept at or under ``budget_bytes`` by evicting
least recently used entries (see :meth:`KVPrefixTree.reserve`); evicting an
entry evicts its dependents first, and reading an entry marks its ancestors
used, so the least recently used entry is nearly always a leaf.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from genlm_backend.cache.kv_block import (
    KVBlock,
    KVCacheStats,
    KVEntry,
    Placement,
)
from genlm_backend.cache.token_trie import TokenTrie, TrieNode

__all__ = ["KVBlock", "KVCacheStats", "KVEntry", "KVPrefixTree", "Placement"]


class KVPrefixTree:
    """Longest-prefix lookup of cached keys/values, LRU-evicted within ``budget_bytes``.

    Contexts live under a namespace (e.g. the active LoRA adapter): keys and
    values computed under one are never served under another (an entry's
    parent is always of its own namespace). Not thread-safe: the backend
    calls it with its compute lock held, except :meth:`cached_length`.

    Raises:
        ValueError: negative budget.
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._trie = TokenTrie()
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
            bytes_shared=sum(e.nbytes for e in self._lru.values() if e.dependents),
        )

    def longest_prefix(
        self, context: Sequence[int], namespace: Hashable = None
    ) -> tuple[KVEntry | None, int]:
        """The entry covering the longest prefix of ``context``, and that prefix's length.

        The entry's own context may be shorter (a prefix of ``context``) or
        longer (``context`` or a branch of it shares its first tokens); either
        way ``entry.pieces(n)`` locates the keys/values of ``context[:n]``.
        Returns ``(None, 0)`` when nothing is shared. Marks the entry and its
        ancestors used.
        """
        node, depth = self._trie.deepest(context, namespace)
        if node is None or depth == 0:
            return None, 0
        best = self._any_entry_below(node)
        self._touch(best)
        return best, depth

    def cached_length(
        self,
        context: Sequence[int],
        namespace: Hashable = None,
        parent: tuple[int, ...] | None = None,
    ) -> int:
        """How many leading tokens of ``context`` have cached keys/values; marks nothing used.

        Safe to call from another thread while the tree changes (dictionary
        lookups only): the answer may then be stale, which suits its use, an
        estimate of a request's cost before it is batched. ``parent``: see
        :meth:`TokenTrie.deepest <genlm_backend.cache.token_trie.TokenTrie.deepest>`.
        """
        return self._trie.deepest(context, namespace, parent)[1]

    @staticmethod
    def _any_entry_below(node: TrieNode) -> KVEntry:
        # Every node without an entry has a descendant with one (empty branches are pruned).
        while node.entry is None:
            node = next(iter(node.children.values()))
        return node.entry

    def _touch(self, entry: KVEntry) -> None:
        # Ancestors after the entry: a parent is never less recently used than its dependents.
        self._lru.move_to_end(id(entry))
        for ancestor in entry.ancestors():
            self._lru.move_to_end(id(ancestor))

    def reserve(self, nbytes: int, pinned: Iterable[KVEntry] = ()) -> bool:
        """Evict least recently used entries until ``nbytes`` more fit in the budget.

        Entries in ``pinned`` (being read right now) and their ancestors are
        kept. Returns whether ``nbytes`` now fit.
        """
        pinned_ids = set()
        for entry in pinned:
            pinned_ids.add(id(entry))
            pinned_ids.update(id(ancestor) for ancestor in entry.ancestors())
        for entry_id in list(self._lru):
            if self._bytes_held + nbytes <= self.budget_bytes:
                break
            candidate = self._lru.get(entry_id)  # None: evicted with an ancestor already
            if (
                candidate is not None
                and entry_id not in pinned_ids
                and not self._any_pinned_below(candidate, pinned_ids)
            ):
                self._evict(candidate)
        return self._bytes_held + nbytes <= self.budget_bytes

    @staticmethod
    def _any_pinned_below(entry: KVEntry, pinned_ids: set[int]) -> bool:
        stack = list(entry.dependents)
        while stack:
            dependent = stack.pop()
            if id(dependent) in pinned_ids:
                return True
            stack.extend(dependent.dependents)
        return False

    def insert(self, context: Sequence[int], entry: KVEntry, namespace: Hashable = None) -> None:
        """Cache ``entry`` as the keys/values of ``context``.

        Entries of prefixes of ``context`` that no entry depends on are
        evicted: the new entry serves them too, so in a growing SMC particle
        only the newest block stays. (When ``context`` extends the latest
        inserted contexts, only the prefixes past that one are looked at:
        its own insertion retired those above it.) If an entry of ``context`` itself is
        cached and depended on, it stays and ``entry`` is dropped.

        The entry's block starts counting against the budget with its first
        entry; call :meth:`reserve` first to make room.

        Raises:
            ValueError: ``entry`` does not hold ``len(context)`` tokens, or
                its parent is not cached under ``namespace``.
        """
        if entry.context_length != len(context):
            raise ValueError(
                f"entry holds {entry.context_length} tokens for a context of {len(context)}"
            )
        parent = entry.parent
        if parent is not None and (
            self._lru.get(id(parent)) is not parent or parent.namespace != namespace
        ):
            raise ValueError("an entry's parent must be cached, under the same namespace")
        if parent is not None:
            parent.dependents.add(entry)  # before the walk: the parent is on it and must stay
        # The walk starts below the node of the context's last inserted prefix,
        # whose own insertion retired the entries above it.
        node, depth = self._trie.insertion_start(context, namespace)
        for token in context[depth:]:
            if node.entry is not None and not node.entry.dependents:
                # The new entry covers this ancestor's context: drop the copy.
                self._evict(node.entry, prune=False)
            node = node.child(token)
        if node.entry is not None:
            if node.entry.dependents:
                if parent is not None:
                    parent.dependents.discard(entry)
                return
            self._evict(node.entry, prune=False)
        block_id = id(entry.block)
        if block_id not in self._blocks:
            self._blocks[block_id] = entry.block
            self._bytes_held += entry.block.nbytes
        entry.block.num_live_entries += 1
        entry.node, entry.namespace = node, namespace
        node.entry = entry
        self._lru[id(entry)] = entry
        self._touch(entry)
        self._trie.remember(context, namespace, node)

    def _evict(self, entry: KVEntry, prune: bool = True) -> None:
        for dependent in list(entry.dependents):
            self._evict(dependent, prune)
        del self._lru[id(entry)]
        self._num_evictions += 1
        if entry.parent is not None:
            entry.parent.dependents.discard(entry)
        node = entry.node
        assert isinstance(node, TrieNode), "an entry in the LRU order is in the tree"
        entry.node = node.entry = None
        block = entry.block
        block.num_live_entries -= 1
        if block.num_live_entries == 0:
            del self._blocks[id(block)]
            self._bytes_held -= block.nbytes
        if prune:
            self._trie.prune(node)

    def commit(
        self,
        block: KVBlock,
        placements: Sequence[Placement],
        namespace: Hashable = None,
    ) -> bool:
        """Keep a computed block: each placement becomes an entry over its row's slots.

        A new block is first made room for (see :meth:`reserve`); if
        it does not fit, nothing is kept and ``False`` is returned. Records
        where each row's written slots end, which :func:`~genlm_backend.cache.kv_block.extendable_block`
        relies on.
        """
        pinned = [p.parent for p in placements if p.parent is not None]
        if block.num_live_entries == 0 and not self.reserve(block.nbytes, pinned):
            return False
        for p in placements:
            if p.parent is not None and self._lru.get(id(p.parent)) is not p.parent:
                continue  # its parent was evicted meanwhile: this row is not kept
            length = len(p.context) - p.offset
            block.row_ends[p.row] = p.start + length
            entry = KVEntry(block, p.row, p.start, length, p.offset, p.parent)
            self.insert(p.context, entry, namespace)
        return True

    def drop_namespace(self, namespace: Hashable) -> int:
        """Evict every entry of ``namespace`` (e.g. an adapter being unloaded); returns how many."""
        root = self._trie.pop_namespace(namespace)
        if root is None:
            return 0
        doomed: list[KVEntry] = []
        stack = [root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                doomed.append(node.entry)
            stack.extend(node.children.values())
        for entry in doomed:
            if self._lru.get(id(entry)) is entry:
                self._evict(entry, prune=False)
        return len(doomed)

    def clear(self) -> None:
        """Drop every entry and block."""
        for entry in self._lru.values():
            entry.node = None
            entry.dependents.clear()
        self._trie.clear()
        self._lru.clear()
        self._blocks.clear()
        self._bytes_held = 0

    def __len__(self) -> int:
        return len(self._lru)
