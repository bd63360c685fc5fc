"""TokenCharacterTrie: per-prefix sums, maxima and logsumexps of token weights, in float64 numpy.

For a weight vector ``ws`` over the vocabulary (``ws[i]`` is the weight of
``decode[i]``), the value of the node for prefix ``p`` is the reduction over
every item whose bytes (letters) start with ``p``; an item's leaf holds its own
weight. See
:mod:`genlm_backend.trie.layout` for the node numbering and the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from genlm_backend.trie.layout import TrieLayout, build_layout
from genlm_backend.trie.weights import weights_to_numpy
from genlm_backend.trie.words import TrieWords, trie_words, word_keys

_NUMPY_OPS: dict[str, Callable] = {"sum": np.add, "max": np.maximum, "logsumexp": np.logaddexp}


class TokenCharacterTrie:
    """A trie over a token vocabulary with one leaf per vocabulary item, reduced in float64 numpy.

    Args:
        decode: The vocabulary; ``decode[i]`` is the item whose weight is
            ``ws[i]``. Items are :class:`~genlm_backend.tokenization.Token` objects
            (what ``decode_vocab`` returns), plain bytes (deprecated: a
            ``DeprecationWarning`` is issued), or other iterables of hashable
            letters such as genlm-control's ``EndOfSequence``; see
            :mod:`genlm_backend.trie.words`. Items with identical or empty
            bytes each get their own leaf.

    Every method returns a fresh array the caller owns. See :mod:`genlm_backend.trie.layout`
    for how the reductions are computed.

    Attributes:
        decode: The vocabulary, as given.
        root: The root node (the empty prefix), always 0.
        num_nodes: Number of nodes; every result has this many values per row.
        word2leaf: ``{key: leaf}``; the key of a Token is ``(bytes, token_id)``, of
            plain bytes the bytes, of any other item the item itself.
        parent: int64 ``[num_nodes]``: each node's parent, -1 for the root.

    Raises:
        TypeError: ``decode`` is not a sequence, or an item is not iterable or unhashable.
        ValueError: ``decode`` is empty, or two items have the same key
            (``"Duplicate word in vocabulary: ..."``).
    """

    def __init__(self, decode: Sequence):
        self._words: TrieWords = trie_words(decode)
        keys = word_keys(decode)
        self.decode = decode
        self.layout: TrieLayout = build_layout(self._words.words)
        self.root = 0
        self.num_nodes = self.layout.num_nodes
        self.num_internal_nodes = self.layout.num_internal
        self.token_id_to_leaf = np.arange(self.num_internal_nodes, self.num_nodes)
        self.parent: np.ndarray = self.layout.parent
        self.word2leaf: dict = dict(zip(keys, range(self.num_internal_nodes, self.num_nodes)))

    # ------------------------------------------------------------------ mappings

    @cached_property
    def leaf2word(self) -> dict:
        """``{leaf: key}``, the inverse of :attr:`word2leaf`."""
        return {leaf: key for key, leaf in self.word2leaf.items()}

    @cached_property
    def idx_to_leaf(self) -> np.ndarray:
        """int32 ``[V, 2]``: row ``i`` is ``(i, leaf of decode[i])``."""
        positions = np.arange(self.layout.num_tokens, dtype=np.int32)
        return np.stack([positions, self.token_id_to_leaf.astype(np.int32)], axis=1)

    @cached_property
    def children(self) -> list[dict]:
        """``children[node]``: ``{letter: child}`` for letter edges (a byte is an ``int``)
        and ``{(None, i): leaf}`` for the leaf of each item ``decode[i]`` that ends at
        ``node`` (built on first use)."""
        children: list[dict] = [{} for _ in range(self.num_nodes)]
        parent = self.parent.tolist()
        prefixes = self.layout.prefixes
        if self._words.letters is None:
            for node in range(1, self.num_internal_nodes):
                children[parent[node]][prefixes[node][-1]] = node
        else:
            letter = self._words.letter
            for node in range(1, self.num_internal_nodes):
                children[parent[node]][letter(ord(prefixes[node][-1]))] = node
        for position, leaf in enumerate(range(self.num_internal_nodes, self.num_nodes)):
            children[parent[leaf]][(None, position)] = leaf
        return children

    @cached_property
    def node2prefix(self) -> dict:
        """``{node: prefix}``: the letters on the path to a node (a leaf: its item's).

        A prefix is ``bytes`` when all its letters are bytes, else a tuple of letters.
        """
        words = self.layout.prefixes + self.layout.words
        if self._words.letters is not None:
            words = list(map(self._words.decode_word, words))
        return dict(enumerate(words))

    def prefix_to_node(self, prefix) -> int | None:
        """The internal node of a prefix (bytes, or a sequence of letters), or ``None``
        if no item starts with it."""
        prefix = self._words.encode_prefix(prefix)
        if prefix is None:
            return None
        prefixes = self.layout.prefixes
        lo, hi = 0, self.num_internal_nodes  # prefixes are sorted by (length, word)
        key = (len(prefix), prefix)
        while lo < hi:
            mid = (lo + hi) // 2
            if (len(prefixes[mid]), prefixes[mid]) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < self.num_internal_nodes and prefixes[lo] == prefix else None

    def leaf_token_id(self, node: int) -> int | None:
        """The position in :attr:`decode` of a leaf node's item, ``None`` for an internal node."""
        return node - self.num_internal_nodes if node >= self.num_internal_nodes else None

    # ------------------------------------------------------------------ reductions

    def weight_sum(self, ws) -> np.ndarray:
        """Sum of the weights of the tokens below each node.

        Args:
            ws: ``[V]`` weights, ``ws[i]`` for ``decode[i]``: a tensor (any device;
                copied to the CPU), numpy array or sequence of numbers, of a real
                dtype (integers are converted), no NaN.

        Returns:
            float64 ``[num_nodes]``.

        Batch results are ``[B, num_nodes]`` transposed views of node-major
        ``[num_nodes, B]`` arrays (``np.ascontiguousarray`` gives C order).

        Raises:
            TypeError, ValueError: invalid ``ws`` (type, dtype, shape, NaN).
        """
        return self._reduce(self._check(ws, batched=False)[None], "sum")[0]

    def weight_max(self, ws) -> np.ndarray:
        """Largest weight of the tokens below each node (correct for negative and ``-inf``).

        Same contract as :meth:`weight_sum`.
        """
        return self._reduce(self._check(ws, batched=False)[None], "max")[0]

    def weight_logsumexp(self, ws) -> np.ndarray:
        """``log(sum(exp(ws)))`` over the tokens below each node, for log-weights.

        ``-inf`` weights contribute nothing; a node whose tokens are all
        ``-inf`` gets ``-inf``. Same contract as :meth:`weight_sum`.
        """
        return self._reduce(self._check(ws, batched=False)[None], "logsumexp")[0]

    def batch_weight_sum(self, ws_batch) -> np.ndarray:
        """:meth:`weight_sum` of each row: ``[B, V]`` or a list of ``[V]`` -> ``[B, num_nodes]``."""
        return self._reduce(self._check(ws_batch, batched=True), "sum")

    def batch_weight_max(self, ws_batch) -> np.ndarray:
        """:meth:`weight_max` of each row: ``[B, V]`` -> float64 ``[B, num_nodes]``."""
        return self._reduce(self._check(ws_batch, batched=True), "max")

    def batch_weight_logsumexp(self, ws_batch) -> np.ndarray:
        """:meth:`weight_logsumexp` of each row: ``[B, V]`` -> float64 ``[B, num_nodes]``."""
        return self._reduce(self._check(ws_batch, batched=True), "logsumexp")

    # The hooks below work on float64 numpy arrays here and on tensors in the
    # parallel trie, hence ``Any``.

    def _check(self, ws, *, batched: bool) -> Any:
        return weights_to_numpy(ws, self.layout.num_tokens, batched=batched)

    def _output(self, result: Any) -> Any:
        """Results leave as computed (the parallel trie may convert them)."""
        return result

    def _preprocess_ws(self, ws) -> Any:
        """``ws`` (``[V]`` or ``[B, V]``, any array-like) validated as float64 numpy."""
        return self._check(ws, batched=np.ndim(ws) == 2)

    def _reduce(self, ws: Any, op: str) -> Any:
        # ws: [B, V] float64. rows: [num_rows, B], so every gather moves whole rows.
        combine = _NUMPY_OPS[op]
        rows = np.empty((self.layout.num_rows, ws.shape[0]))
        rows[: self.layout.num_tokens] = ws.T
        for level in self.layout.levels:
            combine(rows[level.left], rows[level.right], out=rows[level.start : level.stop])
        return rows[self.layout.node_rows].T  # [B, num_nodes] view of [num_nodes, B]

    # ------------------------------------------------------------------ display

    def visualize(self, ws=None, *, prefix=b"", max_nodes: int = 100):
        """A ``graphviz.Digraph`` of the sub-trie below ``prefix`` (breadth-first, capped).

        See :func:`genlm_backend.trie.visualize.visualize_trie`.
        """
        from genlm_backend.trie.visualize import visualize_trie

        return visualize_trie(self, ws, prefix=prefix, max_nodes=max_nodes)
