"""The name of upstream genlm-backend's SGLang backend, which genlm_backend does not provide.

It exists so that code importing it (``from genlm.backend.llm import
AsyncSGLTransformer``) imports; using it raises.
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


class AsyncSGLTransformer(_UnsupportedBackend):
    """Upstream's SGLang backend: not provided (raises on construction and ``from_name``)."""

    backend_name = "SGLang"
