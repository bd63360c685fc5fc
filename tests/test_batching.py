"""AutoBatcher: flush policy, deduplication, worker thread, cancellation, errors, lifecycle.

Ordering is driven by events and futures; wall-clock time is measured only in
the test of the timeout flush, where time itself is under test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from genlm_backend.batching import AutoBatcher, BatcherStats, BatchingConfig
from genlm_backend.errors import BatcherClosedError
from tests.batching_helpers import LONG_S, Recorder, assert_settled, bounded, make_batcher


@pytest.fixture
async def running_recorder():
    return Recorder(asyncio.get_running_loop())


# ---------------------------------------------------------------- construction


def test_needs_a_running_loop():
    with pytest.raises(RuntimeError, match="no running event loop"):
        AutoBatcher(lambda keys: keys, BatchingConfig(max_batch_size=1, timeout_s=1))


# ---------------------------------------------------------------- flush policy


async def test_flushes_at_batch_size(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=3, timeout_s=LONG_S, flush_on_idle=False
    )
    results = await bounded(asyncio.gather(*(batcher.submit(k) for k in range(6))))
    assert results == [f"value:{k}" for k in range(6)]
    assert running_recorder.batches == [[0, 1, 2], [3, 4, 5]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_timeout_flushes_a_lone_request(running_recorder):
    """A lone request waits ``timeout_s`` for company, then goes alone.

    The wait is a lower bound by construction (the batcher re-checks its clock
    before dispatching), so it holds however loaded the machine is; that it
    does not starve is the bounded await itself (``BOUND_S``).
    """
    timeout_s = 0.2
    batcher = make_batcher(
        running_recorder, max_batch_size=8, timeout_s=timeout_s, flush_on_idle=False
    )
    start = time.monotonic()
    assert await bounded(batcher.submit("lonely")) == "value:lonely"
    assert time.monotonic() - start >= timeout_s
    assert running_recorder.batches == [["lonely"]]
    await batcher.aclose()


async def test_idle_flush_forms_one_batch_per_lockstep_step(running_recorder):
    num_tasks, num_steps = 8, 5
    batcher = make_batcher(running_recorder, max_batch_size=100, timeout_s=LONG_S)

    async def particle(i: int) -> list:
        return [await batcher.submit((i, step)) for step in range(num_steps)]

    results = await bounded(asyncio.gather(*(particle(i) for i in range(num_tasks))))
    assert results[3] == [f"value:{(3, step)}" for step in range(num_steps)]
    assert [len(batch) for batch in running_recorder.batches] == [num_tasks] * num_steps
    for step, batch in enumerate(running_recorder.batches):
        assert sorted(batch) == [(i, step) for i in range(num_tasks)]
    assert batcher.stats.mean_batch_size == num_tasks
    await batcher.aclose()


# ---------------------------------------------------------------- deduplication


async def test_deduplicates_queued_keys(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=2, timeout_s=LONG_S, flush_on_idle=False
    )
    results = await bounded(asyncio.gather(*(batcher.submit(k) for k in "aaba")))
    assert results == ["value:a", "value:a", "value:b", "value:a"]
    assert running_recorder.batches == [["a", "b"]]
    stats = batcher.stats
    assert (stats.num_requests, stats.num_deduplicated, stats.num_batched_keys) == (4, 2, 2)
    await batcher.aclose()


async def test_deduplicates_a_key_in_flight(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=1, timeout_s=LONG_S, flush_on_idle=False
    )
    running_recorder.block()
    first = asyncio.ensure_future(batcher.submit("a"))
    assert await bounded(running_recorder.started) == ["a"]
    assert batcher.stats.num_inflight == 1
    second = asyncio.ensure_future(batcher.submit("a"))
    other = asyncio.ensure_future(batcher.submit("b"))
    await asyncio.sleep(0)  # let both enqueue while "a" computes
    assert batcher.stats.num_deduplicated == 1
    running_recorder.gate.set()
    assert await bounded(asyncio.gather(first, second, other)) == ["value:a", "value:a", "value:b"]
    assert running_recorder.batches == [["a"], ["b"]]
    assert_settled(batcher)
    await batcher.aclose()


# ---------------------------------------------------------------- worker thread


async def test_process_batch_runs_off_the_event_loop(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=1, timeout_s=LONG_S)
    running_recorder.block()
    request = asyncio.ensure_future(batcher.submit("k"))
    await bounded(running_recorder.started)
    # The batch is blocked on a threading.Event that only a loop callback sets:
    # if process_batch held the loop's thread, this callback could never run.
    loop_ran = asyncio.Event()
    asyncio.get_running_loop().call_soon(lambda: (loop_ran.set(), running_recorder.gate.set()))
    await bounded(loop_ran.wait())
    assert await bounded(request) == "value:k"
    assert running_recorder.threads[0] is not threading.current_thread()
    await batcher.aclose()


async def test_uses_the_given_executor(running_recorder):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="batcher-test") as executor:
        batcher = make_batcher(running_recorder, max_batch_size=1, timeout_s=0, executor=executor)
        assert await bounded(batcher.submit(1)) == "value:1"
        await batcher.aclose()
    assert running_recorder.threads[0].name.startswith("batcher-test")


# ---------------------------------------------------------------- cancellation


async def test_cancelled_caller_in_flight_does_not_break_others(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=2, timeout_s=LONG_S, flush_on_idle=False
    )
    running_recorder.block()
    cancelled = asyncio.ensure_future(batcher.submit("a"))
    survivor = asyncio.ensure_future(batcher.submit("b"))
    assert await bounded(running_recorder.started) == ["a", "b"]
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    running_recorder.gate.set()
    assert await bounded(survivor) == "value:b"
    assert batcher.stats.num_cancelled == 1
    # the batcher keeps serving
    assert await bounded(asyncio.gather(batcher.submit("c"), batcher.submit("d"))) == [
        "value:c",
        "value:d",
    ]
    assert_settled(batcher)
    await batcher.aclose()


async def test_key_cancelled_before_dispatch_is_never_computed(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=2, timeout_s=LONG_S, flush_on_idle=False
    )
    doomed = asyncio.ensure_future(batcher.submit("doomed"))
    await asyncio.sleep(0)  # let it enqueue
    assert batcher.stats.num_pending == 1
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert batcher.stats.num_pending == 0
    assert await bounded(asyncio.gather(batcher.submit("x"), batcher.submit("y"))) == [
        "value:x",
        "value:y",
    ]
    assert "doomed" not in running_recorder.seen_keys()
    assert running_recorder.batches == [["x", "y"]]
    await batcher.aclose()


async def test_deduplicated_key_survives_one_cancelled_waiter_before_dispatch(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=2, timeout_s=LONG_S, flush_on_idle=False
    )
    leaver = asyncio.ensure_future(batcher.submit("k"))
    stayer = asyncio.ensure_future(batcher.submit("k"))
    await asyncio.sleep(0)
    assert (batcher.stats.num_pending, batcher.stats.num_deduplicated) == (1, 1)
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    assert batcher.stats.num_pending == 1  # the other waiter still wants it
    assert await bounded(batcher.submit("other")) == "value:other"
    assert await bounded(stayer) == "value:k"
    assert running_recorder.batches == [["k", "other"]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_deduplicated_key_survives_one_cancelled_waiter_in_flight(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=1, timeout_s=LONG_S, flush_on_idle=False
    )
    running_recorder.block()
    leaver = asyncio.ensure_future(batcher.submit("k"))
    stayer = asyncio.ensure_future(batcher.submit("k"))
    await bounded(running_recorder.started)
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    running_recorder.gate.set()
    assert await bounded(stayer) == "value:k"
    assert running_recorder.batches == [["k"]]
    await batcher.aclose()


async def test_submit_many_queues_every_key_and_returns_values_in_order(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S, flush_on_idle=True)
    alone = asyncio.ensure_future(batcher.submit("b"))  # another caller's, shared
    values = await bounded(batcher.submit_many(["a", "b", "c", "a"]))
    assert values == ["value:a", "value:b", "value:c", "value:a"]
    assert await bounded(alone) == "value:b"
    assert running_recorder.batches == [["b", "a", "c"]]  # one batch, each key once
    assert batcher.stats.num_deduplicated == 2
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_request_arriving_during_the_idle_check_is_dispatched_without_the_timeout(
    running_recorder,
):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S, flush_on_idle=True)
    first = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0)  # "a" queued; the worker starts on the next pass
    second = asyncio.ensure_future(batcher.submit("b"))  # arrives while it checks for idleness
    assert await bounded(asyncio.gather(first, second)) == ["value:a", "value:b"]
    assert running_recorder.batches == [["a", "b"]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_submit_many_owned_is_true_only_when_no_other_waiter_shared_a_value(
    running_recorder,
):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S, flush_on_idle=True)
    assert await bounded(batcher.submit_many_owned(["a", "b"])) == (["value:a", "value:b"], True)
    # Another caller joins one of this call's computations.
    many = asyncio.ensure_future(batcher.submit_many_owned(["c", "d"]))
    await asyncio.sleep(0)  # "c" and "d" queued
    joiner = asyncio.ensure_future(batcher.submit("d"))
    assert await bounded(many) == (["value:c", "value:d"], False)
    assert await bounded(joiner) == "value:d"
    # This call joins another caller's computation.
    other = asyncio.ensure_future(batcher.submit("e"))
    assert await bounded(batcher.submit_many_owned(["e", "f"])) == (["value:e", "value:f"], False)
    assert await bounded(other) == "value:e"
    # The same key twice in one call shares one computation.
    assert await bounded(batcher.submit_many_owned(["g", "g"])) == (["value:g"] * 2, False)
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_cancelled_submit_many_drops_its_queued_keys_and_keeps_shared_ones(
    running_recorder,
):
    batcher = make_batcher(
        running_recorder, max_batch_size=4, timeout_s=LONG_S, flush_on_idle=False
    )
    shared = asyncio.ensure_future(batcher.submit("shared"))
    many = asyncio.ensure_future(batcher.submit_many(["mine", "shared", "also mine"]))
    await asyncio.sleep(0)  # both queued
    assert batcher.stats.num_pending == 3
    many.cancel()
    with pytest.raises(asyncio.CancelledError):
        await many
    assert batcher.stats.num_pending == 1  # only the key another caller waits for
    more = [batcher.submit(key) for key in ("x", "y", "z")]  # with "shared", a full batch
    assert await bounded(asyncio.gather(shared, *more)) == [
        "value:shared",
        "value:x",
        "value:y",
        "value:z",
    ]
    assert running_recorder.batches == [["shared", "x", "y", "z"]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_submit_many_raises_its_failed_batch_error(running_recorder):
    running_recorder.fail_on = "bad"
    batcher = make_batcher(
        running_recorder, max_batch_size=2, timeout_s=LONG_S, flush_on_idle=False
    )
    with pytest.raises(ValueError, match="cannot process 'bad'"):
        await bounded(batcher.submit_many(["a", "b", "bad", "c"]))
    assert await bounded(batcher.submit_many(["d", "e"])) == ["value:d", "value:e"]
    assert_settled(batcher)
    await batcher.aclose()


# ---------------------------------------------------------------- a caller's group alone


def spy_on_queue(batcher: AutoBatcher) -> list:
    """The keys the batcher queues from now on, one by one."""
    queued = []
    add = batcher._pending.add

    def recording_add(key, future, num_tokens):
        queued.append(key)
        add(key, future, num_tokens)

    batcher._pending.add = recording_add
    return queued


async def computing_group(recorder, submission):
    """``submission`` (a batch call), started and computing behind the recorder's gate."""
    recorder.block()
    many = asyncio.ensure_future(submission)
    await bounded(recorder.started)
    return many


