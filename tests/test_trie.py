"""Every trie implementation against a brute-force reference over real and random vocabularies.

The reference for a node with byte prefix ``p`` reduces, naively, the weights
of all tokens whose bytes start with ``p`` (``math.fsum`` for sums, so it is
correctly rounded). Tolerances: float64 numpy trie: max exact, sum and
logsumexp within 1e-12 relative (summation order); float32 torch trie: max
exact (of the float32-rounded weights), sum and logsumexp within 1e-5 relative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_backend.tokenization import Token, decode_vocab
from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from tests.trie_reference import brute_force, token_ids_by_prefix


def random_weights(num_tokens: int, seed: int, num_rows: int = 2):
    """(probabilities, log-probabilities) ``[num_rows, V]``; ~1 in 7 tokens gets probability 0."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(num_rows, num_tokens))
    logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    logprobs[rng.random((num_rows, num_tokens)) < 1 / 7] = -np.inf
    return np.exp(logprobs), logprobs


def as_tokens(byte_strings) -> list[Token]:
    return [Token(token_id, bytes(data)) for token_id, data in enumerate(byte_strings)]


def check_against_brute_force(vocab, nodes=None, seed=0, num_rows=2):
    """Compare both implementations with the reference on ``nodes`` (None: every internal node)."""
    vocab = as_tokens(vocab)
    sequential = TokenCharacterTrie(vocab)
    parallel = ParallelTokenCharacterTrie(vocab, device="cpu")
    members = token_ids_by_prefix(list(map(bytes, vocab)))
    internal = range(sequential.num_internal_nodes)
    assert sorted(members) == sorted(sequential.node2prefix[node] for node in internal)
    if nodes is None:
        nodes = np.arange(sequential.num_internal_nodes)
    prefixes = [sequential.node2prefix[node] for node in nodes]
    probs, logprobs = random_weights(len(vocab), seed, num_rows)
    seq_sum = sequential.batch_weight_sum(probs)
    seq_max = sequential.batch_weight_max(logprobs)
    seq_lse = sequential.batch_weight_logsumexp(logprobs)
    par_sum = parallel.batch_weight_sum(torch.from_numpy(probs))
    par_max = parallel.batch_weight_max(torch.from_numpy(logprobs))
    par_lse = parallel.batch_weight_logsumexp(torch.from_numpy(logprobs))
    assert all(type(result) is np.ndarray for result in (par_sum, par_max, par_lse))
    for row in range(len(probs)):
        ref_sum, _, _ = brute_force(members, prefixes, probs[row])
        _, ref_max, ref_lse = brute_force(members, prefixes, logprobs[row])
        np.testing.assert_array_equal(seq_max[row, nodes], ref_max)
        np.testing.assert_allclose(seq_sum[row, nodes], ref_sum, rtol=1e-12, atol=0)
        np.testing.assert_allclose(seq_lse[row, nodes], ref_lse, rtol=1e-12, atol=1e-12)
        # rounding to float32 is monotonic, so the max of rounded weights is the rounded max
        np.testing.assert_array_equal(par_max[row, nodes], ref_max.astype(np.float32))
        np.testing.assert_allclose(par_sum[row, nodes], ref_sum, rtol=1e-5, atol=0)
        np.testing.assert_allclose(par_lse[row, nodes], ref_lse, rtol=1e-5, atol=1e-6)
    leaves = sequential.token_id_to_leaf
    np.testing.assert_array_equal(seq_sum[:, leaves], probs)
    np.testing.assert_array_equal(par_max[:, leaves], logprobs.astype(np.float32))
    return sequential


def check_structure(trie: TokenCharacterTrie) -> None:
    """Walking ``children`` byte by byte from the root reaches each token's leaf."""
    for token_id, token in enumerate(trie.decode):
        node = trie.root
        for byte in token:
            node = trie.children[node][byte]
        assert trie.children[node][(None, token_id)] == trie.token_id_to_leaf[token_id]
        assert trie.leaf_token_id(trie.token_id_to_leaf[token_id]) == token_id
        assert trie.prefix_to_node(token) == node


# ---------------------------------------------------------------------- real vocabularies


def test_gpt2_vocabulary_every_node(gpt2_tokenizer):
    vocab, _ = decode_vocab(gpt2_tokenizer)
    trie = check_against_brute_force(vocab, num_rows=1)
    check_structure(trie)


def test_smollm2_vocabulary_every_node(smollm2_tokenizer):
    vocab, _ = decode_vocab(smollm2_tokenizer)
    check_against_brute_force(vocab, seed=1, num_rows=1)


