"""Scoring: nested prefixes in one forward pass, and continuation_logprobs, against plain uncached forwards.

Reference: ``log_softmax(model(context).logits[-1])`` in fp32 for each prefix,
one at a time, no cache, gathered at the continuation's tokens. Tolerance:
1e-4 absolute on log-probabilities (the transformers backend's, float32).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from genlm_backend.cache.plan import LevelPolicy
from genlm_backend.llm import MockAsyncLM
from genlm_backend.llm.hf import AsyncTransformer
from tests.hf_reference import ATOL, assert_matches_reference, reference

EVERY_PIECE_A_LEVEL = LevelPolicy(min_shared_tokens=1, min_unshared_tokens=1)


def expected_scores(model, context, continuation, vocab_size) -> torch.Tensor:
    return torch.tensor(
        [
            reference(model, list(context) + list(continuation[:i]))[:vocab_size][token].item()
            for i, token in enumerate(continuation)
        ]
    )


def tokens(rng: random.Random, n: int, vocab: int = 2000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("levels", [False, True])
async def test_the_prefixes_of_a_continuation_cost_one_forward_pass(tiny_model, levels):
    model, tokenizer = tiny_model
    llm = AsyncTransformer(model, tokenizer)
    rng = random.Random(0)
    prompt, continuation = tokens(rng, 40), tokens(rng, 12)
    if levels:  # the prompt cached and read in place as a shared level
        llm.runner.level_policy = EVERY_PIECE_A_LEVEL
        await llm.next_token_logprobs(prompt)
    before = llm.stats.num_tokens_computed
    contexts = [prompt + continuation[:i] for i in range(len(continuation))]
    rows = await llm.batch_next_token_logprobs(contexts)
    longest = len(prompt) + len(continuation) - 1
    computed = llm.stats.num_tokens_computed - before
    # behind the cached prompt (whose own row is in the output cache) only the continuation runs
    assert computed == (longest - len(prompt) if levels else longest)
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)


async def test_nested_contexts_mixed_with_particle_steps_match(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    rng = random.Random(1)
    base = tokens(rng, 20)
    await llm.next_token_logprobs(base)
    contexts = [base + [t] for t in range(5)]  # one-token steps
    contexts += [base[:7] + tokens(rng, 9)[:i] for i in range(1, 9)]  # a branch's prefixes
    rng.shuffle(contexts)
    rows = await llm.batch_next_token_logprobs(contexts)
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)


async def test_continuation_logprobs_equal_gathered_uncached_rows(tiny_model):
    model, tokenizer = tiny_model
    llm = AsyncTransformer(model, tokenizer)
    rng = random.Random(2)
    context, continuation = tokens(rng, 15), tokens(rng, 10)
    scores = await llm.continuation_logprobs(context, continuation)
    assert scores.dtype == torch.float32 and scores.shape == (len(continuation),)
    expected = expected_scores(model, context, continuation, llm.vocab_size)
    torch.testing.assert_close(scores, expected, atol=ATOL, rtol=0)
    again = llm.continuation_logprobs_sync(context, continuation)  # all cached now
    torch.testing.assert_close(again, expected, atol=ATOL, rtol=0)


async def test_continuations_of_one_context_share_its_keys_and_values(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    rng = random.Random(3)
    context = tokens(rng, 40)
    continuations = [[k, *tokens(rng, 5 + k)] for k in range(4)]  # differ at their first token
    scores = await llm.batch_continuation_logprobs(context, continuations)
    # the context once, then per continuation its context's last token and its own tokens
    assert llm.stats.num_tokens_computed == len(context) + sum(1 + len(c) for c in continuations)
    for continuation, found in zip(continuations, scores):
        expected = expected_scores(model, context, continuation, llm.vocab_size)
        torch.testing.assert_close(found, expected, atol=ATOL, rtol=0)


async def test_concurrent_scoring_and_next_token_requests_batch_together(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    llm = AsyncTransformer(model, tokenizer)
    rng = random.Random(4)
    pairs = [(tokens(rng, 6 + k), tokens(rng, 3 + k)) for k in range(3)]
    particles = [tokens(rng, 9) for _ in range(3)]
    results = await asyncio.gather(
        *(llm.continuation_logprobs(c, x) for c, x in pairs),
        *(llm.next_token_logprobs(p) for p in particles),
    )
    for (context, continuation), found in zip(pairs, results[:3]):
        expected = expected_scores(model, context, continuation, llm.vocab_size)
        torch.testing.assert_close(found, expected, atol=ATOL, rtol=0)
    for particle, row in zip(particles, results[3:]):
        assert_matches_reference(llm, particle, row)
    assert llm.stats.num_batches == 1


async def test_bad_scoring_input_fails_that_caller_only(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    llm = AsyncTransformer(model, tokenizer)
    good = llm.continuation_logprobs([1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match="continuation"):
        await llm.continuation_logprobs([1, 2, 3], [])
    with pytest.raises(ValueError, match=r"continuations\[1\]"):
        await llm.batch_continuation_logprobs([1, 2], [[3], [llm.vocab_size]])
    with pytest.raises(ValueError, match="context"):
        llm.continuation_logprobs_sync([], [1])
    with pytest.raises(TypeError, match="continuation"):
        await llm.continuation_logprobs([1], [2.5])
    too_long = [1] * (llm.max_context_length or 0)
    with pytest.raises(ValueError, match="more than the model's context"):
        await llm.continuation_logprobs(too_long, [1])
    expected = expected_scores(model, [1, 2, 3], [4, 5], llm.vocab_size)
    torch.testing.assert_close(await good, expected, atol=ATOL, rtol=0)
    assert llm.stats.num_requests == 1  # rejected calls count nothing


async def test_the_mock_scores_from_its_rows():
    llm = MockAsyncLM(byte_vocab=[bytes([i]) for i in range(64)])
    context, continuation = [1, 2, 3], [4, 5, 6]
    scores = await llm.continuation_logprobs(context, continuation)
    rows = [llm.next_token_logprobs_sync(context + continuation[:i]) for i in range(3)]
    assert scores.tolist() == [rows[i][t].item() for i, t in enumerate(continuation)]
    (again,) = llm.batch_continuation_logprobs_sync(context, [continuation])
    assert again.tolist() == scores.tolist()


async def test_scoring_passes_hold_a_bounded_number_of_logits(tiny_llama):
    """Past ``max_score_reads`` positions, continuations are cut into pieces scored in turn."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    driver = llm.runner.driver
    driver.max_score_reads = 3
    reads = []
    run_pass = driver.executor.run_pass

    def counting_pass(plan, namespace):
        reads.append(len(plan.reads))
        return run_pass(plan, namespace)

    driver.executor.run_pass = counting_pass
    rng = random.Random(5)
    context = tokens(rng, 9)
    continuations = [tokens(rng, n) for n in (1, 5, 7)]
    scores = await llm.batch_continuation_logprobs(context, continuations)
    for continuation, found in zip(continuations, scores):
        expected = expected_scores(model, context, continuation, llm.vocab_size)
        torch.testing.assert_close(found, expected, atol=ATOL, rtol=0)
    assert max(reads) <= 3 and sum(reads) == 1 + 5 + 7  # every position read once, 3 at most a pass
    assert llm.stats.num_batches == 1  # one batch of the batcher, several passes of the model
