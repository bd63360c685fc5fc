"""Per-request LoRA adapters on AsyncTransformer, checked against uncached forwards of the right adapter.

Adapters are peft LoRAs with non-zero B weights (``init_lora_weights=False``),
so each one really changes the output. Reference: a separate peft model
carrying only that adapter (or the plain base model), one context at a time,
no cache. Tolerance: 1e-4 absolute on fp32 log-probabilities.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.sampling import make_generator, sample_continuation, stream_seeds
from tests.conftest import build_tiny_llama

peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")

ATOL = 1e-4
BASE_SEED = 0


def save_adapter(vocab_size: int, path, seed: int) -> str:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(build_tiny_llama(vocab_size, seed=BASE_SEED), config)
    with (
        torch.no_grad()
    ):  # B is zero-initialised by peft even with init_lora_weights=False on some versions
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return str(path)


class References:
    """Uncached forwards: base model or a fresh peft model carrying exactly one adapter."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._models = {None: build_tiny_llama(vocab_size, seed=BASE_SEED)}

    def __call__(self, adapter_path: str | None, context) -> torch.Tensor:
        if adapter_path not in self._models:
            base = build_tiny_llama(self.vocab_size, seed=BASE_SEED)
            self._models[adapter_path] = peft.PeftModel.from_pretrained(base, adapter_path).eval()
        with torch.inference_mode():
            logits = self._models[adapter_path](
                torch.tensor([list(context)]), use_cache=False
            ).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1)[: self.vocab_size]


@pytest.fixture(scope="module")
def adapter_paths(tiny_llama, tmp_path_factory):
    model, _ = tiny_llama
    folder = tmp_path_factory.mktemp("adapters")
    return [
        save_adapter(model.config.vocab_size, folder / f"adapter{i}", seed=10 + i) for i in range(3)
    ]


@pytest.fixture(scope="module")
def references(tiny_llama):
    return References(tiny_llama[0].config.vocab_size)


@pytest.fixture
def llm(tiny_llama):
    _, tokenizer = tiny_llama
    model = build_tiny_llama(tiny_llama[0].config.vocab_size, seed=BASE_SEED)
    llm = AsyncTransformer(model, tokenizer, batch_size=32, timeout=0.05)
    yield llm
    llm.close()


def check(row: torch.Tensor, references, path, context) -> None:
    torch.testing.assert_close(row, references(path, context), atol=ATOL, rtol=0)


async def test_adapters_really_differ(llm, adapter_paths, references):
    context = [11, 12, 13, 14]
    rows = [references(path, context) for path in [None, *adapter_paths]]
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert (rows[i] - rows[j]).abs().max() > 1e-2


async def test_a_batch_mixing_adapters_matches_each_adapters_forward(
    llm, adapter_paths, references
):
    llm.add_new_lora(adapter_paths[0], "a")
    llm.add_new_lora(adapter_paths[1], "b")
    names = {None: None, "a": adapter_paths[0], "b": adapter_paths[1]}
    prompt = [5, 6, 7, 8, 9]
    requests = [(name, prompt + extra) for extra in ([], [10], [10, 11], [12]) for name in names]
    for round_number in range(3):  # later rounds extend cached contexts of every adapter
        rows = await asyncio.gather(
            *(llm.next_token_logprobs(ctx, lora_name=name) for name, ctx in requests)
        )
        for (name, context), row in zip(requests, rows):
            check(row, references, names[name], context)
        requests = [(name, context + [20 + round_number]) for name, context in requests]
    assert llm.stats.num_batches <= 6  # adapters were batched together, not one batch each


