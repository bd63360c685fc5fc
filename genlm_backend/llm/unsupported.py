"""Names of upstream genlm-backend's Apple MLX and SGLang backends, which genlm_backend does not provide.

They exist so that code importing them (``from genlm.backend.llm import
AsyncMlxLM``, as llamppl does) imports; using them raises.
"""

from __future__ import annotations

from genlm_backend.errors import BackendNotAvailableError


class _UnsupportedBackend:
    """Importable, but building one raises :class:`BackendNotAvailableError`."""

    backend_name = ""

    def __init__(self, *args, **kwargs):
        raise BackendNotAvailableError(
            f"genlm_backend has no {self.backend_name} backend; "
            "use load_model_by_name(name, backend='hf') (or 'vllm')"
        )

    @classmethod
    def from_name(cls, *args, **kwargs):
        """Raises :class:`BackendNotAvailableError`, as the constructor does."""
        return cls()


class AsyncMlxLM(_UnsupportedBackend):
    """Upstream's Apple MLX backend: not provided (raises on construction and ``from_name``)."""

    backend_name = "MLX"


class AsyncSGLTransformer(_UnsupportedBackend):
    """Upstream's SGLang backend: not provided (raises on construction and ``from_name``)."""

    backend_name = "SGLang"
