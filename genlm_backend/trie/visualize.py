"""Graphviz drawings of a token-character trie, or of a small part of it."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    import graphviz


class DrawableTrie(Protocol):
    """What drawing needs of a trie (:class:`~genlm_backend.trie.base.TokenCharacterTrie`
    has it all); the trie module imports this one, never the other way round."""

    @property
    def num_nodes(self) -> int: ...

    @property
    def children(self) -> Sequence[Mapping[Any, int]]: ...

    @property
    def node2prefix(self) -> Mapping[int, Any]: ...

    def prefix_to_node(self, prefix: Any) -> int | None: ...

    def leaf_token_id(self, node: int) -> int | None: ...


def visualize_trie(
    trie: DrawableTrie, ws=None, *, prefix=b"", max_nodes: int = 100
) -> graphviz.Digraph:
    """Draw the sub-trie below ``prefix``: its first ``max_nodes`` nodes, breadth-first.

    Internal nodes show their byte prefix, leaves (double circles) their token
    id; with ``ws`` every node also shows its value. Building the graph needs
    only the ``graphviz`` Python package; rendering it (``.render()``,
    ``.pipe()``, notebook display) needs the Graphviz ``dot`` program and
    otherwise raises ``graphviz.ExecutableNotFound``.

    Args:
        trie: The trie to draw.
        ws: ``None``, or one value per node (``[num_nodes]``, e.g. the result
            of ``trie.weight_sum(token_weights)``).
        prefix: Prefix (bytes, or a sequence of letters) of the sub-trie's root;
            ``b""`` draws from the root.
        max_nodes: Most nodes drawn; a note node says how many were left out.

    Raises:
        ImportError: the ``graphviz`` package is not installed.
        ValueError: ``ws`` does not have one value per node, ``prefix`` starts
            no token, or ``max_nodes`` < 1.
    """
    import graphviz

    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
    values = _node_values(trie, ws)
    start = trie.prefix_to_node(prefix)
    if start is None:
        raise ValueError(f"no token starts with the prefix {prefix!r}")
    nodes, edges, num_left_out = _breadth_first(trie, start, max_nodes)
    graph = graphviz.Digraph(comment=f"token-character trie below {prefix!r}")
    graph.attr(rankdir="LR")
    for node in nodes:
        _draw_node(graph, trie, node, values)
    for parent, child, label in edges:
        graph.edge(str(parent), str(child), label=graphviz.escape(label))
    if num_left_out:
        graph.node("left_out", f"... {num_left_out} more nodes", shape="plaintext")
    return graph


def _node_values(trie: DrawableTrie, ws) -> np.ndarray | None:
    if ws is None:
        return None
    if isinstance(ws, torch.Tensor):
        ws = ws.detach().cpu().numpy()
    values = np.asarray(ws, dtype=np.float64)
    if values.shape != (trie.num_nodes,):
        raise ValueError(
            f"ws must hold one value per node, shape ({trie.num_nodes},), got {values.shape}; "
            "pass e.g. trie.weight_sum(token_weights)"
        )
    return values


def _breadth_first(trie: DrawableTrie, start: int, max_nodes: int):
    nodes, edges = [start], []
    queue = deque([start])
    num_left_out = 0
    while queue:
        node = queue.popleft()
        for key, child in trie.children[node].items():
            if len(nodes) >= max_nodes:
                num_left_out += 1 + _num_descendants(trie, child)
                continue
            label = _edge_label(key)
            nodes.append(child)
            edges.append((node, child, label))
            queue.append(child)
    return nodes, edges, num_left_out


def _edge_label(key) -> str:
    if isinstance(key, tuple) and key[0] is None:
        return f"end of token {key[1]}"
    return repr(bytes([key]))[2:-1] if isinstance(key, int) else repr(key)


def _num_descendants(trie: DrawableTrie, node: int) -> int:
    stack, count = [node], 0
    while stack:
        children = trie.children[stack.pop()].values()
        count += len(children)
        stack.extend(children)
    return count


def _draw_node(graph, trie: DrawableTrie, node: int, values) -> None:
    import graphviz

    token_id = trie.leaf_token_id(node)
    if token_id is None:
        text, shape = repr(trie.node2prefix[node]), "circle"
    else:
        text, shape = f"token {token_id}", "doublecircle"
    if values is not None:
        text += f"\n{values[node]:.4g}"
    graph.node(str(node), graphviz.escape(text), shape=shape)
