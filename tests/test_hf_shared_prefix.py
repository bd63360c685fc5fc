"""Shared prefixes held once and read once: every answer equals a plain uncached forward.

Reference: ``log_softmax(model(full_context).logits[-1])`` in fp32, one context
at a time, no cache. Tolerance: 1e-4 absolute on log-probabilities.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from genlm_backend.cache.kv_block import KVBlock
from genlm_backend.cache.plan import LevelPolicy
from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.hf.attention import (
    Cascade,
    Level,
    cascade_attention,
    grouped_attention_with_lse,
    kernel_mask,
    math_attention_with_lse,
    prefix_attention_with_lse,
)
from genlm_backend.llm.runner import Request
from tests.cuda_emulation import EmulatedCudaKernels, cuda_branches
from tests.hf_reference import assert_matches_reference, random_workload

EVERY_PIECE_A_LEVEL = LevelPolicy(min_shared_tokens=1, min_unshared_tokens=1)

NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(params=[pytest.param("cuda", marks=NEEDS_CUDA), "emulated"])
def cuda_path(request):
    """The device on which ``hf_attention``'s CUDA code runs: a GPU, or the CPU with CUDA's kernels emulated.

    The emulation (``tests/cuda_emulation.py``) checks the inputs the fused
    kernels accept and returns their output layouts, so the code around the
    kernels is tested on machines without a GPU; the GPU runs check the kernels.
    """
    if request.param == "cuda":
        yield "cuda"
        return
    kernels = EmulatedCudaKernels()
    with cuda_branches(), kernels:
        yield "cpu"
    assert sum(kernels.calls.values()) > 0, "the CUDA kernels were never called"


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the log-sum-exp of each query's scores.

    Args:
        query: ``[B, Hq, L, D]``.
        key, value: ``[B, Hkv, S, D]``, ``Hq`` a multiple of ``Hkv`` (grouped heads are not repeated).
        mask: Additive ``[B, 1, L, S]`` (``-inf`` or the dtype's minimum where hidden) or ``None``.
        scale: Factor of the scores.

    Returns:
        ``output [B, Hq, L, D]`` in ``query``'s dtype and ``lse [B, Hq, L]`` in float32.
    """
    num_kv_heads = key.shape[1]
    num_groups = query.shape[1] // num_kv_heads
    if mask is not None:
        mask = kernel_mask(mask, num_groups, num_kv_heads)
    output, lse = grouped_attention_with_lse(query, key, value, mask, scale)
    return output.flatten(1, 2), lse.flatten(1, 2)


def particles_llm(model, tokenizer, **kwargs) -> AsyncTransformer:
    return AsyncTransformer(model, tokenizer, output_cache_bytes=0, **kwargs)


async def run_particles(llm, prompt, num_particles, num_steps, rng, resample_every=0):
    """SMC-shaped workload: distinct first tokens, one token per step, optional resampling; checks every row."""
    particles = [prompt + [1000 + i] for i in range(num_particles)]
    for step in range(num_steps):
        results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        for context, result in zip(particles, results):
            assert_matches_reference(llm, context, result)
        if resample_every and step % resample_every == resample_every - 1:
            particles = [list(rng.choice(particles)) for _ in particles]
        particles = [p + [rng.randrange(2000)] for p in particles]
    return particles


async def test_prompt_is_held_once_and_particles_hold_only_their_own_tokens(tiny_llama):
    model, tokenizer = tiny_llama
    llm = particles_llm(model, tokenizer)
    prompt = [random.Random(0).randrange(2000) for _ in range(300)]
    await llm.next_token_logprobs(prompt)
    prompt_bytes = llm.kv_cache.bytes_held
    await run_particles(llm, prompt, num_particles=8, num_steps=6, rng=random.Random(1))
    stats = llm.kv_cache.stats
    assert stats.bytes_shared == prompt_bytes  # the prompt's entry, continued by every particle
    # 8 particles x (6 own tokens + spare slots) beside the prompt, not 8 more prompts
    assert stats.bytes_held < 2 * prompt_bytes
    assert llm.runner.levels_unsupported is None


async def test_particles_arriving_together_behind_a_new_prompt_compute_it_once(tiny_llama):
    model, tokenizer = tiny_llama
    llm = particles_llm(model, tokenizer)
    prompt = list(range(200, 400))
    contexts = [prompt + [t, t + 1] for t in range(5, 13)]
    results = await llm.batch_next_token_logprobs(contexts)
    assert llm.stats.num_tokens_computed == len(prompt) + 2 * len(contexts)
    for context, result in zip(contexts, results):
        assert_matches_reference(llm, context, result)


