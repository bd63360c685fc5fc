"""AsyncTokenCharacterTrie: batching on the engine's WaitingCalls, errors, cancellation, closing.

Results are checked against the same trie's sync path (exactly: batching must not
change a value) and against the brute-force reference of ``test_trie.py``."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from genlm_backend.errors import BatcherClosedError
from genlm_backend.tokenization.token import make_tokens
from genlm_backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)
from tests.trie_reference import brute_force, token_ids_by_prefix

VOCAB = make_tokens([b"a", b"ab", b"abc", b"b", b"ba", b"", b"ab", b"c"])


class RecordingTrie(ParallelTokenCharacterTrie):
    """Records each batch it computes; can hold a batch until released, or fail one."""

    def __init__(self, vocab):
        super().__init__(vocab, device="cpu")
        self.batches: list[tuple[str, int]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_next = False

    def _reduce(self, ws, op):
        self.batches.append((op, ws.shape[0]))
        self.started.set()
        if not self.release.wait(timeout=60):
            raise TimeoutError("the test never released the batch")
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected trie failure")
        return super()._reduce(ws, op)


def assert_matches_brute_force(trie: TokenCharacterTrie, op: str, ws, got) -> None:
    """``got`` (one row over the trie's nodes) against the float64 brute-force reference:
    each internal node reduces the tokens under its prefix, each leaf is its token's weight.
    Tolerances as for the parallel trie in ``test_trie.py`` (float32)."""
    ws = np.asarray(ws, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    internal = range(trie.num_internal_nodes)
    members = token_ids_by_prefix([bytes(token) for token in VOCAB])
    sums, maxima, logsumexps = brute_force(members, [trie.node2prefix[n] for n in internal], ws)
    want = {"sum": sums, "max": maxima, "logsumexp": logsumexps}[op]
    if op == "max":
        np.testing.assert_array_equal(got[list(internal)], want.astype(np.float32))
    else:
        np.testing.assert_allclose(got[list(internal)], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[trie.token_id_to_leaf], ws.astype(np.float32))


def weight_rows(num_rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(num_rows, len(VOCAB), generator=generator), dim=-1)


async def test_concurrent_requests_form_one_batch_with_the_sync_results():
    trie = RecordingTrie(VOCAB)
    rows = weight_rows(16)
    async with AsyncTokenCharacterTrie(trie, batch_size=64) as async_trie:
        sums = await asyncio.gather(*(async_trie.weight_sum(row.exp()) for row in rows))
    assert trie.batches == [("sum", 16)]
    for row, got in zip(rows, sums):
        torch.testing.assert_close(got, trie.weight_sum(row.exp()), rtol=0, atol=0)
        assert_matches_brute_force(trie, "sum", row.exp(), got)


async def test_mixed_operations_in_one_batch_each_get_their_own_result():
    trie = RecordingTrie(VOCAB)
    rows = weight_rows(6, seed=1)
    async with AsyncTokenCharacterTrie(trie) as async_trie:
        calls = [async_trie.weight_sum, async_trie.weight_max, async_trie.weight_logsumexp] * 2
        results = await asyncio.gather(*(call(row) for call, row in zip(calls, rows)))
    assert sorted(trie.batches) == [("logsumexp", 2), ("max", 2), ("sum", 2)]
    for call, row, got in zip(calls, rows, results):
        expected = getattr(trie, call.__name__)(row)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert_matches_brute_force(trie, call.__name__.removeprefix("weight_"), row, got)


async def test_sequential_backend_returns_float64_numpy():
    async with AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="sequential") as async_trie:
        ws = np.linspace(-3.0, -0.5, len(VOCAB))
        got = await async_trie.weight_max(ws)
    np.testing.assert_array_equal(got, TokenCharacterTrie(VOCAB).weight_max(ws))
    assert got.dtype == np.float64


async def test_bad_input_fails_only_its_caller():
    trie = RecordingTrie(VOCAB)
    good = weight_rows(2)
    bad = good[0].clone()
    bad[3] = float("nan")
    async with AsyncTokenCharacterTrie(trie) as async_trie:
        results = await asyncio.gather(
            async_trie.weight_sum(good[0]),
            async_trie.weight_sum(bad),
            async_trie.weight_sum(good[1][:-1]),
            async_trie.weight_sum(good[1]),
            return_exceptions=True,
        )
    assert trie.batches == [("sum", 2)]
    assert isinstance(results[1], ValueError) and "NaN" in str(results[1])
    assert isinstance(results[2], ValueError) and "tokens" in str(results[2])
    torch.testing.assert_close(results[0], trie.weight_sum(good[0]), rtol=0, atol=0)
    torch.testing.assert_close(results[3], trie.weight_sum(good[1]), rtol=0, atol=0)


async def test_a_failing_batch_fails_its_requests_and_the_trie_keeps_serving():
    trie = RecordingTrie(VOCAB)
    trie.fail_next = True
    rows = weight_rows(3)
    async with AsyncTokenCharacterTrie(trie) as async_trie:
        failed = await asyncio.gather(
            *(async_trie.weight_max(row) for row in rows), return_exceptions=True
        )
        after = await async_trie.weight_max(rows[0])
    assert all(isinstance(e, RuntimeError) and "injected" in str(e) for e in failed)
    torch.testing.assert_close(after, trie.weight_max(rows[0]), rtol=0, atol=0)


async def test_cancelling_one_caller_leaves_the_others_untouched():
    trie = RecordingTrie(VOCAB)
    trie.release.clear()
    rows = weight_rows(3)
    async with AsyncTokenCharacterTrie(trie) as async_trie:
        tasks = [asyncio.create_task(async_trie.weight_sum(row)) for row in rows]
        await asyncio.to_thread(trie.started.wait, 60)  # the batch is computing
        tasks[1].cancel()
        trie.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    for i in (0, 2):
        torch.testing.assert_close(results[i], trie.weight_sum(rows[i]), rtol=0, atol=0)


async def test_aclose_fails_pending_requests_and_later_calls():
    trie = RecordingTrie(VOCAB)
    trie.release.clear()
    async_trie = AsyncTokenCharacterTrie(trie)
    pending = asyncio.create_task(async_trie.weight_sum(weight_rows(1)[0]))
    await asyncio.to_thread(trie.started.wait, 60)
    await async_trie.aclose()
    trie.release.set()
    with pytest.raises(BatcherClosedError, match="closed"):
        await pending
    with pytest.raises(BatcherClosedError, match="closed"):
        await async_trie.weight_max(weight_rows(1)[0])
    assert async_trie.is_closed
    await async_trie.aclose()  # idempotent


def test_each_event_loop_gets_its_own_batcher():
    async_trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, device="cpu")
    row = weight_rows(1)[0]
    first = asyncio.run(async_trie.weight_sum(row))
    second = asyncio.run(async_trie.weight_sum(row))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    asyncio.run(async_trie.aclose())


def test_from_vocab_rejects_unknown_backend_and_arguments():
    with pytest.raises(ValueError, match="backend"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="gpu")
    with pytest.raises(TypeError, match="unexpected keyword argument 'device'"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="sequential", device="cpu")
    with pytest.raises(ValueError, match="batch_size"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, batch_size=0)
