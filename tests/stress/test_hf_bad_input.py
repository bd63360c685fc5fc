"""Bad input mixed into good batches: each bad call fails alone with its own clear error.

Every case of the input contract (empty, negative id, id past the
vocabulary, non-integer element, text instead of ids, wrong tensor rank or
dtype, longer than the model's context) is raised among concurrent good
calls, in the async, batch and sync entry points. The bad call raises its
``TypeError``/``ValueError`` naming the problem; the good calls of the same
``gather`` get exact results (uncached forward, 1e-4); a rejected call
counts no request and leaves nothing pending.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from genlm_backend.llm.hf import AsyncTransformer
from tests.stress.helpers import ReferenceChecker, bad_cases, fresh_contexts

pytestmark = pytest.mark.stress


@pytest.fixture(scope="module")
def shared_llm(llama_copy):
    model, _, tokenizer = llama_copy
    llm = AsyncTransformer(model, tokenizer, batch_size=8)
    yield llm
    llm.close()


@pytest.fixture
def llm_and_checker(shared_llm, llama_copy):
    return shared_llm, ReferenceChecker(llama_copy[1], shared_llm.vocab_size)


async def test_bad_calls_fail_alone_among_concurrent_good_calls(llm_and_checker, stress_figures):
    llm, checker = llm_and_checker
    figures = stress_figures("hf tiny-llama")
    cases = bad_cases(llm.vocab_size, llm.max_context_length)
    rng = random.Random(0)
    good = fresh_contexts(rng, llm.vocab_size, 5 * len(cases))
    calls = [("good", context) for context in good] + [
        (name, case[0]) for name, case in cases.items()
    ]
    rng.shuffle(calls)
    requests_before = llm.stats.num_requests
    outcomes = await asyncio.gather(
        *(llm.next_token_logprobs(ids) for _, ids in calls), return_exceptions=True
    )
    for (name, ids), outcome in zip(calls, outcomes):
        if name == "good":
            checker.add(ids, outcome)
        else:
            _, error_type, phrase = cases[name]
            assert isinstance(outcome, error_type), (name, outcome)
            assert outcome.__class__ is error_type, (name, outcome)
            with pytest.raises(error_type, match=phrase):
                raise outcome
            figures.failed_as_intended += 1
    checker.flush()
    assert llm.stats.num_requests - requests_before == len(good)
    stats = llm.batcher_stats
    assert stats.num_pending == 0 and stats.num_inflight == 0
    figures.served += checker.num_checked


async def test_a_bad_context_rejects_its_batch_call_before_any_work(
    llm_and_checker, stress_figures
):
    llm, checker = llm_and_checker
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(1)
    for name, (bad, error_type, phrase) in bad_cases(
        llm.vocab_size, llm.max_context_length
    ).items():
        batch = fresh_contexts(rng, llm.vocab_size, 3)
        singles = fresh_contexts(rng, llm.vocab_size, 4)
        stats_before = llm.stats
        rejected, *rows = await asyncio.gather(
            llm.batch_next_token_logprobs([*batch[:2], bad, batch[2]]),
            *map(llm.next_token_logprobs, singles),
            return_exceptions=True,
        )
        assert isinstance(rejected, error_type), (name, rejected)
        with pytest.raises(error_type, match=phrase):
            raise rejected
        with pytest.raises(error_type, match=phrase):
            llm.batch_next_token_logprobs_sync([batch[0], bad])
        with pytest.raises(error_type, match=phrase):
            llm.next_token_logprobs_sync(bad)
        figures.failed_as_intended += 3
        for context, row in zip(singles, rows):
            checker.add(context, row)
        # Only the singles were counted and computed: the rejected calls did no work.
        assert llm.stats.num_requests - stats_before.num_requests == len(singles)
        assert llm.stats.num_contexts_computed - stats_before.num_contexts_computed == len(singles)
    checker.add(batch[0], llm.next_token_logprobs_sync(batch[0]))
    checker.flush()
    figures.served += checker.num_checked
