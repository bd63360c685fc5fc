"""Graphviz drawings of the trie: content, sub-tries, limits, and rendering without ``dot``."""

from __future__ import annotations

import graphviz
import numpy as np
import pytest

from genlm_backend.tokenization.token import make_tokens
from genlm_backend.trie import TokenCharacterTrie

VOCAB = make_tokens([b"a", b"ab", b"abc", b"b", b"ab", b"\n"])


def test_whole_trie_with_weights():
    trie = TokenCharacterTrie(VOCAB)
    sums = trie.weight_sum(np.array([0.1, 0.2, 0.3, 0.15, 0.05, 0.2]))
    graph = trie.visualize(sums)
    source = graph.source
    assert isinstance(graph, graphviz.Digraph)
    assert source.count("doublecircle") == len(VOCAB)  # one leaf per token
    assert f"{trie.root} [label=\"b''\n1\"" in source
    node_ab = trie.prefix_to_node(b"ab")
    assert f"{node_ab} [label=\"b'ab'\n0.55\"" in source
    assert "end of token 4" in source and "end of token 1" in source
    assert 'label="\\\\n"' in source  # the newline byte is shown escaped, not as a line break
    assert "more nodes" not in source


def test_sub_trie_below_a_prefix_and_node_limit():
    trie = TokenCharacterTrie(VOCAB)
    below_ab = trie.visualize(prefix=b"ab").source
    assert "b'abc'" in below_ab and "b'b'" not in below_ab and "token 0" not in below_ab
    limited = trie.visualize(max_nodes=3).source
    num_drawn = sum(1 for line in limited.splitlines() if "shape=circle" in line)
    num_drawn += limited.count("shape=doublecircle")
    assert num_drawn == 3
    assert f"... {trie.num_nodes - 3} more nodes" in limited


def test_bad_arguments():
    trie = TokenCharacterTrie(VOCAB)
    with pytest.raises(ValueError, match="one value per node"):
        trie.visualize(np.zeros(len(VOCAB)))
    with pytest.raises(ValueError, match="no token starts with"):
        trie.visualize(prefix=b"zz")
    with pytest.raises(ValueError, match="max_nodes"):
        trie.visualize(max_nodes=0)


def test_building_needs_no_dot_but_rendering_says_it_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `dot` on PATH
    graph = TokenCharacterTrie(VOCAB).visualize()
    assert "digraph" in graph.source
    with pytest.raises(graphviz.ExecutableNotFound, match="dot"):
        graph.pipe(format="svg")


def test_non_byte_letters_are_drawn_by_repr():
    pytest.importorskip("graphviz")

    class EndOfSequence:
        def __iter__(self):
            return iter([self])

        def __repr__(self):
            return "EOS"

    eos = EndOfSequence()
    trie = TokenCharacterTrie([*VOCAB, eos])
    source = trie.visualize(np.asarray(trie.weight_sum(np.ones(len(VOCAB) + 1)))).source
    assert "label=EOS" in source and source.count("doublecircle") == len(VOCAB) + 1
    assert 'label="(EOS,)"' in trie.visualize(prefix=[eos]).source
