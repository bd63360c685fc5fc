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

Lookups. A context's node is reached from its namespace's root in a token
trie (:class:`TokenTrie`), one child per token. Walking a 4,000-token prompt
token by token on every SMC step would cost more than the step's
bookkeeping, so the trie remembers the nodes of the latest inserted
contexts: a context that extends one of them by a token starts its walk
there. A remembered context that others continue (a shared prompt) keeps its
place among them, so a new particle's first step behind it never walks the
prompt. Contexts are hashed by :func:`tail_hash`, which reads their
length and last :data:`HASHED_TAIL` tokens (Python's tuple hash reads every
element): contexts alike in both but different earlier collide (particles
caught in one repetition loop behind a long prompt: each pair of them), and
a dictionary then tells them apart by :func:`same_tokens`, which compares
whole hashes, each taken once per key, before the tokens: a collision costs
one full hash a key, never a comparison a pair, and never a wrong answer.
One request's context is looked up three times (its cost
estimate, its batch's plan, its insertion), always as the same tuple, so the
node found is also kept by the tuple's identity for the later lookups.

A particle's step. The tree keeps the entry committed for each of the
latest contexts by the context's identity, so a request naming its parent
(the context one token shorter, as the front passes it) finds the parent's
entry without a walk or a hash. A step written in place, in the slot after
that entry in its own row, grows the entry by a token instead of making a
new one and retiring the old; the trie learns the grown tokens every
:data:`INDEX_STRIDE` of them (a walk by value meanwhile finds the entry at
its older node: a shorter prefix, never a wrong one). A step of 64 particles
then costs the tree a few dictionary operations a row.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from genlm_backend.cache.kv_block import (
    KVBlock,
    KVCacheStats,
    KVEntry,
    Placement,
)

__all__ = [
    "HASHED_TAIL",
    "ContextKey",
    "KVBlock",
    "KVCacheStats",
    "KVEntry",
    "KVPrefixTree",
    "Placement",
    "TokenTrie",
    "blocks_digest",
    "context_hash",
    "same_tokens",
    "tail_hash",
    "untracked",
]

HASHED_TAIL = 32
"""Tokens at the end of a context that :func:`tail_hash` reads."""


def tail_hash(tokens: tuple[int, ...]) -> int:
    """A hash of ``tokens`` from its length and last :data:`HASHED_TAIL` tokens (equal tuples,
    equal hashes): a slice's worth, whatever the length, but contexts alike at their end
    collide (see :func:`same_tokens`)."""
    return hash((len(tokens), tokens[-HASHED_TAIL:]))


HASH_BLOCK = 32
"""Tokens per block of a context whose hashes chain into :func:`context_hash`. A particle's
call hashes the tokens after its context's last complete block (16 on average, 190 ns;
64 and 430 ns with 128-token blocks); a context read whole hashes each block once (4,096
tokens: about 40 us)."""


def blocks_digest(tokens: tuple[int, ...], digest: int = 0, start: int = 0) -> int:
    """The chained hash of the complete :data:`HASH_BLOCK`-token blocks of ``tokens``,
    continuing ``digest``, that of the blocks before ``start`` (a multiple of
    :data:`HASH_BLOCK`): a context one token past one whose digest is kept costs at most
    one block's hash."""
    end = len(tokens) - len(tokens) % HASH_BLOCK
    for i in range(start, end, HASH_BLOCK):
        digest = hash((digest, tokens[i : i + HASH_BLOCK]))
    return digest


def context_hash(tokens: tuple[int, ...], digest: int | None = None) -> int:
    """A hash of the whole of ``tokens`` (equal tuples, equal hashes): its length, the digest
    of its complete blocks (``digest``, :func:`blocks_digest`'s, when the caller keeps it;
    else read whole, about as fast as Python's hash of the tuple) and the tokens after them.

    Particles caught in one repetition loop behind a long prompt end alike; a
    hash of their last tokens only (:func:`tail_hash`) would make a dictionary
    of them compare every pair.
    """
    length = len(tokens)
    if digest is None:
        digest = blocks_digest(tokens)
    return hash((length, digest, tokens[length - length % HASH_BLOCK :]))