async def test_kv_is_stored_under_the_requests_adapter_not_the_default_at_batch_time(
    llm, adapter_paths, references
):
    llm.add_new_lora(adapter_paths[0], "a")
    context = [21, 22, 23, 24, 25, 26]
    await llm.next_token_logprobs([1])  # this loop's batcher exists before the request queues
    queued = asyncio.ensure_future(llm.next_token_logprobs(context))  # base model
    await asyncio.sleep(0)  # validated and queued, not yet computed
    llm.set_lora(lora_name="a")  # later default calls run under "a"
    extended = asyncio.ensure_future(llm.next_token_logprobs(context + [27]))
    base_row, adapter_row = await asyncio.wait_for(asyncio.gather(queued, extended), 30)
    check(base_row, references, None, context)
    check(adapter_row, references, adapter_paths[0], context + [27])
    # Extensions of the cached base context, under the adapter and under the base model:
    check(
        llm.next_token_logprobs_sync(context + [28]), references, adapter_paths[0], context + [28]
    )
    check(
        llm.next_token_logprobs_sync(context + [28], lora_name=None),
        references,
        adapter_paths[0],
        context + [28],
    )
    llm.clear_lora()
    check(llm.next_token_logprobs_sync(context + [28]), references, None, context + [28])


def test_reregistering_a_name_drops_exactly_its_cached_results_and_kv(
    llm, adapter_paths, references
):
    context = [31, 32, 33, 34, 35]
    llm.add_new_lora(adapter_paths[0], "a")
    llm.add_new_lora(adapter_paths[1], "b")
    for name in (None, "a", "b"):
        llm.next_token_logprobs_sync(context, lora_name=name)
    assert len(llm.output_cache) == 3
    llm.add_new_lora(adapter_paths[2], "a")  # same name, new weights
    assert len(llm.output_cache) == 2  # only "a"'s row went
    check(
        llm.next_token_logprobs_sync(context, lora_name="a"), references, adapter_paths[2], context
    )
    check(
        llm.next_token_logprobs_sync(context + [36], lora_name="a"),
        references,
        adapter_paths[2],
        context + [36],
    )
    hits = llm.stats.num_output_cache_hits
    check(
        llm.next_token_logprobs_sync(context, lora_name="b"), references, adapter_paths[1], context
    )
    check(llm.next_token_logprobs_sync(context), references, None, context)
    assert llm.stats.num_output_cache_hits == hits + 2  # the others' rows were kept
    check(
        llm.next_token_logprobs_sync(context + [36], lora_name="b"),
        references,
        adapter_paths[1],
        context + [36],
    )