async def group_computing_with_a_joiner(batcher, recorder, keys, joining_key):
    """A caller's group, computing behind the recorder's gate, and a request joining it."""
    many = await computing_group(recorder, batcher.submit_many(keys))
    joiner = asyncio.ensure_future(batcher.submit(joining_key))
    await asyncio.sleep(0)  # the joiner has joined
    return many, joiner


async def test_a_group_on_an_idle_batcher_goes_as_a_batch_of_its_own(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    queued = spy_on_queue(batcher)
    assert await bounded(batcher.submit_many_owned(["a", "b", "c"])) == (
        ["value:a", "value:b", "value:c"],
        True,
    )
    assert running_recorder.batches == [["a", "b", "c"]]
    assert queued == []  # no key went through the queue
    stats = batcher.stats
    assert (stats.num_requests, stats.num_batches, stats.num_batched_keys) == (3, 1, 3)
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_group_that_does_not_fit_one_batch_is_queued(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=2, timeout_s=LONG_S)
    queued = spy_on_queue(batcher)
    assert await bounded(batcher.submit_many(["a", "b", "c"])) == ["value:a", "value:b", "value:c"]
    assert running_recorder.batches == [["a", "b"], ["c"]]
    assert queued == ["a", "b", "c"]
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_group_joins_requests_already_queued_or_arriving_in_its_pass(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    before = asyncio.ensure_future(batcher.submit("before"))
    await asyncio.sleep(0)  # "before" is queued: the batcher is not idle
    assert await bounded(batcher.submit_many(["a", "b"])) == ["value:a", "value:b"]
    assert await bounded(before) == "value:before"
    many = asyncio.ensure_future(batcher.submit_many(["c", "d"]))
    await asyncio.sleep(0)  # the batcher is idle: the group waits one pass of the loop
    during = asyncio.ensure_future(batcher.submit("during"))
    assert await bounded(many) == ["value:c", "value:d"]
    assert await bounded(during) == "value:during"
    assert running_recorder.batches == [["before", "a", "b"], ["during", "c", "d"]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_groups_of_one_pass_are_queued_together(running_recorder):
    """Two callers' groups on an idle batcher in the same pass make one batch (a server's
    requests from several clients)."""
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    values = await bounded(
        asyncio.gather(batcher.submit_many(["a", "b"]), batcher.submit_many(["c", "d"]))
    )
    assert values == [["value:a", "value:b"], ["value:c", "value:d"]]
    assert running_recorder.batches == [["a", "b", "c", "d"]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_request_for_a_key_of_a_computing_group_joins_it(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    many = await computing_group(running_recorder, batcher.submit_many_owned(["a", "b"]))
    joiners = [asyncio.ensure_future(batcher.submit("b")) for _ in range(2)]
    await asyncio.sleep(0)
    assert batcher.stats.num_inflight == 2
    running_recorder.gate.set()
    assert await bounded(many) == (["value:a", "value:b"], False)  # its value was shared
    assert await bounded(asyncio.gather(*joiners)) == ["value:b", "value:b"]
    assert running_recorder.batches == [["a", "b"]]
    assert batcher.stats.num_deduplicated == 2
    assert_settled(batcher)
    await batcher.aclose()


async def test_requests_arriving_while_a_group_computes_go_after_it_together(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    many = await computing_group(running_recorder, batcher.submit_many(["a", "b"]))
    first = asyncio.ensure_future(batcher.submit("x"))
    for _ in range(4):  # passes in which an idle loop would dispatch "x" on its own
        await asyncio.sleep(0)
    later = [asyncio.ensure_future(batcher.submit(key)) for key in ("y", "z")]
    await asyncio.sleep(0)
    assert batcher.stats.num_pending == 3
    running_recorder.gate.set()
    assert await bounded(asyncio.gather(many, first, *later)) == [
        ["value:a", "value:b"],
        "value:x",
        "value:y",
        "value:z",
    ]
    assert running_recorder.batches == [["a", "b"], ["x", "y", "z"]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_failed_group_fails_its_caller_and_joiners_alone(running_recorder):
    running_recorder.fail_on = "bad"
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    many, joiner = await group_computing_with_a_joiner(batcher, running_recorder, ["a", "bad"], "a")
    running_recorder.gate.set()
    for outcome in await bounded(asyncio.gather(many, joiner, return_exceptions=True)):
        assert isinstance(outcome, ValueError) and "cannot process 'bad'" in str(outcome)
    assert batcher.stats.num_failed_batches == 1
    assert await bounded(batcher.submit_many(["c", "d"])) == ["value:c", "value:d"]
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_group_returning_the_wrong_number_of_values_fails(running_recorder):
    batcher = make_batcher(lambda keys: ["only one"], max_batch_size=8, timeout_s=LONG_S)
    with pytest.raises(RuntimeError, match="returned 1 values for 2 keys"):
        await bounded(batcher.submit_many(["a", "b"]))
    assert batcher.stats.num_failed_batches == 1
    assert_settled(batcher)
    await batcher.aclose()


async def test_a_cancelled_group_caller_leaves_its_joiners_their_values(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    many, joiner = await group_computing_with_a_joiner(batcher, running_recorder, ["a", "b"], "a")
    many.cancel()
    with pytest.raises(asyncio.CancelledError):
        await many
    running_recorder.gate.set()
    assert await bounded(joiner) == "value:a"
    assert batcher.stats.num_cancelled == 2
    assert_settled(batcher)
    await batcher.aclose()


async def test_aclose_fails_a_computing_group_and_its_joiners_at_once(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=8, timeout_s=LONG_S)
    many, joiner = await group_computing_with_a_joiner(batcher, running_recorder, ["a", "b"], "b")
    await bounded(batcher.aclose())  # returns while the thread is still blocked
    for waiter in (many, joiner):
        with pytest.raises(BatcherClosedError, match="closed"):
            await bounded(waiter)
    assert_settled(batcher)
    running_recorder.gate.set()


# ---------------------------------------------------------------- errors


async def test_exception_fails_exactly_its_batch(running_recorder):
    running_recorder.fail_on = "bad"
    batcher = make_batcher(
        running_recorder, max_batch_size=2, timeout_s=LONG_S, flush_on_idle=False
    )
    outcomes = await bounded(
        asyncio.gather(*(batcher.submit(k) for k in ["bad", "a", "b", "c"]), return_exceptions=True)
    )
    assert running_recorder.batches == [["bad", "a"], ["b", "c"]]
    for outcome in outcomes[:2]:
        assert isinstance(outcome, ValueError) and "cannot process 'bad'" in str(outcome)
    assert outcomes[2:] == ["value:b", "value:c"]
    assert batcher.stats.num_failed_batches == 1
    assert await bounded(asyncio.gather(batcher.submit("d"), batcher.submit("e"))) == [
        "value:d",
        "value:e",
    ]
    assert_settled(batcher)
    await batcher.aclose()


async def test_wrong_number_of_values_fails_that_batch(running_recorder):
    calls = []

    def short_by_one(keys):
        calls.append(list(keys))
        return [f"value:{k}" for k in keys][: -1 if len(calls) == 1 else None]

    batcher = make_batcher(short_by_one, max_batch_size=2, timeout_s=LONG_S, flush_on_idle=False)
    outcomes = await bounded(
        asyncio.gather(batcher.submit("a"), batcher.submit("b"), return_exceptions=True)
    )
    for outcome in outcomes:
        assert isinstance(outcome, RuntimeError)
        assert "returned 1 values for 2 keys" in str(outcome)
    assert await bounded(asyncio.gather(batcher.submit("c"), batcher.submit("d"))) == [
        "value:c",
        "value:d",
    ]
    assert batcher.stats.num_failed_batches == 1
    await batcher.aclose()


# ---------------------------------------------------------------- lifecycle


async def test_aclose_fails_pending_and_later_requests(running_recorder):
    batcher = make_batcher(
        running_recorder, max_batch_size=4, timeout_s=LONG_S, flush_on_idle=False
    )
    pending = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0)
    assert batcher.stats.num_pending == 1
    await bounded(batcher.aclose())
    assert batcher.is_closed
    with pytest.raises(BatcherClosedError, match="closed"):
        await pending
    with pytest.raises(BatcherClosedError, match="closed"):
        await batcher.submit("b")
    await bounded(batcher.aclose())  # idempotent
    assert running_recorder.batches == []
    assert_settled(batcher)


async def test_aclose_fails_a_batch_in_flight_at_once(running_recorder):
    batcher = make_batcher(running_recorder, max_batch_size=1, timeout_s=LONG_S)
    running_recorder.block()
    in_flight = asyncio.ensure_future(batcher.submit("a"))
    await bounded(running_recorder.started)
    await bounded(batcher.aclose())  # returns while the thread is still blocked
    with pytest.raises(BatcherClosedError, match="closed"):
        await in_flight
    assert_settled(batcher)
    running_recorder.gate.set()


async def test_async_with_closes(running_recorder):
    async with make_batcher(running_recorder, max_batch_size=1, timeout_s=0) as batcher:
        assert await bounded(batcher.submit(1)) == "value:1"
    assert batcher.is_closed
    with pytest.raises(BatcherClosedError, match="closed"):
        await batcher.submit(2)


# ---------------------------------------------------------------- statistics


async def test_stats_count_everything(running_recorder):
    running_recorder.fail_on = "bad"
    batcher = make_batcher(
        running_recorder, max_batch_size=3, timeout_s=LONG_S, flush_on_idle=False
    )
    keys = ["a", "b", "a", "c", "bad", "d", "d", "e"]
    outcomes = await bounded(
        asyncio.gather(*(batcher.submit(k) for k in keys), return_exceptions=True)
    )
    # batches: [a, b, c] then [bad, d, e]
    assert running_recorder.batches == [["a", "b", "c"], ["bad", "d", "e"]]
    assert sum(isinstance(o, ValueError) for o in outcomes) == 4  # bad, d, d, e
    stats = batcher.stats
    assert stats == BatcherStats(
        num_requests=8,
        num_deduplicated=2,
        num_batches=2,
        num_batched_keys=6,
        num_failed_batches=1,
        num_cancelled=0,
        num_pending=0,
        num_inflight=0,
        num_pending_tokens=0,
    )
    assert stats.mean_batch_size == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_requests = 0
    await batcher.aclose()


async def test_nothing_left_behind_after_a_mixed_workload(running_recorder):
    running_recorder.fail_on = 13
    batcher = make_batcher(running_recorder, max_batch_size=4, timeout_s=0.005)
    tasks = [asyncio.ensure_future(batcher.submit(k % 20)) for k in range(60)]
    await asyncio.sleep(0)  # every task submits before some are cancelled
    for task in tasks[::7]:
        task.cancel()
    outcomes = await bounded(asyncio.gather(*tasks, return_exceptions=True))
    assert any(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert any(isinstance(o, ValueError) for o in outcomes)
    for key, outcome in zip(range(60), outcomes):
        if isinstance(outcome, str):
            assert outcome == f"value:{key % 20}"
    assert_settled(batcher)
    stats = batcher.stats
    assert stats.num_requests == 60
    assert stats.num_cancelled == len(tasks[::7])
    await batcher.aclose()


def test_loop_batchers_forget_finished_loops():
    from genlm_backend.batching import LoopBatchers

    batchers = LoopBatchers(lambda keys: keys, BatchingConfig(max_batch_size=4, timeout_s=0.01))

    async def use():
        return await batchers.current().submit("k")

    for _ in range(3):
        assert asyncio.run(use()) == "k"
    # Each finished loop's batcher is dropped when the next loop asks for one.
    assert len(batchers._batchers) == 1
    batchers.shutdown()
