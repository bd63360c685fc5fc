"""A deterministic stand-in model for tests and examples."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from genlm_backend.llm.base import AsyncLM


class MockAsyncLM(AsyncLM):
    """Log-probabilities that are a pure function of the context.

    Each context is hashed (BLAKE2b over its int64 bytes, so ``[2]`` and
    ``[0, 1]`` differ) into the seed of a random logit vector. Distinct
    contexts get distinct distributions; the same context always gets the same
    one, in any process. Runs through the same batcher, caches and validation
    as a real backend.

    Args:
        tokenizer: A Hugging Face tokenizer, or ``None`` with ``byte_vocab`` given.
        byte_vocab: The vocabulary, when no tokenizer is at hand.
        **kwargs: :class:`~genlm_backend.llm.base.AsyncLM` options.
    """

    def __init__(self, tokenizer=None, *, byte_vocab=None, **kwargs):
        if tokenizer is None and byte_vocab is None:
            raise ValueError("MockAsyncLM needs a tokenizer or a byte_vocab")
        super().__init__(tokenizer, byte_vocab=byte_vocab, **kwargs)

    @classmethod
    def from_name(cls, model_name: str | None = None, **kwargs) -> MockAsyncLM:
        """A mock over the tokenizer of a local or default model (see :func:`load_tokenizer_by_name`)."""
        from genlm_backend.llm.loader import load_tokenizer_by_name

        return cls(load_tokenizer_by_name(model_name), **kwargs)

    def _compute_logprobs(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        rows = [self._logits(context) for context in contexts]
        return torch.log_softmax(torch.stack(rows), dim=-1).to(self.device)

    def _logits(self, context: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.blake2b(np.asarray(context, dtype=np.int64).tobytes(), digest_size=8)
        generator = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
        return 3.0 * torch.randn(self.vocab_size, generator=generator)
