"""Tries over vocabularies with non-bytes items (genlm-control's EndOfSequence, strings, tuples of
letters): every node against a brute-force reference over letter tuples, and the lookup tables
(word2leaf, leaf2word, idx_to_leaf, children, node2prefix)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_backend.tokenization import Token
from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie


class EndOfSequence:
    """Like genlm-control's: iterates to itself, equal by type name."""

    def __init__(self, name: str = "EOS"):
        self.name = name

    def __iter__(self):
        return iter([self])

    def __eq__(self, other):
        return isinstance(other, EndOfSequence) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return self.name


EOS, EOT = EndOfSequence("EOS"), EndOfSequence("EOT")


def letters(item) -> tuple:
    return tuple(bytes(item)) if isinstance(item, bytes) else tuple(item)


def expected_key(item):
    if isinstance(item, Token):
        return (item.byte_string, item.token_id)
    return item


def check_against_brute_force(vocab, ws: np.ndarray) -> TokenCharacterTrie:
    """Both tries, every node: value == reduction over the items whose letters start there."""
    sequential = TokenCharacterTrie(vocab)
    parallel = ParallelTokenCharacterTrie(vocab, device="cpu")
    words = [letters(item) for item in vocab]
    sums, maxima = sequential.weight_sum(ws), sequential.weight_max(ws)
    par_sums, par_maxima = parallel.weight_sum(ws), parallel.weight_max(ws)
    for node, prefix in sequential.node2prefix.items():
        prefix = letters(prefix)
        if node in sequential.leaf2word:
            members = [sequential.leaf_token_id(node)]
        else:
            members = [i for i, word in enumerate(words) if word[: len(prefix)] == prefix]
        assert members, prefix
        want_sum, want_max = math.fsum(ws[members]), ws[members].max()
        assert sums[node] == pytest.approx(want_sum, rel=1e-12, abs=0)
        assert maxima[node] == want_max
        assert par_sums[node] == pytest.approx(want_sum, rel=1e-5, abs=0)
        assert par_maxima[node] == np.float32(want_max)
    return sequential


def check_tables(trie: TokenCharacterTrie, vocab) -> None:
    """Walking ``children`` letter by letter reaches each item's leaf; tables agree."""
    assert trie.idx_to_leaf.dtype == np.int32 and trie.idx_to_leaf.shape == (len(vocab), 2)
    assert len(trie.children) == trie.num_nodes
    for position, item in enumerate(vocab):
        node = trie.root
        for letter in letters(item):
            node = trie.children[node][letter]
        assert trie.prefix_to_node(letters(item)) == node
        leaf = trie.children[node][(None, position)]
        assert tuple(trie.idx_to_leaf[position]) == (position, leaf)
        assert trie.word2leaf[expected_key(item)] == leaf
        assert trie.leaf2word[leaf] == expected_key(item)
        assert letters(trie.node2prefix[leaf]) == letters(item)
    assert len(trie.word2leaf) == len(trie.leaf2word) == len(vocab)


def test_genlm_control_style_vocabulary_with_end_of_sequence():
    vocab = [Token(0, b"a"), Token(1, b"ab"), Token(2, b"ab"), Token(3, b""), EOS]
    ws = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    trie = check_against_brute_force(vocab, ws)
    check_tables(trie, vocab)
    eos_node = trie.children[trie.root][EOS]
    assert trie.node2prefix[eos_node] == (EOS,)
    assert trie.weight_sum(ws)[eos_node] == 0.25
    assert trie.word2leaf[EOS] == trie.idx_to_leaf[4, 1]
    assert trie.prefix_to_node([EOT]) is None and trie.prefix_to_node(b"zz") is None


def test_string_and_tuple_items():
    vocab = ["ab", "a", (97, EOS), ("a", "b", EOT), Token(4, b"ab")]
    trie = check_against_brute_force(vocab, np.array([1.0, 2.0, 4.0, 8.0, 16.0]))
    check_tables(trie, vocab)
    # the byte letter 97 and the character "a" are different letters
    assert {97, "a"} <= set(trie.children[trie.root])
    assert trie.weight_sum(np.array([1.0, 2.0, 4.0, 8.0, 16.0]))[trie.prefix_to_node([97])] == 20.0


byte_words = st.lists(
    st.binary(max_size=3).map(lambda b: bytes(x % 3 + 97 for x in b)), max_size=25
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=byte_words,
    extras=st.sets(st.sampled_from(["eos", "eot", "str", "tuple"])),
    seed=st.integers(0, 2**16),
)
def test_random_mixed_vocabularies(words, extras, seed):
    vocab = [Token(i, w) for i, w in enumerate(words)]
    vocab += [{"eos": EOS, "eot": EOT, "str": "ab", "tuple": (98, EOT)}[e] for e in sorted(extras)]
    if not vocab:
        vocab = [EOS]
    rng = np.random.default_rng(seed)
    ws = rng.random(len(vocab))
    ws[rng.random(len(vocab)) < 0.2] = 0.0
    trie = check_against_brute_force(vocab, ws)
    check_tables(trie, vocab)


def test_all_token_vocabulary_tables():
    vocab = [Token(5, b"test"), Token(10, b"test"), Token(2, b"te")]
    trie = TokenCharacterTrie(vocab)
    check_tables(trie, vocab)
    assert trie.word2leaf[(b"test", 5)] != trie.word2leaf[(b"test", 10)]
    assert (
        trie.node2prefix[trie.root] == b""
        and trie.node2prefix[trie.prefix_to_node(b"tes")] == b"tes"
    )
    assert trie.decode is vocab
