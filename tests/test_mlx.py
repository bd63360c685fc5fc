"""AsyncMlxLM: every cached, batched or reused path equals plain forwards of the same weights.

References, one context at a time, no cache:

* transformers' float32 forward of the folder the MLX model was loaded from
  (``log_softmax(model(context).logits[-1])``): within :data:`TRANSFORMERS_ATOL`,
  as MLX and torch sum in different orders;
* mlx-lm's own forward over the whole context (``runner.run_uncached``): within
  :data:`UNCACHED_ATOL` (the cached paths add keys/values in another order).

Most tests use a tiny random Llama saved by transformers 5 (so its
``config.json`` keeps the RoPE base under ``rope_parameters``, with a base
mlx-lm's default would get wrong); one uses the real default model.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest
import torch

from genlm_backend.errors import BackendNotAvailableError
from genlm_backend.llm.loader import UnavailableMlxLM, load_model_by_name, mlx_is_available

TRANSFORMERS_ATOL = 1e-3
UNCACHED_ATOL = 1e-4
ROPE_THETA = 500_000.0  # not mlx-lm's default (10,000): a misread config shows

needs_mlx = pytest.mark.skipif(
    not mlx_is_available(), reason="needs mlx and mlx-lm: pip install 'genlm-backend-ng[mlx]'"
)
pytestmark = pytest.mark.mlx


def save_tiny_llama(folder, tokenizer, seed: int = 0):
    """A 2-layer random Llama (grouped-query attention, untied head) saved by transformers 5."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform rows; larger weights make differences visible.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_tokenizer):
    """(folder, transformers model) of the tiny random Llama."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    return folder, save_tiny_llama(folder, smollm2_tokenizer)


@pytest.fixture
def llm(tiny_folder):
    from genlm_backend.llm.mlx import AsyncMlxLM

    return AsyncMlxLM.from_name(str(tiny_folder[0]))


def transformers_row(model, context) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([list(context)]), use_cache=False).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_exact(llm, model, context, row: torch.Tensor) -> None:
    """``row`` is the contract's row for ``context`` and equals both references."""
    assert row.dtype == torch.float32 and row.shape == (llm.vocab_size,)
    assert row.device == torch.device("cpu")
    # normalized up to float32 rounding of log_softmax over 49,152 columns
    assert abs(torch.logsumexp(row.double(), 0).item()) < 1e-4
    expected = transformers_row(model, context)[: llm.vocab_size]
    torch.testing.assert_close(row, expected, atol=TRANSFORMERS_ATOL, rtol=0)
    uncached = llm.next_token_logprobs_uncached(context)
    torch.testing.assert_close(row, uncached, atol=UNCACHED_ATOL, rtol=0)


@needs_mlx
def test_rows_equal_a_transformers_forward_of_the_same_weights(llm, tiny_folder):
    model = tiny_folder[1]
    for context in ([5], [1, 2, 3], list(range(200, 260))):
        assert_exact(llm, model, context, llm.next_token_logprobs_sync(context))


@needs_mlx
def test_a_transformers_5_config_is_read_without_changing_the_folder(tiny_folder):
    import mlx.core as mx
    import mlx_lm

    from genlm_backend.llm.mlx import AsyncMlxLM

    folder, model = tiny_folder
    config_text = (folder / "config.json").read_text()
    config = json.loads(config_text)
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == ROPE_THETA
    context = list(range(100, 140))
    expected = transformers_row(model, context)
    # mlx-lm alone reads the RoPE base from the top level: the default, far off.
    plain, _ = mlx_lm.load(str(folder))
    plain_logits = torch.from_numpy(__import__("numpy").array(plain(mx.array([context]))[0, -1]))
    assert (torch.log_softmax(plain_logits, -1) - expected).abs().max() > 1e-2
    ours = AsyncMlxLM.from_name(str(folder)).next_token_logprobs_sync(context)
    torch.testing.assert_close(ours, expected, atol=TRANSFORMERS_ATOL, rtol=0)
    assert (folder / "config.json").read_text() == config_text


