"""The vLLM backend: :class:`AsyncVirtualLM` (one GPU, or many through vLLM's parallelism).

* ``model``: :class:`AsyncVirtualLM`, the :class:`~genlm_backend.llm.base.AsyncLM` over a vLLM engine;
* ``runner``: :class:`~genlm_backend.llm.vllm.runner.VLLMRunner`, plain requests and particle sessions;
* ``capture``: the logits processors that capture full-vocabulary rows;
* ``compat``: every use of vLLM internals, version-checked.

Importing this package imports no vLLM: :class:`AsyncVirtualLM` loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genlm_backend.llm.vllm.model import AsyncVirtualLM

__all__ = ["AsyncVirtualLM"]


def __getattr__(name: str):
    if name == "AsyncVirtualLM":
        from genlm_backend.llm.vllm.model import AsyncVirtualLM

        return AsyncVirtualLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