COMPARED_LENGTH = 256
"""Tokens up to which :func:`same_tokens` compares two contexts directly (cheaper than hashing)."""


def same_tokens(
    tokens: tuple[int, ...],
    other: tuple[int, ...],
    whole_hash: Callable[[], int],
    other_whole_hash: Callable[[], int],
) -> bool:
    """Whether two contexts of equal :func:`tail_hash` hold the same tokens.

    Contexts alike in length and last tokens but different earlier (particles
    in one repetition loop behind a long prompt) differ after their shared
    prefix: a tuple comparison reads that prefix for every pair a dictionary
    probes, quadratic in the particles. Long contexts compare their whole
    hashes first (``whole_hash``: Python's hash of the tuple, which the caller
    keeps after its first call), read once per context; only equal hashes
    (equal contexts, all but surely) are compared token by token.
    """
    if tokens is other:
        return True
    if len(tokens) > COMPARED_LENGTH and whole_hash() != other_whole_hash():
        return False
    return tokens == other


def _gc_untrack_function():
    """CPython's ``PyObject_GC_UnTrack`` (``None`` elsewhere: a build without the GIL tracks
    objects its own way)."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    untrack.argtypes, untrack.restype = [ctypes.py_object], None
    return untrack


_GC_UNTRACK = _gc_untrack_function()


def _same_objects_function() -> Callable[[tuple[int, ...], tuple[int, ...]], bool] | None:
    """:func:`same_objects` for this interpreter, ``None`` where a tuple's layout is not
    CPython's with the GIL (checked on a tuple made here) or ``memcmp`` is not found."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    try:
        memcmp = ctypes.pythonapi.memcmp  # a PyDLL function: called with the GIL held
    except AttributeError:
        return None
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcmp.restype = ctypes.c_int
    size = ctypes.sizeof(ctypes.c_void_p)
    items = tuple.__basicsize__  # PyTupleObject: its head, then the item pointers
    probe = (object(), object())
    if tuple.__itemsize__ != size or ctypes.c_void_p.from_address(
        id(probe) + items + size
    ).value != id(probe[1]):
        return None

    def same_objects(tokens: tuple[int, ...], prefix: tuple[int, ...]) -> bool:
        count = len(prefix)
        if type(tokens) is not tuple or type(prefix) is not tuple or len(tokens) < count:
            return False
        return not memcmp(id(tokens) + items, id(prefix) + items, count * size)

    return same_objects


_SAME_OBJECTS = _same_objects_function()

SAME_OBJECTS_FROM = 160
"""Tokens from which :func:`same_objects` compares a context's pointers (below, a tuple
comparison of the tokens costs less than the call)."""


def same_objects(tokens: tuple[int, ...], prefix: tuple[int, ...]) -> bool:
    """Whether the first ``len(prefix)`` elements of the tuple ``tokens`` are the very objects
    of the tuple ``prefix``, in order: their pointers compared as memory, at ``memcmp``'s speed.

    A particle's next context is its last one (the tuple the front validated)
    and a token: its elements are that tuple's own objects, whether the caller
    appended to a list or built a new one, so once copied into a tuple they
    compare equal without a comparison per token (behind 4,096 tokens: 1.3 us
    against 9 us). Both are tuples, which no other thread can change meanwhile.
    ``False`` does not mean unequal (equal ints may be distinct objects): the
    caller then compares values. Always ``False`` where the interpreter's
    layout is not CPython's.
    """
    if _SAME_OBJECTS is None:
        return False
    return _SAME_OBJECTS(tokens, prefix)


UNTRACKED_LENGTH = 256
"""Tokens from which :func:`untracked` takes a context off the collector's list."""


