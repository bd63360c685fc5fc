"""What :class:`~genlm_backend.llm.mlx.model.AsyncMlxLM` needs from mlx-lm beyond its public calls.

Fenced here, each with the reason and a check, so that a new mlx-lm release
breaks one module:

* :func:`load_model`: transformers 5 writes ``rope_theta`` (and the scaling
  of non-default RoPE) under ``rope_parameters`` in ``config.json``, where
  mlx-lm's Llama-family models do not look; the values are lifted to the
  top level in memory (the folder on disk is not changed).
* :func:`split_model`: the model's body and output head, so that only the
  rows' last positions go through the head (a long prompt's prefill would
  otherwise project every position onto the vocabulary).
* :func:`clear_at_exit`: MLX may abort the process at exit ("terminate called
  without an active exception") when arrays computed in a thread that has
  ended (the batcher's worker) are freed during interpreter shutdown; the
  runners' keys/values are dropped before that, in an ``atexit`` hook.
* :func:`install_shared_attention`: routes the attention of a model's module
  through :func:`shared_attention` for the runner's own cache objects, so a
  prefix shared by every row of a batch is held and read once.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

SUPPORTED_MLX_LM = ((0, 32), (0, 33))
"""``[lowest, highest)`` (major, minor) of mlx-lm this module was written and tested against."""

_ATTENTION_NAME = "scaled_dot_product_attention"


def check_mlx_lm_version() -> None:
    """Raise ``ImportError`` unless the installed mlx-lm is in :data:`SUPPORTED_MLX_LM`."""
    version = importlib.metadata.version("mlx-lm")
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    low, high = SUPPORTED_MLX_LM
    if not low <= major_minor < high:
        raise ImportError(
            f"AsyncMlxLM supports mlx-lm {low[0]}.{low[1]} to below {high[0]}.{high[1]}, "
            f"found {version}: pip install 'genlm-backend-ng[mlx]'"
        )


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys mlx-lm reads that a transformers 5 ``config.json`` keeps in ``rope_parameters``.

    Only keys missing at the top level are given: ``rope_theta``, and
    ``rope_scaling`` for a non-default RoPE type. A per-layer-type
    ``rope_parameters`` (no ``rope_theta`` of its own) is left to the model.
    """
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}
    overrides: dict[str, Any] = {}
    if "rope_theta" not in config:
        overrides["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        overrides["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return overrides


def load_model(path: str | Path):
    """Load the mlx-lm model of a local folder, reading a transformers 5 config right.

    Raises:
        FileNotFoundError: no ``config.json`` or no safetensors weights in ``path``.
        ValueError: an architecture mlx-lm does not know.
    """
    from mlx_lm.utils import load_model as mlx_load_model

    path = Path(path)
    with open(path / "config.json") as file:
        config = json.load(file)
    model, _ = mlx_load_model(path, model_config=config_overrides(config))
    return model


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside ``mlx_lm.load``'s ``TokenizerWrapper`` (any other tokenizer as it is)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def check_attention_only(model) -> None:
    """Raise ``ValueError`` unless every layer of ``model`` keeps a plain keys/values cache.

    Recurrent and hybrid models (Mamba, ...) keep a state that cannot be
    sliced by token, which the prefix cache needs.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    kinds = {type(cache).__name__ for cache in make_prompt_cache(model)}
    if kinds != {KVCache.__name__}:
        raise ValueError(
            f"AsyncMlxLM serves attention-only models; {type(model).__module__} keeps "
            f"{sorted(kinds)} caches, whose state cannot be reused by prefix"
        )


def split_model(model) -> tuple[Callable, Callable] | None:
    """``(body, head)`` with ``head(body(inputs, cache=c)) == model(inputs, cache=c)``, or ``None``.

    Found by name (``model.model``, then ``lm_head`` or the tied
    ``embed_tokens``) and checked on a two-token input: a model whose output
    is not exactly its head over its body (e.g. one that scales logits
    elsewhere) gets ``None``, and the runner calls the whole model.
    """
    body = getattr(model, "model", None)
    if body is None:
        return None
    if "lm_head" in model:
        head = model.lm_head
    elif hasattr(getattr(body, "embed_tokens", None), "as_linear"):
        head = body.embed_tokens.as_linear
    else:
        return None
    probe = mx.array([[1, 2]])
    try:
        same = mx.array_equal(head(body(probe, cache=None)), model(probe)).item()
    except (TypeError, ValueError, AttributeError):
        return None
    return (body, head) if same else None


_TO_CLEAR_AT_EXIT: weakref.WeakSet = weakref.WeakSet()


def clear_at_exit(runner) -> None:
    """Call ``runner.clear()`` when the interpreter exits, if it is still alive then (see the module's notes)."""
    if not _TO_CLEAR_AT_EXIT:
        atexit.register(_clear_all)
    _TO_CLEAR_AT_EXIT.add(runner)


def _clear_all() -> None:
    for runner in list(_TO_CLEAR_AT_EXIT):
        runner.clear()
    mx.synchronize()


class SharedPrefixCache:
    """Marks the runner's per-layer cache objects that :func:`shared_attention` serves itself."""

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask):
        """Attention output ``[B, Hq, L, D]`` over the shared prefix and ``keys``/``values``."""
        raise NotImplementedError


def install_shared_attention(model) -> bool:
    """Route the attention of ``model``'s module through :class:`SharedPrefixCache` objects.

    The module's ``scaled_dot_product_attention`` (mlx-lm's common one, which
    every Llama-family model calls with its cache) is wrapped once: calls
    whose cache is a :class:`SharedPrefixCache` go to its ``attend``, every
    other call to the original, unchanged. Returns ``False`` when the module
    does not call attention that way (the runner then copies shared prefixes
    into every row instead).
    """
    module = sys.modules[type(model).__module__]
    original = getattr(module, _ATTENTION_NAME, None)
    if original is None:
        return False
    if getattr(original, "_genlm_original", None) is not None:
        return True  # installed for another model of this architecture

    def attention(queries, keys, values, cache=None, scale=1.0, mask=None, **kwargs):
        if isinstance(cache, SharedPrefixCache) and not kwargs.get("sinks"):
            return cache.attend(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    attention._genlm_original = original  # type: ignore[attr-defined]
    setattr(module, _ATTENTION_NAME, attention)
    return True


def positional_limit(args) -> int | None:
    """Longest context a model (its ``args``) attends over in full: its position table or sliding window."""
    limits = [
        getattr(args, "max_position_embeddings", None),
        getattr(args, "sliding_window", None)
        if getattr(args, "use_sliding_window", True)
        else None,
    ]
    known = [int(limit) for limit in limits if limit]
    return min(known) if known else None
