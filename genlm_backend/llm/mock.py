"""A deterministic stand-in model for tests and examples: :class:`MockRunner` and ``MockAsyncLM``."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.runner import Adapter, Request, RunnerStats, ScoreRequest, score_from_rows
from genlm_backend.models import load_tokenizer_by_name


class MockRunner:
    """Log-probabilities that are a pure function of the request.

    Each context is hashed (BLAKE2b over its int64 bytes, so ``[2]`` and
    ``[0, 1]`` differ; an adapter's path salts the hash) into the seed of a
    random logit vector. Distinct contexts or adapters get distinct
    distributions; the same request always gets the same one, in any process.
    "Loading" an adapter only records it: any path works.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.num_tokens_computed = 0
        self._loaded: dict[str, Adapter] = {}

    @property
    def stats(self) -> RunnerStats:
        return RunnerStats(num_tokens_computed=self.num_tokens_computed, kv_cache_bytes=0)

    def request_tokens(self, request: Request) -> int:
        """A request's cost against the batch token budget: its context length."""
        return len(request.context)

    def run(self, requests: Sequence[Request]) -> torch.Tensor:
        rows = [self._logits(request) for request in requests]
        self.num_tokens_computed += sum(len(request.context) for request in requests)
        return torch.log_softmax(torch.stack(rows), dim=-1).to(self.device)

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Scores gathered from the rows of each continuation's prefixes."""
        return score_from_rows(self.run, requests)

    def run_uncached(self, request: Request) -> torch.Tensor:
        return torch.log_softmax(self._logits(request), dim=-1).to(self.device)

    def _logits(self, request: Request) -> torch.Tensor:
        adapter = request.adapter
        if adapter is not None and self._loaded.get(adapter.name) != adapter:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} was removed or re-registered while this request waited"
            )
        digest = hashlib.blake2b(
            np.asarray(request.context, dtype=np.int64).tobytes(), digest_size=8
        )
        if adapter is not None:
            digest.update(adapter.path.encode())
        generator = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
        return 3.0 * torch.randn(self.vocab_size, generator=generator)

    def load_adapter(self, adapter: Adapter) -> None:
        self._loaded[adapter.name] = adapter

    def unload_adapter(self, adapter: Adapter) -> None:
        if self._loaded.get(adapter.name) == adapter:
            del self._loaded[adapter.name]

    def clear(self) -> None:
        """Nothing to drop: the mock keeps no keys/values."""

    def close(self) -> None:
        self._loaded.clear()


class MockAsyncLM(AsyncLM):
    """An :class:`~genlm_backend.llm.base.AsyncLM` over a :class:`MockRunner`.

    Runs through the same batcher, caches and validation as a real backend.

    Args:
        tokenizer: A Hugging Face tokenizer, or ``None`` with ``byte_vocab`` given.
        byte_vocab: The vocabulary, when no tokenizer is at hand.
        deterministic: Steps go when the event loop is idle, never on the
            clock, and calls complete in the order they were made (a mock's
            rows depend on their context alone either way).
        **kwargs: :class:`~genlm_backend.llm.base.AsyncLM` options.

    Raises:
        ValueError: neither a tokenizer nor a ``byte_vocab``.
    """

    def __init__(self, tokenizer=None, *, byte_vocab=None, deterministic: bool = False, **kwargs):
        if tokenizer is None and byte_vocab is None:
            raise ValueError("MockAsyncLM needs a tokenizer or a byte_vocab")
        if deterministic:
            kwargs.update(timeout_s=None, rounds=True)
        super().__init__(tokenizer, byte_vocab=byte_vocab, **kwargs)
        self.runner = MockRunner(self.vocab_size, self.device)

    @classmethod
    def from_name(cls, model_name: str | None = None, **kwargs) -> MockAsyncLM:
        """A mock over the tokenizer of a local or default model (see :func:`load_tokenizer_by_name`)."""
        return cls(load_tokenizer_by_name(model_name), **kwargs)
