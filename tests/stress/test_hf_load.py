"""Load: 200 SMC-like particles make 2,000 concurrent calls to AsyncTransformer under small budgets.

Each particle extends its context by one to three random tokens per step,
sometimes branches off an earlier prefix, and sometimes copies another
particle's context (resampling). Every result is compared with a plain
uncached forward (1e-4 absolute). The cache budgets are small enough that
both caches evict throughout; their retained bytes are sampled from a thread
and must never exceed the budgets. After each half of the run, the tensors
still alive (found through the garbage collector, so allocator noise does not
count) hold no more than the two budgets: nothing leaks. The peak heap in use
(glibc's count, free of the allocator's slack) must stay within the memory
budget; peak RSS is reported, not bounded.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from genlm_backend.llm.hf import AsyncTransformer
from tests.stress.helpers import (
    MIB,
    PeakSampler,
    ReferenceChecker,
    heap_in_use_bytes,
    live_tensor_bytes,
    resting_rss_bytes,
)

pytestmark = pytest.mark.stress

NUM_PARTICLES = 200
NUM_STEPS = 10  # per half: 2 x 5 steps x 200 particles = 2,000 calls
BATCH_SIZE = 32
KV_BUDGET_BYTES = 4 * MIB
OUTPUT_BUDGET_BYTES = 8 * MIB
CHECK_CHUNK = 32
"""Results the checker holds before comparing them (with as many reference rows)."""
WORKING_ALLOWANCE_BYTES = 160 * MIB
"""Heap in use besides the caches: the batch's [32, V] logits and log-probabilities
(6 MiB each), the particles' results waiting for the checker (CHECK_CHUNK x 192 KiB),
its reference forward's rows (the same again, plus logits), and what the first forwards
allocate once. Runs measured 131.6 MiB (first half) and 41 MiB (second), the same to
0.2 MiB from run to run. (RSS, which also counts the freed pages glibc keeps in
per-thread arenas, varied from 96 to 150 MiB between runs: no figure to bound.)"""
SMALL_TENSORS_BYTES = 1 * MIB
"""Live tensor bytes besides the caches allowed after a half (the last context's ids and the like)."""


class Particles:
    """``NUM_PARTICLES`` contexts stepping concurrently; results go to ``checker``."""

    def __init__(self, llm: AsyncTransformer, checker: ReferenceChecker, seed: int):
        self.llm = llm
        self.checker = checker
        self.rng = random.Random(seed)
        vocab = llm.vocab_size
        prompts = [
            tuple(self.rng.randrange(vocab) for _ in range(self.rng.randint(3, 8)))
            for _ in range(5)
        ]
        self.contexts = [self.rng.choice(prompts) for _ in range(NUM_PARTICLES)]

    def _move(self, i: int) -> tuple[int, ...]:
        rng, context = self.rng, self.contexts[i]
        kind = rng.random()
        if kind < 0.2:  # resampling: this particle continues another one's context
            context = self.contexts[rng.randrange(NUM_PARTICLES)]
        elif kind < 0.3:  # a branch off an earlier prefix
            context = context[: rng.randint(1, len(context))]
        extension = tuple(
            rng.randrange(self.llm.vocab_size) for _ in range(rng.choice((1, 1, 1, 2, 3)))
        )
        self.contexts[i] = context + extension
        return self.contexts[i]

    async def _particle(self, i: int, num_steps: int) -> None:
        for _ in range(num_steps):
            context = self._move(i)
            self.checker.add(context, await self.llm.next_token_logprobs(context))

    async def run(self, num_steps: int) -> None:
        await asyncio.gather(*(self._particle(i, num_steps) for i in range(NUM_PARTICLES)))


MEMORY_BUDGET_BYTES = KV_BUDGET_BYTES + OUTPUT_BUDGET_BYTES + WORKING_ALLOWANCE_BYTES


async def test_two_thousand_particle_calls_are_exact_and_stay_within_budgets(
    llama_copy, stress_figures
):
    model, reference_model, tokenizer = llama_copy
    figures = stress_figures("hf tiny-llama")
    llm = AsyncTransformer(
        model,
        tokenizer,
        batch_size=BATCH_SIZE,
        kv_cache_bytes=KV_BUDGET_BYTES,
        output_cache_bytes=OUTPUT_BUDGET_BYTES,
    )
    checker = ReferenceChecker(reference_model, llm.vocab_size, chunk=CHECK_CHUNK)
    checker.add([1, 2, 3], await llm.next_token_logprobs([1, 2, 3]))  # warm-up
    checker.flush()
    llm.clear_cache()
    particles = Particles(llm, checker, seed=0)
    baseline, tensors_baseline = resting_rss_bytes(), live_tensor_bytes()
    start = time.perf_counter()
    peaks, heap_peaks, retained = [], [], []
    with (
        PeakSampler(lambda: llm.kv_cache.bytes_held) as kv_peak,
        PeakSampler(lambda: llm.output_cache.stats.bytes_held) as output_peak,
    ):
        for _ in range(2):
            heap_start = heap_in_use_bytes()  # None off glibc: not measured
            with (
                PeakSampler() as rss_peak,
                PeakSampler(lambda: heap_in_use_bytes() or 0) as heap_peak,
            ):
                await particles.run(NUM_STEPS // 2)
                checker.flush()
            peaks.append(rss_peak.peak - baseline)
            if heap_start is not None:
                heap_peaks.append(heap_peak.peak - heap_start)
            retained.append(live_tensor_bytes() - tensors_baseline)
    figures.wall_s = time.perf_counter() - start

    assert checker.num_checked == 1 + NUM_PARTICLES * NUM_STEPS
    assert kv_peak.peak <= KV_BUDGET_BYTES and output_peak.peak <= OUTPUT_BUDGET_BYTES
    assert llm.kv_cache.stats.num_evictions > 0 and llm.output_cache.stats.num_evictions > 0
    stats = llm.stats
    assert stats.kv_cache_bytes == llm.kv_cache.bytes_held <= KV_BUDGET_BYTES
    assert stats.output_cache_bytes <= OUTPUT_BUDGET_BYTES
    assert stats.num_tokens_computed < stats.num_tokens_requested  # prefixes were reused
    for heap_peak_bytes in heap_peaks:
        assert heap_peak_bytes <= MEMORY_BUDGET_BYTES, f"heap grew {heap_peak_bytes / MIB:.0f} MiB"
    for tensors in retained:
        assert tensors <= KV_BUDGET_BYTES + OUTPUT_BUDGET_BYTES + SMALL_TENSORS_BYTES, retained
    stats = llm.batcher_stats
    assert stats.num_pending == 0 and stats.num_inflight == 0

    figures.served, figures.max_error = checker.num_checked, checker.max_error
    figures.peak_rss_growth_bytes = max(peaks)
    figures.rss_budget_bytes = MEMORY_BUDGET_BYTES  # bounds the heap in use, not RSS
    figures.peak_cache_bytes = kv_peak.peak + output_peak.peak
    figures.cache_budget_bytes = KV_BUDGET_BYTES + OUTPUT_BUDGET_BYTES
    await llm.aclose()