@needs_mlx
async def test_particles_extended_step_by_step_cost_one_token_each(llm, tiny_folder):
    model = tiny_folder[1]
    prompt = [7, 8, 9, 10, 11]
    await llm.next_token_logprobs(prompt)
    rng = random.Random(0)
    particles = [list(prompt) for _ in range(4)]
    for _ in range(6):
        for particle in particles:
            particle.append(rng.randrange(llm.vocab_size))
        before = llm.stats.num_tokens_computed
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        assert llm.stats.num_tokens_computed - before == len(particles)
        for particle, row in zip(particles, rows):
            assert_exact(llm, model, particle, row)
    assert llm.stats.num_batches < llm.stats.num_contexts_computed  # requests really batched


@needs_mlx
async def test_unrelated_particles_past_the_level_length_step_in_one_block(llm, tiny_folder):
    from genlm_backend.llm.mlx.runner import MIN_LEVEL_TOKENS

    model = tiny_folder[1]
    rng = random.Random(4)
    particles = [
        [first] + [rng.randrange(1000) for _ in range(MIN_LEVEL_TOKENS - 4)] for first in range(4)
    ]
    for _ in range(8):  # grow past MIN_LEVEL_TOKENS: no particle shares a prefix with another
        particles = [p + [rng.randrange(1000)] for p in particles]
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    for particle, row in zip(particles, rows):
        assert_exact(llm, model, particle, row)
    # each step is one forward pass over the four rows, written into one block
    assert llm.kv_cache.stats.num_blocks == 1


@needs_mlx
async def test_particles_behind_a_long_prompt_read_it_once_and_resample(llm, tiny_folder):
    from genlm_backend.llm.mlx.runner import MIN_LEVEL_TOKENS

    model = tiny_folder[1]
    prompt = list(range(300, 300 + MIN_LEVEL_TOKENS + 8))
    rng = random.Random(1)
    particles = [prompt + [rng.randrange(1000)] for _ in range(5)]  # prompt not cached yet
    for step in range(5):
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        for particle, row in zip(particles, rows):
            assert_exact(llm, model, particle, row)
        assert llm.kv_cache.stats.bytes_shared > 0  # the prompt's entry is a parent, held once
        if step == 2:  # resample: particles 0 and 1 continue particle 2's context
            particles = [list(particles[2]), list(particles[2]), *particles[2:]]
        particles = [p + [rng.randrange(1000)] for p in particles]
    stats = llm.stats
    assert stats.num_tokens_computed < stats.num_tokens_requested / 5


@needs_mlx
async def test_particles_behind_two_prompts_in_one_batch_read_each_prompt_as_its_own_level(
    llm, tiny_folder
):
    from genlm_backend.llm.mlx.runner import MIN_LEVEL_TOKENS

    model = tiny_folder[1]
    rng = random.Random(5)
    prompts = [[rng.randrange(1000) for _ in range(MIN_LEVEL_TOKENS + 6)] for _ in range(2)]
    await llm.batch_next_token_logprobs(prompts)  # both cached: each a level of its particles
    particles = [prompt + [rng.randrange(1000)] for prompt in prompts for _ in range(3)]
    forwards = []
    executor = llm.runner.driver.executor
    original = executor.run_pass
    executor.run_pass = lambda plan, namespace: forwards.append(plan) or original(plan, namespace)
    for step in range(4):
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        for particle, row in zip(particles, rows):
            assert_exact(llm, model, particle, row)
        if step == 1:  # resample across the prompts: rows of one block behind different levels
            particles = [particles[i] for i in (0, 4, 4, 1, 5, 2)]
        particles = [p + [rng.randrange(1000)] for p in particles]
    levels = {len(row.levels) for plan in forwards for row in plan.rows}
    assert levels == {1} and all(len(plan.rows) == 6 for plan in forwards)
    readers = [len({id(row.levels[0][0]) for row in plan.rows}) for plan in forwards]
    assert readers == [2, 2, 2, 2]  # one pass per step, two levels in it


@needs_mlx
async def test_concurrent_contexts_of_different_lengths_branches_and_prefixes(llm, tiny_folder):
    model = tiny_folder[1]
    rng = random.Random(2)
    seen = [[rng.randrange(2000) for _ in range(rng.randint(3, 12))]]
    for _ in range(4):
        batch = []
        for _ in range(7):
            base = rng.choice(seen)
            kind = rng.random()
            if kind < 0.4:  # extension by 1 to 4 tokens
                context = base + [rng.randrange(2000) for _ in range(rng.randint(1, 4))]
            elif kind < 0.6:  # a prefix
                context = base[: rng.randint(1, len(base))]
            elif kind < 0.85:  # a branch
                context = base[: rng.randint(1, len(base))] + [rng.randrange(2000)]
            else:  # unrelated
                context = [rng.randrange(2000) for _ in range(rng.randint(1, 20))]
            batch.append(context)
        rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in batch))
        for context, row in zip(batch, rows):
            assert_exact(llm, model, context, row)
        seen.extend(batch)


