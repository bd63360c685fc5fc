"""Lifecycle: several event loops, sync calls inside a loop, interrupted runs, closing with work pending.

The same AsyncTransformer serves several ``asyncio.run`` calls in turn, and
sync calls made from inside a running loop while async calls are pending. A
run that ends while a batch computes (as when a notebook cell is
interrupted) leaves the backend usable by the next run. ``aclose()`` with
requests computing and queued fails them all at once with
``BackendClosedError`` (a ``BatcherClosedError``), without waiting for the
computing batch and without blocking the event loop; every later use raises
``BackendClosedError``. Results are checked against uncached forwards (1e-4).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from genlm_backend.errors import BackendClosedError, BatcherClosedError
from genlm_backend.llm.hf import AsyncTransformer
from tests.stress.helpers import WAIT_S, ForwardGate, ReferenceChecker, fresh_contexts, settle

pytestmark = pytest.mark.stress

HOLD_S = WAIT_S  # longest a gated forward waits: a hang guard, never reached by a correct build


@pytest.fixture
def llm_parts(llama_copy):
    """(a fresh AsyncTransformer over the private model copy, its model, a reference checker)."""
    model, reference_model, tokenizer = llama_copy
    # Steps in a worker thread, as a server runs them: a held forward pass leaves the loop free.
    llm = AsyncTransformer(model, tokenizer, batch_size=8, compute_in_loop=False)
    yield llm, model, ReferenceChecker(reference_model, llm.vocab_size)
    llm.close()


async def gathered(llm, contexts):
    return await asyncio.gather(*map(llm.next_token_logprobs, contexts))


def test_several_asyncio_runs_share_one_backend(llm_parts, stress_figures):
    llm, _, checker = llm_parts
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(0)
    history = fresh_contexts(rng, llm.vocab_size, 8)
    for run in range(4):
        contexts = [rng.choice(history) + (rng.randrange(llm.vocab_size),) for _ in range(30)]
        computed_before = llm.stats.num_tokens_computed
        for context, row in zip(contexts, asyncio.run(gathered(llm, contexts))):
            checker.add(context, row)
        if run > 0:
            # Each new context extends one the previous run computed: the keys and
            # values left by that run (on another event loop) serve this one, so
            # each costs exactly its last token.
            num_new = len(set(contexts) - set(history))
            assert llm.stats.num_tokens_computed - computed_before == num_new
        history = contexts
        extra = history[0] + (1,)
        checker.add(extra, llm.next_token_logprobs_sync(extra))  # between runs, no loop
    checker.flush()
    figures.served = checker.num_checked


async def test_sync_calls_inside_a_running_loop_while_async_calls_are_pending(
    llm_parts, stress_figures
):
    llm, _, checker = llm_parts
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(1)
    pending_contexts = fresh_contexts(rng, llm.vocab_size, 24)
    tasks = [asyncio.create_task(llm.next_token_logprobs(c)) for c in pending_contexts]
    await asyncio.sleep(0)  # queued, maybe computing
    sync_contexts = fresh_contexts(rng, llm.vocab_size, 5) + pending_contexts[:3]
    checker.add(sync_contexts[0], llm.next_token_logprobs_sync(sync_contexts[0]))
    for context, row in zip(sync_contexts, llm.batch_next_token_logprobs_sync(sync_contexts)):
        checker.add(context, row)
    for context, outcome in zip(pending_contexts, await settle(tasks)):
        checker.add(context, outcome)
    checker.flush()
    figures.served = checker.num_checked
    stats = llm.batcher_stats
    assert stats.num_pending == 0 and stats.num_inflight == 0


def test_a_run_ended_while_its_batch_computes_leaves_the_backend_usable(llm_parts, stress_figures):
    llm, model, checker = llm_parts
    figures = stress_figures("hf tiny-llama")
    contexts = fresh_contexts(random.Random(2), llm.vocab_size, 20)

    async def interrupted_run(gate: ForwardGate) -> None:
        gate.hold_next()
        for context in contexts:
            asyncio.create_task(llm.next_token_logprobs(context))  # noqa: RUF006 (abandoned on purpose)
        await gate.wait_entered()
        # Returning now, as an interrupted cell does: asyncio.run cancels every task left.

    with ForwardGate(model, wait_s=HOLD_S) as gate:
        asyncio.run(interrupted_run(gate))
        figures.cancelled += len(contexts)
        gate.release()  # the abandoned batch finishes in its worker thread
        rows = asyncio.run(gathered(llm, contexts))
    assert not gate.timed_out
    for context, row in zip(contexts, rows):
        checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked


async def test_aclose_fails_computing_and_queued_requests_at_once(llm_parts, stress_figures):
    llm, model, _ = llm_parts
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(3)
    computing, queued = (
        fresh_contexts(rng, llm.vocab_size, 8),
        fresh_contexts(rng, llm.vocab_size, 30),
    )
    with ForwardGate(model, wait_s=HOLD_S) as gate:
        gate.hold_next()
        tasks = [asyncio.create_task(llm.next_token_logprobs(c)) for c in computing]
        await gate.wait_entered()
        tasks += [asyncio.create_task(llm.next_token_logprobs(c)) for c in queued]
        await asyncio.sleep(0)
        closing = asyncio.create_task(llm.aclose())
        outcomes = await settle(tasks)  # while the forward is still held
        assert not gate.timed_out, "callers were failed only after the computing batch ended"
        assert all(isinstance(o, BackendClosedError) for o in outcomes), outcomes
        figures.failed_as_intended += len(outcomes)
        gate.release()
        await asyncio.wait_for(closing, HOLD_S)
    assert not gate.timed_out
    assert llm.is_closed and llm.batcher_stats is None  # nothing left waiting
    await assert_closed(llm, computing[0])
    figures.failed_as_intended += 4


async def assert_closed(llm, context) -> None:
    with pytest.raises(BackendClosedError, match="closed"):
        await llm.next_token_logprobs(context)
    with pytest.raises(BackendClosedError, match="closed"):
        await llm.batch_next_token_logprobs([context])
    with pytest.raises(BackendClosedError, match="closed"):
        llm.next_token_logprobs_sync(context)
    with pytest.raises(BackendClosedError, match="closed"):
        llm.batch_next_token_logprobs_sync([context])
    await llm.aclose()  # idempotent
    llm.close()


def test_aclose_in_a_later_run_and_use_in_the_next(llm_parts, stress_figures):
    llm, _, checker = llm_parts
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(4)
    first = fresh_contexts(rng, llm.vocab_size, 10)
    for context, row in zip(first, asyncio.run(gathered(llm, first))):
        checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked

    async def close_with_requests_queued() -> list:
        tasks = [
            asyncio.create_task(llm.next_token_logprobs(c))
            for c in fresh_contexts(rng, llm.vocab_size, 10)
        ]
        await asyncio.sleep(0)
        await llm.aclose()
        return await settle(tasks)

    outcomes = asyncio.run(close_with_requests_queued())
    # A request that finished before aclose() took effect keeps its result; none may hang.
    closed = [o for o in outcomes if isinstance(o, BatcherClosedError)]
    assert closed and all(isinstance(o, BackendClosedError) for o in closed)
    figures.failed_as_intended += len(closed)
    asyncio.run(assert_closed(llm, first[0]))
    figures.failed_as_intended += 4


async def test_reset_async_queries_fails_pending_requests_and_keeps_serving(
    llm_parts, stress_figures
):
    llm, model, checker = llm_parts
    figures = stress_figures("hf tiny-llama")
    rng = random.Random(5)
    computing, queued = (
        fresh_contexts(rng, llm.vocab_size, 8),
        fresh_contexts(rng, llm.vocab_size, 12),
    )
    with ForwardGate(model, wait_s=HOLD_S) as gate:
        gate.hold_next()
        tasks = [asyncio.create_task(llm.next_token_logprobs(c)) for c in computing + queued]
        await gate.wait_entered()
        await llm.reset_async_queries()
        outcomes = await settle(tasks)
        assert all(isinstance(o, BatcherClosedError) for o in outcomes), outcomes
        assert not any(isinstance(o, BackendClosedError) for o in outcomes)
        figures.failed_as_intended += len(outcomes)
        gate.release()
        after = await gathered(llm, computing + queued)
    assert not gate.timed_out
    for context, row in zip(computing + queued, after):
        checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked
