"""Long prefills in chunks: a step in the event loop's thread computes at most ``chunk_tokens``
tokens, and the loop runs between chunks; rows stay those of a plain forward."""

from __future__ import annotations

import asyncio

import pytest

from genlm_backend.llm.hf import AsyncTransformer
from tests.conftest import build_tiny_llama
from tests.hf_reference import assert_matches_reference

VOCAB = 256


def tiny_llm(**options) -> AsyncTransformer:
    vocab = [bytes([i]) for i in range(VOCAB)]
    return AsyncTransformer(build_tiny_llama(VOCAB), None, byte_vocab=vocab, **options)


def first_batch(prefix_tokens: int = 190, num_particles: int = 16) -> list[list[int]]:
    prompt = [(7 * i + 3) % VOCAB for i in range(prefix_tokens)]
    return [[*prompt, i, (i * 5) % VOCAB] for i in range(num_particles)]


async def test_a_coroutine_scheduled_during_a_long_prefill_runs_before_it_ends():
    llm = tiny_llm(chunk_tokens=32)
    contexts = first_batch()
    chunks_seen: list[int] = []
    rows_done = asyncio.Event()

    async def bystander():
        # Scheduled after the particles' calls: runs whenever the loop gets a turn.
        while not rows_done.is_set():
            chunks_seen.append(llm.engine.counts["chunks"])
            await asyncio.sleep(0)

    async def particles():
        rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
        rows_done.set()
        return rows

    rows, _ = await asyncio.gather(particles(), bystander())
    num_chunks = llm.engine.counts["chunks"]
    assert num_chunks >= 190 // 32  # the shared prefix alone takes this many
    # The bystander ran between chunks, not only before the first or after the last.
    assert any(0 < seen < num_chunks for seen in chunks_seen), (chunks_seen, num_chunks)
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    llm.close()


async def test_a_coroutine_woken_during_a_chunk_runs_before_the_next_chunk():
    """A timer that comes due while a chunk holds the loop (a ticker, a timeout) fires before
    the next chunk starts: the loop gets a whole turn between chunks."""
    llm = tiny_llm(chunk_tokens=32)
    loop = asyncio.get_running_loop()
    wake = [loop.create_future()]
    woken_before: list[int] = []  # at each chunk's start: the wakes that ran before it
    num_woken = [0]
    advance = llm.runner.advance

    def chunk(requests, max_tokens):
        woken_before.append(num_woken[0])
        computed = advance(requests, max_tokens)
        if computed:
            loop.call_later(0, wake[0].set_result, None)  # due at once, fires after this step
        return computed

    llm.runner.advance = chunk

    async def bystander():
        while True:
            await wake[0]
            wake[0] = loop.create_future()
            num_woken[0] += 1

    watcher = asyncio.ensure_future(bystander())
    contexts = first_batch()
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    watcher.cancel()
    num_chunks = llm.engine.counts["chunks"]
    assert num_chunks >= 190 // 32
    # chunk i started after the bystander's wake for each of the i chunks before it
    assert woken_before[: num_chunks + 1] == list(range(num_chunks + 1)), woken_before
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    llm.close()


async def test_no_step_computes_a_chunk_and_the_rows_together():
    """A shared prefix's last piece, shorter than a chunk, is a step of its own: the rows' step
    computes only the rows' own tokens (computed with them, the piece made that step the
    longest: a loop held for a chunk and the rows' pass at once)."""
    llm = tiny_llm(chunk_tokens=64)
    contexts = first_batch(prefix_tokens=170, num_particles=6)  # 64 + 64 + 42, then 6 rows
    computed = llm.runner.driver
    per_step: list[int] = []
    step = llm.engine.batcher.step

    def counted(todo):
        before = computed.num_tokens_computed
        outcome = step(todo)
        per_step.append(computed.num_tokens_computed - before)
        return outcome

    llm.engine.batcher.step = counted
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    assert per_step == [64, 64, 42, 6 * 2], per_step  # then each row its own two tokens
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    llm.close()


@pytest.mark.parametrize("compute_in_loop", [True, False])
async def test_steps_are_cut_only_in_the_loop_s_thread(compute_in_loop):
    llm = tiny_llm(chunk_tokens=32, compute_in_loop=compute_in_loop)
    contexts = first_batch(prefix_tokens=100, num_particles=4)
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    assert (llm.engine.counts["chunks"] > 0) == compute_in_loop
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    llm.close()


async def test_a_chunked_scoring_batch_scores_as_a_plain_forward():
    llm = tiny_llm(chunk_tokens=16)
    context = [(3 * i + 1) % VOCAB for i in range(80)]
    continuation = [5, 9, 2, 200, 17]
    scores = await llm.continuation_logprobs(context, continuation)
    assert llm.engine.counts["chunks"] > 0
    plain = llm.next_token_logprobs_uncached
    expected = [float(plain(context + continuation[:i])[t]) for i, t in enumerate(continuation)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-4)
    llm.close()


@pytest.mark.parametrize("deterministic", [False, True])
async def test_a_prefill_the_cache_cannot_hold_is_computed_whole(deterministic):
    """Under a budget smaller than the prompt's keys/values, a chunk the tree cannot keep is no
    progress: the batch runs as one pass (chunking on would never end), and its rows are exact."""
    llm = tiny_llm(chunk_tokens=16, kv_cache_bytes=20_000, deterministic=deterministic)
    contexts = first_batch(prefix_tokens=120, num_particles=3)
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    assert llm.kv_cache.bytes_held <= 20_000
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    llm.close()


async def test_chunking_that_never_progresses_ends_in_one_pass():
    """A runner whose chunks are never kept (each step reports a chunk computed, and the next
    finds nothing cached): the prefill's chunk steps are bounded by its cost, then the batch
    runs as one pass and its rows are exact."""
    llm = tiny_llm(chunk_tokens=16)
    llm.runner.advance = lambda requests, max_tokens: max_tokens  # computes "a chunk", keeps none
    contexts = first_batch(prefix_tokens=100, num_particles=2)
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    # the cost at the first chunk: two rows of 102 uncached tokens, plus the chunk's 16
    assert llm.engine.counts["chunks"] == (2 * 102 + 16) // 16 + 1
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    llm.close()


async def test_particles_behind_a_long_prompt_step_without_a_chunk_search():
    """Each particle's step costs its last token: the chunk check finds that by each parent's
    identity, with no lookup of the contexts (the runner's pass looks them up once, or not at
    all when it is planned from the step before)."""
    llm = tiny_llm(chunk_tokens=64)
    contexts = first_batch(prefix_tokens=170, num_particles=6)
    await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    driver = llm.runner.driver
    lookups = []
    lookup = driver.lookup
    driver.lookup = lambda *args, **kwargs: lookups.append(args[0]) or lookup(*args, **kwargs)
    for step in range(3):
        contexts = [[*c, step] for c in contexts]
        rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    # At most one a step, the pass's: the first step's, then none where a step is planned
    # from the last one (the steps after the first write in place).
    assert 1 <= len(lookups) < 3
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    llm.close()
