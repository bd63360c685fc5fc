"""``AsyncMlxLM``: an :class:`~genlm_backend.llm.base.AsyncLM` over an mlx-lm model (Apple MLX)."""

from __future__ import annotations

from pathlib import Path

from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.llm.base import DEFAULT_OUTPUT_CACHE_BYTES, AsyncLM
from genlm_backend.llm.mlx import compat
from genlm_backend.llm.mlx.runner import MlxRunner

DEFAULT_KV_CACHE_BYTES = 4 << 30  # 4 GiB: ~90k tokens of SmolLM2-135M keys/values in fp32
DEFAULT_PREFILL_STEP_SIZE = 2048

_CACHE_OPTS = frozenset(
    {"move_to_cpu"}
)  # upstream's OutputCache options; rows are on the CPU anyway


class AsyncMlxLM(AsyncLM):
    """Next-token log-probabilities from an mlx-lm model, auto-batched, prefix-cached.

    The same contract as every :class:`~genlm_backend.llm.base.AsyncLM`: rows
    are ``float32`` torch tensors of ``len(byte_vocab)`` on the CPU,
    normalized. Concurrent requests are batched into one MLX forward pass
    (rows of different lengths padded and masked). Every context the model
    runs leaves its keys/values in a
    :class:`~genlm_backend.cache.kv_tree.KVPrefixTree` (under the request's
    adapter), so a request extending or branching off it runs the new tokens
    only; a prompt shared by every row of a batch is held and read once.
    LoRA adapters in mlx-lm's format are chosen per request with ``lora_name=``.

    Memory: retained keys/values stay within ``kv_cache_bytes`` and result
    rows within ``output_cache_bytes`` (both LRU). A batch's working memory
    comes on top while it runs.

    The positional arguments are upstream genlm-backend 0.3.1's.

    Args:
        mlx_lm_model: An mlx-lm model of an attention-only architecture (as
            :meth:`from_name` loads it; ``mlx_lm.load`` misreads the RoPE base of
            a ``config.json`` written by transformers 5, :meth:`from_name` does not).
        tokenizer: Its Hugging Face tokenizer, or the ``TokenizerWrapper`` of ``mlx_lm.load``.
        timeout: Most seconds a request waits for company (``timeout_s`` of
            :class:`~genlm_backend.batching.BatchingConfig`).
        prefill_step_size: Most new tokens per row in one model call; longer
            prefills run in chunks.
        cache_size: Most rows in the output cache (upstream's option: 0
            disables it); ``None`` (default): ``output_cache_bytes`` decides.
        cache_opts: Upstream's output-cache options; only ``move_to_cpu`` is
            accepted (rows are on the CPU already).
        batch_size: Most distinct contexts per forward pass; ``None`` (default):
            every waiting context within the ``max_batch_tokens`` budget.
        kv_cache_bytes: Budget of retained keys/values.
        output_cache_bytes: Budget of cached result rows (when ``cache_size`` is ``None``).
        **kwargs: Further :class:`~genlm_backend.llm.base.AsyncLM` options.

    Raises:
        ValueError: a recurrent or hybrid model, a bad option, or an unknown ``cache_opts`` key.
        ImportError: an untested mlx-lm version.
    """

    runner: MlxRunner

    def __init__(
        self,
        mlx_lm_model,
        tokenizer,
        timeout: float = 0.02,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        cache_size: int | None = None,
        cache_opts: dict | None = None,
        *,
        batch_size: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
        deterministic: bool = False,
        **kwargs,
    ):
        if deterministic:
            raise ValueError(
                "deterministic=True is not available on the MLX backend (its kernels' reduction "
                "order depends on the batch); the transformers backend (backend='hf') has it"
            )
        unknown = sorted(set(cache_opts or {}) - _CACHE_OPTS)
        if unknown:
            raise ValueError(f"unknown cache_opts {unknown}; accepted: {sorted(_CACHE_OPTS)}")
        if cache_size is not None and cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        tokenizer = compat.hf_tokenizer(tokenizer)
        kwargs.setdefault("max_context_length", compat.positional_limit(mlx_lm_model.args))
        if cache_size is not None:  # rows of float32 values, one per token of the vocabulary
            output_cache_bytes = cache_size * len(tokenizer) * 4
        super().__init__(
            tokenizer,
            batch_size=batch_size,
            timeout_s=timeout,
            output_cache_bytes=output_cache_bytes,
            device="cpu",
            **kwargs,
        )
        self.kv_cache = KVPrefixTree(kv_cache_bytes)
        self.runner = MlxRunner(mlx_lm_model, self.kv_cache, self.vocab_size, prefill_step_size)

    @property
    def model(self):
        """The mlx-lm model."""
        return self.runner.model

    @property
    def mlx_lm_model(self):
        """The mlx-lm model (upstream's name)."""
        return self.runner.model

    @classmethod
    def from_name(cls, model_name=None, **kwargs) -> AsyncMlxLM:
        """Load a model by local folder, ``.gguf`` file or id resolvable offline (``None``: the default model).

        The folder's ``config.json`` is read as transformers 5 writes it
        (``rope_parameters``) without changing the folder.

        Args:
            **kwargs: Constructor options.

        Raises:
            ModelNotFoundError: ``model_name`` resolves to nothing loadable.
        """
        from transformers import AutoTokenizer

        from genlm_backend.models import resolve_model_path

        path = resolve_model_path(model_name)
        if not Path(path).is_dir():  # a hub id the hub has: fetch its files once
            from huggingface_hub import snapshot_download

            path = snapshot_download(
                str(path), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        model = compat.load_model(path)
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)
