"""AsyncTransformer: every cached, batched or reused path equals a plain uncached forward.

Reference: ``log_softmax(model(full_context).logits[-1])`` in fp32, one context
at a time, no cache. Tolerance: 1e-4 absolute on log-probabilities.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from genlm_backend.cache.kv_tree import INDEX_STRIDE
from genlm_backend.llm import engine
from genlm_backend.llm.hf import AsyncTransformer
from tests.hf_reference import ATOL, assert_matches_reference, random_workload, reference


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_concurrent_workloads_match_uncached_forward(tiny_model, seed):
    model, tokenizer = tiny_model
    llm = AsyncTransformer(model, tokenizer, batch_size=6)
    rng = random.Random(seed)
    distinct: set[tuple[int, ...]] = set()
    for batch in random_workload(rng, 2000, num_rounds=5, per_round=9):
        results = await asyncio.gather(*(llm.next_token_logprobs(c) for c in batch))
        for context, result in zip(batch, results):
            assert_matches_reference(llm, context, result)
        distinct.update(map(tuple, batch))
    stats = llm.stats
    assert stats.num_tokens_computed < stats.num_tokens_requested
    # Each distinct context is computed once (repeats come from the output cache),
    # in batches of at most 6 that really batch.
    assert stats.num_contexts_computed == len(distinct)
    assert len(distinct) / 6 <= stats.num_batches < len(distinct)


async def test_evicted_prefixes_are_recomputed_correctly(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, kv_cache_bytes=200_000, output_cache_bytes=0)
    rng = random.Random(7)
    for batch in random_workload(rng, 3000, num_rounds=6, per_round=8):
        results = await asyncio.gather(*(llm.next_token_logprobs(c) for c in batch))
        assert llm.kv_cache.bytes_held <= 200_000
        for context, result in zip(batch, results):
            assert_matches_reference(llm, context, result)
    assert llm.kv_cache.stats.num_evictions > 0


async def test_sibling_particles_reuse_their_shared_prefix(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    prompt = list(range(100, 120))
    await llm.next_token_logprobs(prompt)
    before = llm.stats.num_tokens_computed
    children = [prompt + [t] for t in (5, 6, 7, 8)]
    results = await asyncio.gather(*(llm.next_token_logprobs(c) for c in children))
    assert llm.stats.num_tokens_computed - before == 4  # one new token each
    for context, result in zip(children, results):
        assert_matches_reference(llm, context, result)


async def test_deep_then_shallow_reuses_the_deep_entry(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    llm = AsyncTransformer(model, tokenizer)
    deep = list(range(300, 340))
    await llm.next_token_logprobs(deep)
    before = llm.stats.num_tokens_computed
    shallow = deep[:17]
    result = await llm.next_token_logprobs(shallow)
    assert llm.stats.num_tokens_computed - before == 1
    assert_matches_reference(llm, shallow, result)


def test_sync_paths_match_and_batch_of_one(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    contexts = [[1, 2, 3], [1, 2, 3, 4, 5], [9], [1, 2, 7]]
    batch = llm.batch_next_token_logprobs_sync(contexts)
    for context, row in zip(contexts, batch):
        assert_matches_reference(llm, context, row)
    single = llm.next_token_logprobs_sync([1, 2, 3, 4, 5, 6])
    assert_matches_reference(llm, [1, 2, 3, 4, 5, 6], single)
    torch.testing.assert_close(llm.next_token_logprobs_uncached([9]), batch[2], atol=ATOL, rtol=0)


async def test_sync_call_inside_a_running_loop(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    llm = AsyncTransformer(model, tokenizer)
    async_result = await llm.next_token_logprobs([10, 20, 30])
    sync_result = llm.next_token_logprobs_sync([10, 20, 30, 40])
    assert_matches_reference(llm, [10, 20, 30], async_result)
    assert_matches_reference(llm, [10, 20, 30, 40], sync_result)


async def test_cached_results_are_fresh_tensors(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    first = await llm.next_token_logprobs([4, 5, 6])
    first.fill_(0.0)  # the cache's row of it is dropped, not served
    second = await llm.next_token_logprobs([4, 5, 6])
    assert_matches_reference(llm, [4, 5, 6], second)
    assert llm.stats.num_output_cache_hits == 0 and llm.stats.num_contexts_computed == 2
    third = await llm.next_token_logprobs([4, 5, 6])  # from the cache: a copy of its own
    third.fill_(2.0)
    assert_matches_reference(llm, [4, 5, 6], second)
    assert llm.stats.num_output_cache_hits == 1
    assert_matches_reference(llm, [4, 5, 6], await llm.next_token_logprobs([4, 5, 6]))
    assert llm.stats.num_output_cache_hits == 2


async def test_cache_kv_and_clear_kv_cache(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    prompt = list(range(50, 70))
    llm.cache_kv(prompt)
    before = llm.stats.num_tokens_computed
    await llm.next_token_logprobs(prompt + [3])
    assert llm.stats.num_tokens_computed - before == 1
    llm.clear_kv_cache()
    assert llm.kv_cache.bytes_held == 0
    before = llm.stats.num_tokens_computed
    result = await llm.next_token_logprobs(prompt + [4])
    assert llm.stats.num_tokens_computed - before == len(prompt) + 1
    assert_matches_reference(llm, prompt + [4], result)


def test_context_longer_than_the_model_is_rejected_before_model_work(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    llm = AsyncTransformer(model, tokenizer)
    assert llm.max_context_length == model.config.n_positions
    with pytest.raises(ValueError, match="more than the model's context"):
        llm.next_token_logprobs_sync([1] * (model.config.n_positions + 1))
    assert llm.stats.num_batches == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_own_pasts_and_new_tokens_beyond_the_longest_sequence_share_a_pass(
    tiny_llama, deterministic
):
    """A cached context stepped beside a new one: the pass's block holds the first's own past
    and the second's new tokens, more slots than the model has positions (slots are not
    positions); each row is the plain forward's."""
    model, tokenizer = tiny_llama
    limit = model.config.max_position_embeddings
    rng = random.Random(8)
    cached = [rng.randrange(2000) for _ in range(limit * 3 // 5)]
    new = [rng.randrange(2000) for _ in range(limit * 3 // 4)]
    llm = AsyncTransformer(model, tokenizer, deterministic=deterministic, output_cache_bytes=0)
    llm.next_token_logprobs_sync(cached)
    batch = [cached + [1, 2, 3], new]
    rows = llm.batch_next_token_logprobs_sync(batch)
    for context, row in zip(batch, rows):
        torch.testing.assert_close(
            row, reference(model, context)[: len(tokenizer)], atol=ATOL, rtol=0
        )


def test_a_model_with_linear_attention_layers_is_rejected_by_name():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,  # the default pattern: three linear-attention layers, one full
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=0,
    )
    model = Qwen3NextForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="LinearAttentionLayer"):
        AsyncTransformer(model, None, byte_vocab=[bytes([i]) for i in range(64)])


def test_a_model_whose_keys_and_values_differ_in_width_is_rejected_by_name():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,  # keys 24 wide, values 16
        v_head_dim=16,
    )
    model = DeepseekV3ForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="v_head_dim"):
        AsyncTransformer(model, None, byte_vocab=[bytes([i]) for i in range(64)])


