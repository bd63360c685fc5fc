"""The engine: waiting calls, the flush points, the budget, the step, settling, failures, threads.

Through ``MockAsyncLM`` (every value compared with a fresh uncached mock) with
its runner wrapped by :class:`Recording`, which records each batch and may
block or fail on demand; ``AsyncTransformer`` on a tiny model where the
budget counts what a runner computes. Ordering is driven by events (the
recording's gate and futures), never by sleeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import random
import threading
import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.batching import BatchingConfig, CpuThreads, WaitingCalls
from genlm_backend.errors import BackendClosedError, BatcherClosedError, BatcherWorkerDiedError
from genlm_backend.llm import MockAsyncLM
from genlm_backend.llm.base import DEFAULT_CHUNK_TOKENS
from genlm_backend.llm.engine import DEFAULT_MAX_BATCH_TOKENS

VOCAB = [bytes([b]) for b in range(32)]
TOL = 1e-6
LONG_S = 60.0  # a timeout no test waits for
BOUND_S = 60.0  # a hang guard on each await: never reached by a correct build


def bounded(awaitable):
    return asyncio.wait_for(awaitable, BOUND_S)


def reference(context) -> torch.Tensor:
    return MockAsyncLM(byte_vocab=VOCAB, output_cache_bytes=0).next_token_logprobs_sync(
        list(context)
    )


class Recording:
    """Wraps an LM's runner: records each batch's contexts and thread; may block or fail."""

    def __init__(self, llm, cost=None):
        self.inner = llm.runner
        llm.runner = self
        self.batches: list[list[tuple[int, ...]]] = []
        self.threads: list[threading.Thread] = []
        self.cost = cost
        self.gate: threading.Event | None = None
        self.started: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fail_on: tuple[int, ...] | None = None

    def block(self) -> None:
        """The next batches wait for :attr:`gate`; :attr:`started` is set when the first begins."""
        self.loop = asyncio.get_running_loop()
        self.gate = threading.Event()
        self.started = self.loop.create_future()

    def run(self, requests):
        self.batches.append([request.context for request in requests])
        self.threads.append(threading.current_thread())
        if self.started is not None and self.loop is not None:
            started, self.started = self.started, None
            self.loop.call_soon_threadsafe(started.set_result, self.batches[-1])
        if self.gate is not None and not self.gate.wait(BOUND_S):
            raise TimeoutError("the test never opened the gate")
        if self.fail_on is not None and self.fail_on in self.batches[-1]:
            raise RuntimeError(f"cannot compute {self.fail_on}")
        return self.inner.run(requests)

    def request_tokens(self, request) -> int:
        if self.cost is not None:
            return self.cost(request.context)
        return self.inner.request_tokens(request)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_llm(**options) -> MockAsyncLM:
    return MockAsyncLM(byte_vocab=VOCAB, **options)


def check_rows(rows, contexts) -> None:
    assert len(rows) == len(contexts)
    for row, context in zip(rows, contexts):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize(
    ("options", "field", "error_type"),
    [
        ({"max_batch_size": 0}, "max_batch_size", ValueError),
        ({"max_batch_size": -3}, "max_batch_size", ValueError),
        ({"max_batch_size": 2.0}, "max_batch_size", TypeError),
        ({"max_batch_size": True}, "max_batch_size", TypeError),
        ({"max_batch_tokens": 0}, "max_batch_tokens", ValueError),
        ({"max_batch_tokens": "64"}, "max_batch_tokens", TypeError),
        ({"timeout_s": -0.1}, "timeout_s", ValueError),
        ({"timeout_s": float("nan")}, "timeout_s", ValueError),
        ({"timeout_s": float("inf")}, "timeout_s", ValueError),
        ({"timeout_s": "0.1"}, "timeout_s", TypeError),
        ({"flush_on_idle": 1}, "flush_on_idle", TypeError),
        ({"rounds": "yes"}, "rounds", TypeError),
    ],
)
def test_rejects_a_bad_field_naming_it(options, field, error_type):
    with pytest.raises(error_type, match=rf"^{field} must be") as error:
        BatchingConfig(**options)
    assert repr(next(iter(options.values()))) in str(error.value)


def test_defaults_have_no_count_and_no_budget():
    config = BatchingConfig()
    assert (
        config.max_batch_size,
        config.max_batch_tokens,
        config.timeout_s,
        config.flush_on_idle,
    ) == (
        None,
        None,
        0.02,
        True,
    )


def test_is_frozen_and_normalizes_timeout_to_float():
    config = BatchingConfig(timeout_s=1)
    assert isinstance(config.timeout_s, float) and config.timeout_s == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 3


def test_without_limits_one_step_takes_everything():
    assert BatchingConfig().next_batch_length([5] * 1000) == 1000


def test_token_budget_cuts_in_arrival_order():
    config = BatchingConfig(max_batch_tokens=10)
    # 4 + 4 fit, + 4 would be 12 > 10; the 1 behind the third 4 waits for the next step
    assert config.next_batch_length([4, 4, 4, 1]) == 2
    assert config.next_batch_length([50, 1]) == 1  # over the budget: alone


def test_count_and_budget_both_bound_a_step():
    config = BatchingConfig(max_batch_size=3, max_batch_tokens=100)
    assert config.next_batch_length([1] * 10) == 3  # count binds
    assert config.next_batch_length([60, 60, 1]) == 1  # budget binds


# ---------------------------------------------------------------- flush points and budget


async def test_a_burst_of_calls_is_one_step_by_default():
    llm = make_llm()
    assert llm.batching == BatchingConfig(
        max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS, chunk_tokens=DEFAULT_CHUNK_TOKENS
    )
    recording = Recording(llm)
    contexts = [(i % 32, i // 32) for i in range(150)]
    rows = await bounded(asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts)))
    assert recording.batches == [contexts]
    check_rows(rows, contexts)
    await llm.aclose()


async def test_lock_step_particles_make_one_step_each():
    llm = make_llm()
    recording = Recording(llm)

    async def particle(i: int) -> None:
        context = [i]
        for _ in range(4):
            await llm.next_token_logprobs(context)
            context.append(i)

    await bounded(asyncio.gather(*(particle(i) for i in range(8))))
    assert [len(batch) for batch in recording.batches] == [8, 8, 8, 8]
    await llm.aclose()


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_the_budget_cuts_steps_in_arrival_order_by_the_runner_s_count(mode):
    llm = make_llm(max_batch_tokens=6)
    recording = Recording(llm)  # the mock counts context lengths
    contexts = [(1, 2, 3), (4, 5, 6), (7, 8), (9, 10, 11, 12), (13,)]
    if mode == "async":
        rows = await bounded(llm.batch_next_token_logprobs(contexts))
    else:
        rows = llm.batch_next_token_logprobs_sync(contexts)
    assert recording.batches == [contexts[:2], contexts[2:4], contexts[4:]]  # 3+3 | 2+4 | 1
    check_rows(rows, contexts)
    await llm.aclose()


async def test_costs_are_looked_up_only_when_the_contexts_lengths_exceed_the_budget():
    """A request costs at most its context's length: contexts whose lengths fit are one step
    without a cost lookup each (a KV tree lookup per request for the transformers runner)."""
    llm = make_llm(max_batch_tokens=6)
    looked_up: list[tuple[int, ...]] = []
    recording = Recording(llm, cost=lambda context: looked_up.append(context) or len(context))
    fits = [(1, 2), (3, 4), (5, 6)]
    check_rows(await bounded(llm.batch_next_token_logprobs(fits)), fits)
    assert recording.batches == [fits] and looked_up == []
    over = [(1, 2, 3), (4, 5, 6), (7,)]
    check_rows(await bounded(llm.batch_next_token_logprobs(over)), over)
    assert recording.batches[1:] == [over[:2], over[2:]] and looked_up[:2] == over[:2]
    await llm.aclose()


async def test_a_request_over_the_budget_goes_alone_and_later_calls_follow_in_order():
    llm = make_llm(max_batch_tokens=4)
    recording = Recording(llm, cost=len)
    long, short = (1,) * 9, [(2,), (3,), (4,), (5,), (6,)]
    big = asyncio.ensure_future(llm.batch_next_token_logprobs([long, short[0]]))
    await asyncio.sleep(0)  # big's task makes its call (a coroutine's call is made as it runs)
    singles = [llm.next_token_logprobs(c) for c in short[1:]]  # each made at the call
    check_rows(await bounded(big), [long, short[0]])
    check_rows(await bounded(asyncio.gather(*singles)), short[1:])
    assert recording.batches == [[long], short[:4], short[4:]]
    await llm.aclose()


async def test_an_explicit_batch_size_caps_each_step():
    llm = make_llm(batch_size=4, max_batch_tokens=None, timeout_s=LONG_S)
    recording = Recording(llm)
    contexts = [(i,) for i in range(10)]
    check_rows(await bounded(llm.batch_next_token_logprobs(contexts)), contexts)
    assert recording.batches == [contexts[:4], contexts[4:8], contexts[8:]]
    await llm.aclose()


async def test_without_the_idle_flush_the_timeout_takes_a_lone_call():
    llm = make_llm(timeout_s=0.0)
    llm.batching = llm.engine.config = BatchingConfig(timeout_s=0.0, flush_on_idle=False)
    recording = Recording(llm)
    check_rows([await bounded(llm.next_token_logprobs([5]))], [(5,)])
    assert recording.batches == [[(5,)]]
    await llm.aclose()


async def test_a_full_count_takes_the_calls_without_waiting_for_the_timeout():
    llm = make_llm(batch_size=3, timeout_s=LONG_S)
    llm.engine.config = BatchingConfig(max_batch_size=3, timeout_s=LONG_S, flush_on_idle=False)
    recording = Recording(llm)
    rows = await bounded(asyncio.gather(*(llm.next_token_logprobs([i]) for i in range(3))))
    check_rows(rows, [(0,), (1,), (2,)])
    assert recording.batches == [[(0,), (1,), (2,)]]
    await llm.aclose()


def test_a_failing_cost_fails_its_batch_only_and_the_engine_goes_on():
    """Costs are looked up when the contexts' lengths exceed the budget (else all fit)."""
    llm = make_llm(max_batch_tokens=10)
    long = (13,) * 11

    def cost(context):
        if context == long:
            raise KeyError("no cost for (13, ...)")
        return 1

    Recording(llm, cost=cost)

    async def main():
        bad = asyncio.ensure_future(llm.next_token_logprobs(list(long)))
        with pytest.raises(KeyError, match="no cost"):
            await bounded(bad)
        return await bounded(llm.next_token_logprobs([7]))

    check_rows([asyncio.run(main())], [(7,)])
    llm.close()