@pytest.mark.parametrize("resample_every", [0, 2])
async def test_long_prompt_particles_with_resampling_match(tiny_model, resample_every):
    model, tokenizer = tiny_model
    llm = particles_llm(model, tokenizer)
    prompt = [random.Random(2).randrange(2000) for _ in range(260)]
    await run_particles(llm, prompt, 6, 8, random.Random(3), resample_every=resample_every)


async def test_every_piece_a_level_deep_chains_after_resampling_match(tiny_llama):
    model, tokenizer = tiny_llama
    llm = particles_llm(model, tokenizer)
    llm.runner.level_policy = EVERY_PIECE_A_LEVEL
    prompt = [random.Random(4).randrange(2000) for _ in range(40)]
    await run_particles(llm, prompt, 6, 10, random.Random(5), resample_every=2)
    assert llm.kv_cache.stats.bytes_shared > 0


@pytest.mark.parametrize("seed", [0, 1])
async def test_random_workloads_with_every_piece_a_level_match(tiny_model, seed):
    model, tokenizer = tiny_model
    llm = AsyncTransformer(model, tokenizer, batch_size=6)
    llm.runner.level_policy = EVERY_PIECE_A_LEVEL
    for batch in random_workload(random.Random(seed), 2000, num_rounds=6, per_round=9):
        results = await asyncio.gather(*(llm.next_token_logprobs(c) for c in batch))
        for context, result in zip(batch, results):
            assert_matches_reference(llm, context, result)


async def test_mixed_prompt_families_and_branches_inside_the_prompt(tiny_llama):
    model, tokenizer = tiny_llama
    llm = particles_llm(model, tokenizer)
    rng = random.Random(6)
    family_a = [rng.randrange(2000) for _ in range(150)]
    family_b = [rng.randrange(2000) for _ in range(120)]
    await llm.batch_next_token_logprobs([family_a, family_b])
    # particles of both families, and rows branching off inside family A's prompt
    contexts = [family_a + [t] for t in range(3)] + [family_b + [t] for t in range(3)]
    contexts += [family_a[:90] + [7, 8], family_a[:100] + [9], family_a[:100] + [10, 11, 12]]
    for _ in range(3):
        results = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
        for context, result in zip(contexts, results):
            assert_matches_reference(llm, context, result)
        contexts = [c + [rng.randrange(2000)] for c in contexts]


async def test_multi_token_extensions_read_the_prompt_as_a_level(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    llm = particles_llm(model, tokenizer)
    prompt = list(range(500, 800))
    await llm.next_token_logprobs(prompt)
    contexts = [prompt + list(range(t, t + n)) for t, n in ((1, 3), (10, 7), (30, 1), (40, 12))]
    results = await llm.batch_next_token_logprobs(contexts)
    assert llm.stats.num_tokens_computed == len(prompt) + 3 + 7 + 1 + 12
    for context, result in zip(contexts, results):
        assert_matches_reference(llm, context, result)


async def test_evicting_the_shared_prompt_mid_run_recomputes_it_correctly(tiny_llama):
    model, tokenizer = tiny_llama
    llm = particles_llm(model, tokenizer)
    prompt = [random.Random(7).randrange(2000) for _ in range(200)]
    particles = await run_particles(llm, prompt, 5, 3, random.Random(8))
    entry, _ = llm.kv_cache.longest_prefix(prompt)
    assert entry is not None and entry.dependents
    llm.kv_cache.reserve(
        llm.kv_cache.budget_bytes
    )  # evicts everything: the prompt and its dependents
    assert llm.kv_cache.longest_prefix(prompt) == (None, 0)
    before = llm.stats.num_tokens_computed
    results = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    for context, result in zip(particles, results):
        assert_matches_reference(llm, context, result)
    # the shared part was computed once, then each particle's own tokens
    shared = len(prompt) + 1 - 1  # the particles' first tokens differ
    assert llm.stats.num_tokens_computed - before == shared + sum(
        len(p) - shared for p in particles
    )


async def test_a_tight_budget_evicts_under_running_particles_and_stays_exact(tiny_llama):
    model, tokenizer = tiny_llama
    llm = particles_llm(model, tokenizer, kv_cache_bytes=1_500_000)
    prompt = [random.Random(9).randrange(2000) for _ in range(220)]
    await run_particles(llm, prompt, 6, 6, random.Random(10), resample_every=2)
    assert llm.kv_cache.bytes_held <= 1_500_000
    assert llm.kv_cache.stats.num_evictions > 0


async def test_a_prompt_shared_under_one_adapter_is_never_read_under_another(tiny_llama, tmp_path):
    peft = pytest.importorskip("peft")
    model, tokenizer = tiny_llama
    torch.manual_seed(0)
    lora = peft.get_peft_model(
        type(model)(model.config).eval(),
        peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False),
    )
    lora.save_pretrained(tmp_path / "adapter")
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    llm = particles_llm(fresh, tokenizer)
    llm.add_new_lora(str(tmp_path / "adapter"), "keys")
    prompt = [random.Random(11).randrange(2000) for _ in range(150)]
    await llm.next_token_logprobs(prompt)  # the base model's prompt is cached first
    contexts = [prompt + [t] for t in range(4)]
    for lora_name in ("keys", None, "keys"):
        results = await asyncio.gather(
            *(llm.next_token_logprobs(c, lora_name=lora_name) for c in contexts)
        )
        for context, result in zip(contexts, results):
            expected = llm.next_token_logprobs_uncached(context, lora_name=lora_name)
            torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)
    base = await llm.next_token_logprobs(contexts[0])
    adapted = await llm.next_token_logprobs(contexts[0], lora_name="keys")
    assert (base - adapted).abs().max() > 1e-3  # the adapter changes keys/values


