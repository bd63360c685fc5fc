"""The token trie under :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`: a node per cached token position.

A context's node is reached from its namespace's root by one child per
token. Walking a 4,000-token prompt token by token on every SMC step would
cost more than the step's bookkeeping, so the trie remembers the nodes of
the latest inserted contexts: a context that extends one of them by a token
starts its walk there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from genlm_backend.cache.kv_block import KVEntry

NUM_RECENT_CONTEXTS = 1024
"""Inserted contexts whose nodes a :class:`TokenTrie` remembers."""


class TrieNode:
    """One token position of a namespace's contexts; ``entry`` is the KV entry ending here, if any."""

    __slots__ = ("children", "entry", "is_attached", "parent", "token")

    def __init__(self, parent: TrieNode | None, token: Hashable):
        self.children: dict[Hashable, TrieNode] = {}
        self.entry: KVEntry | None = None
        self.parent = parent
        self.token = token
        self.is_attached = True  # False once pruned from the trie

    def child(self, token: Hashable) -> TrieNode:
        """The child for ``token``, created if missing."""
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = TrieNode(self, token)
        return node


class TokenTrie:
    """Per-namespace token tries with a shortcut to the latest inserted contexts' nodes."""

    def __init__(self) -> None:
        self._roots: dict[Hashable, TrieNode] = {}
        self._recent: OrderedDict[tuple[Hashable, tuple], TrieNode] = OrderedDict()

    def deepest(self, context: Sequence[int], namespace: Hashable) -> tuple[TrieNode | None, int]:
        """The node of the longest prefix of ``context`` in the trie, and its depth."""
        node, depth = self._roots.get(namespace), 0
        if node is None:
            return None, 0
        if len(context) > 1:
            hint = self._recent.get((namespace, tuple(context[:-1])))
            if hint is not None and hint.is_attached:
                node, depth = hint, len(context) - 1
        for token in context[depth:]:
            child = node.children.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
        return node, depth

    def insertion_start(self, context: Sequence[int], namespace: Hashable) -> tuple[TrieNode, int]:
        """Where inserting ``context`` walks from: the node of its last inserted prefix one token
        shorter (whose own insertion walked the way above it), else the namespace's root."""
        root = self._roots.setdefault(namespace, TrieNode(None, namespace))
        if len(context) > 1:
            hint = self._recent.get((namespace, tuple(context[:-1])))
            if hint is not None and hint.is_attached:
                return hint, len(context) - 1
        return root, 0

    def remember(self, context: Sequence[int], namespace: Hashable, node: TrieNode) -> None:
        """``node`` is ``context``'s: a later walk for an extension of it starts there."""
        key = (namespace, tuple(context))
        self._recent[key] = node
        self._recent.move_to_end(key)
        if len(self._recent) > NUM_RECENT_CONTEXTS:
            self._recent.popitem(last=False)

    @staticmethod
    def prune(node: TrieNode) -> None:
        """Detach ``node`` and its ancestors while they hold no entry and no children."""
        while (parent := node.parent) is not None and not node.children and node.entry is None:
            del parent.children[node.token]
            node.is_attached = False
            node = parent

    def pop_namespace(self, namespace: Hashable) -> TrieNode | None:
        """Remove ``namespace``'s trie and return its root (``None`` if it had none)."""
        self._recent.clear()
        return self._roots.pop(namespace, None)

    def clear(self) -> None:
        self._roots.clear()
        self._recent.clear()
