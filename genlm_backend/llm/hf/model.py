"""``AsyncTransformer``: an :class:`~genlm_backend.llm.base.AsyncLM` over a transformers model."""

from __future__ import annotations

import torch

from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.llm.base import DEFAULT_OUTPUT_CACHE_BYTES, AsyncLM
from genlm_backend.llm.hf.compat import attention_window, max_positions
from genlm_backend.llm.hf.runner import HFRunner

DEFAULT_KV_CACHE_BYTES = 4 << 30  # 4 GiB: ~90k tokens of SmolLM2-135M keys/values in fp32


class AsyncTransformer(AsyncLM):
    """Next-token log-probabilities from a transformers causal LM, auto-batched, prefix-cached.

    Every context the model runs leaves its keys/values in a
    :class:`~genlm_backend.cache.kv_tree.KVPrefixTree` (under the request's
    adapter): a later request that extends or branches off it runs the model
    over the new tokens only. No call to :meth:`cache_kv` is needed. Results
    are on the model's device. LoRA adapters (peft) are chosen per request
    with ``lora_name=``; one batch may mix them.

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
        cpu_threads: ``"auto"`` (default): on the CPU, steps adapt their torch
            threads to the cores they get, so that processes sharing a machine
            do not take the cores from one another
            (:class:`~genlm_backend.batching.CpuThreads`); ``None``: fixed.
        deterministic: Reproducible rows and runs (docs/contract.md,
            "Reproducibility"): each row has the bits of its context computed
            alone from an empty cache, whatever shares its batch and whatever
            the cache holds (:mod:`~genlm_backend.llm.hf.exact`); steps go when
            the event loop is idle, never on the clock (``timeout`` is ignored);
            calls complete in the order they were made, whatever the cache
            holds and whoever else calls (``rounds`` of
            :class:`~genlm_backend.batching.BatchingConfig`); the thread
            count is fixed (``cpu_threads`` is ignored).
        executor: What runs a planned pass: ``"auto"`` (default), ``"transformers"``
            or ``"fused"`` (the Llama family's fused decoder; see
            :class:`~genlm_backend.llm.hf.runner.HFRunner`). The fused decoder's
            compiled code is specialized to the torch thread count: with it, the
            count stays fixed (``cpu_threads`` is ignored).
        **kwargs: Further :class:`~genlm_backend.llm.base.AsyncLM` options
            (``compute_in_loop``, ``chunk_tokens``, ...).

    Raises:
        ImportError: the installed transformers is not a supported version.
        ValueError: ``deterministic`` with a model whose attention the runner
            cannot compute itself (the message says why); ``executor="fused"``
            for a model outside the Llama family, or with ``deterministic``.
    """

    runner: HFRunner

    def __init__(
        self,
        hf_model,
        hf_tokenizer,
        batch_size: int | None = None,
        timeout: float = 0.02,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
        cpu_threads: str | None = "auto",
        deterministic: bool = False,
        executor: str = "auto",
        **kwargs,
    ):
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
        window = attention_window(hf_model.config)
        longest = max_positions(hf_model.config)
        kwargs.setdefault("max_context_length", longest if window is None else min(window, longest))
        super().__init__(
            hf_tokenizer,
            batch_size=batch_size,
            timeout_s=None if deterministic else timeout,
            rounds=deterministic,
            output_cache_bytes=output_cache_bytes,
            device=hf_model.device,
            cpu_threads=None if deterministic else cpu_threads,
            **kwargs,
        )
        self.kv_cache = KVPrefixTree(kv_cache_bytes)
        self.runner = HFRunner(
            hf_model.eval(),
            self.kv_cache,
            self.vocab_size,
            deterministic=deterministic,
            executor=executor,
        )
        if self.runner.executor is not self.runner.executor_of_transformers:
            # Compiled code guards on the torch thread count: adapting it would recompile.
            self.engine.batcher.cpu_threads = None

    @property
    def model(self):
        """The transformers model (wrapped in a ``peft.PeftModel`` once an adapter is loaded)."""
        return self.runner.model

    @classmethod
    def from_name(
        cls,
        model_id=None,
        bitsandbytes_opts: dict | None = None,
        hf_opts: dict | None = None,
        **kwargs,
    ) -> AsyncTransformer:
        """Load a model by local folder, ``.gguf`` file or id resolvable offline (``None``: the default model).

        Args:
            bitsandbytes_opts: If given, a ``BitsAndBytesConfig`` is built from them.
            hf_opts: Keyword arguments for ``AutoModelForCausalLM.from_pretrained``
                (default ``dtype=torch.float32``).
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
