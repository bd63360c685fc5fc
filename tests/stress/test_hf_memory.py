"""Working memory of one AsyncTransformer batch: long fresh prompts must not cost ``[B, K, V]`` logits.

A batch of ``B`` fresh contexts of ``K`` tokens needs logits only at each
row's last token: ``[B, V]``. Computing them at every position would take
``B * K * V`` floats (here 8 x 400 x 49,152 x 4 bytes = 600 MiB) for nothing.
The test samples this process's RSS while such a batch runs and bounds its
growth well below that, then checks the rows against uncached forwards (1e-4).
"""

from __future__ import annotations

import random

import pytest

from genlm_backend.llm.hf import AsyncTransformer
from tests.stress.helpers import (
    MIB,
    PeakSampler,
    ReferenceChecker,
    fresh_contexts,
    resting_rss_bytes,
)

pytestmark = pytest.mark.stress

NUM_CONTEXTS, CONTEXT_LENGTH = 8, 400
WORKING_MEMORY_BUDGET_BYTES = 128 * MIB
"""Activations (attention scores: 8 x 2 heads x 400 x 400 floats = 10 MiB), the
keys/values block, the [B, V] rows and the allocator's slack."""


def test_a_batch_of_long_prompts_keeps_logits_of_last_tokens_only(llama_copy, stress_figures):
    model, reference_model, tokenizer = llama_copy
    figures = stress_figures("hf tiny-llama")
    llm = AsyncTransformer(model, tokenizer, batch_size=NUM_CONTEXTS, output_cache_bytes=0)
    llm.next_token_logprobs_sync([1, 2, 3])  # warm-up
    rng = random.Random(0)
    contexts = fresh_contexts(
        rng, llm.vocab_size, NUM_CONTEXTS, lengths=(CONTEXT_LENGTH, CONTEXT_LENGTH)
    )
    start = resting_rss_bytes()  # freed memory of earlier tests handed back first
    with PeakSampler() as rss:
        rows = llm.batch_next_token_logprobs_sync(contexts)
    growth = rss.peak - start
    figures.peak_rss_growth_bytes, figures.rss_budget_bytes = growth, WORKING_MEMORY_BUDGET_BYTES
    assert llm.stats.num_batches == 2  # warm-up, then one batch of all eight
    checker = ReferenceChecker(reference_model, llm.vocab_size)
    for context, row in zip(contexts, rows):
        checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked
    assert growth <= WORKING_MEMORY_BUDGET_BYTES, f"one batch took {growth / MIB:.0f} MiB"
    llm.close()