# ---------------------------------------------------------------- deduplication and settling


@pytest.mark.parametrize("output_cache_bytes", [0, 1 << 20])
async def test_identical_requests_of_one_step_are_computed_once(output_cache_bytes):
    llm = make_llm(output_cache_bytes=output_cache_bytes)
    recording = Recording(llm)
    contexts = [[1, 2], [3], [1, 2], [3], [1, 2]]
    rows = await bounded(
        asyncio.gather(
            *(llm.next_token_logprobs(c) for c in contexts),
            llm.batch_next_token_logprobs([[3], [1, 2], [3]]),
        )
    )
    assert recording.batches == [[(1, 2), (3,)]]
    check_rows(rows[:5], contexts)
    check_rows(list(rows[5]), [[3], [1, 2], [3]])
    assert llm.batcher_stats.num_deduplicated == 6
    await llm.aclose()


@pytest.mark.parametrize("output_cache_bytes", [0, 1 << 20])
async def test_a_request_arriving_while_its_context_computes_gets_that_computation_s_row(
    output_cache_bytes,
):
    llm = make_llm(output_cache_bytes=output_cache_bytes)
    llm.engine.compute_in_loop = False
    recording = Recording(llm)
    recording.block()
    first = asyncio.ensure_future(llm.next_token_logprobs([4, 4]))
    await bounded(recording.started)
    second = asyncio.ensure_future(llm.batch_next_token_logprobs([[4, 4], [4, 5]]))
    await asyncio.sleep(0)  # the call is made (ordering only)
    assert llm.batcher_stats.num_pending == 1  # (4, 5): (4, 4) is computing
    recording.gate.set()
    rows = await bounded(asyncio.gather(first, second))
    check_rows([rows[0], *rows[1]], [(4, 4), (4, 4), (4, 5)])
    assert recording.batches == [[(4, 4)], [(4, 5)]]
    assert llm.stats.num_output_cache_hits == 0
    await llm.aclose()


