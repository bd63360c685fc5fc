"""The transformers backend: :class:`AsyncTransformer` and what it alone uses.

* ``model``: :class:`AsyncTransformer`, the :class:`~genlm_backend.llm.base.AsyncLM` over a transformers model;
* ``runner``: :class:`~genlm_backend.llm.hf.runner.HFRunner`, a batch of requests in, ``[B, V]`` out;
* ``plan``: the batch plan, a value: which cached pieces each row reads in place or copies;
* ``attention``: attention that reads each shared level once and merges by log-sum-exp;
* ``compat``, ``adapters``: transformers and peft internals, version-checked.

Keys/values live in the backend-neutral KV prefix tree
(:mod:`genlm_backend.cache.kv_tree`), which the MLX backend shares.

Importing this package imports no transformers: :class:`AsyncTransformer` loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genlm_backend.llm.hf.model import AsyncTransformer

__all__ = ["AsyncTransformer"]


def __getattr__(name: str):
    if name == "AsyncTransformer":
        from genlm_backend.llm.hf.model import AsyncTransformer

        return AsyncTransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