async def test_sliding_window_models_serve_contexts_within_the_window_exactly(smollm2_tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        sliding_window=160,
    )
    llm = particles_llm(MistralForCausalLM(config).eval(), smollm2_tokenizer)
    assert llm.max_context_length == 160
    await run_particles(llm, list(range(100, 240)), 4, 3, random.Random(12))
    assert llm.kv_cache.stats.bytes_shared > 0
    with pytest.raises(ValueError, match="160"):
        await llm.next_token_logprobs(list(range(161)))


@pytest.mark.slow
async def test_smollm2_long_prompt_particles_match(smollm2_model, smollm2_tokenizer):
    llm = particles_llm(smollm2_model, smollm2_tokenizer)
    text = "SELECT name, email FROM users WHERE signup_date > '2024-01-01' ORDER BY name; "
    # Past LevelPolicy's min_unshared_tokens (512): a level even for one row after resampling.
    prompt = smollm2_tokenizer.encode(text * 50)[:600]
    await llm.next_token_logprobs(prompt)
    await run_particles(llm, prompt, 3, 2, random.Random(13), resample_every=1)


# ------------------------------------------------------------------ attention kernels


def random_attention_inputs(
    generator, num_rows=3, q_heads=6, kv_heads=2, num_queries=4, num_keys=21
):
    query = torch.randn(num_rows, q_heads, num_queries, 64, generator=generator)
    key = torch.randn(num_rows, kv_heads, num_keys, 64, generator=generator)
    value = torch.randn(num_rows, kv_heads, num_keys, 64, generator=generator)
    mask = torch.zeros(num_rows, 1, num_queries, num_keys)
    for row in range(num_rows):
        mask[row, :, :, : row * 3] = torch.finfo(torch.float32).min  # left padding
    return query, key, value, mask


def reference_attention(query, key, value, mask, scale):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scale + (0 if mask is None else mask)
    return scores.softmax(-1) @ value, scores.logsumexp(-1)


@pytest.mark.parametrize("with_mask", [True, False])
def test_fused_and_plain_attention_with_lse_equal_the_reference(with_mask):
    query, key, value, mask = random_attention_inputs(torch.Generator().manual_seed(0))
    mask = mask if with_mask else None
    expected, expected_lse = reference_attention(query, key, value, mask, 0.125)
    grouped, grouped_lse = math_attention_with_lse(query, key, value, mask, 0.125)
    for output, lse in (
        attention_with_lse(query, key, value, mask, 0.125),
        (
            grouped.flatten(1, 2),
            grouped_lse.flatten(1, 2),
        ),  # [B, Hkv, g, L, ...] -> [B, Hq, L, ...]
    ):
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=0)


def test_prefix_attention_with_lse_equals_the_reference():
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 2, 24, 64, generator=generator)  # 24 queries per key/value head
    key, value = torch.randn(2, 1, 2, 40, 64, generator=generator)
    expected, expected_lse = reference_attention(query, key, value, None, 0.125)
    output, lse = prefix_attention_with_lse(query, key, value, 0.125)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=0)


