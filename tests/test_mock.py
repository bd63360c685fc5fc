"""MockAsyncLM: a deterministic, context-sensitive stand-in model."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from genlm_backend.llm import MockAsyncLM

VOCAB = [bytes([b]) for b in range(ord("A"), ord("A") + 20)]


def logprobs(context, **kwargs) -> torch.Tensor:
    return MockAsyncLM(byte_vocab=VOCAB, **kwargs).next_token_logprobs_sync(context)


def test_same_context_same_output_across_instances():
    torch.testing.assert_close(logprobs([1, 2, 3]), logprobs([1, 2, 3]), atol=0, rtol=0)


def test_same_output_in_another_process():
    script = (
        "from genlm_backend.llm import MockAsyncLM;"
        f"llm = MockAsyncLM(byte_vocab={VOCAB!r});"
        "print(repr(llm.next_token_logprobs_sync([1, 2, 3]).tolist()))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    expected = logprobs([1, 2, 3])
    torch.testing.assert_close(torch.tensor(eval(out.stdout)), expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "a, b",
    [
        ([2], [0, 1]),  # would collide under a naive concatenation of digits
        ([1, 2], [12]),
        ([0], [0, 0]),  # zero-padding must not collide
        ([1], [1, 1]),
    ],
)
def test_distinct_contexts_get_distinct_outputs(a, b):
    assert not torch.allclose(logprobs(a), logprobs(b), atol=1e-3)


def test_permutations_get_distinct_outputs():
    rows = [logprobs(list(p)) for p in itertools.permutations([1, 2, 3])]
    for x, y in itertools.combinations(rows, 2):
        assert not torch.allclose(x, y, atol=1e-3)


def test_output_is_normalized_and_unaffected_by_batching():
    llm = MockAsyncLM(byte_vocab=VOCAB, batch_size=2)
    contexts = [[i, j] for i in range(4) for j in range(3)]
    batch = llm.batch_next_token_logprobs_sync(contexts)
    assert batch.shape == (12, len(VOCAB)) and batch.dtype == torch.float32
    torch.testing.assert_close(torch.logsumexp(batch, -1), torch.zeros(12), atol=1e-5, rtol=0)
    for row, context in zip(batch, contexts):
        torch.testing.assert_close(row, logprobs(context), atol=1e-6, rtol=0)


def test_needs_a_tokenizer_or_a_vocabulary():
    with pytest.raises(ValueError, match="tokenizer or a byte_vocab"):
        MockAsyncLM()


def test_mock_over_a_real_tokenizer(gpt2_tokenizer):
    llm = MockAsyncLM(gpt2_tokenizer)
    assert llm.vocab_size == len(gpt2_tokenizer)
    ids = gpt2_tokenizer.encode("Hello world")
    row = llm.next_token_logprobs_sync(ids)
    assert row.shape == (len(gpt2_tokenizer),)
    assert abs(torch.logsumexp(row, -1).item()) < 1e-5
