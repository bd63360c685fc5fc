"""Cancellation, faults, bad input and lifecycle of AsyncTokenCharacterTrie over the GPT-2 vocabulary.

Results are compared with the float64 sequential trie (see ``trie_helpers.check``).

* Cancellation: a fifth of the calls cancelled before queueing, while queued
  or while their batch computes (held by a gate in ``_reduce``); queued
  calls whose callers left are never computed.
* Faults: ``_reduce`` raising (and once out of memory) on chosen batches
  fails exactly their callers; later calls succeed.
* Bad input: each invalid weight vector fails its caller alone, before queueing.
* Lifecycle: several ``asyncio.run`` calls; ``aclose()`` with calls computing
  and queued fails them at once with ``BatcherClosedError``; use after close raises it.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from genlm_backend.errors import BatcherClosedError
from genlm_backend.trie import AsyncTokenCharacterTrie
from tests.stress.helpers import WAIT_S, out_of_memory_error, settle
from tests.stress.trie_helpers import check, weights

pytestmark = pytest.mark.stress


async def test_random_fifth_cancelled_at_every_stage(stress_trie, tries, stress_figures):
    vocab, reference = tries
    figures = stress_figures("trie gpt2")
    async_trie = AsyncTokenCharacterTrie(stress_trie, batch_size=16)
    rng, py_rng = np.random.default_rng(1), random.Random(1)
    number = 0
    for _ in range(3):
        calls = [weights(rng, len(vocab), "sum", number + i) for i in range(80)]
        number += len(calls)
        cancelled = set(py_rng.sample(range(80), 16))
        stress_trie.hold_next()
        tasks = [asyncio.create_task(async_trie.weight_sum(ws)) for ws in calls[:16]]
        await asyncio.to_thread(stress_trie.entered.wait, WAIT_S)  # the first 16 compute
        tasks += [asyncio.create_task(async_trie.weight_sum(ws)) for ws in calls[16:]]
        before = {i for i in cancelled if i >= 16 and i % 2}
        for i in before:
            tasks[i].cancel()  # never runs: never queued
        await asyncio.sleep(0)
        later = [tasks[i] for i in cancelled - before]
        for task in later:
            task.cancel()
        await asyncio.wait(later)
        stats = async_trie.batcher_stats
        assert stats.num_inflight == 16 and stats.num_pending == 64 - len(
            cancelled - set(range(16))
        )
        stress_trie.release.set()
        outcomes = await settle(tasks)
        live = [i for i in range(80) if i not in cancelled]
        assert all(isinstance(outcomes[i], asyncio.CancelledError) for i in cancelled)
        check(reference, [("sum", calls[i]) for i in live], [outcomes[i] for i in live])
        computed = sorted(
            n for batch in stress_trie.batches[-5:] for n in batch if n >= number - 80
        )
        assert computed == sorted(
            {number - 80 + i for i in live} | set(range(number - 80, number - 64))
        )
        figures.served += len(live)
        figures.cancelled += len(cancelled)
    stats = async_trie.batcher_stats
    assert stats.num_pending == stats.num_inflight == 0
    await async_trie.aclose()


async def test_failed_batches_fail_exactly_their_callers(stress_trie, tries, stress_figures):
    vocab, reference = tries
    figures = stress_figures("trie gpt2")
    async_trie = AsyncTokenCharacterTrie(stress_trie, batch_size=8)
    rng = np.random.default_rng(2)
    calls = [weights(rng, len(vocab), "max", i) for i in range(40)]
    errors = {1: RuntimeError("injected trie failure"), 3: out_of_memory_error()}
    stress_trie.planned_errors = dict(errors)
    outcomes = await settle([asyncio.create_task(async_trie.weight_max(ws)) for ws in calls])
    failed = {
        n: errors[b] for b, batch in enumerate(stress_trie.batches) if b in errors for n in batch
    }
    assert len(failed) == 16
    for i, outcome in enumerate(outcomes):
        if i in failed:
            assert outcome is failed[i]
            figures.failed_as_intended += 1
    live = [i for i in range(40) if i not in failed]
    check(reference, [("max", calls[i]) for i in live], [outcomes[i] for i in live])
    retry = await asyncio.gather(*(async_trie.weight_max(calls[i]) for i in failed))
    check(reference, [("max", calls[i]) for i in failed], retry)
    figures.served += len(live) + len(retry)
    await async_trie.aclose()


async def test_bad_weights_fail_alone_among_good_calls(stress_trie, tries, stress_figures):
    vocab, reference = tries
    figures = stress_figures("trie gpt2")
    size = len(vocab)
    nan = torch.ones(size)
    nan[7] = float("nan")
    cases = {
        "too short": (
            torch.ones(size - 1),
            ValueError,
            f"entries per row, but the vocabulary has {size}",
        ),
        "2-D": (torch.ones(2, size), ValueError, "must have shape"),
        "NaN": (nan, ValueError, r"NaN \(first at index \[7\]\)"),
        "complex dtype": (torch.ones(size, dtype=torch.complex64), TypeError, "real numbers"),
        "strings": (["x"] * size, TypeError, "real numbers"),
        "none": (None, TypeError, "torch tensor, numpy array or sequence of numbers"),
    }
    rng = np.random.default_rng(3)
    good = [weights(rng, size, "sum", i) for i in range(30)]
    calls = [("good", ws) for ws in good] + [(name, case[0]) for name, case in cases.items()]
    random.Random(3).shuffle(calls)
    async with AsyncTokenCharacterTrie(stress_trie, batch_size=8) as async_trie:
        outcomes = await asyncio.gather(
            *(async_trie.weight_sum(ws) for _, ws in calls), return_exceptions=True
        )
    for (name, _), outcome in zip(calls, outcomes):
        if name != "good":
            _, error_type, phrase = cases[name]
            with pytest.raises(error_type, match=phrase):
                raise outcome
            figures.failed_as_intended += 1
    goods = [(ws, got) for (name, ws), got in zip(calls, outcomes) if name == "good"]
    check(reference, [("sum", ws) for ws, _ in goods], [got for _, got in goods])
    assert sum(map(len, stress_trie.batches)) == len(good)  # bad calls never reached a batch
    figures.served += len(goods)


def test_several_runs_then_aclose_with_calls_computing_and_queued(
    stress_trie, tries, stress_figures
):
    vocab, reference = tries
    figures = stress_figures("trie gpt2")
    async_trie = AsyncTokenCharacterTrie(stress_trie, batch_size=8)
    rng = np.random.default_rng(4)

    async def run(calls):
        return await asyncio.gather(*(async_trie.weight_logsumexp(ws) for ws in calls))

    for _ in range(3):
        calls = [weights(rng, len(vocab), "logsumexp", i) for i in range(12)]
        check(reference, [("logsumexp", ws) for ws in calls], asyncio.run(run(calls)))
        figures.served += len(calls)

    async def close_while_computing():
        stress_trie.hold_next()
        calls = [weights(rng, len(vocab), "sum", i) for i in range(20)]
        tasks = [asyncio.create_task(async_trie.weight_sum(ws)) for ws in calls]
        await asyncio.to_thread(stress_trie.entered.wait, WAIT_S)
        closing = asyncio.create_task(async_trie.aclose())
        outcomes = await settle(tasks)
        assert not stress_trie.returned.is_set()  # failed while the batch still computed
        stress_trie.release.set()
        await closing
        # The held batch then runs to completion in its thread; nobody gets its values.
        assert await asyncio.to_thread(stress_trie.returned.wait, WAIT_S)
        with pytest.raises(BatcherClosedError, match="closed"):
            await async_trie.weight_sum(calls[0])
        return outcomes

    outcomes = asyncio.run(close_while_computing())
    assert all(isinstance(o, BatcherClosedError) for o in outcomes)
    figures.failed_as_intended += len(outcomes) + 1
