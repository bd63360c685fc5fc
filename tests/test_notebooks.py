"""Execute the example notebooks (nbclient) and check what they show."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import nbformat
import pytest

import genlm_backend

nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbclient (test extra)")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str) -> nbformat.NotebookNode:
    """Run the notebook in a fresh kernel that imports the ``genlm_backend`` under test.

    The kernel starts in ``notebooks/``, where ``import genlm_backend`` would find
    whichever copy is installed (another checkout's, with an editable install):
    the folder holding the tested package goes first on its path.
    """
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    package_root = str(Path(genlm_backend.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    ).execute(env={**os.environ, "PYTHONPATH": path})
    return notebook


def outputs_of(notebook, kind: str) -> list:
    return [
        out
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if kind in out.get("data", {})
    ]


@pytest.mark.slow
def test_smc_walkthrough_runs_and_plots_weights():
    notebook = execute("smc_walkthrough.ipynb")
    assert outputs_of(notebook, "image/png"), "the weights plot is missing"
    stats = outputs_of(notebook, "text/plain")[-1]["data"]["text/plain"]
    assert stats.startswith("LMStats(")
    computed = int(stats.split("num_tokens_computed=")[1].split(",")[0])
    requested = int(stats.split("num_tokens_requested=")[1].split(",")[0])
    assert computed < requested / 5  # prefix reuse across steps and resampling


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="rendering the trie needs Graphviz's `dot` (apt-get install graphviz); "
    "CI installs it and fails its system-packages step without it",
)
def test_trie_notebook_renders_graphviz():
    notebook = execute("token_character_trie.ipynb")
    assert outputs_of(notebook, "image/svg+xml"), "the Graphviz picture is missing"


def genlm_control_installed() -> bool:
    try:
        return importlib.util.find_spec("genlm.control") is not None
    except ModuleNotFoundError:  # no `genlm` namespace at all
        return False


def stream_text(notebook) -> str:
    return "".join(
        out.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not genlm_control_installed(),
    reason="needs genlm-control 0.4.1 installed next to genlm_backend (recipe in docs/genlm_control.md)",
)
def test_genlm_control_regex_notebook_samples_matching_emails():
    notebook = execute("genlm_control_regex.ipynb")
    first = outputs_of(notebook, "text/plain")[0]["data"]["text/plain"]
    assert first == "True", "genlm.backend is not served by genlm_backend"
    assert "all match the regex: True" in stream_text(notebook)
    stats = outputs_of(notebook, "text/plain")[-1]["data"]["text/plain"]
    computed = int(stats.split("num_tokens_computed=")[1].split(",")[0])
    requested = int(stats.split("num_tokens_requested=")[1].split(",")[0])
    assert computed < requested / 5  # the prompt and shared prefixes are computed once
