"""Bad vocabularies and bad weights raise clear errors, for every trie implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie

VOCAB = [b"a", b"ab", b"b"]
TRIES = [TokenCharacterTrie(VOCAB), ParallelTokenCharacterTrie(VOCAB, device="cpu")]
IDS = ["sequential", "parallel"]


@pytest.mark.parametrize("trie", TRIES, ids=IDS)
@pytest.mark.parametrize(
    "ws, error, match",
    [
        (np.zeros(2), ValueError, "3 tokens"),
        (np.zeros((1, 3)), ValueError, "shape"),
        (np.array([0.1, np.nan, 0.2]), ValueError, "NaN"),
        (np.array([1, 2, 3]), TypeError, "floating"),
        (torch.tensor([1, 2, 3]), TypeError, "floating"),
        (torch.tensor([True, False, True]), TypeError, "floating"),
        ([0.1, 0.2, 0.3], TypeError, "array|tensor"),
        (torch.zeros(3, device="meta"), ValueError, "meta"),
    ],
)
def test_bad_single_weights(trie, ws, error, match):
    for method in (trie.weight_sum, trie.weight_max, trie.weight_logsumexp):
        with pytest.raises(error, match=match):
            method(ws)


@pytest.mark.parametrize("trie", TRIES, ids=IDS)
@pytest.mark.parametrize(
    "ws_batch, error, match",
    [
        (np.zeros(3), ValueError, "shape"),
        (np.zeros((2, 4)), ValueError, "3 tokens"),
        ([], ValueError, "empty"),
        ([np.zeros(3), np.zeros(2)], ValueError, "3 tokens"),
        (torch.tensor([[0.0, float("nan"), 0.0]]), ValueError, r"NaN \(first at index \[0, 1\]\)"),
    ],
)
def test_bad_batches(trie, ws_batch, error, match):
    for method in (trie.batch_weight_sum, trie.batch_weight_max, trie.batch_weight_logsumexp):
        with pytest.raises(error, match=match):
            method(ws_batch)


def test_batch_accepts_a_list_of_rows_and_a_matrix_alike():
    trie = ParallelTokenCharacterTrie(VOCAB, device="cpu")
    rows = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]], dtype=torch.float64)
    from_matrix = trie.batch_weight_sum(rows)
    from_list = trie.batch_weight_sum(list(rows))
    assert from_matrix.dtype == torch.float32 and from_matrix.shape == (2, trie.num_nodes)
    torch.testing.assert_close(from_matrix, from_list, rtol=0, atol=0)
    torch.testing.assert_close(from_matrix[:, trie.root], torch.ones(2), rtol=1e-6, atol=0)


def test_sequential_trie_takes_cpu_tensors():
    trie = TokenCharacterTrie(VOCAB)
    got = trie.weight_sum(torch.tensor([0.1, 0.2, 0.7], dtype=torch.float32))
    assert got.dtype == np.float64 and got[trie.root] == pytest.approx(1.0, rel=1e-7)


@pytest.mark.parametrize(
    "decode, error, match",
    [
        ([], ValueError, "empty"),
        (b"abc", TypeError, "sequence of bytes"),
        ([b"a", "b"], TypeError, r"decode\[1\] is str"),
        ([b"a", 3], TypeError, r"decode\[1\] is int"),
    ],
)
def test_bad_vocabularies(decode, error, match):
    for cls in (TokenCharacterTrie, ParallelTokenCharacterTrie):
        with pytest.raises(error, match=match):
            cls(decode)