def test_output_is_trimmed_to_the_tokenizer_vocabulary(gpt2_tokenizer):
    from tests.conftest import build_tiny_gpt2

    model = build_tiny_gpt2(len(gpt2_tokenizer) + 47)  # padded embedding matrix
    llm = AsyncTransformer(model, gpt2_tokenizer)
    result = llm.next_token_logprobs_sync([1, 2, 3])
    assert result.shape == (len(gpt2_tokenizer),)
    assert abs(torch.logsumexp(result, 0).item()) < 1e-5
    expected = reference(model, [1, 2, 3])[: len(gpt2_tokenizer)]
    torch.testing.assert_close(result, torch.log_softmax(expected, 0), atol=ATOL, rtol=0)


def test_model_without_columns_for_added_tokens_gives_them_minus_inf(gpt2_tokenizer):
    from tests.conftest import build_tiny_gpt2

    model = build_tiny_gpt2(len(gpt2_tokenizer) - 3)
    llm = AsyncTransformer(model, gpt2_tokenizer)
    result = llm.next_token_logprobs_sync([1, 2, 3])
    assert torch.isneginf(result[-3:]).all()
    assert abs(torch.logsumexp(result, 0).item()) < 1e-5


async def test_lora_results_are_keyed_by_adapter(tiny_llama, tmp_path):
    peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")
    from tests.conftest import build_tiny_llama

    model, tokenizer = tiny_llama
    base = build_tiny_llama(model.config.vocab_size)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(build_tiny_llama(model.config.vocab_size), config)
    adapted.save_pretrained(tmp_path / "adapter")
    reference_adapted = adapted.eval()

    llm = AsyncTransformer(base, tokenizer)
    context = [11, 12, 13, 14]
    base_result = await llm.next_token_logprobs(context)
    llm.add_new_lora(str(tmp_path / "adapter"), "a")
    llm.set_lora(lora_name="a")
    lora_result = await llm.next_token_logprobs(context)
    lora_extended = await llm.next_token_logprobs(context + [15])
    llm.clear_lora()
    base_again = await llm.next_token_logprobs(context + [15])

    torch.testing.assert_close(
        lora_result, reference(reference_adapted, context), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        lora_extended, reference(reference_adapted, context + [15]), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        base_result,
        reference(build_tiny_llama(model.config.vocab_size), context),
        atol=ATOL,
        rtol=0,
    )
    torch.testing.assert_close(
        base_again,
        reference(build_tiny_llama(model.config.vocab_size), context + [15]),
        atol=ATOL,
        rtol=0,
    )
    assert (lora_result - base_result).abs().max() > 1e-3  # the adapter changes the output
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        llm.set_lora(lora_name="missing")