def untracked(tokens: tuple[int, ...]) -> tuple[int, ...]:
    """``tokens``, off the cyclic garbage collector's list (on CPython with the GIL; else as it is).

    Only for a tuple of ints, which is in no reference cycle: reference
    counting frees it. A tracked tuple is read whole by each collection that
    finds it young, until one sees it holds only untracked objects; every
    step makes each particle a new context, so behind a 4,096-token prompt
    64 particles' contexts cost the collector about 3 ms a step
    (BENCHMARKS.md). Contexts are untracked where they are validated, from
    :data:`UNTRACKED_LENGTH` tokens (a shorter one costs a collection less than the call).
    """
    if _GC_UNTRACK is not None and len(tokens) >= UNTRACKED_LENGTH:
        _GC_UNTRACK(tokens)
    return tokens


class ContextKey:
    """A dictionary key for ``tokens`` under ``namespace``, hashed by :func:`tail_hash` (cheap
    for a key made at each insertion; told apart from a colliding key by :func:`same_tokens`)."""

    __slots__ = ("_hash", "_whole_hash", "namespace", "tokens")

    def __init__(self, namespace: Hashable, tokens: tuple[int, ...]):
        self.namespace = namespace
        self.tokens = tokens
        self._hash = hash((namespace, tail_hash(tokens)))
        self._whole_hash: int | None = None

    def __hash__(self) -> int:
        return self._hash

    def whole_hash(self) -> int:
        """Python's hash of the whole context (read once, on a first collision)."""
        if self._whole_hash is None:
            self._whole_hash = hash(self.tokens)
        return self._whole_hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ContextKey):
            return NotImplemented
        return self.namespace == other.namespace and same_tokens(
            self.tokens, other.tokens, self.whole_hash, other.whole_hash
        )

    def __repr__(self) -> str:
        return f"ContextKey({self.namespace!r}, <{len(self.tokens)} tokens>)"


NUM_RECENT_CONTEXTS = 1024
"""Inserted contexts whose nodes a :class:`TokenTrie` remembers (plus those others continue)."""

INDEX_STRIDE = 16
"""Tokens an entry grows in place (one a step) before its trie nodes are made (see
:meth:`KVPrefixTree.commit`)."""

NUM_LATEST = 1024
"""Contexts a :class:`KVPrefixTree` keeps the committed entry of, by identity (the latest committed)."""

_NUM_HINTS = 1024
"""Most contexts whose found node a :class:`TokenTrie` keeps by the context's identity
(each is dropped at its insertion, its last lookup; the oldest go first past this)."""


