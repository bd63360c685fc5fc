"""The documentation's Python snippets run as written: each page's ```python blocks,
read top to bottom, parse as a script (no bare ``await``: ``asyncio.run``) and
use no name they do not import or define."""

from __future__ import annotations

import builtins
import re
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def page_script(page: Path) -> str:
    return "\n".join(BLOCK.findall(page.read_text(encoding="utf-8")))


# The pages with Python snippets; migration.md sets old and new code side by side in
# tables: not scripts.
PAGES = [
    page
    for page in [*sorted(ROOT.glob("docs/*.md")), ROOT / "README.md"]
    if page.name != "migration.md" and page_script(page)
]


def undefined_names(source: str) -> set[str]:
    """Names a script reads that no import, assignment, definition or builtin provides."""
    table = symtable.symtable(source, "<docs>", "exec")
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins))
    missing = set()

    def visit(scope):
        for symbol in scope.get_symbols():
            if scope is table:
                if symbol.is_referenced() and symbol.get_name() not in defined:
                    missing.add(symbol.get_name())
            elif symbol.is_global() and symbol.get_name() not in defined:
                missing.add(symbol.get_name())
        for child in scope.get_children():
            visit(child)

    visit(table)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_python_snippets_are_complete_scripts(page):
    source = page_script(page)
    compile(source, page.name, "exec")  # a bare top-level await is a SyntaxError here
    assert undefined_names(source) == set()


def test_the_check_finds_what_it_should():
    assert undefined_names("import asyncio\nasync def f():\n    return await llm.x(asyncio)\n") == {
        "llm"
    }
    assert undefined_names("x = 1\nprint(x, y)\n") == {"y"}
    with pytest.raises(SyntaxError):
        compile("await f()\n", "<docs>", "exec")


def test_the_api_reference_covers_every_backend_and_the_demo():
    directives = re.findall(r"^::: (\S+)$", (ROOT / "docs" / "api.md").read_text(), re.MULTILINE)
    for module in directives:
        path = ROOT.joinpath(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module
    required = {
        "genlm_backend.llm.hf.model",
        "genlm_backend.llm.vllm.model",
        "genlm_backend.llm.mock",
        "genlm_backend.demo",
        "genlm_backend.cli",
        "genlm_backend.install_vllm",
    }
    assert required <= set(directives)


def markdown_table(text: str) -> list[list[str]]:
    """The rows of the first markdown table in ``text`` (header and rule excluded), as cells."""
    lines = text[text.index("\n|") + 1 :].splitlines()
    table = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return table


def current_figures() -> dict[str, list[str]]:
    """BENCHMARKS.md's current figures by workload: figure, command, machine, date, commit."""
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    section = text.split("\n## Current figures\n", 1)[1].split("\n## ", 1)[0]
    return {row[0]: row[1:] for row in markdown_table(section)}


def test_benchmarks_opens_with_the_current_figure_of_every_workload():
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    first_section = re.search(r"^## (.+)$", text, re.MULTILINE)
    assert first_section is not None and first_section.group(1) == "Current figures"
    figures = current_figures()
    assert len(figures) >= 10
    for workload, (figure, command, machine, date, commit) in figures.items():
        assert figure and command and machine, workload
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), (workload, date)
        assert re.fullmatch(r"[0-9a-f]{7}", commit), (workload, commit)


def test_the_readme_results_are_benchmarks_current_figures():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    figures = current_figures()
    rows = markdown_table(results)
    assert rows
    for workload, figure, machine in rows:
        assert workload in figures, workload
        assert [figure, machine] == [figures[workload][0], figures[workload][2]], workload


TIMING = re.compile(r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)? ?(ms|us)\b")


@pytest.mark.parametrize("page", sorted(ROOT.glob("docs/*.md")), ids=lambda page: page.name)
def test_the_docs_quote_no_timings_benchmarks_holds_them(page):
    """A figure quoted outside BENCHMARKS.md goes stale there: the docs point to it instead."""
    assert TIMING.search(page.read_text(encoding="utf-8")) is None


def test_the_docs_index_lists_every_page_of_the_nav():
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\((\S+\.md)\)", index))
    assert set(nav) - {"index.md"} == listed
