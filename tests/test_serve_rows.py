"""A server's rows: held contexts looked up before validation, the others validated and computed."""

from __future__ import annotations

import pytest
import torch

from genlm_backend.llm import MockAsyncLM
from genlm_backend.serve.rows import batch_rows, held_rows

SMALL_VOCAB = [bytes([b]) for b in b"abcdefghijkl"]
V = len(SMALL_VOCAB)
MAX_CONTEXT = 8
TOL = 1e-6


def make_llm() -> MockAsyncLM:
    return MockAsyncLM(byte_vocab=SMALL_VOCAB, max_context_length=MAX_CONTEXT)


def reference(context) -> torch.Tensor:
    return MockAsyncLM(byte_vocab=SMALL_VOCAB, output_cache_bytes=0).next_token_logprobs_sync(
        list(context)
    )


@pytest.fixture
def llm():
    llm = make_llm()
    yield llm
    llm.close()


async def test_rows_held_first_equal_the_validated_path_s_and_count_alike(llm):
    await llm.batch_next_token_logprobs([[1], [2, 3]])
    mixed = [(2, 3), (7,), (1,), (7, 8)]
    rows = await batch_rows(llm, mixed, None)
    other = make_llm()
    await other.batch_next_token_logprobs([[1], [2, 3]])
    await other.batch_next_token_logprobs([list(c) for c in mixed])
    for row, context in zip(rows, mixed):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    counted = ("num_requests", "num_tokens_requested", "num_output_cache_hits", "num_batches")
    assert [getattr(llm.stats, name) for name in counted] == [
        getattr(other.stats, name) for name in counted
    ]
    assert llm.stats.num_output_cache_hits == 2 and llm.stats.num_contexts_computed == 4
    assert llm.output_cache.stats.num_misses == other.output_cache.stats.num_misses
    other.close()


async def test_a_bad_context_among_held_ones_is_named_and_nothing_is_counted(llm):
    await llm.batch_next_token_logprobs([[1], [2, 3]])
    before = llm.stats.num_requests
    with pytest.raises(ValueError, match=r"token_ids_list\[2\]: .*outside the vocabulary"):
        await batch_rows(llm, [(1,), (2, 3), (1, V)], None)
    with pytest.raises(ValueError, match=r"token_ids_list\[1\]: .*more than the model's context"):
        await batch_rows(llm, [(1,), (1,) * (MAX_CONTEXT + 1)], None)
    with pytest.raises(ValueError, match="unknown"):
        await batch_rows(llm, [(1,)], "nobody")
    assert llm.stats.num_requests == before


async def test_held_rows_are_every_row_or_none_and_count_only_when_all_are_held(llm):
    await llm.batch_next_token_logprobs([[1], [2, 3]])
    before = llm.stats
    assert held_rows(llm, [(1,), (7,)], None) is None  # (7,) is not held: nothing counted
    assert llm.stats == before
    rows = held_rows(llm, [(2, 3), (1,)], None)
    assert rows is not None
    for row, context in zip(rows, [(2, 3), (1,)]):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    after = llm.stats
    assert after.num_requests == before.num_requests + 2
    assert after.num_output_cache_hits == before.num_output_cache_hits + 2
    assert after.num_tokens_requested == before.num_tokens_requested + 3
    assert after.num_batches == before.num_batches
    with pytest.raises(ValueError, match="unknown"):
        held_rows(llm, [(1,)], "nobody")


async def test_a_step_not_held_is_told_by_one_lookup(llm, monkeypatch):
    """A particles' step (rows to compute) is known not held from its last context: one
    context hashed, not each (a request made by the server reads its whole context)."""
    from genlm_backend.llm import runner as runner_module

    await llm.batch_next_token_logprobs([[1], [2, 3]])
    hashed = []
    real = runner_module.context_hash
    monkeypatch.setattr(
        runner_module, "context_hash", lambda tokens, *a: hashed.append(tokens) or real(tokens, *a)
    )
    assert held_rows(llm, [(1,), (2, 3), (4,), (5, 6)], None) is None
    assert hashed == [(5, 6)]
    assert held_rows(llm, [(1,), (2, 3)], None) is not None  # held: every row looked up


async def test_a_particles_step_is_hashed_from_its_parents_not_read_whole(llm, monkeypatch):
    """Contexts one token past recent ones are validated and hashed from their parents' digests:
    no request of the batch reads its whole context to hash it."""
    from genlm_backend.llm import runner as runner_module

    await llm.batch_next_token_logprobs([[1, 2], [3, 4]])
    read_whole = []
    real = runner_module.context_hash
    monkeypatch.setattr(
        runner_module,
        "context_hash",
        lambda tokens, *a: read_whole.append(tokens) or real(tokens, *a),
    )
    rows = await batch_rows(llm, [(1, 2, 5), (3, 4, 6)], None)
    assert read_whole == []
    for row, context in zip(rows, [(1, 2, 5), (3, 4, 6)]):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
