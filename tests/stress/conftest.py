"""Stress-suite fixtures: private copies of the tiny models and the end-of-run figures table.

Every stress test records what it did (calls served, cancelled, failed on
purpose, peak memory against its budget) through the ``stress_figures``
fixture; ``pytest_terminal_summary`` prints them as one markdown table.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest

from tests.stress.helpers import MIB

_FIGURES = pytest.StashKey[list]()


@dataclass
class Figures:
    """What one stress test did; memory figures are ``None`` where not measured."""

    backend: str
    test: str
    served: int = 0
    cancelled: int = 0
    failed_as_intended: int = 0
    peak_rss_growth_bytes: int | None = None
    rss_budget_bytes: int | None = None
    peak_cache_bytes: int | None = None
    cache_budget_bytes: int | None = None
    wall_s: float | None = None
    max_error: float | None = None
    """Largest absolute difference from the reference over the results checked."""


@pytest.fixture
def stress_figures(request):
    """``stress_figures(backend)`` -> a :class:`Figures` row kept for the end-of-run table."""
    rows = request.config.stash.setdefault(_FIGURES, [])

    def new_row(backend: str) -> Figures:
        row = Figures(backend=backend, test=request.node.name)
        rows.append(row)
        return row

    return new_row


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.1f}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = config.stash.get(_FIGURES, [])
    if not rows:
        return
    write = terminalreporter.write_line
    terminalreporter.section("stress figures")
    write(
        "| backend | test | served | cancelled | failed as intended | peak RSS growth MiB "
        "| RSS budget MiB | peak cache MiB | cache budget MiB | max abs error | wall s |"
    )
    write("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        wall = "" if row.wall_s is None else f"{row.wall_s:.1f}"
        error = "" if row.max_error is None else f"{row.max_error:.1e}"
        write(
            f"| {row.backend} | {row.test} | {row.served} | {row.cancelled} | "
            f"{row.failed_as_intended} | {_mib(row.peak_rss_growth_bytes)} | "
            f"{_mib(row.rss_budget_bytes)} | {_mib(row.peak_cache_bytes)} | "
            f"{_mib(row.cache_budget_bytes)} | {error} | {wall} |"
        )
    totals = [
        sum(getattr(r, f) for r in rows) for f in ("served", "cancelled", "failed_as_intended")
    ]
    write(f"total: {totals[0]} served, {totals[1]} cancelled, {totals[2]} failed as intended")


@pytest.fixture(scope="module")
def llama_copy(tiny_llama):
    """(model, reference model, tokenizer): private copies, so hooks never touch the shared fixture."""
    model, tokenizer = tiny_llama
    return copy.deepcopy(model), copy.deepcopy(model), tokenizer


@pytest.fixture(scope="module")
def gpt2_copy(tiny_gpt2):
    """(model, reference model, tokenizer) for the tiny GPT-2."""
    model, tokenizer = tiny_gpt2
    return copy.deepcopy(model), copy.deepcopy(model), tokenizer


@pytest.fixture(scope="module")
def tries(gpt2_tokenizer):
    """(the GPT-2 byte vocabulary, its float64 sequential reference trie)."""
    from genlm_backend.tokenization import decode_vocab
    from genlm_backend.trie import TokenCharacterTrie

    vocab, _ = decode_vocab(gpt2_tokenizer)
    return vocab, TokenCharacterTrie(vocab)


@pytest.fixture
def stress_trie(tries):
    """A fresh instrumented trie over the GPT-2 vocabulary (see ``trie_helpers.StressTrie``)."""
    from tests.stress.trie_helpers import StressTrie

    return StressTrie(tries[0])