def test_cascade_attention_equals_attention_over_the_concatenation():
    generator = torch.Generator().manual_seed(1)
    query, own_keys, own_values, mask = random_attention_inputs(generator)
    # two levels in one block: a prompt read by every row, a span read by rows 0 and 2
    block_keys = torch.randn(2, 2, 40, 64, generator=generator)
    block_values = torch.randn(2, 2, 40, 64, generator=generator)

    block = KVBlock(torch.stack([block_keys, block_values])[None])  # one layer
    levels = [Level(block, 0, 0, 30, None), Level(block, 1, 5, 12, torch.tensor([0, 2]))]
    output = cascade_attention(0, query, own_keys, own_values, mask, 0.125, Cascade(levels))
    for row in range(3):
        keys = [block_keys[0:1, :, :30]] + ([block_keys[1:2, :, 5:17]] if row != 1 else [])
        values = [block_values[0:1, :, :30]] + ([block_values[1:2, :, 5:17]] if row != 1 else [])
        keys.append(own_keys[row : row + 1])
        values.append(own_values[row : row + 1])
        visible = [torch.zeros(1, 1, 4, k.shape[2]) for k in keys[:-1]] + [mask[row : row + 1]]
        expected, _ = reference_attention(
            query[row : row + 1],
            torch.cat(keys, 2),
            torch.cat(values, 2),
            torch.cat(visible, 3),
            0.125,
        )
        torch.testing.assert_close(output[row], expected[0].transpose(0, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_mask", [True, False])
def test_cuda_attention_with_lse_equals_the_reference(cuda_path, dtype, with_mask):
    query, key, value, mask = random_attention_inputs(torch.Generator().manual_seed(2))
    expected, expected_lse = reference_attention(
        query, key, value, mask if with_mask else None, 0.125
    )
    cuda = [t.to(cuda_path, dtype) for t in (query, key, value)]
    output, lse = attention_with_lse(*cuda, mask.to(cuda_path, dtype) if with_mask else None, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(output.float().cpu(), expected, atol=tolerance, rtol=0)
    torch.testing.assert_close(lse.cpu(), expected_lse, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_runner_long_prompt_particles_match_uncached_forward(cuda_path, dtype):
    from genlm_backend.cache.kv_tree import KVPrefixTree
    from genlm_backend.llm.hf.runner import HFRunner
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(2000).to(cuda_path, dtype)
    model.config._attn_implementation = "sdpa"
    runner = HFRunner(model, KVPrefixTree(1 << 30), 2000)
    rng = random.Random(14)
    prompt = tuple(rng.randrange(2000) for _ in range(300))
    runner.logprobs([prompt])
    particles = [(*prompt, 1000 + i) for i in range(8)]
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for step in range(4):
        rows = runner.logprobs(particles)
        for context, row in zip(particles, rows):
            expected = torch.log_softmax(runner.run_uncached(Request(None, context)).float(), -1)
            torch.testing.assert_close(row, expected, atol=tolerance, rtol=0)
        if step == 1:  # resample: rows 0-3 continue row 0, rows 4-7 continue row 5
            particles = [particles[0]] * 4 + [particles[5]] * 4
        particles = [(*p, rng.randrange(2000)) for p in particles]
    assert runner.kv_tree.stats.bytes_shared > 0


@pytest.mark.parametrize("build", ["build_tiny_llama", "build_tiny_gpt2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_runner_random_workloads_with_every_piece_a_level_match(cuda_path, build, seed):
    """Extensions, siblings, prefixes and fresh contexts on CUDA, every cached piece read as a level."""
    from genlm_backend.cache.kv_tree import KVPrefixTree
    from genlm_backend.llm.hf.runner import HFRunner
    from tests import conftest

    model = getattr(conftest, build)(2000).to(cuda_path)
    model.config._attn_implementation = "sdpa"
    runner = HFRunner(model, KVPrefixTree(1 << 30), 2000)
    runner.level_policy = EVERY_PIECE_A_LEVEL
    for batch in random_workload(random.Random(seed), 2000, num_rounds=6, per_round=9):
        contexts = list(dict.fromkeys(tuple(c) for c in batch))
        rows = runner.logprobs(contexts)
        for context, row in zip(contexts, rows):
            expected = torch.log_softmax(runner.run_uncached(Request(None, context)).float(), -1)
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=0)
    assert runner.kv_tree.stats.bytes_shared > 0
