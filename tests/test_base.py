"""The AsyncLM contract, exercised through MockAsyncLM.

The reference for every value is a fresh MockAsyncLM instance (the mock is a
pure function of the context), so caching, batching and deduplication are
checked against an independent computation.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from genlm_backend.errors import BackendClosedError, BatcherClosedError
from genlm_backend.llm import LMStats, MockAsyncLM
from genlm_backend.llm.base import OUTPUT_CACHE_INITIAL_BYTES
from genlm_backend.llm.runner import Request

SMALL_VOCAB = [bytes([b]) for b in b"abcdefghijkl"]
V = len(SMALL_VOCAB)
MAX_CONTEXT = 8
TOL = 1e-6


def make_llm(**kwargs) -> MockAsyncLM:
    kwargs.setdefault("max_context_length", MAX_CONTEXT)
    return MockAsyncLM(byte_vocab=SMALL_VOCAB, **kwargs)


def reference(context) -> torch.Tensor:
    """The next-token log-probabilities of a fresh, uncached mock."""
    return MockAsyncLM(byte_vocab=SMALL_VOCAB, output_cache_bytes=0).next_token_logprobs_sync(
        list(context)
    )


@pytest.fixture
def llm():
    llm = make_llm()
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def gpt2_llm(gpt2_tokenizer):
    """A mock over the real GPT-2 vocabulary (50,257 tokens)."""
    try:
        from genlm_backend.tokenization import decode_vocab  # noqa: F401
    except ImportError:
        # Vocabulary decoding lands separately; the mock only needs the vocabulary's size.
        tokens = gpt2_tokenizer.convert_ids_to_tokens(list(range(len(gpt2_tokenizer))))
        return MockAsyncLM(byte_vocab=[t.encode() for t in tokens])
    return MockAsyncLM(gpt2_tokenizer)


# ---------------------------------------------------------------- output contract


def check_row(row: torch.Tensor, llm, context) -> None:
    assert row.dtype == torch.float32
    assert row.shape == (llm.vocab_size,)
    assert row.device == llm.device
    assert abs(torch.logsumexp(row, dim=-1).item()) < 1e-5
    torch.testing.assert_close(row, llm_reference(llm, context), atol=TOL, rtol=0)


def llm_reference(llm, context) -> torch.Tensor:
    fresh = MockAsyncLM(byte_vocab=llm.byte_vocab, output_cache_bytes=0)
    return fresh.next_token_logprobs_sync(list(context))


@pytest.mark.parametrize("which", ["small", "gpt2"])
async def test_output_contract_on_every_entry_point(which, request):
    llm = make_llm() if which == "small" else request.getfixturevalue("gpt2_llm")
    contexts = [[0], [1, 2, 3], [5, 5]]
    check_row(await llm.next_token_logprobs(contexts[1]), llm, contexts[1])
    check_row(llm.next_token_logprobs_sync(contexts[2]), llm, contexts[2])
    batch = await llm.batch_next_token_logprobs(contexts)
    assert batch.shape == (3, llm.vocab_size) and batch.dtype == torch.float32
    for row, context in zip(batch, contexts):
        check_row(row, llm, context)
    batch_sync = llm.batch_next_token_logprobs_sync(contexts)
    torch.testing.assert_close(batch_sync, batch, atol=TOL, rtol=0)


async def test_distinct_contexts_get_distinct_rows(llm):
    rows = await llm.batch_next_token_logprobs([[1], [2], [1, 2], [2, 1]])
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.allclose(rows[i], rows[j])


# ---------------------------------------------------------------- fresh tensors


async def test_mutating_results_never_corrupts_later_results(llm):
    context = [3, 1, 4]
    expected = reference(context)
    first = await llm.next_token_logprobs(context)  # computed
    first.fill_(0.0)
    cached = await llm.next_token_logprobs(context)  # from the output cache
    torch.testing.assert_close(cached, expected, atol=TOL, rtol=0)
    cached.fill_(1.0)
    sync = llm.next_token_logprobs_sync(context)
    torch.testing.assert_close(sync, expected, atol=TOL, rtol=0)
    sync.fill_(2.0)
    batch = await llm.batch_next_token_logprobs([context, context])
    batch.fill_(3.0)
    batch_sync = llm.batch_next_token_logprobs_sync([context])
    batch_sync.fill_(4.0)
    torch.testing.assert_close(await llm.next_token_logprobs(context), expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("output_cache_bytes", [0, 1 << 20])
async def test_deduplicated_results_are_independent_tensors(output_cache_bytes):
    llm = make_llm(output_cache_bytes=output_cache_bytes)
    context = [7, 7, 7]
    expected = reference(context)
    a, b = await asyncio.gather(llm.next_token_logprobs(context), llm.next_token_logprobs(context))
    assert llm.stats.num_contexts_computed == 1
    a.fill_(0.0)
    torch.testing.assert_close(b, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(await llm.next_token_logprobs(context), expected, atol=TOL, rtol=0)
    llm.close()


def record_runner_outputs(llm) -> list[torch.Tensor]:
    """The tensors ``llm``'s runner returns from now on, in order."""
    outputs: list[torch.Tensor] = []
    run = llm.runner.run

    def recording_run(requests):
        outputs.append(run(requests))
        return outputs[-1]

    llm.runner.run = recording_run
    return outputs


