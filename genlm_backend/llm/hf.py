"""``AsyncTransformer``: the HuggingFace transformers backend."""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import contextmanager

import torch

from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.llm.base import DEFAULT_OUTPUT_CACHE_BYTES, AsyncLM, TokenIds, validate_token_ids
from genlm_backend.llm.hf_runner import HFRunner, _max_positions

DEFAULT_KV_CACHE_BYTES = 4 << 30  # 4 GiB: ~90k tokens of SmolLM2-135M keys/values in fp32


class AsyncTransformer(AsyncLM):
    """Next-token log-probabilities from a transformers causal LM, auto-batched, prefix-cached.

    Every context the model runs leaves its keys/values in a
    :class:`~genlm_backend.cache.kv_tree.KVPrefixTree`: a later request that
    extends or branches off it runs the model over the new tokens only. No
    call to :meth:`cache_kv` is needed. Results are on the model's device.

    Memory: retained keys/values stay within ``kv_cache_bytes`` and result rows
    within ``output_cache_bytes`` (both LRU). A batch's working memory (about
    one block of its keys/values plus activations) comes on top while it runs.

    Args:
        hf_model: A transformers causal LM (eval mode is set).
        hf_tokenizer: Its tokenizer.
        batch_size: Most distinct contexts per forward pass; ``None`` (default):
            every waiting context within the ``max_batch_tokens`` budget.
        timeout: Most seconds a request waits for company (``timeout_s`` of
            :class:`~genlm_backend.batching.BatchingConfig`).
        kv_cache_bytes: Budget of retained keys/values.
        output_cache_bytes: Budget of cached result rows.
        **kwargs: Further :class:`~genlm_backend.llm.base.AsyncLM` options.
    """

    def __init__(
        self,
        hf_model,
        hf_tokenizer,
        batch_size: int | None = None,
        timeout: float = 0.02,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
        **kwargs,
    ):
        self.model = hf_model.eval()
        kwargs.setdefault("max_context_length", _max_positions(hf_model.config))
        super().__init__(
            hf_tokenizer,
            batch_size=batch_size,
            timeout_s=timeout,
            output_cache_bytes=output_cache_bytes,
            device=hf_model.device,
            **kwargs,
        )
        self.kv_cache = KVPrefixTree(kv_cache_bytes)
        self._runner = HFRunner(hf_model, self.kv_cache, self.vocab_size)
        self._active_lora: str | None = None
        self._lora_names: set[str] = set()

    @classmethod
    def from_name(
        cls, model_id=None, hf_opts: dict | None = None, bitsandbytes_opts: dict | None = None, **kwargs
    ) -> AsyncTransformer:
        """Load a model by local folder, ``.gguf`` file or id resolvable offline (``None``: the default model).

        Args:
            hf_opts: Keyword arguments for ``AutoModelForCausalLM.from_pretrained``
                (default ``dtype=torch.float32``).
            bitsandbytes_opts: If given, a ``BitsAndBytesConfig`` is built from them.
            **kwargs: Constructor options.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from genlm_backend.models import resolve_model_path

        path = resolve_model_path(model_id)
        hf_opts = {"dtype": torch.float32, **(hf_opts or {})}
        if bitsandbytes_opts:
            from transformers import BitsAndBytesConfig

            hf_opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
        model = AutoModelForCausalLM.from_pretrained(path, **hf_opts)
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)

    # ------------------------------------------------------------------ AsyncLM hooks

    def _compute_logprobs(self, contexts: list[tuple[int, ...]]) -> torch.Tensor:
        return self._runner.logprobs(contexts, namespace=self._active_lora)

    def _cache_namespace(self) -> Hashable:
        return self._active_lora

    @contextmanager
    def _activate_namespace(self, namespace: Hashable):
        if namespace is None:
            if self._lora_names:
                with self.model.disable_adapter():
                    yield
            else:
                yield
        else:
            self.model.set_adapter(namespace)
            yield

    def _num_tokens_computed(self) -> int:
        return self._runner.num_tokens_computed

    def _kv_cache_bytes(self) -> int:
        return self.kv_cache.bytes_held

    def _clear_model_caches(self) -> None:
        self.kv_cache.clear()

    def _release_model(self) -> None:
        self.kv_cache.clear()

    # ------------------------------------------------------------------ upstream API

    def next_token_logprobs_uncached(self, token_ids: TokenIds) -> torch.Tensor:
        """One plain forward pass over the whole context: no batching, no cache read or written."""
        ids = validate_token_ids(token_ids, self.vocab_size, self.max_context_length)
        with self._compute_lock, self._activate_namespace(self._active_lora):
            return self._runner.logprobs_uncached(ids)

    def cache_kv(self, prompt_tokens: TokenIds) -> None:
        """Run ``prompt_tokens`` now so later requests extending it start from its keys/values.

        Optional: every evaluated context is cached anyway.
        """
        self.next_token_logprobs_sync(prompt_tokens)

    def clear_kv_cache(self) -> None:
        """Drop every retained key/value (results in the output cache stay)."""
        with self._compute_lock:
            self.kv_cache.clear()

    # ------------------------------------------------------------------ LoRA (peft)

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Load a peft adapter from ``lora_path`` under ``lora_name`` (not activated).

        Raises:
            ImportError: peft is not installed.
        """
        from peft import PeftModel

        with self._compute_lock:
            if not self._lora_names:
                self.model = PeftModel.from_pretrained(self.model, lora_path, adapter_name=lora_name)
                self._runner.model = self.model
            else:
                self.model.load_adapter(lora_path, adapter_name=lora_name)
            self._lora_names.add(lora_name)

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Make ``lora_name`` the adapter later requests run under (loading it from ``lora_path`` if new).

        Cached results and keys/values are keyed by adapter, so none is served stale.

        Raises:
            ValueError: ``lora_name`` is unknown and no ``lora_path`` is given.
        """
        if lora_name not in self._lora_names:
            if lora_path is None:
                raise ValueError(f"unknown LoRA adapter {lora_name!r}; load it with add_new_lora() first")
            self.add_new_lora(lora_path, lora_name)
        self._active_lora = lora_name

    def clear_lora(self) -> None:
        """Run later requests on the base model (adapters stay loaded)."""
        self._active_lora = None
