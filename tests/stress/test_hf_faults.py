"""Faults: a model forward that raises on chosen batches, and bad input mixed into good batches.

A forward pre-hook raises a chosen exception (a plain ``RuntimeError`` or a
``torch.OutOfMemoryError`` as the CUDA allocator raises it) in chosen
forwards. A subclass of AsyncTransformer records which contexts each batch
held, so the test knows exactly which callers shared a failed batch. Checks:
exactly those callers get the error (the very exception raised), every other
caller gets the exact result (uncached forward, 1e-4), the caches hold
nothing of a failed forward, and later calls for the failed contexts succeed.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.runner import Request
from tests.stress.helpers import (
    ForwardFaults,
    ReferenceChecker,
    fresh_contexts,
    out_of_memory_error,
    settle,
)

pytestmark = pytest.mark.stress


class RecordingTransformer(AsyncTransformer):
    """Records each batch's contexts and the number of the first forward it ran."""

    def __init__(self, *args, faults: ForwardFaults, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults
        self.batches: list[tuple[list[tuple[int, ...]], int]] = []
        run = self.runner.run

        def recorded_run(requests):
            contexts = [request.context for request in requests]
            self.batches.append((contexts, self.faults.num_forwards))
            return run(requests)

        self.runner.run = recorded_run

    def errors_of_failed_forwards(
        self, planned: dict[int, BaseException]
    ) -> dict[tuple[int, ...], BaseException]:
        """Each context of a batch that ran a forward numbered in ``planned`` -> that
        forward's error (a batch stops at its first failed forward; a context's
        latest batch counts)."""
        ends = [first for _, first in self.batches[1:]] + [self.faults.num_forwards]
        errors = {}
        for (contexts, first), end in zip(self.batches, ends):
            failed = [n for n in range(first, end) if n in planned]
            for context in contexts:
                if failed:
                    errors[context] = planned[failed[0]]
                else:
                    errors.pop(context, None)
        return errors


@pytest.fixture
def faulty_llm(llama_copy):
    model, reference_model, tokenizer = llama_copy
    with ForwardFaults(model) as faults:
        llm = RecordingTransformer(model, tokenizer, batch_size=8, faults=faults)
        yield llm, ReferenceChecker(reference_model, llm.vocab_size)
        llm.close()


async def test_failed_batches_fail_exactly_their_callers_and_leave_no_cache_entries(
    faulty_llm, stress_figures
):
    llm, checker = faulty_llm
    figures = stress_figures("hf tiny-llama")
    contexts = fresh_contexts(random.Random(0), llm.vocab_size, 32)  # fresh: one forward per batch
    errors = {1: RuntimeError("injected forward failure"), 3: out_of_memory_error()}
    llm.faults.plan(errors)
    kv_before = llm.kv_cache.stats
    outcomes = await settle([asyncio.create_task(llm.next_token_logprobs(c)) for c in contexts])

    assert llm.faults.num_forwards == len(llm.batches) == 4
    failed_batches = [set(llm.batches[n][0]) for n in errors]
    for context, outcome in zip(contexts, outcomes):
        error = next(
            (errors[n] for n, batch in zip(errors, failed_batches) if context in batch), None
        )
        if error is None:
            checker.add(context, outcome)
            assert Request(None, context) in llm.output_cache
        else:
            assert outcome is error
            assert Request(None, context) not in llm.output_cache
            figures.failed_as_intended += 1
    kv_after = llm.kv_cache.stats
    assert kv_after.num_blocks - kv_before.num_blocks == 2  # one block per successful forward
    assert kv_after.num_entries - kv_before.num_entries == 16
    assert llm.batcher_stats.num_failed_batches == 2

    for context, row in zip(
        contexts, await asyncio.gather(*map(llm.next_token_logprobs, contexts))
    ):
        checker.add(context, row)  # the failed ones are recomputed, the others served from cache
    checker.flush()
    figures.served = checker.num_checked
    assert figures.failed_as_intended == 16


async def test_random_faults_under_particle_load(faulty_llm, stress_figures):
    llm, checker = faulty_llm
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(3)
    contexts = fresh_contexts(rng, llm.vocab_size, 40)
    planned = {
        n: out_of_memory_error() if n % 2 else RuntimeError(f"fault {n}")
        for n in rng.sample(range(60), 8)
    }
    llm.faults.plan(planned)
    calls = []
    for _ in range(6):  # particles extend, branch and copy each other
        calls = [rng.choice(contexts) + (rng.randrange(llm.vocab_size),) for _ in range(60)]
        outcomes = await settle([asyncio.create_task(llm.next_token_logprobs(c)) for c in calls])
        failed = llm.errors_of_failed_forwards(planned)
        for context, outcome in zip(calls, outcomes):
            if context in failed and isinstance(outcome, Exception):
                assert outcome is failed[context]  # the very exception its forward raised
                figures.failed_as_intended += 1
            else:
                assert context not in failed, f"{context} shared a failed batch but got {outcome!r}"
                checker.add(context, outcome)
        contexts = [c for c in calls if c not in failed] or contexts
    assert figures.failed_as_intended > 0
    retry = await asyncio.gather(*map(llm.next_token_logprobs, calls))  # no fault is planned now
    for context, row in zip(calls, retry):
        checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked
    assert llm.batcher_stats.num_pending == 0 and llm.batcher_stats.num_inflight == 0


async def test_failure_in_the_second_forward_of_a_batch_leaves_only_exact_entries(
    faulty_llm, stress_figures
):
    llm, checker = faulty_llm
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(5)
    base = fresh_contexts(rng, llm.vocab_size, 1)[0]
    checker.add(base, await llm.next_token_logprobs(base))
    # One extension by a single token (first forward) and fresh contexts (second forward).
    batch = [base + (7,)] + fresh_contexts(rng, llm.vocab_size, 3)
    llm.faults.plan({1: out_of_memory_error()})
    outcomes = await settle([asyncio.create_task(llm.next_token_logprobs(c)) for c in batch])
    assert llm.faults.num_forwards == 2 and len(llm.batches) == 2
    assert all(isinstance(o, torch.OutOfMemoryError) for o in outcomes)
    assert all(Request(None, c) not in llm.output_cache for c in batch)
    figures.failed_as_intended += len(batch)
    # Keys/values of the completed first forward may be reused: they must be exact.
    for context, row in zip(batch, await asyncio.gather(*map(llm.next_token_logprobs, batch))):
        checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked


async def test_out_of_memory_in_a_sync_call_fails_only_that_call(faulty_llm, stress_figures):
    llm, checker = faulty_llm
    figures = stress_figures("hf tiny-llama")
    contexts = fresh_contexts(random.Random(6), llm.vocab_size, 3)
    llm.faults.plan({0: out_of_memory_error()})
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        llm.batch_next_token_logprobs_sync(contexts)
    figures.failed_as_intended += len(contexts)
    rows = llm.batch_next_token_logprobs_sync(contexts)
    for context, row in zip(contexts, rows):
        checker.add(context, row)
    checker.add(contexts[0], await llm.next_token_logprobs(contexts[0]))
    checker.flush()
    figures.served = checker.num_checked