@pytest.mark.parametrize("output_cache_bytes", [0, 1 << 20])
async def test_a_batch_computed_for_its_caller_alone_is_the_runner_output_itself(
    output_cache_bytes,
):
    llm = make_llm(output_cache_bytes=output_cache_bytes)
    outputs = record_runner_outputs(llm)
    contexts = [[1, 2], [1, 3], [4]]
    batch = await llm.batch_next_token_logprobs(contexts)
    sync = llm.batch_next_token_logprobs_sync([[5, 6], [7]])
    one = await llm.batch_next_token_logprobs([[8]])
    assert [r.data_ptr() for r in (batch, sync, one)] == [out.data_ptr() for out in outputs]
    if output_cache_bytes:  # the cache holds views of the same output: no copy made
        held = llm.output_cache.get(Request(None, (1, 3)))
        assert held.untyped_storage().data_ptr() == outputs[0].data_ptr()
    for rows, batch_contexts in ((batch, contexts), (sync, [[5, 6], [7]]), (one, [[8]])):
        expected = torch.stack([reference(context) for context in batch_contexts])
        torch.testing.assert_close(rows, expected, atol=TOL, rtol=0)
        rows.fill_(0.0)  # the caller's own: the cache drops its views, later results are unchanged
    for context in contexts + [[5, 6], [7], [8]]:
        torch.testing.assert_close(
            await llm.next_token_logprobs(context), reference(context), atol=TOL, rtol=0
        )
    assert llm.stats.num_output_cache_hits == 0 and llm.stats.num_contexts_computed == 12
    llm.close()


async def test_a_particle_s_row_is_a_view_of_its_step_s_output():
    llm = make_llm()
    outputs = record_runner_outputs(llm)
    contexts = [[1], [2], [3]]
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    assert len(outputs) == 1 and all(row._base is outputs[0] for row in rows)
    rows[1].fill_(0.0)  # one caller's write: nobody else's row changes, no cached row is served
    for row, context in zip((rows[0], rows[2]), ([1], [3])):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    again = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    for row, context in zip(again, contexts):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    assert llm.stats.num_output_cache_hits == 0  # the step's output was written to: recomputed
    llm.close()


async def test_a_cache_of_copies_lets_the_runner_output_go_with_its_callers():
    """``output_cache_views=False`` (a client of a server, whose rows are lent memory): the
    callers hold the runner's output, the cache copies of its rows."""
    llm = make_llm(output_cache_views=False)
    outputs = record_runner_outputs(llm)
    contexts = [[1, 2], [1, 3], [4]]
    batch = await llm.batch_next_token_logprobs(contexts)
    assert batch.data_ptr() == outputs[0].data_ptr()  # the callers' rows: no copy
    held = llm.output_cache.get(Request(None, (1, 3)))
    assert held.untyped_storage().data_ptr() != outputs[0].data_ptr()  # the cache's own copy
    outputs[0].fill_(0.0)  # whatever becomes of the runner's output, the cache's rows stay
    for context in contexts:
        torch.testing.assert_close(
            await llm.next_token_logprobs(context), reference(context), atol=TOL, rtol=0
        )
    assert llm.stats.num_output_cache_hits == 3
    llm.close()


