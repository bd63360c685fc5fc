"""TokenCharacterTrie: per-prefix sums, maxima and logsumexps of token weights, in float64 numpy.

For a weight vector ``ws`` over the vocabulary (index = token id), the value of
the node for byte prefix ``p`` is the reduction over every token whose bytes
start with ``p``; a token's leaf holds its own weight. See
:mod:`genlm_backend.trie.layout` for the node numbering and the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np

from genlm_backend.trie.layout import TrieLayout, build_layout
from genlm_backend.trie.weights import weights_to_numpy

_NUMPY_OPS: dict[str, Callable] = {"sum": np.add, "max": np.maximum, "logsumexp": np.logaddexp}


class TokenCharacterTrie:
    """A byte trie over a token vocabulary with one leaf per token, reduced in float64 numpy.

    Args:
        decode: The vocabulary: ``decode[token_id]`` is the token's bytes (or an
            object with a ``byte_string`` attribute, e.g. a ``Token``). Tokens
            with identical or empty bytes each get their own leaf.

    Every method returns a fresh array the caller owns. See :mod:`genlm_backend.trie.layout`
    for how the reductions are computed.

    Attributes:
        decode: The vocabulary as ``list[bytes]``.
        root: The root node (the empty prefix), always 0.
        num_nodes: Number of nodes; every result has this many values per row.
        token_id_to_leaf: int64 ``[V]``: the leaf node of each token.

    Raises:
        TypeError: ``decode`` is not a sequence of bytes-like items.
        ValueError: ``decode`` is empty.
    """

    def __init__(self, decode: Sequence):
        self.layout: TrieLayout = build_layout(decode)
        self.decode: list[bytes] = self.layout.byte_vocab
        self.root = 0
        self.num_nodes = self.layout.num_nodes
        self.num_internal_nodes = self.layout.num_internal
        self.token_id_to_leaf = np.arange(self.num_nodes - len(self.decode), self.num_nodes)
        self.parent: np.ndarray = self.layout.parent
        """int64 ``[num_nodes]``: each node's parent, -1 for the root."""

    # ------------------------------------------------------------------ mappings

    @cached_property
    def children(self) -> list[dict]:
        """``children[node]``: ``{byte: child}`` for byte edges and ``{(None, token_id): leaf}``
        for the leaf of each token whose bytes end at ``node`` (built on first use)."""
        children: list[dict] = [{} for _ in range(self.num_nodes)]
        prefixes = self.layout.prefixes
        for node in range(1, self.num_internal_nodes):
            children[self.parent[node]][prefixes[node][-1]] = node
        for token_id, leaf in enumerate(self.token_id_to_leaf.tolist()):
            children[self.parent[leaf]][(None, token_id)] = leaf
        return children

    @cached_property
    def node2prefix(self) -> list[bytes]:
        """``node2prefix[node]``: the byte prefix a node stands for (a leaf: its token's bytes)."""
        return self.layout.prefixes + self.decode

    def prefix_to_node(self, prefix: bytes) -> int | None:
        """The internal node of a byte prefix, or ``None`` if no token starts with it."""
        prefixes = self.layout.prefixes
        lo, hi = 0, self.num_internal_nodes  # prefixes are sorted by (length, bytes)
        key = (len(prefix), prefix)
        while lo < hi:
            mid = (lo + hi) // 2
            if (len(prefixes[mid]), prefixes[mid]) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < self.num_internal_nodes and prefixes[lo] == prefix else None

    def leaf_token_id(self, node: int) -> int | None:
        """The token of a leaf node, ``None`` for an internal node."""
        return node - self.num_internal_nodes if node >= self.num_internal_nodes else None

    # ------------------------------------------------------------------ reductions

    def weight_sum(self, ws) -> np.ndarray:
        """Sum of the weights of the tokens below each node.

        Args:
            ws: ``[V]`` numpy array or CPU tensor of a floating dtype, no NaN.

        Returns:
            float64 ``[num_nodes]``.

        Batch results are ``[B, num_nodes]`` transposed views of node-major
        ``[num_nodes, B]`` arrays (``np.ascontiguousarray`` gives C order).

        Raises:
            TypeError, ValueError: invalid ``ws`` (type, dtype, shape, device, NaN).
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

    def _check(self, ws, *, batched: bool) -> np.ndarray:
        return weights_to_numpy(ws, len(self.decode), batched=batched)

    def _reduce(self, ws: np.ndarray, op: str) -> np.ndarray:
        # ws: [B, V] float64. rows: [num_rows, B], so every gather moves whole rows.
        combine = _NUMPY_OPS[op]
        rows = np.empty((self.layout.num_rows, ws.shape[0]))
        rows[: len(self.decode)] = ws.T
        for level in self.layout.levels:
            combine(rows[level.left], rows[level.right], out=rows[level.start : level.stop])
        return rows[self.layout.node_rows].T  # [B, num_nodes] view of [num_nodes, B]

    # ------------------------------------------------------------------ display

    def visualize(self, ws=None, *, prefix: bytes = b"", max_nodes: int = 100):
        """A ``graphviz.Digraph`` of the sub-trie below ``prefix`` (breadth-first, capped).

        See :func:`genlm_backend.trie.visualize.visualize_trie`.
        """
        from genlm_backend.trie.visualize import visualize_trie

        return visualize_trie(self, ws, prefix=prefix, max_nodes=max_nodes)
