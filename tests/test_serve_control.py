"""genlm-control through a server: AWRS SMC on a ``RemoteLM`` samples what it samples in-process.

genlm-control's ``PromptedLLM`` takes the ``RemoteLM`` unchanged (it reads
``tokenizer`` and ``byte_vocab`` and calls ``next_token_logprobs`` and
``batch_next_token_logprobs``). The server runs the mock backend over the
default model's tokenizer, so the run is fast and every row is exact; the
in-process reference is a ``MockAsyncLM`` over the same tokenizer.

Runs where genlm-control 0.4.1 is installed (CI's client-suites step installs
it and runs this file; recipe in docs/genlm_control.md); skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

from genlm_backend import MockAsyncLM
from genlm_backend.serve import RemoteLM
from tests.serve_support import ServerProcess


def genlm_control_installed() -> bool:
    try:
        return importlib.util.find_spec("genlm.control") is not None
    except ModuleNotFoundError:  # no `genlm` namespace at all
        return False


pytestmark = [
    pytest.mark.skipif(
        not genlm_control_installed(),
        reason="needs genlm-control 0.4.1 installed next to genlm_backend (docs/genlm_control.md)",
    ),
    pytest.mark.timeout(300),
]

EMAIL = r"[a-z]{2,12}\.[a-z]{2,12}@[a-z]{3,12}\.(com|org|net)"
REQUEST = "Make up a work email address for Jane Doe. Answer with the address only."


def awrs_smc(llm, num_particles: int = 4, max_tokens: int = 6):
    """Regex-constrained AWRS SMC on ``llm``, seeded: (particles' contexts, log weights)."""
    import genlm_backend.alias

    genlm_backend.alias.install()
    from genlm.control import AWRS, BoolFSA, PromptedLLM

    potential = PromptedLLM(llm, eos_byte_strings=[b"<|im_end|>"])
    potential.prompt_ids = llm.tokenizer.encode(REQUEST)
    condition = BoolFSA.from_regex(EMAIL).coerce(potential, f=b"".join)

    async def run():
        np.random.seed(0)
        torch.manual_seed(0)
        sampler = AWRS(potential, condition, seed=0)
        return await sampler.smc(
            n_particles=num_particles, ess_threshold=0.5, max_tokens=max_tokens
        )

    sequences = asyncio.run(run())
    return [list(context) for context in sequences.contexts], list(sequences.log_weights)


def test_awrs_smc_through_a_server_samples_what_it_samples_in_process():
    server = ServerProcess.cli("--backend", "mock", "--port", "0")
    try:
        with RemoteLM(server.url) as remote:
            served = awrs_smc(remote)
            lm_stats, serve_stats = remote.server_stats()
        assert lm_stats.num_requests > 0 and serve_stats.num_rejected == 0
    finally:
        server.stop()
    in_process = awrs_smc(MockAsyncLM.from_name(None))
    assert served[0] == in_process[0]
    assert np.array_equal(np.asarray(served[1]), np.asarray(in_process[1]))
    assert any(context for context in served[0])  # the particles did sample tokens