async def test_a_batch_sharing_rows_with_other_callers_shares_no_memory_with_them():
    llm = make_llm(output_cache_bytes=0)
    outputs = record_runner_outputs(llm)
    for joiner in (
        llm.next_token_logprobs([1, 3]),
        llm.batch_next_token_logprobs([[1, 3]]),
    ):
        # The joiner's context is one of the batch's: one runner output of exactly its rows.
        batch, joined = await asyncio.gather(
            llm.batch_next_token_logprobs([[1, 2], [1, 3]]), joiner
        )
        assert outputs[-1].shape[0] == 2
        assert batch.untyped_storage().data_ptr() != joined.untyped_storage().data_ptr()
        batch.fill_(0.0)
        torch.testing.assert_close(joined.reshape(-1), reference([1, 3]), atol=TOL, rtol=0)
    # A batch with a cached row, or the same context twice, is stacked too.
    cached = make_llm()
    await cached.next_token_logprobs([1, 2])
    outputs = record_runner_outputs(cached)
    for batch_contexts in ([[1, 2], [4, 4]], [[5], [5]]):
        rows = await cached.batch_next_token_logprobs(batch_contexts)
        assert rows.data_ptr() != outputs[-1].data_ptr()
        expected = torch.stack([reference(context) for context in batch_contexts])
        torch.testing.assert_close(rows, expected, atol=TOL, rtol=0)
    llm.close()
    cached.close()


async def test_the_output_cache_grows_into_its_budget_once_an_evicted_row_is_asked_again():
    """Steps of new contexts (particles extending their own) leave the output cache at its
    initial limit; a request for a row it evicted doubles the limit, and is answered
    exactly, recomputed."""
    vocab = [b"<%d>" % i for i in range(49152)]
    llm = MockAsyncLM(byte_vocab=vocab)
    block_bytes = 64 * len(vocab) * 4  # a step of 64 contexts: 12.6 MB
    initial = OUTPUT_CACHE_INITIAL_BYTES
    assert 2 * block_bytes <= initial < 3 * block_bytes <= llm.output_cache.budget_bytes
    steps = [[[step, particle] for particle in range(64)] for step in range(5)]
    for contexts in steps[:3]:
        await llm.batch_next_token_logprobs(contexts)
        assert llm.output_cache.stats.bytes_held <= initial
    assert llm.output_cache.stats.limit_bytes == initial
    assert llm.stats.num_output_cache_hits == 0
    (row,) = await llm.batch_next_token_logprobs(steps[0][:1])  # evicted: recomputed
    assert llm.stats.num_output_cache_hits == 0
    assert llm.output_cache.stats.limit_bytes == 2 * initial
    fresh = MockAsyncLM(byte_vocab=vocab, output_cache_bytes=0)
    torch.testing.assert_close(row, fresh.next_token_logprobs_sync(steps[0][0]), atol=0, rtol=0)
    for contexts in steps[3:]:  # two more steps: the initial limit would have evicted steps[1]
        await llm.batch_next_token_logprobs(contexts)
    await llm.batch_next_token_logprobs(steps[1])
    assert llm.stats.num_output_cache_hits == 64
    llm.close()
    fresh.close()


async def test_a_batch_of_cached_rows_is_one_fresh_copy_of_them(monkeypatch):
    """Rows a step reads from the output cache are views of one copy made for that step: a
    batch call whose rows all were cached gets that copy itself (not stacked again), and its
    writes reach no cached row and no other caller."""
    llm = make_llm()
    contexts = [[1, 2], [1, 3], [4]]
    computed = await llm.batch_next_token_logprobs(contexts)
    outputs = record_runner_outputs(llm)
    stacked = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacked.append(1) or stack(*a, **k))
    batch = await llm.batch_next_token_logprobs(contexts)
    monkeypatch.undo()
    assert stacked == []  # the step's one copy is the batch: no second, stacked copy
    assert outputs == [] and llm.stats.num_output_cache_hits == 3
    assert batch.untyped_storage().data_ptr() != computed.untyped_storage().data_ptr()
    single = await llm.next_token_logprobs([1, 3])  # read in a later step: its own copy
    assert single.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    batch.fill_(0.0)
    torch.testing.assert_close(single, reference([1, 3]), atol=TOL, rtol=0)
    for context in contexts:
        torch.testing.assert_close(
            await llm.next_token_logprobs(context), reference(context), atol=TOL, rtol=0
        )
    llm.close()


# ---------------------------------------------------------------- input validation