@needs_mlx
async def test_eviction_keeps_keys_values_within_a_tiny_budget(tiny_folder):
    from genlm_backend.llm.mlx import AsyncMlxLM

    folder, model = tiny_folder
    budget = 40_000  # keys/values of about 40 tokens of this model
    llm = AsyncMlxLM.from_name(str(folder), kv_cache_bytes=budget, output_cache_bytes=0)
    rng = random.Random(3)
    particles = [[rng.randrange(2000) for _ in range(10)] for _ in range(3)]
    for _ in range(8):
        particles = [p + [rng.randrange(2000)] for p in particles]
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        assert llm.kv_cache.bytes_held <= budget
        for particle, row in zip(particles, rows):
            assert_exact(llm, model, particle, row)
    assert llm.kv_cache.stats.num_evictions > 0
    assert llm.stats.kv_cache_bytes == llm.kv_cache.bytes_held


@needs_mlx
async def test_batch_calls_and_long_prefills_in_chunks(tiny_folder):
    from genlm_backend.llm.mlx import AsyncMlxLM

    folder, model = tiny_folder
    llm = AsyncMlxLM.from_name(str(folder), prefill_step_size=4)
    contexts = [list(range(10, 31)), list(range(10, 20)), [3], list(range(10, 23))]
    rows = await llm.batch_next_token_logprobs(contexts)
    assert rows.shape == (4, llm.vocab_size)
    for context, row in zip(contexts, rows):
        assert_exact(llm, model, context, row)
    more = [c + [1, 2] for c in contexts]
    for context, row in zip(more, llm.batch_next_token_logprobs_sync(more)):
        assert_exact(llm, model, context, row)


@needs_mlx
async def test_bad_input_fails_its_caller_only(llm):
    good = llm.next_token_logprobs([1, 2, 3])
    with pytest.raises(ValueError):
        await llm.next_token_logprobs([])
    with pytest.raises(ValueError):
        await llm.next_token_logprobs([llm.vocab_size])
    with pytest.raises(TypeError):
        await llm.next_token_logprobs("text")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        await llm.next_token_logprobs([1], lora_name="nope")
    with pytest.raises(ValueError):
        llm.batch_next_token_logprobs_sync([[1], []])
    assert (await good).shape == (llm.vocab_size,)


@needs_mlx
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prefill_step_size": 0}, "prefill_step_size"),
        ({"cache_opts": {"maxsize": 3}}, "unknown cache_opts"),
        ({"cache_size": -1}, "cache_size"),
    ],
)
def test_bad_options_are_refused_at_construction(tiny_folder, options, message):
    from genlm_backend.llm.mlx import AsyncMlxLM

    with pytest.raises(ValueError, match=message):
        AsyncMlxLM.from_name(str(tiny_folder[0]), **options)


@needs_mlx
def test_upstream_arguments_and_loader(tiny_folder):
    from genlm_backend.llm.mlx import AsyncMlxLM

    folder = str(tiny_folder[0])
    llm = AsyncMlxLM.from_name(folder, timeout=0.001, prefill_step_size=64, cache_size=0)
    assert llm.output_cache.budget_bytes == 0 and llm.timeout_s == 0.001
    loaded = load_model_by_name(folder, backend="mlx", llm_opts={"cache_size": 4})
    assert isinstance(loaded, AsyncMlxLM)
    assert loaded.output_cache.budget_bytes == 4 * len(loaded.tokenizer) * 4


@needs_mlx
async def test_sampling_is_reproducible(llm):
    first = await llm.batch_sample([[1, 2], [3]], max_tokens=4, eos_token_ids=[], seed=5)
    again = await llm.batch_sample([[1, 2], [3]], max_tokens=4, eos_token_ids=[], seed=5)
    assert first == again and [len(s) for s in first] == [4, 4]


