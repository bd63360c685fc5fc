"""Language-model backends behind one contract, :class:`AsyncLM`.

Backends with heavy dependencies are imported lazily: ``AsyncTransformer``
on first use, ``AsyncVirtualLM`` only when asked for (it needs vLLM).
"""

from genlm_backend.llm.base import AsyncLM, LMStats, validate_token_ids
from genlm_backend.llm.loader import default_backend, load_model_by_name
from genlm_backend.llm.mock import MockAsyncLM

__all__ = [
    "AsyncLM",
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
        from genlm_backend.llm.loader import vllm_is_available, vllm_missing_error

        if not vllm_is_available():
            raise vllm_missing_error("AsyncVirtualLM")
        from genlm_backend.llm.vllm import AsyncVirtualLM

        return AsyncVirtualLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
