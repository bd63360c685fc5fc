"""The shape of a token-character trie and the reduction plan every implementation runs.

Node numbering (shared by every trie class):

* internal nodes ``0 .. num_internal - 1`` are the distinct prefixes of the
  vocabulary's words (byte strings, or letter sequences: see
  :mod:`genlm_backend.trie.words`), ordered by (length, word); node 0 is the
  root (the empty prefix);
* leaf ``num_internal + t`` belongs to the item at position ``t``. Every token has its own
  leaf, so tokens with identical (or empty) words stay distinct.

Reduction plan. A node's value is a reduction (sum, max, logsumexp) over the
leaves below it. Most internal nodes have exactly one child, so their value is
their child's value and costs nothing. Every other node reduces its children's
values through a balanced tree of binary operations. Each binary operation
gets a *row*: rows ``0 .. V - 1`` hold the token weights, later rows hold
results, grouped into *levels* whose operands all lie in earlier levels. A
level is two gathers and one element-wise operation over contiguous output
rows, so an implementation runs ``len(levels)`` dense steps and one final
gather (:attr:`TrieLayout.node_rows`) that gives every node its value.

Why this shape (docs/trie.md and BENCHMARKS.md give the measurements): the
per-node reductions that ``index_add_``/``index_reduce_`` or a token-by-node
sparse matrix perform cost several times more than gathers of contiguous rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReductionLevel:
    """Rows ``start .. stop - 1`` get ``op(rows[left], rows[right])``, element-wise."""

    start: int
    stop: int
    left: np.ndarray  # int64 [stop - start]
    right: np.ndarray  # int64 [stop - start]


@dataclass(frozen=True)
class TrieLayout:
    """Topology of the trie over one vocabulary, and its reduction plan."""

    words: list
    """The word of each leaf (``bytes``, or ``str`` of letter codes)."""
    prefixes: list
    """Prefix of each internal node (index = node), in the words' form."""
    parent: np.ndarray
    """int64 ``[num_nodes]``: parent of each node, -1 for the root."""
    num_rows: int
    """Rows of the work array: ``len(words)`` token rows plus one per binary operation."""
    levels: list[ReductionLevel]
    node_rows: np.ndarray
    """int64 ``[num_nodes]``: the work-array row holding each node's value."""

    @property
    def num_tokens(self) -> int:
        return len(self.words)

    @property
    def num_internal(self) -> int:
        return len(self.prefixes)

    @property
    def num_nodes(self) -> int:
        return len(self.prefixes) + len(self.words)


def build_layout(vocab: Sequence[bytes] | Sequence[str]) -> TrieLayout:
    """Build the trie over the words ``vocab`` (index = position) and its reduction plan.

    Args:
        vocab: Non-empty; all ``bytes``, or all ``str`` of letter codes
            (:mod:`genlm_backend.trie.words`).
    """
    prefixes = sorted({token[:i] for token in vocab for i in range(len(token) + 1)})
    prefixes.sort(key=len)  # stable: (length, word) order, root first
    node_of = {prefix: node for node, prefix in enumerate(prefixes)}
    num_internal = len(prefixes)
    parent = np.empty(num_internal + len(vocab), dtype=np.int64)
    parent[0] = -1
    parent[1:num_internal] = [node_of[prefix[:-1]] for prefix in prefixes[1:]]
    parent[num_internal:] = [node_of[token] for token in vocab]
    depth_starts = np.searchsorted(
        np.fromiter(map(len, prefixes), np.int64, num_internal), np.arange(len(prefixes[-1]) + 2)
    )
    num_rows, levels, node_rows = _plan_reduction(parent, num_internal, len(vocab), depth_starts)
    return TrieLayout(list(vocab), prefixes, parent, num_rows, levels, node_rows)


def _plan_reduction(parent, num_internal, num_tokens, depth_starts):
    """Binary-operation rows for every internal node with two or more children."""
    children_order = np.argsort(parent[1:], kind="stable") + 1
    child_starts = np.concatenate([[0], np.cumsum(np.bincount(parent[1:], minlength=num_internal))])
    node_rows = np.empty(len(parent), dtype=np.int64)
    node_rows[num_internal:] = np.arange(num_tokens)
    heights = [0] * num_tokens
    operands: list[tuple[int, int]] = []
    num_children = np.diff(child_starts)
    for depth in range(len(depth_starts) - 2, -1, -1):  # children before parents
        nodes = np.arange(depth_starts[depth], depth_starts[depth + 1])
        single = nodes[num_children[nodes] == 1]
        node_rows[single] = node_rows[children_order[child_starts[single]]]
        for node in nodes[num_children[nodes] > 1].tolist():
            kids = children_order[child_starts[node] : child_starts[node + 1]]
            node_rows[node] = _combine(node_rows[kids].tolist(), heights, operands)
    return _renumber_by_height(num_tokens, heights, operands, node_rows)


def _combine(rows: list[int], heights: list[int], operands: list[tuple[int, int]]) -> int:
    """Add binary operations reducing ``rows``, lowest first (a Huffman tree on heights)."""
    heap = [(heights[row], row) for row in rows]
    heapq.heapify(heap)
    while len(heap) > 1:
        height_a, row_a = heapq.heappop(heap)
        height_b, row_b = heapq.heappop(heap)
        row = len(heights)
        heights.append(max(height_a, height_b) + 1)
        operands.append((row_a, row_b))
        heapq.heappush(heap, (heights[row], row))
    return heap[0][1]


def _renumber_by_height(num_tokens, heights, operands, node_rows):
    """Order operation rows by height so each level is a contiguous block after its operands."""
    op_heights = np.asarray(heights[num_tokens:], dtype=np.int64)
    order = np.argsort(op_heights, kind="stable")
    new_row = np.arange(len(heights))
    new_row[num_tokens + order] = num_tokens + np.arange(len(order))
    pairs = np.asarray(operands, dtype=np.int64).reshape(-1, 2)[order]
    left, right = new_row[pairs[:, 0]], new_row[pairs[:, 1]]
    sorted_heights = op_heights[order]
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(sorted_heights)) + 1, [len(order)]])
    levels = [
        ReductionLevel(num_tokens + lo, num_tokens + hi, left[lo:hi], right[lo:hi])
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist())
        if hi > lo
    ]
    return len(heights), levels, new_row[node_rows]
