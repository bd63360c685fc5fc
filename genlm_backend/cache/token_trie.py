"""The token trie under :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`: a node per cached token position.

A context's node is reached from its namespace's root by one child per
token. Walking a 4,000-token prompt token by token on every SMC step would
cost more than the step's bookkeeping, so the trie remembers the nodes of
the latest inserted contexts: a context that extends one of them by a token
starts its walk there. A remembered context that others continue (a shared
prompt) keeps its place among them, so a new particle's first step behind
it never walks the prompt.

Finding that node copies the context's first ``n - 1`` tokens and compares
them with the remembered context (hashed by its length and last tokens,
:mod:`~genlm_backend.cache.keys`), which costs their length at C speed. One
request's context is looked up three times (its cost estimate, its batch's
plan, its insertion), always as the same tuple, so the node found is also
kept by the tuple's identity for the later lookups.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from genlm_backend.cache.keys import ContextKey
from genlm_backend.cache.kv_block import KVEntry

NUM_RECENT_CONTEXTS = 1024
"""Inserted contexts whose nodes a :class:`TokenTrie` remembers (plus those others continue)."""

_NUM_HINTS = 1024
"""Most contexts whose found node a :class:`TokenTrie` keeps by the context's identity
(each is dropped at its insertion, its last lookup; the oldest go first past this)."""


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
    """Per-namespace token tries with a shortcut to the latest inserted contexts' nodes.

    Lookups may come from another thread while the trie changes (see
    :meth:`KVPrefixTree.cached_length`): each is a single dictionary
    operation, and a node found is used only while it is attached.
    """

    def __init__(self) -> None:
        self._roots: dict[Hashable, TrieNode] = {}
        self._recent: OrderedDict[ContextKey, TrieNode] = OrderedDict()
        # id(context) -> (context, namespace, node of context[:-1])
        self._hints: OrderedDict[int, tuple[Sequence[int], Hashable, TrieNode]] = OrderedDict()

    def deepest(
        self, context: Sequence[int], namespace: Hashable, parent: tuple[int, ...] | None = None
    ) -> tuple[TrieNode | None, int]:
        """The node of the longest prefix of ``context`` in the trie, and its depth.

        ``parent``: ``context[:-1]`` as a tuple the trie may have remembered
        (then found by identity, without copying or comparing the context).
        """
        node, depth = self._roots.get(namespace), 0
        if node is None:
            return None, 0
        hint = self._parent_hint(context, namespace, parent)
        if hint is not None:
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
        hint = self._parent_hint(context, namespace)
        # A request's last lookup: its context is not kept alive past it.
        self._hints.pop(id(context), None)
        if hint is not None:
            return hint, len(context) - 1
        return root, 0

    def _parent_hint(
        self, context: Sequence[int], namespace: Hashable, parent: tuple[int, ...] | None = None
    ) -> TrieNode | None:
        """The attached node of ``context[:-1]`` if that was a remembered context, else ``None``."""
        if len(context) < 2:
            return None
        kept = self._hints.get(id(context))
        if kept is not None and kept[0] is context and kept[1] == namespace and kept[2].is_attached:
            return kept[2]
        if parent is None or len(parent) != len(context) - 1:
            parent = tuple(context[:-1])
        node = self._recent.get(ContextKey(namespace, parent))
        if node is None or not node.is_attached:
            return None
        if type(context) is tuple:  # immutable: its identity names its tokens
            self._hints[id(context)] = (context, namespace, node)
            if len(self._hints) > _NUM_HINTS:
                self._hints.popitem(last=False)
        return node

    def remember(self, context: Sequence[int], namespace: Hashable, node: TrieNode) -> None:
        """``node`` is ``context``'s: a later walk for an extension of it starts there."""
        key = ContextKey(namespace, tuple(context))
        self._recent[key] = node
        self._recent.move_to_end(key)
        if len(self._recent) > NUM_RECENT_CONTEXTS:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Forget the least recently inserted context, passing over (a few) that others continue."""
        for _ in range(_NUM_KEPT_PARENTS_PER_INSERT):
            key, node = self._recent.popitem(last=False)
            entry = node.entry
            if entry is None or not entry.dependents or not node.is_attached:
                return
            self._recent[key] = node  # a shared prompt: back to the newest end
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
        self._hints.clear()
        return self._roots.pop(namespace, None)

    def clear(self) -> None:
        self._roots.clear()
        self._recent.clear()
        self._hints.clear()


_NUM_KEPT_PARENTS_PER_INSERT = 4
"""Remembered contexts that others continue one insertion moves back before forgetting the oldest anyway."""
