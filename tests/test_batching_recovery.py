"""A batcher whose worker dies: pending requests fail, new ones are refused, the owner recovers.

The worker is killed by an error raised where its own loop picks the next
batch (``_take_batch``): the one place outside ``process_batch`` that runs
between batches. Ordering is driven by the recorder's gate and futures.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from genlm_backend.batching import BatchingConfig, LoopBatchers
from genlm_backend.errors import BatcherClosedError, BatcherWorkerDiedError
from genlm_backend.llm import MockAsyncLM
from tests.batching_helpers import LONG_S, Recorder, assert_settled, bounded, make_batcher


class WorkerBug(Exception):
    """Stands for a bug in the batcher's own serving loop."""


def kill_worker_at_next_batch(batcher) -> WorkerBug:
    bug = WorkerBug("the serve loop broke")

    def broken_take_batch():
        raise bug

    batcher._take_batch = broken_take_batch
    return bug


@pytest.fixture
async def recorder():
    return Recorder(asyncio.get_running_loop())


async def test_dead_worker_fails_pending_requests_with_the_cause(recorder):
    batcher = make_batcher(recorder, timeout_s=LONG_S)
    bug = kill_worker_at_next_batch(batcher)
    outcomes = await bounded(
        asyncio.gather(*(batcher.submit(k) for k in "abc"), return_exceptions=True)
    )
    for outcome in outcomes:
        assert isinstance(outcome, BatcherWorkerDiedError)
        assert isinstance(outcome, BatcherClosedError)
        assert outcome.__cause__ is bug
        assert "the serve loop broke" in str(outcome)
    assert batcher.is_closed and batcher.worker_error is bug
    assert recorder.batches == []
    assert_settled(batcher)


async def test_dead_worker_refuses_new_requests(recorder):
    batcher = make_batcher(recorder, timeout_s=LONG_S)
    kill_worker_at_next_batch(batcher)
    with pytest.raises(BatcherWorkerDiedError):
        await bounded(batcher.submit("first"))
    with pytest.raises(BatcherWorkerDiedError, match="create a new one"):
        await bounded(batcher.submit("later"))
    assert recorder.batches == []
    await batcher.aclose()  # still closes cleanly
    assert batcher.worker_error is not None


async def test_death_between_batches_keeps_the_finished_batch(recorder):
    batcher = make_batcher(recorder, timeout_s=LONG_S)
    recorder.block()
    computing = asyncio.ensure_future(batcher.submit("computing"))
    assert await bounded(recorder.started) == ["computing"]
    queued = [asyncio.ensure_future(batcher.submit(k)) for k in ("q1", "q2")]
    kill_worker_at_next_batch(batcher)
    recorder.gate.set()
    assert await bounded(computing) == "value:computing"
    for task in queued:
        with pytest.raises(BatcherWorkerDiedError):
            await bounded(task)
    assert recorder.batches == [["computing"]]
    assert_settled(batcher)


async def test_loop_batchers_replace_a_dead_batcher(caplog):
    recorder = Recorder(asyncio.get_running_loop())
    batchers = LoopBatchers(recorder, BatchingConfig(timeout_s=LONG_S))
    dead = batchers.current()
    kill_worker_at_next_batch(dead)
    with pytest.raises(BatcherWorkerDiedError):
        await bounded(batchers.current().submit("lost"))
    with caplog.at_level(logging.WARNING, logger="genlm_backend.batching.loops"):
        fresh = batchers.current()
    assert fresh is not dead and not fresh.is_closed
    assert await bounded(fresh.submit("served")) == "value:served"
    assert batchers.num_worker_deaths == 1
    assert any("worker died" in record.getMessage() for record in caplog.records)
    await batchers.aclose()


async def test_lm_recovers_on_the_next_request():
    vocab = [bytes([b]) for b in range(16)]
    llm = MockAsyncLM(byte_vocab=vocab)
    fresh = MockAsyncLM(byte_vocab=vocab, output_cache_bytes=0)
    await bounded(llm.next_token_logprobs([1]))  # creates this loop's batcher
    kill_worker_at_next_batch(llm.batchers.current())
    with pytest.raises(BatcherWorkerDiedError):
        await bounded(llm.next_token_logprobs([2, 3]))
    row = await bounded(llm.next_token_logprobs([2, 3]))
    torch.testing.assert_close(row, fresh.next_token_logprobs_sync([2, 3]), atol=1e-6, rtol=0)
    await llm.aclose()
