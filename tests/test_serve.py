"""RemoteLM against a real ``genlm-backend serve`` process (mock backend, default tokenizer).

The reference is an in-process ``MockAsyncLM`` built independently from the
same tokenizer: every row must be the same float32 bytes.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from genlm_backend import MockAsyncLM, load_model_by_name
from genlm_backend.errors import BackendClosedError
from genlm_backend.serve import RemoteLM
from tests.serve_support import ServerProcess


@pytest.fixture(scope="module")
def server():
    server = ServerProcess.cli("--backend", "mock", "--port", "0", "--adapter-dir", "/adapters")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference():
    return MockAsyncLM.from_name(None)


@pytest.fixture
def remote(server):
    with load_model_by_name("genlm://" + server.url.removeprefix("http://")) as lm:
        yield lm


def contexts_of(lm, text: str, count: int) -> list[list[int]]:
    ids = lm.tokenizer.encode(text)
    return [ids + [token] for token in range(count)]


def test_vocabulary_and_tokenizer_match_in_process(remote, reference):
    assert isinstance(remote, RemoteLM)
    assert remote.byte_vocab == reference.byte_vocab
    assert [bytes(t) for t in remote.byte_vocab] == [bytes(t) for t in reference.byte_vocab]
    assert [type(t) for t in remote.byte_vocab] == [type(t) for t in reference.byte_vocab]
    assert [t.token_id for t in remote.byte_vocab] == [t.token_id for t in reference.byte_vocab]
    assert remote.str_vocab == reference.str_vocab
    text = "Hello, world! Ünïcode ✓"
    assert remote.tokenizer.encode(text) == reference.tokenizer.encode(text)
    assert remote.tokenizer.eos_token_id == reference.tokenizer.eos_token_id
    assert remote.tokenizer.name_or_path == reference.tokenizer.name_or_path
    assert remote.server_backend == "mock"


async def test_concurrent_awaits_are_one_round_trip_with_exact_rows(remote, reference):
    contexts = contexts_of(remote, "The capital of France is", 16)
    round_trips = remote.runner.num_round_trips
    rows = await asyncio.gather(*map(remote.next_token_logprobs, contexts))
    assert remote.runner.num_round_trips == round_trips + 1
    expected = reference.batch_next_token_logprobs_sync(contexts)
    assert all(row.dtype == torch.float32 for row in rows)
    assert torch.equal(torch.stack(rows), expected)
    assert remote.stats.num_batches == 1 and remote.stats.num_contexts_computed == 16


async def test_batch_and_sync_calls_are_exact(remote, reference):
    contexts = contexts_of(remote, "Once upon a time", 5)
    expected = reference.batch_next_token_logprobs_sync(contexts)
    assert torch.equal(await remote.batch_next_token_logprobs(contexts), expected)
    assert torch.equal(remote.batch_next_token_logprobs_sync(contexts), expected)
    assert torch.equal(remote.next_token_logprobs_sync(contexts[2]), expected[2])
    uncached = remote.next_token_logprobs_uncached(contexts[3])
    assert torch.equal(uncached, reference.next_token_logprobs_uncached(contexts[3]))


async def test_returned_rows_are_the_callers_own(remote):
    (context,) = contexts_of(remote, "Mutate me", 1)
    first = await remote.next_token_logprobs(context)
    first.fill_(0.0)
    assert not torch.equal(await remote.next_token_logprobs(context), first)


async def test_sampling_matches_in_process(remote, reference):
    prompt = remote.tokenizer.encode("Sampling from afar")
    eos = [remote.tokenizer.eos_token_id]
    assert await remote.sample(prompt, 6, eos, seed=3) == await reference.sample(
        prompt, 6, eos, seed=3
    )
    prompts = [prompt, prompt[:2], prompt]
    expected = await reference.batch_sample(prompts, 4, eos, temperature=0.7, seed=5)
    assert await remote.batch_sample(prompts, 4, eos, temperature=0.7, seed=5) == expected


async def test_lora_adapters_live_on_the_server(remote, reference):
    (context,) = contexts_of(remote, "adapted", 1)
    remote.add_new_lora("/adapters/a", "a")
    reference.add_new_lora("/adapters/a", "a")
    try:
        row = await remote.next_token_logprobs(context, lora_name="a")
        assert torch.equal(row, await reference.next_token_logprobs(context, lora_name="a"))
        assert not torch.equal(row, await remote.next_token_logprobs(context))
        with RemoteLM(remote.url) as other:  # a later client learns the server's adapters
            assert torch.equal(other.next_token_logprobs_sync(context, "a"), row)
    finally:
        remote.remove_lora("a")
        reference.remove_lora("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        await remote.next_token_logprobs(context, lora_name="a")


def test_an_adapter_path_outside_the_adapter_dir_is_refused_over_http(remote):
    """The server was started with ``--adapter-dir /adapters``: a path elsewhere, or one
    leading out of it, is refused for this request and registers nothing."""
    for path in ("/etc", "/adapters/../etc", "../etc/passwd", "/adaptersX/a"):
        with pytest.raises(PermissionError, match="is not in a folder this server loads from"):
            remote.add_new_lora(path, "outside")
    assert "outside" not in remote.runner.fetch_info()["adapters"]


def test_another_client_s_registration_of_a_name_is_refused_never_answered(remote, reference):
    """B registers "x" from one folder, then A from another: B's requests under "x" fail
    (the server's registration changed), A's get A's adapter, and B registering again
    gets B's back."""
    (context,) = contexts_of(remote, "whose adapter", 1)
    with RemoteLM(remote.url) as other:
        remote.add_new_lora("/adapters/b", "x")
        reference.add_new_lora("/adapters/b", "x")
        try:
            mine = remote.next_token_logprobs_sync(context, "x")
            assert torch.equal(mine, reference.next_token_logprobs_sync(context, "x"))
        finally:
            reference.remove_lora("x")
        other.add_new_lora("/adapters/a", "x")  # the same name, other weights
        with pytest.raises(ValueError, match=r"'x' was registered again .* register it again"):
            remote.next_token_logprobs_sync(context + [1], "x")
        reference.add_new_lora("/adapters/a", "x")
        try:
            theirs = other.next_token_logprobs_sync(context + [1], "x")
            assert torch.equal(theirs, reference.next_token_logprobs_sync(context + [1], "x"))
        finally:
            reference.remove_lora("x")
        remote.add_new_lora("/adapters/b", "x")
        reference.add_new_lora("/adapters/b", "x")
        try:
            again = remote.next_token_logprobs_sync(context + [1], "x")
            assert torch.equal(again, reference.next_token_logprobs_sync(context + [1], "x"))
            assert not torch.equal(again, theirs)
        finally:
            reference.remove_lora("x")
            remote.remove_lora("x")


async def test_bad_input_fails_in_the_client_before_any_round_trip(remote):
    round_trips = remote.runner.num_round_trips
    with pytest.raises(TypeError):
        await remote.next_token_logprobs("text")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await remote.next_token_logprobs([remote.vocab_size])
    assert remote.runner.num_round_trips == round_trips


def test_cache_kv_clear_cache_and_stats(remote, server):
    (context,) = contexts_of(remote, "cache me", 1)
    remote.cache_kv(context)
    first = remote.next_token_logprobs_sync(context)
    assert remote.stats.num_output_cache_hits == 1  # the second call never left the client
    remote.clear_cache()
    remote.clear_kv_cache()
    assert remote.stats.output_cache_bytes == 0
    assert torch.equal(remote.next_token_logprobs_sync(context), first)
    lm_stats, serve_stats = remote.server_stats()
    assert lm_stats.num_requests >= 2 and serve_stats.num_rows_served >= 2
    assert serve_stats.num_in_flight == 0


async def test_close_and_context_managers(server):
    async with RemoteLM(server.url) as lm:
        (context,) = contexts_of(lm, "closing", 1)
        await lm.next_token_logprobs(context)
    with pytest.raises(BackendClosedError):
        await lm.next_token_logprobs(context)
    with RemoteLM(server.url) as lm:
        lm.next_token_logprobs_sync(context)
    with pytest.raises(BackendClosedError):
        lm.next_token_logprobs_sync(context)
    with RemoteLM(server.url) as lm:  # the server outlives its clients
        assert lm.next_token_logprobs_sync(context).shape == (lm.vocab_size,)


def test_the_command_passes_llm_opts_and_stops_cleanly_on_sigterm():
    options = '{"max_context_length": 64}'
    server = ServerProcess.cli("--backend", "mock", "--port", "0", "--llm-opts", options)
    try:
        with RemoteLM(server.url) as lm:
            assert lm.max_context_length == 64
            lm.batch_next_token_logprobs_sync([[1], [2], [3]])
        server.send_signal(signal.SIGTERM)
        assert server.wait_exit() == 0
        server.wait_for(r"shutting down \(SIGTERM\): failing 0 request")
        server.wait_for(r"stopped after 1 requests \(3 rows served, 0 failed by the shutdown\)")
    finally:
        server.stop()