@pytest.mark.slow
def test_qwen3_vocabulary_sampled_nodes(load_test_tokenizer):
    vocab, _ = decode_vocab(load_test_tokenizer("qwen3"))
    num_internal = len({token[:i] for token in vocab for i in range(len(token) + 1)})
    rng = np.random.default_rng(2)
    nodes = np.concatenate([np.arange(300), rng.choice(num_internal, 5000, replace=False)])
    check_against_brute_force(vocab, nodes=nodes, seed=2, num_rows=1)


# ---------------------------------------------------------------------- edge cases


def test_identical_and_empty_tokens_keep_their_own_leaves():
    vocab = as_tokens([b"ab", b"ab", b"", b"a", b"", b"abc"])
    trie = check_against_brute_force(vocab)
    check_structure(trie)
    assert len(set(trie.token_id_to_leaf.tolist())) == len(vocab)
    ws = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    sums = trie.weight_sum(ws)
    assert sums[trie.root] == 63.0
    assert sums[trie.prefix_to_node(b"ab")] == 35.0
    assert sums[trie.token_id_to_leaf[1]] == 2.0


def test_max_of_negative_and_all_minus_inf_weights():
    vocab = as_tokens([b"a", b"ab", b"b"])
    ws = np.array([-3.0, -1.0, -np.inf])
    for trie in (TokenCharacterTrie(vocab), ParallelTokenCharacterTrie(vocab, device="cpu")):
        maxima = np.asarray(trie.weight_max(ws))
        assert maxima[trie.root] == -1.0
        assert maxima[trie.prefix_to_node(b"a")] == -1.0
        assert maxima[trie.prefix_to_node(b"b")] == -np.inf
        lse = np.asarray(trie.weight_logsumexp(ws))
        assert lse[trie.prefix_to_node(b"b")] == -np.inf
        assert lse[trie.root] == pytest.approx(np.logaddexp(-3.0, -1.0), rel=1e-6)


def test_single_token_vocabulary():
    for vocab in ([b""], [b"xyz"]):
        trie = check_against_brute_force(vocab)
        assert trie.weight_max(np.array([-2.5]))[trie.root] == -2.5
        assert trie.word2leaf == {(vocab[0], 0): trie.token_id_to_leaf[0]}


def test_logsumexp_does_not_underflow_where_exp_would():
    vocab = as_tokens([b"a", b"ab", b"b"])
    ws = np.array([-1000.0, -1001.0, -2000.0])
    for trie in (TokenCharacterTrie(vocab), ParallelTokenCharacterTrie(vocab, device="cpu")):
        lse = np.asarray(trie.weight_logsumexp(ws))
        expected = -1000.0 + math.log1p(math.exp(-1.0))
        assert lse[trie.prefix_to_node(b"a")] == pytest.approx(expected, rel=1e-6)
        assert lse[trie.prefix_to_node(b"b")] == -2000.0


# short byte strings over {a, b, c}: many shared prefixes, duplicates and empty tokens
vocabularies = st.lists(
    st.binary(max_size=4).map(lambda b: bytes(x % 3 + 97 for x in b)), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vocab=vocabularies, seed=st.integers(0, 2**16))
def test_random_small_vocabularies(vocab, seed):
    trie = check_against_brute_force(vocab, seed=seed)
    check_structure(trie)


def vocabulary_like_a_model_s(num_tokens: int, seed: int) -> list[Token]:
    """Every single byte, then random words over ten letters (many shared prefixes and some
    duplicates), as many tokens as a model's vocabulary: built here, so a machine without
    the npm tokenizers (the GPU session's) runs the test too."""
    rng = np.random.default_rng(seed)
    words = [bytes(rng.integers(97, 107, size=rng.integers(2, 9))) for _ in range(num_tokens - 256)]
    return as_tokens([bytes([byte]) for byte in range(256)] + words)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parallel_on_cuda_matches_sequential():
    vocab = vocabulary_like_a_model_s(50257, seed=3)
    sequential = TokenCharacterTrie(vocab)
    parallel = ParallelTokenCharacterTrie(vocab, device="cuda", output="tensor")
    probs, logprobs = random_weights(len(vocab), seed=3, num_rows=8)
    got_sum = parallel.batch_weight_sum(torch.from_numpy(probs).cuda())
    got_max = parallel.batch_weight_max(torch.from_numpy(logprobs).cuda())
    assert got_sum.device.type == "cuda"
    np.testing.assert_allclose(got_sum.cpu().numpy(), sequential.batch_weight_sum(probs), rtol=1e-5)
    np.testing.assert_array_equal(
        got_max.cpu().numpy(), sequential.batch_weight_max(logprobs.astype(np.float32))
    )
