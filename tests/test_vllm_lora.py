"""AsyncVirtualLM with per-request LoRA adapters (an engine built with ``enable_lora``).

Reference: a transformers forward of a peft model carrying exactly that
adapter (or the plain base model), one context at a time. Tolerance: 1e-3
absolute, as in test_vllm.py. The adapters have non-zero B weights, so each
really changes the output.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: .ci/install_vllm.sh)")
peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")

from genlm_backend.llm.vllm import AsyncVirtualLM  # noqa: E402
from tests.conftest import build_tiny_llama  # noqa: E402

pytestmark = pytest.mark.vllm

ATOL = 1e-3
ENGINE_OPTS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 128,
    "gpu_memory_utilization": 0.3,
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 2,
}


def save_adapter(vocab_size: int, path, seed: int) -> str:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(build_tiny_llama(vocab_size), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return str(path)


def reference(vocab_size: int, adapter_path, context) -> torch.Tensor:
    model = build_tiny_llama(vocab_size)
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_path)
    with torch.inference_mode():
        logits = model.eval()(torch.tensor([list(context)])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)[:vocab_size]


@pytest.fixture(scope="module")
def lora_vllm(tmp_path_factory, smollm2_tokenizer):
    vocab_size = len(smollm2_tokenizer)
    path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_llama(vocab_size).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    adapters = [
        save_adapter(vocab_size, tmp_path_factory.mktemp(f"adapter{i}"), seed=20 + i)
        for i in range(2)
    ]
    llm = AsyncVirtualLM.from_name(path, engine_opts=ENGINE_OPTS)
    yield llm, adapters
    llm.close()


def test_mixed_adapters_and_reregistration_match_references(lora_vllm):
    llm, (first, second) = lora_vllm
    vocab = llm.vocab_size
    llm.add_new_lora(first, "a")
    contexts = [[5, 6, 7, 8], [5, 6, 7, 8, 9], [40, 41]]
    names = {None: None, "a": first}

    async def mixed():
        calls = [llm.next_token_logprobs(c, lora_name=n) for c in contexts for n in names]
        return await asyncio.gather(*calls)

    rows = asyncio.run(mixed())
    for (context, name), row in zip([(c, n) for c in contexts for n in names], rows):
        torch.testing.assert_close(row, reference(vocab, names[name], context), atol=ATOL, rtol=0)
    assert (rows[0] - rows[1]).abs().max() > 1e-2
    # One-token extensions (particle sessions) stay with their adapter:
    step = llm.next_token_logprobs_sync(contexts[1] + [10], lora_name="a")
    torch.testing.assert_close(step, reference(vocab, first, contexts[1] + [10]), atol=ATOL, rtol=0)
    llm.add_new_lora(second, "a")  # re-registration: new weights, old rows dropped
    row = llm.next_token_logprobs_sync(contexts[1] + [10], lora_name="a")
    torch.testing.assert_close(row, reference(vocab, second, contexts[1] + [10]), atol=ATOL, rtol=0)
    llm.remove_lora("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        llm.next_token_logprobs_sync(contexts[0], lora_name="a")
