"""The runner contract, one suite over the HF, vLLM and mock runners.

A runner turns distinct requests into ``[B, V]`` float32 normalized rows; each
row must equal a plain uncached forward of that request, whatever the runner
cached from earlier batches, and whatever adapters the batch mixes. For the HF
and vLLM runners the reference is ``tests/hf_reference.py``'s: transformers'
forward of the same weights, copied before the runner got them, adapters
loaded by peft; for the mock, its defining function (``run_uncached``).
Tolerance: 1e-4 absolute (1e-3 for vLLM, whose kernels differ more, as in test_vllm.py).
The HF runner's model is a tiny GPT-2; vLLM's a tiny Llama on an engine built with
``enable_lora`` (vLLM's GPT-2 takes no adapters).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from genlm_backend.llm.runner import Adapter, Request
from tests.conftest import build_tiny_gpt2, build_tiny_llama
from tests.hf_reference import Reference

RUNNERS = ["mock", "hf", "vllm"]


def make_mock(tokenizer, tmp_path_factory):
    from genlm_backend.llm.mock import MockRunner

    runner = MockRunner(len(tokenizer), torch.device("cpu"))
    return runner, None, 1e-6, runner.run_uncached


def make_hf(tokenizer, tmp_path_factory):
    from genlm_backend.cache.kv_tree import KVPrefixTree
    from genlm_backend.llm.hf.runner import HFRunner

    model = build_tiny_gpt2(len(tokenizer))
    reference = Reference(model, len(tokenizer))
    runner = HFRunner(model, KVPrefixTree(1 << 30), len(tokenizer))
    return runner, None, 1e-4, reference.of


def make_vllm(tokenizer, tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (CPU: .ci/install_vllm.sh)")
    from genlm_backend.llm.vllm import AsyncVirtualLM

    path = tmp_path_factory.mktemp("contract_llama")
    model = build_tiny_llama(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    opts = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "gpu_memory_utilization": 0.3,
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 2,
    }
    llm = AsyncVirtualLM.from_name(path, engine_opts=opts)
    return llm.runner, llm, 1e-3, Reference(model, len(tokenizer)).of


@pytest.fixture(scope="module", params=RUNNERS)
def runner_case(request, gpt2_tokenizer, tmp_path_factory):
    """(name, runner, tolerance, reference) for each runner, built once per module;
    ``reference(request)`` is the request's row."""
    maker = {"mock": make_mock, "hf": make_hf, "vllm": make_vllm}[request.param]
    runner, owner, tolerance, reference = maker(gpt2_tokenizer, tmp_path_factory)
    yield request.param, runner, tolerance, reference
    (owner or runner).close()


def check_rows(runner_case, requests, rows) -> None:
    _, runner, tolerance, reference = runner_case
    assert rows.dtype == torch.float32 and rows.shape == (len(requests), runner.vocab_size)
    assert torch.logsumexp(rows, dim=-1).abs().max() < 1e-4
    for request, row in zip(requests, rows):
        torch.testing.assert_close(row, reference(request), atol=tolerance, rtol=0)


