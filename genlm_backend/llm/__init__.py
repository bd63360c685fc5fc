"""Language-model backends behind one contract, :class:`AsyncLM`.

Backends with heavy dependencies are imported lazily: ``AsyncTransformer``
on first use, ``AsyncVirtualLM`` and ``AsyncMlxLM`` only when asked for.
Without vLLM (MLX), ``AsyncVirtualLM`` (``AsyncMlxLM``) is a placeholder whose
construction raises :class:`~genlm_backend.errors.BackendNotAvailableError`
with an install hint, so ``from genlm_backend import *`` works everywhere.
"""

from genlm_backend.llm.base import AsyncLM, validate_token_ids
from genlm_backend.llm.loader import default_backend, load_model_by_name
from genlm_backend.llm.mock import MockAsyncLM
from genlm_backend.llm.stats import LMStats
from genlm_backend.llm.unsupported import AsyncSGLTransformer

__all__ = [
    "AsyncLM",
    "AsyncMlxLM",
    "AsyncSGLTransformer",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "LMStats",
    "MockAsyncLM",
    "default_backend",
    "load_model_by_name",
    "validate_token_ids",
]


def __getattr__(name):
    if name == "AsyncTransformer":
        from genlm_backend.llm.hf import AsyncTransformer

        return AsyncTransformer
    if name == "AsyncVirtualLM":
        from genlm_backend.llm.loader import UnavailableVirtualLM, vllm_is_available

        if not vllm_is_available():
            return UnavailableVirtualLM
        from genlm_backend.llm.vllm import AsyncVirtualLM

        return AsyncVirtualLM
    if name == "AsyncMlxLM":
        from genlm_backend.llm.mlx import AsyncMlxLM

        return AsyncMlxLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