# ---------------------------------------------------------------- a particle's call


async def test_a_particle_s_call_is_queued_at_the_call_and_is_its_own_future():
    llm = make_llm()
    recording = Recording(llm)
    call = llm.next_token_logprobs([5, 1])
    assert llm.batcher_stats.num_requests == 1  # queued before any await
    assert asyncio.isfuture(call) and asyncio.iscoroutine(call)
    assert asyncio.ensure_future(call) is call  # gather and wait_for take it with no task
    check_rows([await bounded(call)], [(5, 1)])
    check_rows([await bounded(call)], [(5, 1)])  # a future: awaited again, the same row
    assert recording.batches == [[(5, 1)]]
    await llm.aclose()


async def test_tasks_and_task_groups_take_a_particle_s_call_as_a_coroutine():
    llm = make_llm()
    task = asyncio.create_task(llm.next_token_logprobs([4]))
    async with asyncio.TaskGroup() as group:
        grouped = group.create_task(llm.next_token_logprobs([4, 2]))
    check_rows([await bounded(task), grouped.result()], [(4,), (4, 2)])
    await llm.aclose()


def test_with_no_loop_running_a_particle_s_call_is_a_coroutine_queued_when_run():
    llm = make_llm()
    call = llm.next_token_logprobs([3])
    assert inspect.iscoroutine(call) and llm.batcher_stats is None  # no queue yet
    check_rows([asyncio.run(call)], [(3,)])
    llm.close()


