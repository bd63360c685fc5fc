"""The count-free default policy: a burst goes as one batch, bounded by a token budget.

At the batcher (a recording ``process_batch``) and through the language-model
API (``MockAsyncLM``, compared with a fresh uncached mock; ``AsyncTransformer``
on a tiny model, compared with a plain uncached forward).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm_backend.batching import DEFAULT_MAX_BATCH_TOKENS, BatchingConfig
from genlm_backend.llm import MockAsyncLM
from tests.batching_helpers import LONG_S, Recorder, assert_settled, bounded, make_batcher

VOCAB = [bytes([b]) for b in range(32)]
TOL = 1e-6


@pytest.fixture
async def recorder():
    return Recorder(asyncio.get_running_loop())


async def test_default_policy_sends_a_burst_as_one_batch(recorder):
    batcher = make_batcher(recorder, timeout_s=LONG_S)
    keys = list(range(150))  # more than any count default a batcher has had
    assert await bounded(asyncio.gather(*(batcher.submit(k) for k in keys))) == [
        f"value:{k}" for k in keys
    ]
    assert recorder.batches == [keys]
    await batcher.aclose()


async def test_token_budget_splits_a_burst_in_arrival_order(recorder):
    cost = {"a": 4, "b": 4, "c": 4, "d": 1, "e": 9}.get
    batcher = make_batcher(recorder, request_tokens=cost, max_batch_tokens=10, timeout_s=LONG_S)
    results = await bounded(asyncio.gather(*(batcher.submit(k) for k in "abcde")))
    assert results == [f"value:{k}" for k in "abcde"]
    assert recorder.batches == [["a", "b"], ["c", "d"], ["e"]]
    assert_settled(batcher)
    await batcher.aclose()


async def test_full_budget_dispatches_without_waiting_for_idle_or_timeout(recorder):
    batcher = make_batcher(
        recorder, request_tokens=len, max_batch_tokens=6, timeout_s=LONG_S, flush_on_idle=False
    )
    # Only a full budget can dispatch here: idle flush is off and the timeout is never reached.
    keys = ["xxx", "yyy", "zz", "w", "vvvv"]  # tokens 3+3 | 2+1 (+4 would be 7) | 4, left waiting
    tasks = [asyncio.ensure_future(batcher.submit(k)) for k in keys]
    assert await bounded(asyncio.gather(*tasks[:2])) == ["value:xxx", "value:yyy"]
    assert recorder.batches[0] == ["xxx", "yyy"]
    # 2+1+4 = 7 tokens wait: full, so [zz, w] goes (it may already have, as soon as vvvv
    # arrived); vvvv alone (4 < 6) waits for company.
    assert await bounded(asyncio.gather(*tasks[2:4])) == ["value:zz", "value:w"]
    assert recorder.batches == [["xxx", "yyy"], ["zz", "w"]]
    assert not tasks[4].done() and batcher.stats.num_pending_tokens == 4
    assert await bounded(batcher.submit("uu")) == "value:uu"  # 4+2 = 6: full again
    assert await bounded(tasks[4]) == "value:vvvv"
    assert recorder.batches[-1] == ["vvvv", "uu"]
    await batcher.aclose()


async def test_cost_is_counted_once_per_distinct_key(recorder):
    calls = []

    def cost(key: str) -> int:
        calls.append(key)
        return len(key)

    batcher = make_batcher(recorder, request_tokens=cost, max_batch_tokens=100, timeout_s=LONG_S)
    recorder.block()
    first = asyncio.ensure_future(batcher.submit("blocker"))
    await bounded(recorder.started)
    waiting = [asyncio.ensure_future(batcher.submit(k)) for k in ("ab", "ab", "cde")]
    await asyncio.sleep(0)  # let the submissions run (ordering only: no time is waited for)
    assert batcher.stats.num_pending_tokens == 5  # "ab" counted once
    recorder.gate.set()
    assert await bounded(asyncio.gather(first, *waiting)) == [
        "value:blocker",
        "value:ab",
        "value:ab",
        "value:cde",
    ]
    assert calls == ["blocker", "ab", "cde"]
    assert batcher.stats.num_pending_tokens == 0
    await batcher.aclose()


async def test_explicit_batch_size_still_caps(recorder):
    batcher = make_batcher(recorder, max_batch_size=4, max_batch_tokens=1000, timeout_s=LONG_S)
    await bounded(asyncio.gather(*(batcher.submit(k) for k in range(10))))
    assert recorder.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    await batcher.aclose()


async def test_a_failing_cost_function_fails_only_its_caller(recorder):
    def cost(key):
        if key == "bad":
            raise KeyError("no cost for bad")
        return 1 if key != "negative" else -1

    batcher = make_batcher(recorder, request_tokens=cost, max_batch_tokens=10, timeout_s=LONG_S)
    outcomes = await bounded(
        asyncio.gather(
            *(batcher.submit(k) for k in ("a", "bad", "negative", "b")), return_exceptions=True
        )
    )
    assert outcomes[0] == "value:a" and outcomes[3] == "value:b"
    assert isinstance(outcomes[1], KeyError)
    assert isinstance(outcomes[2], ValueError) and "int >= 0" in str(outcomes[2])
    assert recorder.seen_keys() == ["a", "b"]
    assert not batcher.is_closed
    await batcher.aclose()


# ---------------------------------------------------------------- through the AsyncLM API


def reference(context) -> torch.Tensor:
    return MockAsyncLM(byte_vocab=VOCAB, output_cache_bytes=0).next_token_logprobs_sync(
        list(context)
    )


async def test_lm_default_serves_a_burst_in_one_batch():
    llm = MockAsyncLM(byte_vocab=VOCAB)
    assert llm.batching == BatchingConfig(max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS)
    contexts = [[i % 32, i // 32] for i in range(100)]
    rows = await bounded(asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts)))
    assert llm.stats.num_batches == 1 and llm.stats.num_contexts_computed == 100
    for context, row in zip(contexts, rows):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    await llm.aclose()


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_lm_token_budget_counts_context_lengths(mode):
    llm = MockAsyncLM(byte_vocab=VOCAB, max_batch_tokens=6)
    contexts = [[1, 2, 3], [4, 5, 6], [7, 8], [9, 10, 11, 12], [13]]
    if mode == "async":
        rows = await bounded(llm.batch_next_token_logprobs(contexts))
    else:
        rows = llm.batch_next_token_logprobs_sync(contexts)
    # lengths 3+3 | 2+4 | 1
    assert llm.stats.num_batches == 3 and llm.stats.num_contexts_computed == 5
    for context, row in zip(contexts, rows):
        torch.testing.assert_close(row, reference(context), atol=TOL, rtol=0)
    await llm.aclose()


def test_lm_options_map_to_one_config_and_fail_naming_the_field():
    llm = MockAsyncLM(byte_vocab=VOCAB, batch_size=5, timeout_s=0.5, max_batch_tokens=None)
    assert llm.batching == BatchingConfig(max_batch_size=5, timeout_s=0.5)
    assert (llm.batch_size, llm.timeout_s) == (5, 0.5)
    with pytest.raises(ValueError, match="max_batch_tokens must be"):
        MockAsyncLM(byte_vocab=VOCAB, max_batch_tokens=0)
    with pytest.raises(ValueError, match="max_batch_size must be"):
        MockAsyncLM(byte_vocab=VOCAB, batch_size=0)


def test_transformer_keeps_upstream_keywords(tiny_llama):
    from genlm_backend.llm.hf import AsyncTransformer

    model, tokenizer = tiny_llama
    default = AsyncTransformer(model, tokenizer)
    assert default.batching.max_batch_size is None
    assert default.batching.max_batch_tokens == DEFAULT_MAX_BATCH_TOKENS
    explicit = AsyncTransformer(model, tokenizer, batch_size=20, timeout=0.5)
    assert (explicit.batching.max_batch_size, explicit.batching.timeout_s) == (20, 0.5)
    with pytest.raises(ValueError, match="timeout_s must be"):
        AsyncTransformer(model, tokenizer, timeout=-1)
    default.close()
    explicit.close()


async def test_transformer_default_burst_is_one_forward_and_exact(tiny_llama):
    from genlm_backend.llm.hf import AsyncTransformer

    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    contexts = [[1 + i, 2 + i, 3] for i in range(40)]
    rows = await bounded(asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts)))
    assert llm.stats.num_batches == 1
    with torch.inference_mode():
        for context, row in zip(contexts, rows):
            logits = model(torch.tensor([context]), use_cache=False).logits[0, -1]
            expected = torch.log_softmax(logits.float(), -1)[: llm.vocab_size]
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=0)
    await llm.aclose()
