"""The blocking calls of :class:`~genlm_backend.llm.base.AsyncLM`: computed in the calling thread.

They share the output cache and the model with the async path (under the
same compute lock) but no batcher: they need no event loop, and work inside
a running one too (a notebook cell, a callback).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from genlm_backend.llm.runner import Request
from genlm_backend.llm.validation import TokenIds, as_list_of_contexts, validate_token_ids

if TYPE_CHECKING:
    from genlm_backend.batching import BatchingConfig
    from genlm_backend.llm.adapters import AdapterRegistry
    from genlm_backend.llm.runner import Runner


class SyncMethods:
    """``*_sync`` calls, ``next_token_logprobs_uncached`` and ``cache_kv`` of ``AsyncLM``."""

    if TYPE_CHECKING:  # provided by AsyncLM
        runner: Runner
        adapters: AdapterRegistry
        batching: BatchingConfig
        device: torch.device
        max_context_length: int | None
        _compute_lock: threading.Lock

        def _request_tokens(self, request: Request) -> int: ...

        @property
        def vocab_size(self) -> int: ...

        def _check_open(self) -> None: ...

        def _requests(
            self, token_ids_list: list[TokenIds], lora_name: str | None
        ) -> list[Request]: ...

        def _cached(self, request: Request) -> torch.Tensor | None: ...

        def _process_batch(self, requests: list[Request]) -> list[torch.Tensor | ValueError]: ...

    def next_token_logprobs_sync(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`next_token_logprobs`; works inside a running event loop too."""
        # Validated here first, so errors name token_ids (not token_ids_list[0]).
        validate_token_ids(token_ids, self.vocab_size, self.max_context_length)
        return self.batch_next_token_logprobs_sync([token_ids], lora_name)[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[TokenIds], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`batch_next_token_logprobs`; computes in the calling thread."""
        requests = self._requests(as_list_of_contexts(token_ids_list), lora_name)
        rows: dict[Request, torch.Tensor] = {}
        for request in requests:
            cached = self._cached(request)
            if cached is not None:
                rows[request] = cached
        missing = [request for request in dict.fromkeys(requests) if request not in rows]
        for chunk in self.batching.split(missing, self._request_tokens):
            for request, row in zip(chunk, self._process_batch(chunk)):
                if isinstance(row, ValueError):
                    raise row
                rows[request] = row
        return torch.stack([rows[request] for request in requests])  # stack copies: caller owns it

    def next_token_logprobs_uncached(
        self, token_ids: TokenIds, lora_name: str | None = None
    ) -> torch.Tensor:
        """One plain forward pass over the whole context: no batching, no cache read or written."""
        self._check_open()
        request = Request(
            self.adapters.resolve(lora_name),
            validate_token_ids(token_ids, self.vocab_size, self.max_context_length),
        )
        with self._compute_lock:
            return self.runner.run_uncached(request).to(self.device)

    def cache_kv(self, prompt_tokens: TokenIds, lora_name: str | None = None) -> None:
        """Run ``prompt_tokens`` now, so later requests extending it start from its keys/values.

        Optional: every evaluated context is cached anyway.
        """
        self.next_token_logprobs_sync(prompt_tokens, lora_name)