BAD_INPUTS = [
    pytest.param([], ValueError, "empty", id="empty"),
    pytest.param([1.0], TypeError, "token_ids[0]", id="float"),
    pytest.param([1, "2"], TypeError, "token_ids[1]", id="str-element"),
    pytest.param([None], TypeError, "NoneType", id="none"),
    pytest.param([True], TypeError, "bool", id="bool"),
    pytest.param(torch.tensor([1.0, 2.0]), TypeError, "integer dtype", id="float-tensor"),
    pytest.param(torch.tensor([True]), TypeError, "integer dtype", id="bool-tensor"),
    pytest.param(np.array([1.5]), TypeError, "integer dtype", id="float-array"),
    pytest.param([-1], ValueError, "token_ids[0] = -1 is outside", id="negative"),
    pytest.param([0, V], ValueError, f"token_ids[1] = {V} is outside", id="too-large"),
    pytest.param(
        list(range(MAX_CONTEXT + 1)), ValueError, "more than the model's context", id="too-long"
    ),
    pytest.param("abc", TypeError, "sequence of ints", id="str"),
    pytest.param(5, TypeError, "sequence of ints", id="int"),
    pytest.param(torch.tensor([[1, 2]]), TypeError, "1-D", id="2d-tensor"),
    pytest.param(np.array([[1, 2]]), TypeError, "1-D", id="2d-array"),
    pytest.param(torch.tensor(3), TypeError, "1-D", id="0d-tensor"),
]


@pytest.mark.parametrize("bad, error, message", BAD_INPUTS)
async def test_bad_input_raises_before_model_work(llm, bad, error, message):
    before = llm.stats
    with pytest.raises(error) as info:
        await llm.next_token_logprobs(bad)
    assert message in str(info.value)
    with pytest.raises(error, match=None) as info:
        llm.next_token_logprobs_sync(bad)
    assert message in str(info.value)
    with pytest.raises(error):
        await llm.batch_next_token_logprobs([[1], bad])
    with pytest.raises(error):
        llm.batch_next_token_logprobs_sync([[1], bad])
    with pytest.raises(error):
        await llm.sample(bad, max_tokens=2, eos_token_ids=[])
    assert llm.stats == before


@pytest.mark.parametrize("bad, error, message", BAD_INPUTS)
async def test_bad_input_does_not_affect_concurrent_requests(llm, bad, error, message):
    good = [[1, 2], [3], [1, 2, 3]]
    outcomes = await asyncio.gather(
        llm.next_token_logprobs(good[0]),
        llm.next_token_logprobs(bad),
        llm.next_token_logprobs(good[1]),
        llm.batch_next_token_logprobs([good[2], bad]),
        llm.next_token_logprobs(good[2]),
        return_exceptions=True,
    )
    assert isinstance(outcomes[1], error) and message in str(outcomes[1])
    assert isinstance(outcomes[3], error)
    for outcome, context in zip([outcomes[0], outcomes[2], outcomes[4]], good):
        torch.testing.assert_close(outcome, reference(context), atol=TOL, rtol=0)


async def test_bad_list_of_contexts(llm):
    with pytest.raises(ValueError, match="empty"):
        await llm.batch_next_token_logprobs([])
    with pytest.raises(TypeError, match="list of contexts"):
        llm.batch_next_token_logprobs_sync("abc")
    with pytest.raises(TypeError, match="list of contexts"):
        await llm.batch_next_token_logprobs(7)


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(np.array([1, 2, 3], dtype=np.int32), id="int32-array"),
        pytest.param(np.array([1, 2, 3], dtype=np.uint8), id="uint8-array"),
        pytest.param(torch.tensor([1, 2, 3]), id="int64-tensor"),
        pytest.param(torch.tensor([1, 2, 3], dtype=torch.int16), id="int16-tensor"),
        pytest.param([np.int64(1), np.int32(2), 3], id="numpy-scalars"),
        pytest.param((1, 2, 3), id="tuple"),
        pytest.param(range(1, 4), id="range"),
    ],
)
async def test_integer_inputs_of_any_kind_are_accepted(llm, ids):
    expected = reference([1, 2, 3])
    torch.testing.assert_close(await llm.next_token_logprobs(ids), expected, atol=TOL, rtol=0)
    torch.testing.assert_close(llm.next_token_logprobs_sync(ids), expected, atol=TOL, rtol=0)


# ---------------------------------------------------------------- sync bridge and loops


