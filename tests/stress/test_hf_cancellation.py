"""Cancellation: 20% of AsyncTransformer calls cancelled before queueing, while queued, or while computing.

Each round holds one batch inside the model's forward (a gate in a forward
pre-hook), queues more calls behind it, then cancels a random fifth of all
calls: those of the computing batch while it computes, the others either
before their task ever ran or while they wait in the queue. Some contexts
are requested by several callers, so a cancelled caller may share its
request with a live one. After the gate opens:

* every live caller gets the exact result (uncached forward, 1e-4);
* a queued request whose callers were all cancelled is never computed;
* the computing batch finishes for its live callers and its rows are cached,
  even when all the callers of a row were cancelled;
* nothing stays pending or in flight in the batcher.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.runner import Request
from tests.stress.helpers import ForwardGate, ReferenceChecker, fresh_contexts, settle

pytestmark = pytest.mark.stress

BATCH_SIZE = 16
NUM_ROUNDS = 4
NUM_QUEUED = 84  # calls queued behind the computing batch, per round
CANCEL_FRACTION = 0.2


def queued_contexts(
    rng: random.Random, vocab: int, computing: list, history: list
) -> list[tuple[int, ...]]:
    """Calls waiting behind the computing batch: fresh contexts, repeats, extensions of earlier ones."""
    fresh = fresh_contexts(rng, vocab, NUM_QUEUED // 2)
    calls = []
    for _ in range(NUM_QUEUED):
        kind = rng.random()
        if kind < 0.5:
            calls.append(rng.choice(fresh))
        elif kind < 0.6:
            calls.append(rng.choice(computing))  # joins the computing request
        else:
            calls.append(rng.choice(history) + (rng.randrange(vocab),))
    return calls


def choose_cancellations(
    rng: random.Random, num_computing: int
) -> tuple[set[int], set[int], set[int]]:
    """Indices to cancel while computing, before queueing and while queued (20% of all calls)."""
    num_calls = num_computing + NUM_QUEUED
    chosen = rng.sample(range(num_calls), round(CANCEL_FRACTION * num_calls))
    computing = {i for i in chosen if i < num_computing}
    rest = [i - num_computing for i in chosen if i >= num_computing]
    before = set(rest[: len(rest) // 2])
    return computing, before, set(rest) - before


async def cancellation_round(llm, gate, rng, history, checker) -> tuple[int, int]:
    """One round; returns (calls served, calls cancelled)."""
    vocab = llm.vocab_size
    computing = fresh_contexts(rng, vocab, BATCH_SIZE)
    queued = queued_contexts(rng, vocab, computing, history)
    cancel_computing, cancel_before, cancel_queued = choose_cancellations(rng, len(computing))
    computed_before, requests_before = llm.stats.num_contexts_computed, llm.stats.num_requests

    gate.hold_next()
    computing_tasks = [asyncio.create_task(llm.next_token_logprobs(c)) for c in computing]
    await gate.wait_entered()  # the first BATCH_SIZE distinct calls fill one batch
    queued_tasks = [asyncio.create_task(llm.next_token_logprobs(c)) for c in queued]
    for i in cancel_before:
        queued_tasks[i].cancel()  # before its first step: its call, queued, is dropped
    await asyncio.sleep(0)  # every other task makes its first step and queues
    cancelled = [computing_tasks[i] for i in cancel_computing] + [
        queued_tasks[i] for i in cancel_queued
    ]
    for task in cancelled:
        task.cancel()
    await asyncio.wait(cancelled)

    live_queued = {c for i, c in enumerate(queued) if i not in cancel_before | cancel_queued}
    waiting = live_queued - set(computing)
    assert llm.batcher_stats.num_inflight == BATCH_SIZE
    assert llm.batcher_stats.num_pending == len(waiting)
    gate.release()
    outcomes = await settle(computing_tasks + queued_tasks)

    cancelled_ids = cancel_computing | {len(computing) + i for i in cancel_before | cancel_queued}
    for i, (context, outcome) in enumerate(zip(computing + queued, outcomes)):
        if i in cancelled_ids:
            assert isinstance(outcome, asyncio.CancelledError), (i, outcome)
        else:
            checker.add(context, outcome)
    never_computed = {c for c in queued if c not in live_queued and c not in computing}
    assert all(Request(None, c) not in llm.output_cache for c in never_computed)
    assert all(Request(None, c) in llm.output_cache for c in computing)
    assert llm.stats.num_contexts_computed - computed_before == BATCH_SIZE + len(waiting)
    made = len(computing) + len(queued)  # each call is counted as it is made, cancelled or not
    assert llm.stats.num_requests - requests_before == made
    assert llm.batcher_stats.num_pending == 0 and llm.batcher_stats.num_inflight == 0
    history.extend(computing + sorted(live_queued))
    return len(outcomes) - len(cancelled_ids), len(cancelled_ids)


async def test_random_fifth_cancelled_at_every_stage(llama_copy, stress_figures):
    model, reference_model, tokenizer = llama_copy
    figures = stress_figures("hf tiny-llama")
    llm = AsyncTransformer(
        model, tokenizer, batch_size=BATCH_SIZE, output_cache_bytes=1 << 30, compute_in_loop=False
    )
    checker = ReferenceChecker(reference_model, llm.vocab_size)
    rng = random.Random(0)
    history = fresh_contexts(rng, llm.vocab_size, 8)
    with ForwardGate(model) as gate:
        for _ in range(NUM_ROUNDS):
            served, cancelled = await cancellation_round(llm, gate, rng, history, checker)
            figures.served += served
            figures.cancelled += cancelled
    checker.flush()
    assert checker.num_checked == figures.served
    assert figures.cancelled == NUM_ROUNDS * round(CANCEL_FRACTION * (BATCH_SIZE + NUM_QUEUED))
    # Later calls on the same backend are unaffected.
    after = fresh_contexts(rng, llm.vocab_size, 24)
    for context, row in zip(after, await asyncio.gather(*map(llm.next_token_logprobs, after))):
        checker.add(context, row)
    checker.flush()
    await llm.aclose()


async def test_cancelling_every_caller_of_a_computing_batch_leaves_the_backend_serving(
    llama_copy, stress_figures
):
    model, reference_model, tokenizer = llama_copy
    figures = stress_figures("hf tiny-llama")
    llm = AsyncTransformer(model, tokenizer, batch_size=8, compute_in_loop=False)
    checker = ReferenceChecker(reference_model, llm.vocab_size)
    contexts = fresh_contexts(random.Random(1), llm.vocab_size, 8)
    with ForwardGate(model) as gate:
        gate.hold_next()
        tasks = [asyncio.create_task(llm.next_token_logprobs(c)) for c in contexts]
        await gate.wait_entered()
        for task in tasks:
            task.cancel()
        outcomes = await settle(tasks)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
        figures.cancelled += len(tasks)
        # The abandoned batch still holds the model; a new call waits for it, then runs.
        follow_up = asyncio.create_task(llm.next_token_logprobs(contexts[0] + (5,)))
        gate.release()
        checker.add(contexts[0] + (5,), (await settle([follow_up]))[0])
    again = await asyncio.gather(*map(llm.next_token_logprobs, contexts))  # from the output cache
    for context, row in zip(contexts, again):
        checker.add(context, row)
    checker.flush()
    figures.served += checker.num_checked
    assert llm.batcher_stats.num_pending == 0 and llm.batcher_stats.num_inflight == 0
    assert llm.stats.num_contexts_computed == len(contexts) + 1
    await llm.aclose()
