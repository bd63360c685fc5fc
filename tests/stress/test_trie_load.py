"""Load: 200 particles make 2,000 concurrent AsyncTokenCharacterTrie calls over the GPT-2 vocabulary.

Calls mix ``weight_sum``, ``weight_max`` and ``weight_logsumexp``; a fifth
reuse another particle's weights. Every result equals the float64 sequential
trie (max exactly, of the float32-rounded weights; sum and logsumexp within
1e-5 relative, as in tests/test_trie.py). The heap in use (allocator slack
excluded) stays within a budget in each half of the run, and the second half
needs no more than the first; afterwards the batcher is empty and no tensor
of the run is left alive.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from genlm_backend.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie
from tests.stress.helpers import (
    PeakSampler,
    heap_in_use_bytes,
    live_tensor_bytes,
    resting_rss_bytes,
)
from tests.stress.trie_helpers import OPS, check, weights

pytestmark = pytest.mark.stress

NUM_PARTICLES, NUM_STEPS = 200, 10
HEAP_BUDGET_BATCH_OUTPUTS = 16
"""Heap in use at once during the run, in batch outputs (``[64, num_nodes]`` float32,
36 MiB for GPT-2): each result waiting for the checker (up to 128) is a row of its
batch's output and keeps all of it alive; add the batch computing (its input, work rows
and output) and the particles' weights. Runs measured 450 and 474 MiB for the two halves
(13.1 outputs), the same to 0.1 MiB from run to run; RSS, which counts the freed pages
glibc keeps, measured 588-629 MiB."""


async def test_two_thousand_particle_calls_match_the_sequential_trie(tries, stress_figures):
    vocab, reference = tries
    figures = stress_figures("trie gpt2")
    async_trie = AsyncTokenCharacterTrie(ParallelTokenCharacterTrie(vocab), batch_size=64)
    rng = np.random.default_rng(0)
    last: list[torch.Tensor | None] = [None] * NUM_PARTICLES
    held: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (op, weights, result)

    def check_held() -> None:
        check(reference, [(op, ws) for op, ws, _ in held], [got for _, _, got in held])
        figures.served += len(held)
        held.clear()

    async def particle(i: int, half: int) -> None:
        for step in range(half * NUM_STEPS // 2, (half + 1) * NUM_STEPS // 2):
            op = OPS[(i + step) % 3]
            other = last[int(rng.integers(NUM_PARTICLES))]
            # A fifth reuse another particle's weights when they are of the right kind.
            if other is not None and rng.random() < 0.2 and (other[1] < 0) == (op == "logsumexp"):
                ws = other
            else:
                ws = weights(rng, len(vocab), op, number=i)
            last[i] = ws
            held.append((op, ws, await getattr(async_trie, f"weight_{op}")(ws)))
            if len(held) >= 128:  # check in chunks, so few results are held at once
                check_held()

    # Warm-up (not counted): batches of every operation, so the trie's lazily built index
    # tensors exist before the baseline.
    for op in OPS:
        await asyncio.gather(
            *(getattr(async_trie, f"weight_{op}")(torch.ones(len(vocab))) for _ in range(64))
        )
    baseline = live_tensor_bytes()
    start = time.perf_counter()
    start_rss = resting_rss_bytes()
    heap_start = heap_in_use_bytes()  # None off glibc: not measured
    heap_peaks = []
    with PeakSampler() as rss:
        for half in range(2):
            with PeakSampler(lambda: heap_in_use_bytes() or 0) as heap_peak:
                await asyncio.gather(*(particle(i, half) for i in range(NUM_PARTICLES)))
            heap_peaks.append(heap_peak.peak - (heap_start or 0))
    check_held()
    figures.wall_s = time.perf_counter() - start
    assert figures.served == NUM_PARTICLES * NUM_STEPS
    stats = async_trie.batcher_stats
    assert stats.num_pending == stats.num_inflight == 0 and stats.mean_batch_size > 10
    last.clear()
    # The loop drops its last finished futures (and their results) on its next passes.
    for _ in range(2):
        await asyncio.sleep(0)
    assert live_tensor_bytes() - baseline < 1 << 20  # nothing of the run is left alive
    figures.peak_rss_growth_bytes = rss.peak - start_rss
    # Bounded, and not growing with the number of calls: the second half holds at
    # most one batch output more than the first (results pinned across the halves).
    if heap_start is not None:
        batch_output_bytes = 64 * async_trie.trie.num_nodes * 4
        assert max(heap_peaks) <= HEAP_BUDGET_BATCH_OUTPUTS * batch_output_bytes, heap_peaks
        assert heap_peaks[1] <= heap_peaks[0] + batch_output_bytes, heap_peaks
    await async_trie.aclose()