class TrieNode:
    """One token position of a namespace's contexts; ``entry`` is the KV entry ending here, if any."""

    __slots__ = ("children", "depth", "entry", "is_attached", "parent", "token")

    def __init__(self, parent: TrieNode | None, token: Hashable):
        self.children: dict[Hashable, TrieNode] = {}
        self.entry: KVEntry | None = None
        self.parent = parent
        self.token = token
        self.depth: int = 0 if parent is None else parent.depth + 1
        """Tokens of the context ending here."""
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

    def forget_hint(self, context: Sequence[int]) -> None:
        """Drop what a lookup kept for ``context`` (its insertion is its last lookup)."""
        self._hints.pop(id(context), None)

    def insertion_start(self, context: Sequence[int], namespace: Hashable) -> tuple[TrieNode, int]:
        """Where inserting ``context`` walks from: the node of its last inserted prefix one token
        shorter (whose own insertion walked the way above it), else the namespace's root."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TrieNode(None, namespace)
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
        # id(context) -> (namespace, its entry): contexts committed lately, found by identity
        # (a particle's next step names its context as its parent). The entry holds the
        # context it was last committed for (KVEntry.context), which the identity is checked
        # against: the tree keeps one context per live entry alive, not one per key here. A
        # weak reference: an evicted entry's block is not kept alive here.
        self._latest: OrderedDict[int, tuple[Hashable, weakref.ref[KVEntry]]] = OrderedDict()
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
        self,
        context: Sequence[int],
        namespace: Hashable = None,
        parent: tuple[int, ...] | None = None,
    ) -> tuple[KVEntry | None, int]:
        """The entry covering the longest prefix of ``context``, and that prefix's length.

        The entry's own context may be shorter (a prefix of ``context``) or
        longer (``context`` or a branch of it shares its first tokens); either
        way ``entry.pieces(n)`` locates the keys/values of ``context[:n]``.
        Returns ``(None, 0)`` when nothing is shared. Marks the entry and its
        ancestors used. ``parent``: see
        :meth:`TokenTrie.deepest <genlm_backend.cache.kv_tree.TokenTrie.deepest>`.
        """
        if parent is not None and len(parent) == len(context) - 1:
            latest = self._latest_entry(parent, namespace)
            if latest is not None:
                self._touch(latest)
                return latest, len(parent)
        node, depth = self._trie.deepest(context, namespace, parent)
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
        :meth:`TokenTrie.deepest <genlm_backend.cache.kv_tree.TokenTrie.deepest>`.
        """
        if (
            parent is not None
            and len(parent) == len(context) - 1
            and self._latest_entry(parent, namespace) is not None
        ):
            return len(parent)
        return self._trie.deepest(context, namespace, parent)[1]

    def _latest_entry(self, context: Sequence[int], namespace: Hashable) -> KVEntry | None:
        """The live entry last committed for this very ``context`` object, else ``None``."""
        kept = self._latest.get(id(context))
        if kept is None or kept[0] != namespace:
            return None
        entry = kept[1]()
        if entry is None or entry.node is None or entry.context is not context:
            return None  # evicted, or committed for another context since
        return entry

    @staticmethod
    def _any_entry_below(node: TrieNode) -> KVEntry:
        # Every node without an entry has a descendant with one (empty branches are pruned).
        while node.entry is None:
            node = next(iter(node.children.values()))
        return node.entry

    def _touch(self, entry: KVEntry) -> None:
        # Ancestors after the entry: a parent is never less recently used than its dependents.
        lru = self._lru
        found: KVEntry | None = entry
        while found is not None:
            lru.move_to_end(id(found))
            found = found.parent

    def reserve(self, nbytes: int, pinned: Iterable[KVEntry] = ()) -> bool:
        """Evict least recently used entries until ``nbytes`` more fit in the budget.

        Entries in ``pinned`` (being read right now) and their ancestors are
        kept. Returns whether ``nbytes`` now fit.
        """
        pinned_ids = set()
        for entry in pinned:
            held: KVEntry | None = entry
            while held is not None:  # the entry and its ancestors
                pinned_ids.add(id(held))
                held = held.parent
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

    def insert(
        self,
        context: Sequence[int],
        entry: KVEntry,
        namespace: Hashable = None,
        found: KVEntry | None = None,
        reused: int = 0,
    ) -> None:
        """Cache ``entry`` as the keys/values of ``context``.

        Entries of prefixes of ``context`` that no entry depends on are
        evicted: the new entry serves them too, so in a growing SMC particle
        only the newest block stays. (When ``context`` extends the latest
        inserted contexts, only the prefixes past that one are looked at:
        its own insertion retired those above it.) If an entry of ``context`` itself is
        cached and depended on, it stays and ``entry`` is dropped.

        The entry's block starts counting against the budget with its first
        entry; call :meth:`reserve` first to make room. ``found``: an entry
        holding ``context[:reused]`` (the context's lookup's): the walk starts at
        its trie node when that is at most ``reused`` deep.

        Raises:
            ValueError: ``entry`` does not hold ``len(context)`` tokens, or
                its parent is not cached under ``namespace``.
        """
        if entry.offset + entry.length != len(context):
            raise ValueError(
                f"entry holds {entry.offset + entry.length} tokens for a context of {len(context)}"
            )
        parent = entry.parent
        if (parent is None) != (entry.offset == 0):
            raise ValueError(
                f"an entry with offset {entry.offset} needs a parent exactly when offset > 0"
            )
        if parent is not None and (
            self._lru.get(id(parent)) is not parent or parent.namespace != namespace
        ):
            raise ValueError("an entry's parent must be cached, under the same namespace")
        # The walk starts below the node of a prefix inserted before (the lookup's entry's, or
        # the context's last inserted one token shorter), whose insertion retired the entries
        # above it.
        start = found.node if found is not None and found.namespace == namespace else None
        if isinstance(start, TrieNode) and start.depth <= reused:
            self._trie.forget_hint(context)
            self._insert_below(start, start.depth, context, entry, namespace)
        else:
            node, depth = self._trie.insertion_start(context, namespace)
            self._insert_below(node, depth, context, entry, namespace)

    def _insert_below(
        self,
        node: TrieNode,
        depth: int,
        context: Sequence[int],
        entry: KVEntry,
        namespace: Hashable,
    ) -> KVEntry:
        """:meth:`insert`'s walk and bookkeeping from ``node``, the node of ``context[:depth]``;
        the entry that holds ``context`` afterwards (``entry``, or one cached and depended on)."""
        parent = entry.parent
        if parent is not None:
            parent.dependents.add(entry)  # before the walk: the parent is on it and must stay
        for token in context[depth:]:
            if node.entry is not None and not node.entry.dependents:
                # The new entry covers this ancestor's context: drop the copy.
                self._evict(node.entry, prune=False)
            node = node.child(token)
        if node.entry is not None:
            if node.entry.dependents:
                if parent is not None:
                    parent.dependents.discard(entry)
                return node.entry
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
        return entry

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
        kept: list[KVEntry | None] | None = None,
    ) -> bool:
        """Keep a computed block: each placement becomes an entry over its row's slots.

        A new block is first made room for (see :meth:`reserve`); if
        it does not fit, nothing is kept and ``False`` is returned. Records
        where each row's written slots end, which :func:`~genlm_backend.cache.plan.extendable_block`
        relies on. ``kept``: gets, per placement, the entry over its row's slots that now
        holds its context (``None``: the row is not kept, or another entry holds its context).
        """
        pinned = [p.parent for p in placements if p.parent is not None]
        if block.num_live_entries == 0 and not self.reserve(block.nbytes, pinned):
            if kept is not None:
                kept.extend([None] * len(placements))
            return False
        for p in placements:
            if p.parent is not None and self._lru.get(id(p.parent)) is not p.parent:
                if kept is not None:
                    kept.append(None)
                continue  # its parent was evicted meanwhile: this row is not kept
            found = p.found
            if found is not None and self._can_grow(found, block, p, namespace):
                entry = self._grow(found, p.context, namespace)
            else:
                length = len(p.context) - p.offset
                block.row_ends[p.row] = p.start + length
                entry = KVEntry(block, p.row, p.start, length, p.offset, p.parent)
                self.insert(p.context, entry, namespace, found, p.reused)
                if entry.node is None:  # an entry cached and depended on holds the context
                    if kept is not None:
                        kept.append(None)
                    continue
            if kept is not None:
                kept.append(entry if entry.block is block else None)
            self._keep_latest(p.context, namespace, entry)
        return True

    def extend_in_place(
        self, entries: Sequence[KVEntry], block: KVBlock, end: int, namespace: Hashable
    ) -> bool:
        """Whether a one-token step may write slot ``end`` of ``block`` in place for each of
        ``entries``, row ``i`` extending ``entries[i]``: each still cached under ``namespace``
        (not evicted, nor retired by a longer entry), over row ``i`` of ``block``, its span
        ending at ``end``, the row's last written slot (nothing grew it since), and a slot
        left. Marks each entry, and then each ancestor once, used.

        What :func:`~genlm_backend.cache.plan.extendable_block` checks of a batch's lookups,
        for entries a step just committed: a particles' next step, planned without looking
        its contexts up (see :class:`~genlm_backend.llm.runner.PrefixCacheDriver`).
        """
        if end >= block.num_slots or len(entries) != block.num_rows:
            return False
        lru, row_ends = self._lru, block.row_ends
        for i, entry in enumerate(entries):
            if (
                lru.get(id(entry)) is not entry
                or entry.block is not block
                or entry.row != i
                or entry.start + entry.length != end
                or row_ends[i] != end
                or entry.namespace != namespace
            ):
                return False
        for entry in entries:
            lru.move_to_end(id(entry))
        ancestors = {id(e.parent): e.parent for e in entries if e.parent is not None}
        while ancestors:  # a parent after its dependents, each once
            for entry in ancestors.values():
                lru.move_to_end(id(entry))
            ancestors = {id(e.parent): e.parent for e in ancestors.values() if e.parent is not None}
        return True

    def is_cached(self, entry: KVEntry | None) -> bool:
        """Whether ``entry`` is in the tree (not evicted, nor retired by a longer entry)."""
        return entry is not None and self._lru.get(id(entry)) is entry

    def grow_in_place(
        self, entries: Sequence[KVEntry], contexts: Sequence[Sequence[int]], namespace: Hashable
    ) -> list[KVEntry | None]:
        """Commit a one-token step written in place for ``entries``, as
        :meth:`extend_in_place` allowed it just before (nothing changed the tree since):
        entry ``i`` grows by the slot written, now holding ``contexts[i]``, as :meth:`commit`
        grows an entry, without its checks, and without marking it used again (the check
        did). The entry holding each context afterwards, as :meth:`commit`'s ``kept``."""
        kept: list[KVEntry | None] = []
        for entry, context in zip(entries, contexts):
            block = entry.block
            entry = self._grow(entry, context, namespace, touch=False)
            kept.append(entry if entry.block is block else None)
            self._keep_latest(context, namespace, entry)
        return kept

    def _keep_latest(self, context: Sequence[int], namespace: Hashable, entry: KVEntry) -> None:
        """``entry`` was just committed for ``context``: found by the context's identity."""
        entry.context = context
        latest = self._latest
        latest[id(context)] = (namespace, weakref.ref(entry))
        if len(latest) > NUM_LATEST:
            latest.popitem(last=False)

    def _can_grow(self, entry: KVEntry, block: KVBlock, p: Placement, namespace: Hashable) -> bool:
        """Whether ``p`` is ``entry``'s context and one more token, written in place: ``entry``
        held the whole of ``p.context[:-1]`` (its lookup's), and the slot written is the one
        after ``entry``'s in its own row of ``block``, the row's last written one."""
        return (
            self._lru.get(id(entry)) is entry
            and entry.block is block
            and entry.row == p.row
            and entry.start == p.start
            and entry.offset == p.offset
            and entry.parent is p.parent
            and entry.namespace == namespace
            and entry.offset + entry.length == p.reused == len(p.context) - 1
            and block.row_ends[p.row] == entry.start + entry.length
        )

    def _grow(
        self, entry: KVEntry, context: Sequence[int], namespace: Hashable, touch: bool = True
    ) -> KVEntry:
        """``entry`` holding ``context``, one token more than it held (:meth:`_can_grow`): its
        span grows in place, marked used with ``touch``; the entry that holds ``context``
        afterwards.

        An SMC step without resampling, every particle: no entry made, none evicted. The trie
        learns the new tokens every :data:`INDEX_STRIDE` of them (until then the entry stays
        at its node: a walk finds it there, and the particle's next step finds it by identity,
        :meth:`longest_prefix`'s ``parent``), as a fresh entry over the same slots, which
        retires this one as :meth:`insert` retires a prefix's.
        """
        entry.length += 1
        entry.block.row_ends[entry.row] = entry.start + entry.length
        if touch:
            self._touch(entry)
        node = entry.node
        assert isinstance(node, TrieNode), "a live entry is in the trie"
        if len(context) - node.depth < INDEX_STRIDE:
            return entry
        fresh = KVEntry(
            entry.block, entry.row, entry.start, entry.length, entry.offset, entry.parent
        )
        return self._insert_below(node, node.depth, context, fresh, namespace)

    def drop_namespace(self, namespace: Hashable) -> int:
        """Evict every entry of ``namespace`` (e.g. an adapter being unloaded); returns how many."""
        self._latest.clear()
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
        self._latest.clear()
        self._lru.clear()
        self._blocks.clear()
        self._bytes_held = 0

    def __len__(self) -> int:
        return len(self._lru)