@needs_mlx
def test_recurrent_models_are_refused():
    from mlx_lm.models import mamba

    from genlm_backend.llm.mlx.runner import MlxRunner

    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        state_size=4,
        num_hidden_layers=1,
        conv_kernel=2,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=2,
    )
    with pytest.raises(ValueError, match="attention-only"):
        MlxRunner(mamba.Model(args), None, 32, 8)  # type: ignore[arg-type]


@needs_mlx
def test_upstream_import_paths_give_the_real_class():
    code = (
        "from genlm_backend import alias; alias.install()\n"
        "from genlm.backend.llm import AsyncMlxLM\n"
        "from genlm.backend.llm.mlx import AsyncMlxLM as Same\n"
        "from genlm_backend.llm.mlx.model import AsyncMlxLM as Real\n"
        "assert AsyncMlxLM is Same is Real, AsyncMlxLM\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_without_mlx_the_placeholder_raises_with_the_install_hint():
    with pytest.raises(BackendNotAvailableError, match=r"genlm-backend-ng\[mlx\]"):
        UnavailableMlxLM(object(), object())
    with pytest.raises(BackendNotAvailableError, match="mlx"):
        UnavailableMlxLM.from_name("any-model")


@needs_mlx
@pytest.mark.slow
async def test_default_model_matches_transformers(smollm2_model, default_model_dir):
    from genlm_backend.llm.mlx import AsyncMlxLM

    llm = AsyncMlxLM.from_name(None)
    prompt = llm.tokenizer.encode("The capital of France is a city that")
    contexts = [prompt + [t] for t in (13, 314, 1000)]
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in [prompt, *contexts]))
    for context, row in zip([prompt, *contexts], rows):
        assert_exact(llm, smollm2_model, context, row)


LORA_PARAMETERS = {"rank": 4, "scale": 10.0, "dropout": 0.0}


def save_mlx_adapter(model_folder, folder, seed: int) -> str:
    """An mlx-lm LoRA adapter over the tiny model's 2 layers, with random non-zero A and B."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from genlm_backend.llm.mlx.compat import load_model

    model = load_model(model_folder)
    linear_to_lora_layers(model, 2, LORA_PARAMETERS)
    mx.random.seed(seed)
    weights = {
        k: mx.random.normal(v.shape) * 0.5
        for k, v in tree_flatten(model.trainable_parameters())
        if "lora_" in k
    }
    folder.mkdir()
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": LORA_PARAMETERS}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def adapter_reference(model_folder, adapter_folder, context) -> torch.Tensor:
    """A fresh model carrying only the adapter (mlx-lm's own loading), one plain forward."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_adapters

    from genlm_backend.llm.mlx.compat import load_model

    model = load_adapters(load_model(model_folder), adapter_folder)
    model.eval()
    logits = np.array(model(mx.array([list(context)]))[0, -1].astype(mx.float32))
    return torch.log_softmax(torch.from_numpy(logits), -1)


@needs_mlx
async def test_lora_adapters_per_request_match_their_own_forward(llm, tiny_folder, tmp_path):
    folder = tiny_folder[0]
    paths = [save_mlx_adapter(folder, tmp_path / name, seed) for name, seed in (("a", 1), ("b", 2))]
    context = [5, 6, 7, 8, 9]
    base_before = llm.next_token_logprobs_sync(context)
    llm.add_new_lora(paths[0], "a")
    llm.add_new_lora(paths[1], "b")
    assert torch.equal(llm.next_token_logprobs_uncached(context), base_before)  # bit for bit
    contexts = [context + [t] for t in (1, 2, 3)]
    names = [None, "a", "b"]
    rows = await asyncio.gather(
        *(llm.next_token_logprobs(c, lora_name=n) for c in contexts for n in names)
    )
    for i, (c, n) in enumerate((c, n) for c in contexts for n in names):
        expected = (
            llm.next_token_logprobs_uncached(c)
            if n is None
            else adapter_reference(folder, paths[names.index(n) - 1], c)
        )
        torch.testing.assert_close(rows[i], expected, atol=UNCACHED_ATOL, rtol=0)
    assert (rows[1] - rows[0]).abs().max() > 1e-2  # the adapters change the distribution
    llm.remove_lora("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        await llm.next_token_logprobs(context, lora_name="a")


@needs_mlx
def test_a_peft_adapter_is_refused_with_the_reason(llm, tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="not an mlx-lm LoRA adapter"):
        llm.add_new_lora(str(tmp_path), "peft")