async def test_a_refused_particle_s_call_raises_where_awaited_for_its_caller_only():
    llm = make_llm()
    recording = Recording(llm)
    refused = llm.next_token_logprobs([1, 999])  # nothing raised at the call
    kept = llm.next_token_logprobs([1, 2])
    outcomes = await bounded(asyncio.gather(refused, kept, return_exceptions=True))
    assert isinstance(outcomes[0], ValueError)
    assert str(outcomes[0]) == "token_ids[1] = 999 is outside the vocabulary [0, 32)"
    check_rows(outcomes[1:], [(1, 2)])
    assert recording.batches == [[(1, 2)]]
    await llm.aclose()
    with pytest.raises(BackendClosedError):
        await bounded(llm.next_token_logprobs([1]))


async def test_a_task_of_a_particle_s_call_cancelled_before_it_ran_cancels_the_call():
    llm = make_llm(timeout_s=LONG_S)
    recording = Recording(llm)
    call = llm.next_token_logprobs([9])
    task = asyncio.create_task(call)
    task.cancel()  # before the task's first step: the cancellation is thrown into the call
    check_rows([await bounded(llm.next_token_logprobs([8]))], [(8,)])
    with pytest.raises(asyncio.CancelledError):
        await task
    assert call.cancelled() and recording.batches == [[(8,)]]
    await llm.aclose()


async def test_closing_a_particle_s_call_or_throwing_into_it_cancels_it_while_it_waits():
    llm = make_llm(timeout_s=LONG_S)
    recording = Recording(llm)
    closed, thrown = llm.next_token_logprobs([7]), llm.next_token_logprobs([7, 1])
    closed.close()
    with pytest.raises(LookupError, match="thrown in"):
        thrown.throw(LookupError("thrown in"))
    assert closed.cancelled() and thrown.cancelled()
    check_rows([await bounded(llm.next_token_logprobs([6]))], [(6,)])
    assert recording.batches == [[(6,)]] and llm.batcher_stats.num_cancelled == 2
    await llm.aclose()


