"""A real transformers model behind ``genlm-backend serve --backend hf``: rows are the in-process bytes.

The model is a tiny random GPT-2 over the real GPT-2 tokenizer, saved to a
folder that both the server process and the in-process reference load. Each
step is one batch on both sides (one round trip, one in-process batch), so
the computations are the same and the float32 bytes must be equal.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.serve import RemoteLM
from tests.conftest import build_tiny_gpt2
from tests.serve_support import ServerProcess

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, gpt2_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    build_tiny_gpt2(len(gpt2_tokenizer)).save_pretrained(folder)
    gpt2_tokenizer.save_pretrained(folder)
    return folder


def test_rows_through_the_server_are_the_in_process_bytes(model_dir):
    server = ServerProcess.cli("--backend", "hf", "--model", str(model_dir), "--port", "0")
    # Fixed torch threads, as the server's worker has: a row's bits depend on the count.
    local = AsyncTransformer.from_name(str(model_dir), cpu_threads=None)
    try:
        with RemoteLM(server.url) as remote:
            assert remote.byte_vocab == local.byte_vocab
            assert remote.max_context_length == local.max_context_length == 512
            prompt = remote.tokenizer.encode("Particles in flight, one model")
            assert prompt == local.tokenizer.encode("Particles in flight, one model")
            contexts = [prompt + [token] for token in range(8)]
            for _ in range(3):  # each step extends every context (KV reuse on both sides)

                async def step(lm, contexts=contexts):
                    return torch.stack(await asyncio.gather(*map(lm.next_token_logprobs, contexts)))

                remote_rows = asyncio.run(step(remote))
                local_rows = asyncio.run(step(local))
                assert torch.equal(remote_rows, local_rows)
                contexts = [c + [int(row.argmax())] for c, row in zip(contexts, local_rows)]
            lm_stats, _ = remote.server_stats()
            assert lm_stats.num_batches == 3
            assert lm_stats.num_tokens_computed == local.stats.num_tokens_computed
    finally:
        local.close()
        server.stop()