def test_remove_lora_drops_its_results_and_forgets_the_name(llm, adapter_paths, references):
    context = [41, 42, 43]
    llm.add_new_lora(adapter_paths[0], "a")
    llm.next_token_logprobs_sync(context, lora_name="a")
    llm.next_token_logprobs_sync(context)
    kv_entries = len(llm.kv_cache)
    llm.remove_lora("a")
    assert len(llm.output_cache) == 1
    assert len(llm.kv_cache) < kv_entries
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        llm.next_token_logprobs_sync(context, lora_name="a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        llm.remove_lora("a")
    check(llm.next_token_logprobs_sync(context + [44]), references, None, context + [44])
    llm.add_new_lora(adapter_paths[1], "a")  # the name is free again
    check(
        llm.next_token_logprobs_sync(context, lora_name="a"), references, adapter_paths[1], context
    )


async def test_unknown_adapter_fails_only_its_caller(llm, adapter_paths, references):
    llm.add_new_lora(adapter_paths[0], "a")
    good = [llm.next_token_logprobs([3, 4, 5], lora_name="a"), llm.next_token_logprobs([3, 4, 5])]
    bad = llm.next_token_logprobs([3, 4, 5], lora_name="missing")
    outcomes = await asyncio.wait_for(asyncio.gather(*good, bad, return_exceptions=True), 30)
    assert isinstance(outcomes[2], ValueError) and "missing" in str(outcomes[2])
    check(outcomes[0], references, adapter_paths[0], [3, 4, 5])
    check(outcomes[1], references, None, [3, 4, 5])
    for call in (llm.next_token_logprobs_uncached, llm.cache_kv, llm.next_token_logprobs_sync):
        with pytest.raises(ValueError, match="unknown LoRA adapter"):
            call([3], lora_name="missing")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        llm.set_lora(lora_name="missing")


async def test_a_request_waiting_while_its_adapter_is_replaced_fails_alone(
    llm, adapter_paths, references
):
    llm.add_new_lora(adapter_paths[0], "a")
    await llm.next_token_logprobs([1])
    waiting = asyncio.ensure_future(llm.next_token_logprobs([7, 8, 9], lora_name="a"))
    await asyncio.sleep(0)  # queued under the first registration of "a"
    llm.add_new_lora(adapter_paths[1], "a")
    contexts = [[7, 8, 9, n] for n in range(40)]  # fills the batch, so it runs at once
    later = asyncio.ensure_future(llm.batch_next_token_logprobs(contexts, lora_name="a"))
    outcomes = await asyncio.wait_for(asyncio.gather(waiting, later, return_exceptions=True), 30)
    assert isinstance(outcomes[0], ValueError) and "re-registered" in str(outcomes[0])
    for context, row in zip(contexts, outcomes[1]):
        check(row, references, adapter_paths[1], context)
    check(
        await llm.next_token_logprobs([7, 8, 9], lora_name="a"),
        references,
        adapter_paths[1],
        [7, 8, 9],
    )


async def test_every_entry_point_takes_lora_name(llm, adapter_paths, references):
    llm.add_new_lora(adapter_paths[0], "a")
    path, context = adapter_paths[0], [51, 52, 53]
    check(llm.next_token_logprobs_uncached(context, lora_name="a"), references, path, context)
    llm.cache_kv(context, lora_name="a")
    check(
        await llm.next_token_logprobs(context + [1], lora_name="a"), references, path, context + [1]
    )
    rows = await llm.batch_next_token_logprobs([context, context + [2]], lora_name="a")
    check(rows[1], references, path, context + [2])
    rows = llm.batch_next_token_logprobs_sync([context + [3]], lora_name="a")
    check(rows[0], references, path, context + [3])
    sampled = await llm.sample(context, 4, [], seed=7, lora_name="a")
    llm.set_lora(lora_name="a")
    assert await llm.sample(context, 4, [], seed=7) == sampled  # same adapter, same stream
    llm.clear_lora()
    prompts = [context, context + [9]]
    sampled = await llm.batch_sample(prompts, 6, [], temperature=0.05, seed=3, lora_name="a")
    seeds = stream_seeds(3, len(prompts))
    assert sampled == [
        await reference_sample(references, path, prompt, 6, 0.05, s)
        for prompt, s in zip(prompts, seeds)
    ]
    # The adapter is what decided: the base model draws other tokens from the same streams.
    assert sampled != [
        await reference_sample(references, None, prompt, 6, 0.05, s)
        for prompt, s in zip(prompts, seeds)
    ]


async def reference_sample(references, path, prompt, max_tokens, temperature, seed):
    """:func:`sample_continuation` on uncached forwards of adapter ``path`` (``None``: base)."""

    async def next_logprobs(context):
        return references(path, context)

    return await sample_continuation(
        next_logprobs, prompt, max_tokens, [], temperature, make_generator(seed)
    )


async def test_continuations_are_scored_under_their_adapter(llm, adapter_paths, references):
    llm.add_new_lora(adapter_paths[0], "a")
    context, continuation = [31, 32, 33, 34], [35, 36, 37]
    for name, path in ((None, None), ("a", adapter_paths[0])):
        scores = await llm.continuation_logprobs(context, continuation, lora_name=name)
        expected = torch.tensor(
            [
                references(path, context + continuation[:i])[token].item()
                for i, token in enumerate(continuation)
            ]
        )
        torch.testing.assert_close(scores, expected, atol=ATOL, rtol=0)