KEPT = ("await", "gather", "task")  # handlings whose caller gets the row
DROPPED = ("cancel", "close", "throw", "task cancelled")  # before any step takes the call


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(KEPT + DROPPED),
            st.lists(st.integers(0, len(VOCAB) - 1), min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_particle_calls_handled_any_way_get_their_rows_and_drop_only_what_no_one_awaits(
    program,
):
    """Each call of a program is awaited, gathered, made a task, or dropped (cancelled,
    closed, thrown into, or its task cancelled) before a step takes it: every kept call gets
    its context's row; each context a kept call asked for is computed once, and no other."""

    async def main():
        llm = make_llm()
        recording = Recording(llm)
        calls = [
            (how, tuple(context), llm.next_token_logprobs(context)) for how, context in program
        ]
        tasks = {
            i: asyncio.create_task(call) for i, (how, _, call) in enumerate(calls) if "task" in how
        }
        for i, (how, _, call) in enumerate(calls):
            if how == "cancel":
                call.cancel()
            elif how == "close":
                call.close()
            elif how == "throw":
                with pytest.raises(LookupError):
                    call.throw(LookupError("dropped"))
            elif how == "task cancelled":
                tasks[i].cancel()  # before the task's first step
        for how, context, call in calls:
            if how == "await":
                check_rows([await bounded(call)], [context])
        kept = [
            (i, context) for i, (how, context, _) in enumerate(calls) if how in ("gather", "task")
        ]
        rows = await bounded(
            asyncio.gather(*(tasks[i] if i in tasks else calls[i][2] for i, _ in kept))
        )
        check_rows(rows, [context for _, context in kept])
        for i, (how, _, call) in enumerate(calls):
            if how in DROPPED:
                if how == "task cancelled":
                    with pytest.raises(asyncio.CancelledError):
                        await tasks[i]
                assert call.cancelled(), how
        computed = [context for batch in recording.batches for context in batch]
        asked = {context for how, context, _ in calls if how in KEPT}
        assert sorted(computed) == sorted(asked)
        num_dropped = sum(how in DROPPED for how, _ in program)
        assert llm.batcher_stats.num_cancelled == num_dropped
        await llm.aclose()

    asyncio.run(main())


def test_a_particle_s_call_is_a_coroutine_function_to_mock():
    spec = unittest.mock.create_autospec(MockAsyncLM, instance=True)
    assert isinstance(spec.next_token_logprobs, unittest.mock.AsyncMock)


# ---------------------------------------------------------------- cancellation


async def test_a_call_cancelled_before_its_step_is_never_computed():
    llm = make_llm(timeout_s=LONG_S)
    recording = Recording(llm)
    doomed = asyncio.ensure_future(llm.next_token_logprobs([9]))
    kept = asyncio.ensure_future(llm.next_token_logprobs([8]))
    await asyncio.sleep(0)  # both calls made (ordering only)
    doomed.cancel()
    check_rows([await bounded(kept)], [(8,)])
    assert recording.batches == [[(8,)]]
    assert doomed.cancelled() and llm.batcher_stats.num_cancelled == 1
    await llm.aclose()


async def test_a_cancelled_caller_leaves_a_shared_request_to_the_others():
    llm = make_llm(timeout_s=LONG_S)
    recording = Recording(llm)
    doomed = asyncio.ensure_future(llm.next_token_logprobs([6, 1]))
    kept = asyncio.ensure_future(llm.batch_next_token_logprobs([[6, 1], [6, 2]]))
    await asyncio.sleep(0)
    doomed.cancel()
    check_rows(list(await bounded(kept)), [(6, 1), (6, 2)])
    assert recording.batches == [[(6, 1), (6, 2)]]
    await llm.aclose()


async def test_a_caller_cancelled_while_its_step_computes_leaves_the_others_their_rows():
    llm = make_llm()
    llm.engine.compute_in_loop = False
    recording = Recording(llm)
    recording.block()
    doomed = asyncio.ensure_future(llm.next_token_logprobs([3, 3]))
    kept = asyncio.ensure_future(llm.next_token_logprobs([3, 4]))
    await bounded(recording.started)
    doomed.cancel()
    recording.gate.set()
    check_rows([await bounded(kept)], [(3, 4)])
    assert doomed.cancelled()
    check_rows([await bounded(llm.next_token_logprobs([3, 3]))], [(3, 3)])
    assert len(recording.batches) == 1  # the cancelled caller's row was kept in the cache
    await llm.aclose()


async def test_a_call_made_and_cancelled_while_a_step_computes_is_counted_as_cancelled():
    llm = make_llm()
    llm.engine.compute_in_loop = False
    recording = Recording(llm)
    recording.block()
    kept = asyncio.ensure_future(llm.next_token_logprobs([2, 3]))
    await bounded(recording.started)
    doomed = asyncio.ensure_future(llm.next_token_logprobs([2, 4]))
    await asyncio.sleep(0)  # the call is made (ordering only)
    doomed.cancel()
    recording.gate.set()
    check_rows([await bounded(kept)], [(2, 3)])
    assert doomed.cancelled() and llm.batcher_stats.num_cancelled == 1
    assert recording.batches == [[(2, 3)]]  # the cancelled call's context is never computed
    await llm.aclose()


# ---------------------------------------------------------------- failures


async def test_a_model_error_fails_exactly_its_step_s_calls_and_the_engine_goes_on():
    llm = make_llm()
    recording = Recording(llm)
    recording.fail_on = (5,)
    outcomes = await bounded(
        asyncio.gather(
            llm.next_token_logprobs([5]),
            llm.batch_next_token_logprobs([[6], [5]]),
            llm.next_token_logprobs([6]),
            return_exceptions=True,
        )
    )
    assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
    recording.fail_on = None
    check_rows([await bounded(llm.next_token_logprobs([6]))], [(6,)])
    stats = llm.batcher_stats
    assert (stats.num_failed_batches, stats.num_pending, stats.num_inflight) == (1, 0, 0)
    await llm.aclose()


class LoopBug(Exception):
    """Stands for a bug in the engine's own serve loop."""


async def test_a_dead_loop_fails_its_calls_with_the_cause_and_the_next_call_starts_afresh(
    caplog,
):
    llm = make_llm(timeout_s=LONG_S)
    Recording(llm)
    bug = LoopBug("the serve loop broke")
    state = llm.engine.batcher._state(asyncio.get_running_loop())

    def broken_take():
        raise bug

    state.calls.take = broken_take
    outcomes = await bounded(
        asyncio.gather(*(llm.next_token_logprobs([i]) for i in range(3)), return_exceptions=True)
    )
    for outcome in outcomes:
        assert isinstance(outcome, BatcherWorkerDiedError) and outcome.__cause__ is bug
    with caplog.at_level(logging.WARNING, logger="genlm_backend.batching"):
        check_rows([await bounded(llm.next_token_logprobs([1]))], [(1,)])
    assert llm.engine.num_loop_restarts == 1
    assert "restarting a genlm engine loop" in caplog.text
    await llm.aclose()


async def test_reset_fails_waiting_calls_and_the_next_call_starts_afresh():
    llm = make_llm(timeout_s=LONG_S, batch_size=100)
    await llm.next_token_logprobs([1])
    pending = asyncio.ensure_future(llm.next_token_logprobs([2]))
    await asyncio.sleep(0)
    await llm.reset_async_queries()
    with pytest.raises(BatcherClosedError, match="closed"):
        await bounded(pending)
    check_rows([await bounded(llm.next_token_logprobs([2]))], [(2,)])
    await llm.aclose()


async def test_aclose_fails_computing_and_waiting_calls_at_once():
    llm = make_llm()
    llm.engine.compute_in_loop = False
    recording = Recording(llm)
    recording.block()
    computing = asyncio.ensure_future(llm.next_token_logprobs([1]))
    await bounded(recording.started)
    waiting = asyncio.ensure_future(llm.next_token_logprobs([2]))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(llm.aclose())
    for call in (computing, waiting):
        with pytest.raises(BackendClosedError):
            await bounded(call)
    assert not closing.done()  # the model is released once the step has finished
    recording.gate.set()
    await bounded(closing)
    with pytest.raises(BackendClosedError):
        await llm.next_token_logprobs([3])


# ---------------------------------------------------------------- threads


@pytest.mark.parametrize("in_loop", [True, False])
async def test_steps_run_in_the_loop_s_thread_or_in_one_worker(in_loop):
    llm = make_llm()
    llm.engine.compute_in_loop = in_loop
    recording = Recording(llm)
    for i in range(3):
        await bounded(llm.next_token_logprobs([i]))
    threads = set(recording.threads)
    assert len(threads) == 1
    assert (threads == {threading.current_thread()}) == in_loop
    await llm.aclose()


def test_one_engine_serves_several_asyncio_runs_and_forgets_their_loops():
    llm = make_llm()
    for run in range(3):

        async def main(run=run):
            return await asyncio.gather(*(llm.next_token_logprobs([run, i]) for i in range(3)))

        check_rows(asyncio.run(main()), [(run, i) for i in range(3)])
    assert len(llm.engine.batcher._loops) == 1  # the finished runs' states were dropped
    assert llm.stats.num_batches == 3
    llm.close()


def test_cpu_threads_go_to_one_while_shared_and_try_again_later():
    threads = CpuThreads(4)
    for _ in range(5):
        threads.judge(0.98)
    assert threads.num_threads == 4
    threads.judge(0.4)  # another process took the cores
    assert threads.num_threads == 4  # one slow step is no sign of it yet
    threads.judge(0.4)
    assert threads.num_threads == 1
    for _ in range(CpuThreads.FIRST_TRY_AFTER - 1):
        threads.judge(1.0)
    assert threads.num_threads == 1
    threads.judge(1.0)
    assert threads.num_threads == 4  # the try
    threads.judge(0.5)  # still shared: back to one, the next try twice as late
    assert threads.num_threads == 1
    for _ in range(2 * CpuThreads.FIRST_TRY_AFTER - 1):
        threads.judge(1.0)
    assert threads.num_threads == 1
    threads.judge(0.6)  # a step that did not get its core resets the count
    for _ in range(2 * CpuThreads.FIRST_TRY_AFTER):
        threads.judge(1.0)
    assert threads.num_threads == 4
    threads.judge(0.95)  # the try holds: the next fall starts over
    threads.judge(0.1)
    threads.judge(0.1)
    assert threads.num_threads == 1
    for _ in range(CpuThreads.FIRST_TRY_AFTER):
        threads.judge(1.0)
    assert threads.num_threads == 4
    fixed = CpuThreads(4, adaptive=False)
    fixed.observe((4, 0.0, 0.0))
    assert fixed.num_threads == 4 and not CpuThreads(1).adaptive


def test_one_slow_step_keeps_the_full_count():
    """A first forward faulting its weights in, or a collection, makes one step slow; only
    judgements of shared cores in a row put the steps on one thread."""
    threads = CpuThreads(2)
    for share in (0.98, 0.5, 0.97, 0.6, 0.99):
        threads.judge(share)
        assert threads.num_threads == 2
    threads.judge(0.5)
    threads.judge(0.7)
    assert threads.num_threads == 1


def test_short_steps_are_judged_together():
    threads = CpuThreads(2)
    short_s = CpuThreads.MIN_JUDGED_S / 4
    for _ in range(3):
        threads.record(0.3 * short_s, short_s)
    assert threads.num_threads == 2  # three short steps span less than MIN_JUDGED_S
    threads.record(0.3 * short_s, short_s)
    assert threads.num_threads == 2  # four do: their share (0.3), a first judgement of shared
    for _ in range(4):
        threads.record(0.3 * short_s, short_s)
    assert threads.num_threads == 1  # the second in a row: the cores are shared
    for _ in range(4 * CpuThreads.FIRST_TRY_AFTER - 1):
        threads.record(short_s, short_s)
    assert threads.num_threads == 1
    threads.record(short_s, short_s)
    assert threads.num_threads == 2  # FIRST_TRY_AFTER judgements of free cores: the try


def test_a_step_in_the_loop_runs_on_its_thread_count_and_gives_the_thread_its_own_back():
    own = torch.get_num_threads()
    llm = make_llm()
    llm.engine.batcher.cpu_threads = CpuThreads(own + 1)
    counts = []
    run = llm.runner.run
    llm.runner.run = lambda requests: counts.append(torch.get_num_threads()) or run(requests)

    async def call():
        await llm.next_token_logprobs([1, 3])
        return torch.get_num_threads()

    try:
        assert asyncio.run(call()) == own  # given back after the step
        llm.next_token_logprobs_sync([1, 2])  # a synchronous call: the caller's count
        assert counts == [own + 1, own] and torch.get_num_threads() == own
    finally:
        torch.set_num_threads(own)
        llm.close()


# ---------------------------------------------------------------- waiting calls


async def test_waiting_calls_fill_in_over_steps_and_fail_on_an_error():
    loop = asyncio.get_running_loop()
    calls = WaitingCalls(BatchingConfig())
    a = calls.add(["x", "y", "z"], loop)
    b = calls.add(["y"], loop)
    c = calls.add(["w"], loop)
    taken = calls.take()
    assert calls.missing(taken) == ["x", "y", "z", "w"]
    calls.settle(taken, {"x": 1, "y": 2, "w": ValueError("no w")})
    assert b.future.result() == [2]
    assert isinstance(c.future.exception(), ValueError)
    assert not a.future.done() and len(calls) == 1  # back in the queue, missing z
    taken = calls.take()
    assert taken == [a] and calls.missing(taken) == ["z"]
    calls.settle(taken, {"z": 3})
    assert a.future.result() == [1, 2, 3]
    assert calls.stats().num_pending == 0


# ---------------------------------------------------------------- rounds


def completion_log(llm, calls: dict) -> tuple[list, asyncio.Future]:
    """Start each named call (name -> context) in order; the log gets (name, steps so far) as each completes."""
    log: list[tuple[str, int]] = []

    async def call(name, context):
        row = await llm.next_token_logprobs(context)
        log.append((name, llm.batcher_stats.num_batches))
        return row

    tasks = [asyncio.ensure_future(call(name, context)) for name, context in calls.items()]
    return log, asyncio.gather(*tasks)


@pytest.mark.parametrize("rounds", [False, True])
async def test_a_call_with_a_cached_row_completes_in_its_turn(rounds):
    """The output cache is read by the step: a cached row is settled with the calls taken beside it."""
    llm = make_llm(timeout_s=None, rounds=rounds)
    llm.next_token_logprobs_sync([5])
    log, done = completion_log(llm, {"a": [1, 2], "cached": [5], "c": [3]})
    check_rows(await bounded(done), [[1, 2], [5], [3]])
    assert [name for name, _ in log] == ["a", "cached", "c"]
    assert llm.stats.num_output_cache_hits == 1
    await llm.aclose()


@pytest.mark.parametrize("rounds", [False, True])
async def test_a_round_cut_by_the_budget_settles_its_calls_together_in_call_order(rounds):
    llm = make_llm(timeout_s=None, rounds=rounds, max_batch_tokens=4)
    recording = Recording(llm, cost=len)
    log, done = completion_log(llm, {"long": [1] * 4, "b": [2], "c": [3]})
    check_rows(await bounded(done), [[1] * 4, [2], [3]])
    assert recording.batches == [[(1,) * 4], [(2,), (3,)]]
    assert log == (
        [("long", 2), ("b", 2), ("c", 2)] if rounds else [("long", 1), ("b", 2), ("c", 2)]
    )
    await llm.aclose()


async def particles_drawing(llm, num_particles: int = 6, num_steps: int = 5) -> list:
    """Particles that, as SMC does, draw from one shared generator as each row arrives:
    the draws, in the order they were made, with the row's bits that chose each token."""
    rng = random.Random(0)
    draws: list = []

    async def particle(i: int) -> None:
        context = [i + 1]
        for _ in range(num_steps):
            row = await llm.next_token_logprobs(context)
            draw = rng.random()
            token = int(
                torch.multinomial(
                    row.exp(), 1, generator=torch.Generator().manual_seed(int(draw * 2**31))
                )
            )
            draws.append((i, draw, token))
            context.append(token)

    await asyncio.gather(*(particle(i) for i in range(num_particles)))
    return draws


async def traffic(llm, seed: int, contexts: list, stop: asyncio.Event) -> int:
    """Another caller: batches of the given contexts' prefixes and random ones until ``stop``."""
    rng = random.Random(seed)
    num_calls = 0
    while not stop.is_set():
        batch = [
            list(rng.choice(contexts)[: rng.randint(1, 6)])
            if rng.random() < 0.7
            else [rng.randrange(len(VOCAB)) for _ in range(rng.randint(1, 9))]
            for _ in range(rng.randint(1, 5))
        ]
        await llm.batch_next_token_logprobs(batch)
        num_calls += 1
    return num_calls


@pytest.mark.parametrize("compute_in_loop", [True, False])
async def test_in_rounds_a_program_repeats_whatever_else_calls(compute_in_loop):
    """The same draws in the same order alone and beside other traffic that warms the cache
    with the particles' own contexts and makes the budget cut steps differently."""

    def lm(rounds: bool):
        llm = make_llm(timeout_s=None, rounds=rounds, max_batch_tokens=12)
        llm.engine.compute_in_loop = compute_in_loop
        return llm

    alone = await bounded(particles_drawing(lm(rounds=True)))
    contexts = [[i + 1] + [t for j, _, t in alone if j == i] for i in range(6)]

    async def beside(seed: int, rounds: bool) -> list:
        llm = lm(rounds)
        stop = asyncio.Event()
        other = asyncio.ensure_future(traffic(llm, seed, contexts, stop))
        draws = await bounded(particles_drawing(llm))
        stop.set()
        assert await bounded(other) > 0
        await llm.aclose()
        return draws

    for seed in range(4):
        assert await beside(seed, rounds=True) == alone
    if compute_in_loop:  # the same traffic reorders the draws of the default engine
        assert any([await beside(seed, rounds=False) != alone for seed in range(4)])


# ---------------------------------------------------------------- the backends' options


def test_lm_options_map_to_one_config_and_fail_naming_the_field():
    llm = make_llm(batch_size=5, timeout_s=0.5, max_batch_tokens=None, chunk_tokens=None)
    assert llm.batching == llm.engine.config == BatchingConfig(max_batch_size=5, timeout_s=0.5)
    assert (llm.batch_size, llm.timeout_s) == (5, 0.5)
    with pytest.raises(ValueError, match="max_batch_tokens must be"):
        make_llm(max_batch_tokens=0)
    with pytest.raises(ValueError, match="max_batch_size must be"):
        make_llm(batch_size=0)
    with pytest.raises(ValueError, match="cpu_threads must be"):
        make_llm(cpu_threads=2)
    with pytest.raises(ValueError, match="chunk_tokens must be"):
        make_llm(chunk_tokens=0)
    with pytest.raises(TypeError, match="compute_in_loop must be a bool"):
        make_llm(compute_in_loop="yes")
    llm.close()
