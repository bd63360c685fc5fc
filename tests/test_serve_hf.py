"""A real transformers model behind ``genlm-backend serve --backend hf``: rows are the in-process bytes.

The model is a tiny random GPT-2 over the real GPT-2 tokenizer, saved to a
folder that both the server process and the in-process reference load. Each
step is one batch on both sides (one round trip, one in-process batch), so
the computations are the same and the float32 bytes must be equal.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.serve import RemoteLM
from tests.conftest import build_tiny_gpt2
from tests.serve_support import ServerProcess, in_thread

pytestmark = pytest.mark.timeout(180)

HANG_S = 120.0  # a hang guard on a client thread: never reached by a correct build


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


def save_lora(model_dir, folder, seed: int) -> str:
    """A peft LoRA of the tiny GPT-2 with non-zero weights (so it changes the rows), saved."""
    from transformers import AutoModelForCausalLM

    peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False
    )
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return str(folder)


def test_two_clients_registering_one_adapter_name_never_get_each_other_s_rows(model_dir, tmp_path):
    """B registers "x" from one folder, A from another: B's next request under "x" is
    refused (never answered with A's weights); each client's rows are its own
    adapter's, as peft computes them from the folder, also for a context the server
    computed under the other registration (never its cached row)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import ATOL, Reference

    adapters = tmp_path / "adapters"
    first = save_lora(model_dir, adapters / "first", seed=1)
    second = save_lora(model_dir, adapters / "second", seed=2)
    reference = Reference(AutoModelForCausalLM.from_pretrained(model_dir), 50257)
    server = ServerProcess.cli(
        "--backend", "hf", "--model", str(model_dir), "--port", "0", "--adapter-dir", str(adapters)
    )
    try:
        with RemoteLM(server.url) as b, RemoteLM(server.url) as a:
            context = b.tokenizer.encode("Whose weights answer")
            b.add_new_lora("first", "x")
            row = b.next_token_logprobs_sync(context, "x")
            torch.testing.assert_close(row, reference.row(context, first), atol=ATOL, rtol=0)
            a.add_new_lora("second", "x")
            with pytest.raises(ValueError, match=r"'x' was registered again"):
                b.next_token_logprobs_sync(context + [11], "x")
            row = a.next_token_logprobs_sync(context + [11], "x")
            torch.testing.assert_close(
                row, reference.row(context + [11], second), atol=ATOL, rtol=0
            )
            b.add_new_lora("first", "x")  # B takes it back
            # The server computed this context under A's registration: never its cached row.
            row = b.next_token_logprobs_sync(context + [11], "x")
            torch.testing.assert_close(row, reference.row(context + [11], first), atol=ATOL, rtol=0)
            row = b.next_token_logprobs_sync(context + [12], "x")
            torch.testing.assert_close(row, reference.row(context + [12], first), atol=ATOL, rtol=0)
            a.remove_lora("x")  # A's registration was replaced by B's: B's stays
            row = b.next_token_logprobs_sync(context + [13], "x")
            torch.testing.assert_close(row, reference.row(context + [13], first), atol=ATOL, rtol=0)
    finally:
        server.stop()


def test_deterministic_rows_through_the_server_ignore_another_client_s_traffic(model_dir):
    """``serve --deterministic``: A's rows, computed while B sends batches of its own over
    the same prompt (sharing A's steps and cache), and B's rows too, are the bits of each
    context computed alone, from an empty cache, in this process; and within float32
    rounding (``ATOL``) of transformers' plain forward, which takes none of the
    deterministic path. A steps until the server's counters prove that one of its
    batches held both clients' requests (at least three steps)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import ATOL, reference

    server = ServerProcess.cli(
        "--backend", "hf", "--model", str(model_dir), "--port", "0", "--deterministic"
    )
    alone = AsyncTransformer.from_name(str(model_dir), deterministic=True)
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def check_row(context: list[int], row: torch.Tensor) -> None:
        alone.clear_cache()
        assert torch.equal(row, alone.next_token_logprobs_sync(context)), context
        torch.testing.assert_close(row, reference(plain, context), atol=ATOL, rtol=0)

    stop, busy = threading.Event(), threading.Event()
    first_tokens = range(6)  # A's contexts: the prompt and one of these, then its own tokens

    def other_client(prompt: list[int]) -> list:
        """B's batches: prefixes of the prompt and tokens A's contexts never hold at that
        place, so no row of B's is one of A's (each asks the model for its own)."""
        rng = random.Random(1)
        batches = []
        with RemoteLM(server.url) as b:
            while not stop.is_set():
                batch = [
                    prompt[: rng.randint(1, len(prompt))]
                    + [rng.randrange(len(first_tokens), 50257) for _ in range(rng.randint(0, 4))]
                    for _ in range(rng.randint(1, 12))
                ]
                batches.append((batch, b.batch_next_token_logprobs_sync(batch)))
                busy.set()
        return batches

    try:
        with RemoteLM(server.url) as a:
            prompt = a.tokenizer.encode("Particles in flight, one model, many clients")
            thread, outcome = in_thread(other_client, prompt)
            assert busy.wait(HANG_S), outcome
            contexts = [prompt + [token] for token in first_tokens]
            for step in range(MAX_STEPS):

                async def step_rows(contexts=contexts):
                    return await asyncio.gather(*map(a.next_token_logprobs, contexts))

                rows = asyncio.run(step_rows())
                for context, row in zip(contexts, rows):
                    check_row(context, row)
                contexts = [c + [int(row.argmax())] for c, row in zip(contexts, rows)]
                if step >= 2 and shared_batches(a) > 0:
                    break
            assert shared_batches(a) > 0, (
                f"no batch held both clients' requests in {step + 1} steps"
            )
            stop.set()
            thread.join(HANG_S)
            assert "error" not in outcome, outcome
            for batch, rows in outcome["result"][-2:]:
                for context, row in zip(batch, rows):
                    check_row(context, row)
    finally:
        stop.set()
        alone.close()
        server.stop()


MAX_STEPS = 12  # a hang guard: A's first step nearly always goes in a batch with B's


def shared_batches(client: RemoteLM) -> int:
    """A lower bound on the server's batches that held requests of two clients.

    Each client has one request in flight at most (one round trip at a time); a
    request answered without the model counts at least one output-cache hit; so
    when fewer batches ran than answered requests needed, some batch held two
    requests, of two clients.
    """
    lm_stats, serve_stats = client.server_stats()
    assert serve_stats.num_rejected == 0, serve_stats
    answered = serve_stats.num_requests - serve_stats.num_in_flight
    return answered - lm_stats.num_output_cache_hits - lm_stats.num_batches
