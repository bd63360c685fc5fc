"""Bad vocabularies and bad weights raise clear errors; every accepted weight form gives the same
result, for every trie implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_backend.tokenization import Token
from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie

VOCAB = [Token(0, b"a"), Token(1, b"ab"), Token(2, b"b")]
TRIES = [TokenCharacterTrie(VOCAB), ParallelTokenCharacterTrie(VOCAB, device="cpu")]
IDS = ["sequential", "parallel"]


@pytest.mark.parametrize("trie", TRIES, ids=IDS)
@pytest.mark.parametrize(
    "ws, error, match",
    [
        (np.zeros(2), ValueError, "3 tokens"),
        (np.zeros((1, 3)), ValueError, "shape"),
        (np.array([0.1, np.nan, 0.2]), ValueError, "NaN"),
        (np.array([1j, 2, 3]), TypeError, "real"),
        (torch.tensor([1j, 2, 3]), TypeError, "real"),
        (["a", "b", "c"], TypeError, "real"),
        ([0.1, [0.2], 0.3], ValueError, "rectangular"),
        ("abc", TypeError, "sequence of numbers"),
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


@pytest.mark.parametrize("trie", TRIES, ids=IDS)
@pytest.mark.parametrize(
    "ws",
    [
        [3, 1, 2],
        (3.0, 1.0, 2.0),
        np.array([3, 1, 2], dtype=np.int64),
        torch.tensor([3, 1, 2]),
        torch.tensor([3.0, 1.0, 2.0], dtype=torch.float16),
    ],
    ids=["list", "tuple", "int64-array", "int-tensor", "float16-tensor"],
)
def test_integer_and_sequence_weights_equal_float_weights(trie, ws):
    want = np.array([3.0, 1.0, 2.0])
    for method in ("weight_sum", "weight_max", "weight_logsumexp"):
        expected = np.asarray(getattr(trie, method)(want))
        np.testing.assert_array_equal(np.asarray(getattr(trie, method)(ws)), expected)


@pytest.mark.parametrize("trie", TRIES, ids=IDS)
def test_batch_accepts_matrices_lists_of_rows_and_nested_lists_alike(trie):
    rows = [[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]
    from_matrix = np.asarray(trie.batch_weight_sum(torch.tensor(rows, dtype=torch.float64)))
    from_rows = np.asarray(trie.batch_weight_sum([np.array(row) for row in rows]))
    from_nested = np.asarray(trie.batch_weight_sum(rows))
    assert from_matrix.shape == (2, trie.num_nodes)
    np.testing.assert_array_equal(from_matrix, from_rows)
    np.testing.assert_array_equal(from_matrix, from_nested)
    np.testing.assert_allclose(from_matrix[:, trie.root], np.ones(2), rtol=1e-6, atol=0)


def test_parallel_results_are_float32_numpy_or_tensors_on_request():
    as_numpy = ParallelTokenCharacterTrie(VOCAB, device="cpu")
    as_tensor = ParallelTokenCharacterTrie(VOCAB, device="cpu", output="tensor")
    ws = torch.tensor([0.1, 0.2, 0.7])
    got_numpy, got_tensor = as_numpy.weight_sum(ws), as_tensor.weight_sum(ws)
    assert type(got_numpy) is np.ndarray and got_numpy.dtype == np.float32
    assert isinstance(got_tensor, torch.Tensor) and got_tensor.dtype == torch.float32
    np.testing.assert_array_equal(got_numpy, got_tensor.numpy())
    assert as_numpy.device == "cpu" and as_numpy._preprocess_ws([ws]).device.type == "cpu"
    with pytest.raises(ValueError, match="output"):
        ParallelTokenCharacterTrie(VOCAB, device="cpu", output="list")


@pytest.mark.parametrize("device", ["invalid", "tpu:7", 3.5])
def test_bad_devices_raise_value_error(device):
    with pytest.raises(ValueError, match="Invalid device"):
        ParallelTokenCharacterTrie(VOCAB, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_raises_value_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        ParallelTokenCharacterTrie(VOCAB, device="cuda")


def test_sequential_trie_takes_tensors_of_any_dtype_and_device():
    trie = TokenCharacterTrie(VOCAB)
    got = trie.weight_sum(torch.tensor([0.1, 0.2, 0.7], dtype=torch.float32))
    assert got.dtype == np.float64 and got[trie.root] == pytest.approx(1.0, rel=1e-7)
    assert type(trie._preprocess_ws(torch.zeros(3))) is np.ndarray


@pytest.mark.parametrize(
    "decode, error, match",
    [
        ([], ValueError, "empty"),
        (b"abc", TypeError, "sequence of tokens"),
        ([Token(0, b"a"), 3], TypeError, r"decode\[1\] \(int\) is not iterable"),
        ([Token(0, b"a"), [[1, 2]]], TypeError, "unhashable letter"),
        ([Token(0, b"a"), (1, 2), [1, 2]], TypeError, "hashable"),
        ([Token(0, b"a"), Token(1, b"b"), Token(0, b"a")], ValueError, "Duplicate word"),
        ([Token(0, b"a"), "ab", "ab"], ValueError, r"Duplicate word in vocabulary: 'ab'"),
    ],
)
def test_bad_vocabularies(decode, error, match):
    for cls in (TokenCharacterTrie, ParallelTokenCharacterTrie):
        with pytest.raises(error, match=match):
            cls(decode)


def test_plain_bytes_are_deprecated_and_duplicates_rejected():
    with pytest.warns(DeprecationWarning, match="plain bytes") as record:
        trie = TokenCharacterTrie([Token(0, b"a"), b"b"])
    with pytest.warns(DeprecationWarning) as from_parallel:
        ParallelTokenCharacterTrie([b"a"], device="cpu")
    assert record[0].filename == from_parallel[0].filename == __file__  # the caller's line
    assert trie.word2leaf == {(b"a", 0): trie.token_id_to_leaf[0], b"b": trie.token_id_to_leaf[1]}
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="Duplicate word"):
        TokenCharacterTrie([b"a", b"a"])
