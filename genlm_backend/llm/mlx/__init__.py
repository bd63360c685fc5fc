"""The Apple MLX backend: :class:`AsyncMlxLM` over an mlx-lm model.

Importing this package needs no MLX: without ``mlx`` and ``mlx-lm``,
``AsyncMlxLM`` is a placeholder whose construction raises
:class:`~genlm_backend.errors.BackendNotAvailableError` with the install hint.
"""

from genlm_backend.llm.loader import UnavailableMlxLM, mlx_is_available

if mlx_is_available():
    from genlm_backend.llm.mlx.model import AsyncMlxLM
else:
    AsyncMlxLM = UnavailableMlxLM  # type: ignore[misc,assignment]

__all__ = ["AsyncMlxLM"]
