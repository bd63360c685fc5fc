"""AsyncTokenCharacterTrie start/cleanup/shutdown: stopping a loop's batcher fails exactly its
pending requests, and the next request is served again (checked against the synchronous trie)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from genlm_backend.errors import BatcherClosedError
from genlm_backend.tokenization.token import make_tokens
from genlm_backend.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie

VOCAB = make_tokens([b"a", b"ab", b"abc", b"b", b"", b"ab"])


class HeldTrie(ParallelTokenCharacterTrie):
    """Holds each batch until ``release`` is set."""

    def __init__(self):
        super().__init__(VOCAB, device="cpu")
        self.started, self.release = threading.Event(), threading.Event()
        self.release.set()

    def _reduce(self, ws, op):
        self.started.set()
        if not self.release.wait(timeout=60):
            raise TimeoutError("the test never released the batch")
        return super()._reduce(ws, op)


def row(seed: int = 0) -> torch.Tensor:
    return torch.softmax(torch.randn(len(VOCAB), generator=torch.Generator().manual_seed(seed)), 0)


async def test_start_runs_the_batcher_and_cleanup_stops_it():
    async_trie = AsyncTokenCharacterTrie(HeldTrie())
    assert not async_trie.is_running and async_trie._task is None
    async_trie.start()
    assert async_trie.is_running and async_trie._task is not None
    await async_trie.cleanup()
    assert not async_trie.is_running and async_trie._task is None
    await async_trie.cleanup()  # idempotent
    got = await async_trie.weight_sum(row())  # served again after cleanup
    np.testing.assert_array_equal(got, async_trie.trie.weight_sum(row()))
    await async_trie.aclose()


def test_start_needs_a_running_loop():
    with pytest.raises(RuntimeError, match="no running event loop"):
        AsyncTokenCharacterTrie(HeldTrie()).start()


@pytest.mark.parametrize("stop", ["cleanup", "shutdown"])
async def test_stopping_fails_pending_requests_and_serves_the_next(stop):
    trie = HeldTrie()
    trie.release.clear()
    async_trie = AsyncTokenCharacterTrie(trie)
    pending = asyncio.create_task(async_trie.weight_sum(row(1)))
    await asyncio.to_thread(trie.started.wait, 60)
    if stop == "cleanup":
        await async_trie.cleanup()
    else:
        async_trie.shutdown()
    trie.release.set()
    with pytest.raises(BatcherClosedError, match="closed"):
        await pending
    got = await async_trie.weight_max(row(2))
    np.testing.assert_array_equal(got, trie.weight_max(row(2)))
    assert async_trie.is_running and not async_trie.is_closed
    await async_trie.aclose()


def test_shutdown_outside_a_loop_then_a_new_loop_is_served():
    async_trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, device="cpu")
    first = asyncio.run(async_trie.weight_sum(row(3)))
    async_trie.shutdown()
    async_trie.shutdown()  # idempotent
    second = asyncio.run(async_trie.weight_sum(row(3)))
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, async_trie.trie.weight_sum(row(3)))


async def test_start_after_aclose_raises():
    async_trie = AsyncTokenCharacterTrie(HeldTrie())
    await async_trie.aclose()
    with pytest.raises(BatcherClosedError, match="closed"):
        async_trie.start()


async def test_queue_request_checks_the_operation():
    async_trie = AsyncTokenCharacterTrie(HeldTrie())
    with pytest.raises(ValueError, match="Unknown operation: 'invalid-op'"):
        await async_trie._queue_request(row(), "invalid-op")
    task = await async_trie._queue_request(row(4), "logsumexp")
    np.testing.assert_array_equal(await task, async_trie.trie.weight_logsumexp(row(4)))
    await async_trie.aclose()