@pytest.mark.slow
async def test_smollm2_particles_match_uncached_forward(smollm2_model, smollm2_tokenizer):
    llm = AsyncTransformer(smollm2_model, smollm2_tokenizer)
    prompt = smollm2_tokenizer.encode("The quick brown fox")
    rng = random.Random(3)
    particles = [list(prompt) for _ in range(6)]
    for _ in range(3):
        results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        for particle, result in zip(particles, results):
            assert_matches_reference(llm, particle, result)
        # resample (siblings share prefixes) then extend
        particles = [list(rng.choice(particles)) + [rng.randrange(49152)] for _ in particles]
    assert llm.stats.num_tokens_computed < llm.stats.num_tokens_requested


def test_a_batch_whose_second_pass_fails_leaves_nothing_in_the_kv_tree(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    llm.next_token_logprobs_sync([1, 2, 3])
    entries_before = llm.kv_cache.stats.num_entries
    calls = {"n": 0}
    original = model.forward

    def fail_on_second_pass(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    model.forward = fail_on_second_pass
    try:
        # [1, 2, 3, 4] extends by one token (first pass), [7, 8, 9] is new (second pass).
        with pytest.raises(RuntimeError, match="injected failure"):
            llm.batch_next_token_logprobs_sync([[1, 2, 3, 4], [7, 8, 9]])
    finally:
        del model.forward
    assert calls["n"] == 2
    assert llm.kv_cache.stats.num_entries == entries_before
    assert llm.kv_cache.longest_prefix([1, 2, 3, 4, 5])[1] == 3
    result = llm.next_token_logprobs_sync([1, 2, 3, 4])
    assert_matches_reference(llm, [1, 2, 3, 4], result)


async def test_lock_step_particles_extend_their_block_in_place_and_stay_exact(tiny_llama):
    """SMC steps without resampling write into the previous block's spare slots; results stay exact."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    rng = random.Random(11)
    # Unequal prompts: rows are left-padded in the first block, so the shared start is > 0.
    particles = [[rng.randrange(3000) for _ in range(n)] for n in (5, 9, 7, 9)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    particles = [p + [rng.randrange(3000)] for p in particles]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    blocks_seen = set()
    for _ in range(6):
        particles = [p + [rng.randrange(3000)] for p in particles]
        results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        for particle, result in zip(particles, results):
            assert_matches_reference(llm, particle, result)
        blocks_seen.add(id(llm.kv_cache.longest_prefix(particles[0])[0].block))
    assert len(blocks_seen) < 6  # some steps reused the block in place
    # Resampling (a duplicated row) falls back to copying; still exact.
    particles = [particles[0], particles[0] + [1], particles[2], particles[3]]
    particles = [p + [rng.randrange(3000)] for p in particles]
    results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    for particle, result in zip(particles, results):
        assert_matches_reference(llm, particle, result)


async def test_in_place_steps_reuse_the_last_mask_equal_to_a_fresh_one(tiny_llama, monkeypatch):
    """A one-token step writing in place gets the last step's mask one slot wider: equal,
    bit for bit, to the mask made afresh for its plan; any other pass gets a fresh one."""
    from genlm_backend.llm.hf import runner as hf_runner

    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    made, handed = [], []
    fresh = hf_runner.own_part_mask

    def counted(plan, inputs, num_slots, dtype, device):
        made.append(plan.num_past)
        return fresh(plan, inputs, num_slots, dtype, device)

    real_call = hf_runner.StepMask.__call__

    def checked(self, plan, inputs, block, dtype, device):
        mask = real_call(self, plan, inputs, block, dtype, device)
        expected = fresh(plan, inputs, block.num_slots, dtype, device)
        assert torch.equal(mask, expected), f"step behind {plan.num_past} slots"
        handed.append(plan.num_past)
        return mask

    monkeypatch.setattr(hf_runner, "own_part_mask", counted)
    monkeypatch.setattr(hf_runner.StepMask, "__call__", checked)
    rng = random.Random(3)
    # Unequal prompts: each row's own part starts at its own slot of the block.
    particles = [[rng.randrange(3000) for _ in range(n)] for n in (5, 9, 7, 9)]
    for _ in range(8):
        results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        for particle, result in zip(particles, results):
            assert_matches_reference(llm, particle, result)
        particles = [p + [rng.randrange(3000)] for p in particles]
    assert len(handed) == 8
    assert len(made) < len(handed) - 3, "most steps widened the kept mask"
    # Resampling: a new block, so a fresh mask, and the rows stay exact.
    made.clear()
    particles = [particles[0], particles[0] + [1], particles[2], particles[3]]
    results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    for particle, result in zip(particles, results):
        assert_matches_reference(llm, particle, result)
    assert made, "a pass into a new block made its mask afresh"


async def test_particles_growing_in_place_past_the_trie_stride_stay_exact(tiny_llama):
    """A particle's step in place grows its entry (the trie learns its tokens every
    INDEX_STRIDE steps): no entry is made or evicted, every row stays the uncached
    forward's, also after resampling, and a walk by value finds all but the newest stride."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    rng = random.Random(5)
    prompt = [rng.randrange(3000) for _ in range(20)]
    particles = [prompt + [i] for i in range(4)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    num_entries = llm.kv_cache.stats.num_entries
    for step in range(2 * INDEX_STRIDE + 3):
        particles = [p + [rng.randrange(3000)] for p in particles]
        results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        assert llm.kv_cache.stats.num_entries == num_entries
        if step % 5 == 0 or step >= 2 * INDEX_STRIDE:
            for particle, result in zip(particles, results):
                assert_matches_reference(llm, particle, result)
    by_value = list(particles[1]) + [7]  # a new list, no parent: the trie walk alone
    cached = llm.kv_cache.cached_length(by_value)
    assert len(particles[1]) - INDEX_STRIDE < cached <= len(particles[1])
    # Resampling: two copies of one particle and two others branch off its grown entry.
    particles = [particles[0] + [1], particles[0] + [2], particles[3] + [3], by_value]
    results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    for particle, result in zip(particles, results):
        assert_matches_reference(llm, particle, result)


async def test_masked_grouped_query_attention_keeps_heads_grouped_and_exact(
    tiny_llama, monkeypatch
):
    """On CPU the runner's masked attention calls SDPA with grouped key/value heads, not repeated ones."""
    from genlm_backend.llm.hf import compat as hf_compat

    model, tokenizer = tiny_llama
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    calls = {"grouped": 0}
    grouped = hf_compat._sdpa_grouped_kv

    def counting(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None:
            assert key.shape[1] == model.config.num_key_value_heads  # not repeated
            calls["grouped"] += 1
        return grouped(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    hf_compat._register_grouped_sdpa()
    monkeypatch.setitem(AttentionInterface._global_mapping, hf_compat._GROUPED_SDPA, counting)
    llm = AsyncTransformer(model, tokenizer)
    contexts = [[5, 6, 7], [5, 6, 8, 9, 10], [11]]
    results = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    results += await asyncio.gather(*(llm.next_token_logprobs(c + [3]) for c in contexts))
    for context, result in zip(contexts + [c + [3] for c in contexts], results):
        assert_matches_reference(llm, context, result)
    assert calls["grouped"] >= 2 * model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"  # restored after every pass


def test_grouped_sdpa_equals_transformers_sdpa_with_repeated_heads():
    """The same attention as transformers' ``sdpa`` function under a ragged additive mask, prefill and decode."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from genlm_backend.llm.hf.compat import _sdpa_grouped_kv

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    generator = torch.Generator().manual_seed(0)
    for num_queries in (1, 5):
        query = torch.randn(4, 6, num_queries, 16, generator=generator)
        key, value = (torch.randn(4, 2, 12, 16, generator=generator) for _ in range(2))
        visible = torch.rand(4, 1, num_queries, 12, generator=generator) > 0.3
        visible[..., -1] = True  # every query sees at least one slot
        mask = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)
        expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
        result, _ = _sdpa_grouped_kv(module, query, key, value, mask, scaling=0.25)
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("compute_in_loop", [True, False])
async def test_batches_run_in_the_loop_thread_when_asked_else_in_a_worker(
    tiny_llama, compute_in_loop
):
    import threading

    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, compute_in_loop=compute_in_loop)
    threads = []
    run = llm.runner.run
    llm.runner.run = lambda requests: threads.append(threading.get_ident()) or run(requests)  # type: ignore[method-assign]
    contexts = [[1, 2, 3], [1, 2, 4], [5]]
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    for context, row in zip(contexts, rows):
        assert_matches_reference(llm, context, row)
    in_loop = threads == [threading.get_ident()]
    assert in_loop == compute_in_loop and len(threads) == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):  # errors reach their caller
        await llm.next_token_logprobs([10**9])
    llm.runner.run = lambda requests: (_ for _ in ()).throw(RuntimeError("model failed"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="model failed"):
        await llm.next_token_logprobs([7, 8])
    assert (await llm.next_token_logprobs([1, 2, 3])).shape == rows[0].shape  # still serving
    await llm.aclose()


def test_transformer_keeps_upstream_keywords(tiny_llama):

    model, tokenizer = tiny_llama
    default = AsyncTransformer(model, tokenizer)
    assert default.batching.max_batch_size is None
    assert default.batching.max_batch_tokens == engine.DEFAULT_MAX_BATCH_TOKENS
    assert default.engine.compute_in_loop and default.engine.cpu_threads is not None
    explicit = AsyncTransformer(model, tokenizer, batch_size=20, timeout=0.5)
    assert (explicit.batching.max_batch_size, explicit.batching.timeout_s) == (20, 0.5)
    with pytest.raises(ValueError, match="timeout_s must be"):
        AsyncTransformer(model, tokenizer, timeout=-1)
    default.close()
    explicit.close()


async def test_transformer_default_burst_is_one_forward_and_exact(tiny_llama):
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer)
    contexts = [[1 + i, 2 + i, 3] for i in range(40)]
    rows = await asyncio.wait_for(
        asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts)), 60
    )
    assert llm.stats.num_batches == 1
    for context, row in zip(contexts, rows):
        expected = reference(model, context)[: llm.vocab_size]
        torch.testing.assert_close(row, expected, atol=1e-4, rtol=0)
    await llm.aclose()
