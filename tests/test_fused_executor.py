"""The fused executor (``executor="fused"``) under the prefix-cache driver: its rows are a plain
forward's, through prefix reuse, shared levels read once, in-place steps, nested rows, chunked
prefills and scoring; adapters' passes run the transformers model; what it cannot serve is refused.

The integration tests run the decoder eagerly (its compiled functions are the decoder's own
tests'); one test compiles it through ``AsyncTransformer``'s option, as a user would.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from genlm_backend.cache.plan import LevelPolicy
from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.hf.fused import FusedDecoder
from genlm_backend.llm.hf.runner import FusedExecutor, TransformersExecutor
from tests.conftest import build_tiny_llama
from tests.hf_reference import reference

VOCAB = 256
ATOL = 1e-4


@pytest.fixture
def eager_decoders(monkeypatch):
    """``executor="fused"`` builds eager decoders (compiling is the decoder tests' business)."""
    of = FusedDecoder.of.__func__
    monkeypatch.setattr(
        FusedDecoder, "of", classmethod(lambda cls, model, **kw: of(cls, model, compiled=False))
    )


def fused_llm(model=None, **options) -> AsyncTransformer:
    model = build_tiny_llama(VOCAB) if model is None else model
    vocab = [bytes([i]) for i in range(VOCAB)]
    return AsyncTransformer(model, None, byte_vocab=vocab, executor="fused", **options)


def check(llm, contexts, rows) -> None:
    pristine = build_tiny_llama(VOCAB)  # the model's weights now live in the decoder's matrices
    for context, row in zip(contexts, rows):
        torch.testing.assert_close(row, reference(pristine, context), atol=ATOL, rtol=0)


async def test_fused_rows_are_a_plain_forward_s_through_the_cache(eager_decoders):
    llm = fused_llm()
    assert isinstance(llm.runner.executor, FusedExecutor)
    llm.runner.level_policy = LevelPolicy(min_shared_tokens=16, min_unshared_tokens=16)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]
    particles = [[*prompt, rng.randrange(VOCAB)] for _ in range(6)]
    for step in range(4):  # the prompt read once as a level, steps in place, a resample
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        check(llm, particles, rows)
        if step == 1:
            particles = [list(rng.choice(particles)) for _ in particles]
        for p in particles:
            p.append(rng.randrange(VOCAB))
    longest = [*particles[0], 5, 6, 7]
    nested = [longest[:n] for n in range(len(longest) - 3, len(longest) + 1)]
    check(llm, nested, await llm.batch_next_token_logprobs(nested))  # read from one pass
    continuation = [9, 8, 7]
    scores = await llm.continuation_logprobs(prompt, continuation)
    pristine = build_tiny_llama(VOCAB)
    expected = [
        float(reference(pristine, prompt + continuation[:i])[t]) for i, t in enumerate(continuation)
    ]
    assert scores.tolist() == pytest.approx(expected, abs=ATOL)
    llm.close()


async def test_a_chunked_prefill_through_the_fused_executor(eager_decoders):
    llm = fused_llm(chunk_tokens=16)
    prompt = [(5 * i + 2) % VOCAB for i in range(70)]
    contexts = [[*prompt, i] for i in range(3)]
    rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
    # 16, 16, then the last 38 at once: a rest of 22 would not count as shared (under 32 tokens)
    assert llm.engine.counts["chunks"] == 3
    check(llm, contexts, rows)
    llm.close()


def test_an_adapter_s_passes_run_the_transformers_model(eager_decoders, tmp_path):
    peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(build_tiny_llama(VOCAB), config)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    llm = fused_llm()
    llm.add_new_lora(str(tmp_path / "adapter"), "a")
    context = [1, 2, 3, 4]
    plain = llm.next_token_logprobs_sync(context)
    under = llm.next_token_logprobs_sync(context, lora_name="a")
    check(llm, [context], [plain])
    with torch.inference_mode():
        expected = peft.PeftModel.from_pretrained(build_tiny_llama(VOCAB), tmp_path / "adapter")
        logits = expected.eval()(torch.tensor([context]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(under, torch.log_softmax(logits.float(), -1), atol=ATOL, rtol=0)
    assert not torch.allclose(plain, under, atol=1e-3)  # the adapter changed the rows
    llm.close()


def test_what_the_fused_executor_cannot_serve_is_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        fused_llm(gpt2)
    with pytest.raises(ValueError, match="does not compute exact rows"):
        fused_llm(deterministic=True)
    vocab = [bytes([i]) for i in range(VOCAB)]
    with pytest.raises(ValueError, match="executor must be one of"):
        AsyncTransformer(build_tiny_llama(VOCAB), None, byte_vocab=vocab, executor="quick")


def test_auto_runs_the_transformers_model_where_the_fused_one_is_not_shown_faster():
    vocab = [bytes([i]) for i in range(VOCAB)]
    llm = AsyncTransformer(build_tiny_llama(VOCAB), None, byte_vocab=vocab)
    assert type(llm.runner.executor) is TransformersExecutor  # on the CPU: FUSED_BY_DEFAULT
    llm.close()


async def test_the_compiled_fused_executor_matches_a_plain_forward_and_compiles_once():
    """The one family CI compiles (the others: ``-m fused_all`` in tests/test_fused_decoder.py):
    each of the decoder's three functions compiles once, whole, and passes of other shapes
    (a prefill, then one-token steps, then a shared prompt's rows) never recompile it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    llm = fused_llm()
    contexts = [[3, 1, 4, 1, 5], [3, 1, 4, 1, 6], [9, 2]]
    check(llm, contexts, await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts)))
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(2):
            contexts = [[*c, 7 + step] for c in contexts]
            rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts))
            check(llm, contexts, rows)
    assert counters["stats"]["unique_graphs"] == 3
    llm.close()
    torch._dynamo.reset()