def workload(rng: random.Random, vocab: int, num_rounds: int):
    """Rounds of distinct contexts: one-token extensions (particles), siblings and fresh prompts."""
    particles = [[rng.randrange(vocab) for _ in range(rng.randint(2, 9))] for _ in range(4)]
    for _ in range(num_rounds):
        batch = [p + [rng.randrange(vocab)] for p in particles]
        batch.append(rng.choice(particles)[:-1] + [rng.randrange(vocab)])
        batch.append([rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
        particles = batch[:4]
        yield list({tuple(c): None for c in batch})


def test_rows_equal_uncached_forwards_across_cached_rounds(runner_case):
    runner = runner_case[1]
    rng = random.Random(0)
    tokens_before = runner.stats.num_tokens_computed
    for contexts in workload(rng, runner.vocab_size, 4):
        requests = [Request(None, tuple(c)) for c in contexts]
        check_rows(runner_case, requests, runner.run(requests))
    assert runner.stats.num_tokens_computed > tokens_before


def test_clear_keeps_results_exact(runner_case):
    runner = runner_case[1]
    requests = [Request(None, (5, 6, 7)), Request(None, (5, 6, 7, 8))]
    runner.run(requests)
    runner.clear()
    assert runner.stats.kv_cache_bytes == 0
    check_rows(runner_case, requests, runner.run(requests))


def adapter_for(name: str, runner, tmp_path) -> Adapter:
    """An adapter this runner can load: any path for the mock, a peft LoRA (non-zero B) of
    its tiny model for HF (GPT-2) and vLLM (Llama)."""
    if name == "mock":
        return Adapter("a", 1, "mock-weights")
    peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")
    torch.manual_seed(4)
    if name == "hf":
        base = build_tiny_gpt2(runner.vocab_size)
        config = peft.LoraConfig(
            r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False
        )
    else:
        base = build_tiny_llama(runner.vocab_size)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    return Adapter("a", 1, str(tmp_path / "adapter"))


def test_a_batch_mixing_adapters_equals_uncached_forwards(runner_case, tmp_path):
    name, runner, _, _ = runner_case
    adapter = adapter_for(name, runner, tmp_path)
    runner.load_adapter(adapter)
    try:
        for contexts in workload(random.Random(1), runner.vocab_size, 3):
            requests = [Request(a, tuple(c)) for c in contexts for a in (None, adapter)]
            rows = runner.run(requests)
            check_rows(runner_case, requests, rows)
            assert (rows[0] - rows[1]).abs().max() > 1e-3  # the adapter changes the output
    finally:
        runner.unload_adapter(adapter)
    with pytest.raises(ValueError, match="removed or re-registered"):
        runner.run([Request(adapter, (1, 2))])


def test_a_request_is_equal_and_hashed_by_adapter_and_context_and_survives_pickling():
    import pickle

    from genlm_backend.llm.runner import Adapter, Request

    request = Request(Adapter("a", 1, "/path"), (1, 2, 3))
    same = Request(Adapter("a", 1, "/path"), (1, 2, 3), parent=(1, 2))  # parent: not identity
    assert request == same and hash(request) == hash(same)
    assert request != Request(Adapter("a", 2, "/path"), (1, 2, 3))
    assert request != Request(Adapter("a", 1, "/path"), (0, 2, 3))
    copy = pickle.loads(pickle.dumps(same))
    assert copy == request and hash(copy) == hash(request) and copy.parent is None
    assert {request: 1}[copy] == 1


def test_contexts_alike_in_length_and_last_tokens_are_distinct_keys():
    from genlm_backend.cache.kv_tree import HASHED_TAIL, ContextKey
    from genlm_backend.llm.runner import Request

    tail = tuple(range(HASHED_TAIL))
    a, b = Request(None, (1, *tail)), Request(None, (2, *tail))
    assert hash(a) != hash(b) and a != b  # hashed whole
    table = {a: "a", b: "b"}
    assert table[Request(None, (1, *tail))] == "a" and table[Request(None, (2, *tail))] == "b"
    keys = ContextKey(None, (1, *tail)), ContextKey(None, (2, *tail))
    assert hash(keys[0]) == hash(keys[1]) and keys[0] != keys[1]  # hashed by their tails
    assert {key: i for i, key in enumerate(keys)}[ContextKey(None, (2, *tail))] == 1


class _CountedTokens(tuple):
    """A context that counts its token-by-token comparisons."""

    comparisons = 0

    def __eq__(self, other):
        _CountedTokens.comparisons += 1
        return tuple.__eq__(self, other)

    __hash__ = tuple.__hash__


@pytest.mark.parametrize("key_kind", ["request", "context-key"])
def test_contexts_alike_at_their_end_are_told_apart_without_comparing_their_tokens(key_kind):
    """Particles in one repetition loop behind a long prompt: alike in length and last tokens,
    different after the prompt. A dictionary of them compares no pair's tokens (each
    comparison reads the prompt); equal contexts still find each other."""
    from genlm_backend.cache.kv_tree import COMPARED_LENGTH, HASHED_TAIL, ContextKey
    from genlm_backend.llm.runner import Request

    key = (lambda c: Request(None, c)) if key_kind == "request" else (lambda c: ContextKey(None, c))
    prompt = tuple(range(COMPARED_LENGTH + 100))
    contexts = [_CountedTokens((*prompt, first, *[5] * HASHED_TAIL)) for first in range(32)]
    keys = [key(context) for context in contexts]
    # A request is hashed whole; a tree key by its tail (every pair collides), told apart by
    # whole hashes.
    assert len({hash(k) for k in keys}) == (32 if key_kind == "request" else 1)
    _CountedTokens.comparisons = 0
    table = {k: i for i, k in enumerate(keys)}
    assert len(table) == 32 and _CountedTokens.comparisons == 0
    equal = [key(_CountedTokens(tuple(context))) for context in contexts]  # new objects
    assert [table[k] for k in equal] == list(range(32))
    assert _CountedTokens.comparisons == 32  # one for each equal pair


def test_a_requests_hash_is_its_whole_contexts_from_scratch_or_from_its_parents_digest():
    """The front hashes a context from its parent's block digest; a request made without the
    hash reads the whole context: the same hash, at every length around a block's end."""
    from genlm_backend.cache.kv_tree import HASH_BLOCK, blocks_digest, context_hash
    from genlm_backend.llm.runner import Request

    tokens = tuple(random.Random(0).randrange(1000) for _ in range(3 * HASH_BLOCK + 5))
    digest = 0
    for length in range(1, len(tokens) + 1):
        context, parent = tokens[:length], tokens[: length - 1]
        digest = blocks_digest(context, digest, len(parent) - len(parent) % HASH_BLOCK)
        assert digest == blocks_digest(context)
        assert context_hash(context, digest) == context_hash(context)
        assert hash(Request(None, context, hashed=context_hash(context, digest))) == hash(
            Request(None, context)
        )
    assert context_hash(tokens) != context_hash((7, *tokens[1:]))  # the first token counts


@pytest.mark.parametrize("shape", [(1, 7), (3, 49152), (64, 1000), (5, 4099)])
def test_logits_a_runner_owns_are_normalized_in_place_as_the_same_bits(shape):
    """A model's fresh float32 logits become the rows where they lie: the bits of the
    out-of-place log-softmax, a plain tensor callers may write to (also from inference
    mode), and the input's memory."""
    from genlm_backend.llm.runner import fit_to_vocab

    generator = torch.Generator().manual_seed(shape[0] * shape[1])
    source = 8 * torch.randn(shape, generator=generator)
    expected = torch.log_softmax(source, dim=-1)
    with torch.inference_mode():
        logits = source.clone()
        rows = fit_to_vocab(logits, shape[1], own=True)
    assert rows.data_ptr() == logits.data_ptr() and not rows.is_inference()
    assert torch.equal(rows, expected)
    assert torch.equal(fit_to_vocab(source, shape[1]), expected)  # not owned: a new tensor
    rows[0].fill_(0.0)  # the caller's row
    assert torch.equal(rows[1:], expected[1:])


@pytest.mark.parametrize(
    "columns, dtype", [(12, torch.float32), (8, torch.float32), (10, torch.bfloat16)]
)
def test_logits_of_another_width_or_dtype_are_fitted_anew_even_when_owned(columns, dtype):
    """Owned logits the vocabulary does not fit exactly (or not float32) take the plain
    path: columns dropped and renormalized, or padded with -inf; the logits unchanged."""
    from genlm_backend.llm.runner import fit_to_vocab

    logits = torch.randn(3, columns, generator=torch.Generator().manual_seed(columns)).to(dtype)
    before = logits.clone()
    rows = fit_to_vocab(logits, 10, own=True)
    assert rows.shape == (3, 10) and rows.dtype == torch.float32
    assert torch.equal(logits, before)
    kept = logits.float()[:, :10]
    expected = torch.log_softmax(kept, -1)
    if columns < 10:  # missing columns: -inf
        expected = torch.cat([expected, torch.full((3, 10 - columns), -torch.inf)], dim=-1)
    assert torch.equal(rows, expected)