def test_sync_works_without_an_event_loop(llm):
    torch.testing.assert_close(
        llm.next_token_logprobs_sync([4, 2]), reference([4, 2]), atol=TOL, rtol=0
    )
    rows = llm.batch_next_token_logprobs_sync([[4, 2], [2, 4]])
    torch.testing.assert_close(rows[1], reference([2, 4]), atol=TOL, rtol=0)


async def test_sync_works_inside_a_running_loop(llm):
    pending = asyncio.ensure_future(llm.next_token_logprobs([6]))
    row = llm.next_token_logprobs_sync([4, 2])
    torch.testing.assert_close(row, reference([4, 2]), atol=TOL, rtol=0)
    torch.testing.assert_close(await pending, reference([6]), atol=TOL, rtol=0)


def test_one_object_serves_several_asyncio_runs(llm):
    for run in range(3):
        contexts = [[run], [run, 1], [run, 2]]

        async def main(contexts):
            return await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))

        for row, context in zip(asyncio.run(main(contexts)), contexts):
            torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    assert llm.stats.num_batches == 3  # one batch per run: each loop batches its requests


async def test_concurrent_requests_share_batches(llm):
    contexts = [[i, j] for i in range(5) for j in range(4)]
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    assert llm.stats.num_batches == 1 and llm.stats.num_contexts_computed == 20
    for row, context in zip(rows, contexts):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)


async def test_batch_results_equal_single_results(llm):
    contexts = [[1], [2, 3], [1], [4, 5, 6]]
    batch = await llm.batch_next_token_logprobs(contexts)
    batch_sync = make_llm().batch_next_token_logprobs_sync(contexts)
    assert batch.shape == batch_sync.shape == (4, V)
    for i, context in enumerate(contexts):
        torch.testing.assert_close(batch[i], reference(context), atol=TOL, rtol=0)
        torch.testing.assert_close(batch_sync[i], reference(context), atol=TOL, rtol=0)


async def test_a_batch_computes_only_the_rows_not_cached(llm):
    await llm.batch_next_token_logprobs([[1], [2, 3]])
    mixed = [[2, 3], [7], [1], [7, 8]]
    batch = await llm.batch_next_token_logprobs(mixed)
    stats = llm.stats
    assert stats.num_batches == 2 and stats.num_contexts_computed == 4
    assert stats.num_output_cache_hits == 2
    for row, context in zip(batch, mixed):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    await llm.batch_next_token_logprobs(mixed)  # every row cached: no batch at all
    assert llm.stats.num_batches == 2 and llm.stats.num_output_cache_hits == 6


def test_sync_batches_respect_batch_size():
    llm = make_llm(batch_size=3)
    llm.batch_next_token_logprobs_sync([[i] for i in range(7)])
    assert llm.stats.num_batches == 3 and llm.stats.num_contexts_computed == 7


# ---------------------------------------------------------------- sampling


async def test_sample_is_reproducible_with_a_seed(llm):
    first = await llm.sample([1, 2], max_tokens=6, eos_token_ids=[], seed=11)
    again = await llm.sample([1, 2], max_tokens=6, eos_token_ids=[], seed=11)
    other = await llm.sample([1, 2], max_tokens=6, eos_token_ids=[], seed=12)
    assert first == again and len(first) == 6
    assert all(isinstance(t, int) and 0 <= t < V for t in first)
    assert other != first  # fixed seeds: deterministic, 12**-6 odds of a tie


async def test_sample_stops_at_eos_without_returning_it():
    llm = make_llm(max_context_length=None)
    free = await llm.sample([0], max_tokens=40, eos_token_ids=[], seed=5)
    stop_token = next(t for t in free if t != free[0])
    stop_at = free.index(stop_token)
    # Same seed, same contexts: the same draws until the stop token comes up.
    stopped = await llm.sample([0], max_tokens=40, eos_token_ids=[stop_token], seed=5)
    assert stopped == free[:stop_at]
    assert await llm.sample([0], max_tokens=0, eos_token_ids=[], seed=5) == []


async def test_batch_sample_gives_each_prompt_its_own_stream(llm):
    prompts = [[3, 3]] * 6
    samples = await llm.batch_sample(prompts, max_tokens=5, eos_token_ids=[], seed=1)
    assert len(samples) == 6 and all(len(s) == 5 for s in samples)
    assert len({tuple(s) for s in samples}) > 1  # identical prompts, independent draws
    assert await llm.batch_sample(prompts, max_tokens=5, eos_token_ids=[], seed=1) == samples


def sampled_frequencies(samples: list[list[int]]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor([s[0] for s in samples]), minlength=V)
    return counts.double() / len(samples)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
async def test_sample_frequencies_match_the_distribution(llm, temperature):
    num_samples, prompt = 6000, [2, 7]
    logprobs = await llm.next_token_logprobs(prompt)
    probs = torch.softmax(logprobs.double() / temperature, dim=-1)
    samples = await llm.batch_sample(
        [prompt] * num_samples, max_tokens=1, eos_token_ids=[], temperature=temperature, seed=0
    )
    frequencies = sampled_frequencies(samples)
    # 5 standard errors per token (seeded: the outcome is fixed, the margin is wide).
    margin = 5 * torch.sqrt(probs * (1 - probs) / num_samples) + 1e-3
    assert torch.all((frequencies - probs).abs() <= margin), (frequencies, probs)
    # The check has power: the other temperature's distribution is rejected.
    other = torch.softmax(logprobs.double() / (1.5 - temperature), dim=-1)
    assert not torch.all((frequencies - other).abs() <= margin)


async def test_sample_rejects_bad_options(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        await llm.sample([1], max_tokens=-1, eos_token_ids=[])
    with pytest.raises(ValueError, match="temperature"):
        await llm.sample([1], max_tokens=1, eos_token_ids=[], temperature=0.0)


# ---------------------------------------------------------------- caching


async def test_clear_cache_forces_recomputation(llm):
    first = await llm.next_token_logprobs([1, 1])
    await llm.next_token_logprobs([1, 1])
    assert llm.stats.num_batches == 1 and llm.stats.output_cache_bytes == V * 4
    llm.clear_cache()
    assert llm.stats.output_cache_bytes == 0 and len(llm.output_cache) == 0
    again = await llm.next_token_logprobs([1, 1])
    assert llm.stats.num_batches == 2
    torch.testing.assert_close(again, first, atol=TOL, rtol=0)


async def test_output_cache_counts_the_whole_block_its_rows_keep_alive(llm):
    await llm.batch_next_token_logprobs([[1], [2], [3], [4]])
    rows = [llm.output_cache.get(Request(None, (t,))) for t in (1, 2, 3, 4)]
    assert len({row.untyped_storage().data_ptr() for row in rows}) == 1  # one block, uncopied
    assert llm.output_cache.stats.bytes_held == rows[0].untyped_storage().nbytes() == 4 * V * 4
    await llm.next_token_logprobs([5])  # a block of its own
    assert llm.output_cache.stats.bytes_held == 5 * V * 4


def test_a_kept_block_leaves_the_budget_with_its_last_row():
    from genlm_backend.cache.output import OutputCache

    first, second = torch.randn(4, 50), torch.randn(2, 50)
    cache = OutputCache(6 * 50 * 4, keep_views=True)  # room for both blocks, no more
    cache.put_many([(("a", i), row) for i, row in enumerate(first.unbind(0))])
    cache.put_many([(("b", i), row) for i, row in enumerate(second.unbind(0))])
    assert cache.stats.bytes_held == 6 * 50 * 4 and len(cache) == 6
    cache.get(("a", 0))  # least recent first now: a1, a2, a3, b0, b1, a0
    cache.put(("c", 0), torch.randn(50))  # a block of one more row
    # Evicting a1..a3 and b0 frees nothing (a0 keeps the first block, b1 the second);
    # evicting b1 frees the second block, and then c0 fits.
    assert cache.keys() == [("a", 0), ("c", 0)]
    assert cache.stats.bytes_held == 5 * 50 * 4 and cache.stats.num_evictions == 5
    torch.testing.assert_close(cache[("a", 0)], first[0], atol=0, rtol=0)


def test_a_block_larger_than_the_budget_is_not_kept_its_rows_are_copied():
    from genlm_backend.cache.output import OutputCache

    block = torch.randn(8, 50)
    cache = OutputCache(3 * 50 * 4, keep_views=True)
    cache.put_many([(i, row) for i, row in enumerate(block.unbind(0))])
    assert [i for i in range(8) if i in cache] == [5, 6, 7]
    for i in (5, 6, 7):
        assert cache[i].untyped_storage().nbytes() == 50 * 4
        torch.testing.assert_close(cache[i], block[i], atol=0, rtol=0)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_put_many_keeps_compact_copies_of_a_batch_s_rows_within_budget(device):
    from genlm_backend.cache.output import OutputCache

    block = torch.randn(8, 50, device=device)
    expected = block.clone()
    cache = OutputCache(3 * 50 * block.element_size())  # room for three rows
    cache.put_many([(i, row) for i, row in enumerate(block.unbind(0))])
    block.fill_(0.0)  # the batch's output is the caller's: the cache holds copies
    assert [i for i in range(8) if i in cache] == [5, 6, 7]
    for i in (5, 6, 7):
        row = cache[i]
        assert row.device == block.device
        assert row.untyped_storage().nbytes() == 50 * row.element_size()
        torch.testing.assert_close(row, expected[i], atol=0, rtol=0)


def test_get_many_is_get_for_each_key_in_order():
    from genlm_backend.cache.output import OutputCache

    one_by_one, together = OutputCache(maxsize=3), OutputCache(maxsize=3)
    for cache in (one_by_one, together):
        for name in "abc":
            cache[name] = torch.full((4,), float(ord(name)))
    keys = ["c", "x", "a", "a"]
    expected = [one_by_one.get(key) for key in keys]
    found = together.get_many(keys)
    assert [row is None for row in found] == [False, True, False, False]
    for row, want in zip(found, expected):
        if want is not None:
            torch.testing.assert_close(row, want, atol=0, rtol=0)
    assert together.stats == one_by_one.stats  # 3 hits, 1 miss
    for cache in (one_by_one, together):
        cache["d"] = torch.zeros(4)  # evicts the least recently used: "b", not "c" or "a"
    assert together.keys() == one_by_one.keys() == ["c", "a", "d"]


# ---------------------------------------------------------------- lifecycle and errors


async def test_aclose_fails_pending_requests_and_later_use():
    llm = make_llm(timeout_s=60.0)
    pending = asyncio.ensure_future(llm.next_token_logprobs([1]))
    await asyncio.sleep(0)
    await asyncio.wait_for(llm.aclose(), 60)
    with pytest.raises(BackendClosedError):
        await pending
    with pytest.raises(BackendClosedError, match="closed"):
        await llm.next_token_logprobs([1])
    with pytest.raises(BackendClosedError):
        llm.next_token_logprobs_sync([1])
    with pytest.raises(BackendClosedError):
        await llm.batch_next_token_logprobs([[1]])
    await llm.aclose()  # idempotent
    assert issubclass(BackendClosedError, BatcherClosedError)


def test_close_then_use_raises():
    llm = make_llm()
    llm.next_token_logprobs_sync([1])
    llm.close()
    with pytest.raises(BackendClosedError):
        llm.batch_next_token_logprobs_sync([[1]])
    with pytest.raises(BackendClosedError):
        asyncio.run(llm.next_token_logprobs([1]))


async def test_async_with_closes():
    async with make_llm() as llm:
        await llm.next_token_logprobs([1])
    with pytest.raises(BackendClosedError):
        await llm.next_token_logprobs([1])


async def test_reset_async_queries_keeps_the_backend_usable(llm):
    await llm.next_token_logprobs([2])
    pending = asyncio.ensure_future(llm.next_token_logprobs([1]))
    await asyncio.sleep(0)
    await asyncio.wait_for(llm.reset_async_queries(), 60)
    with pytest.raises(BatcherClosedError, match="closed"):
        await pending
    row = await asyncio.wait_for(llm.next_token_logprobs([2]), 60)  # cached
    torch.testing.assert_close(row, reference([2]), atol=TOL, rtol=0)


def test_constructor_rejects_bad_options():
    with pytest.raises(ValueError, match="batch_size"):
        make_llm(batch_size=0)
    with pytest.raises(ValueError, match="timeout_s"):
        make_llm(timeout_s=-1)
    with pytest.raises(ValueError, match="budget_bytes"):
        make_llm(output_cache_bytes=-1)


# ---------------------------------------------------------------- statistics


async def test_stats_count_requests_batches_and_tokens(llm):
    await llm.next_token_logprobs([1, 2])  # computed
    await llm.next_token_logprobs([1, 2])  # output cache hit
    await asyncio.gather(llm.next_token_logprobs([3]), llm.next_token_logprobs([4, 5, 6]))
    llm.batch_next_token_logprobs_sync([[7], [1, 2]])  # one computed, one hit
    stats = llm.stats
    assert stats == LMStats(
        num_requests=6,
        num_batches=3,
        num_contexts_computed=4,
        num_output_cache_hits=2,
        num_tokens_requested=2 + 2 + 1 + 3 + 1 + 2,
        num_tokens_computed=2 + 1 + 3 + 1,  # the computed contexts only, not the cache hits
        output_cache_bytes=4 * V * 4,
        kv_cache_bytes=0,
    )
    assert stats.mean_batch_size == pytest.approx(4 / 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_requests = 0


async def test_stats_of_identical_concurrent_requests(llm):
    await asyncio.gather(*(llm.next_token_logprobs([9, 9]) for _ in range(3)))
    stats = llm.stats
    # One computation shared by three requests: neither cache hits nor extra contexts.
    assert (stats.num_requests, stats.num_contexts_computed, stats.num_output_cache_hits) == (
        3,
        1,
        0,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sample_token_on_a_cuda_row_draws_what_the_cpu_draws():
    from genlm_backend.llm.base import sample_token

    logits = torch.log_softmax(
        3 * torch.randn(128_256, generator=torch.Generator().manual_seed(1)), 0
    )
    on_cpu, on_cuda = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    cpu_draws = [sample_token(logits, on_cpu) for _ in range(300)]
    cuda_draws = [sample_token(logits.cuda(), on_cuda) for _ in range(300)]
    assert cuda_draws == cpu_draws


def test_sample_token_follows_the_distribution_and_skips_impossible_tokens():
    from genlm_backend.llm.base import sample_token

    logits = torch.tensor([0.0, float("-inf"), 1.0, 2.0, float("-inf")])
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_token(logits, generator) for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=5).double()
    expected = torch.softmax(logits.double(), 0) * len(draws)
    assert counts[1] == 0 and counts[4] == 0
    # within 5 standard errors of each expected count
    assert torch.all(
        (counts - expected).abs() <= 5 * expected.mul(1 - expected / len(draws)).sqrt() + 1e-9
    )


def test_sample_token_across_blocks_follows_the_distribution():
    """Rows longer than a block: the block sums pick the block, its own sum the index."""
    from genlm_backend.llm.sampling import BLOCK, sample_token

    size = 3 * BLOCK + 5
    possible = [0, BLOCK - 1, BLOCK, 2 * BLOCK + 7, size - 1]
    logits = torch.full((size,), float("-inf"))
    logits[possible] = torch.tensor([0.5, 1.0, -0.3, 0.0, 2.0])
    generator = torch.Generator().manual_seed(3)
    draws = torch.tensor([sample_token(logits, generator, 0.8) for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=size).double()
    assert counts.sum() == counts[possible].sum()  # nothing impossible drawn
    expected = torch.softmax(logits.double() / 0.8, 0)[possible] * len(draws)
    assert torch.all(
        (counts[possible] - expected).abs() <= 5 * expected.mul(1 - expected / len(draws)).sqrt()
    )


@pytest.mark.parametrize(
    ("num_possible", "u", "expected"),
    [(10, 0.0, 0), (10, 0.5, 5), (10, 1.0, 9), (1034, 1.0, 1033), (1020, 1.0, 1019)],
)
def test_a_target_at_the_top_of_the_cdf_draws_the_last_possible_token(num_possible, u, expected):
    """u = 1 puts the target at the row's whole sum, where rounding (of ``u * total``, or between
    the block sums and a block's cumulative sum) can put it: the last possible index then, never
    a padded or impossible one, nor one of a block without a possible token."""
    from genlm_backend.llm.sampling import BLOCK, _draw_on_cpu

    logits = torch.full((BLOCK + 40,), float("-inf"))
    logits[:num_possible] = 0.0
    assert _draw_on_cpu(logits, u, 1.0) == expected


def test_a_bfloat16_row_draws_what_its_float32_values_draw():
    """Its values are converted before the maximum is subtracted, not rounded after it
    (a subtraction in bfloat16 moves the edges of tokens' shares: 23 of 5,000 draws differed)."""
    from genlm_backend.llm.sampling import sample_token

    logits = (3 * torch.randn(2000, generator=torch.Generator().manual_seed(0))).bfloat16()
    as_bf16, as_fp32 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    draws = [sample_token(logits, as_bf16) for _ in range(5000)]
    assert draws == [sample_token(logits.float(), as_fp32) for _ in range(5000)]
