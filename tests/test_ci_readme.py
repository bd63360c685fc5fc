"""CI runs the README's Quick-start commands verbatim: the extraction, and the step list."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_extractor():
    spec = importlib.util.spec_from_file_location(
        "readme_commands", ROOT / ".ci" / "readme_commands.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


extractor = load_extractor()


def test_the_readme_has_exactly_the_two_quick_start_commands():
    commands = extractor.quick_start_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert commands == [
        "pip install torch==2.13.0 && pip install -e . && genlm-backend demo",
        'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest',
    ]


def test_the_script_prints_one_command_per_line():
    result = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), str(ROOT / "README.md")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.splitlines() == extractor.quick_start_commands(
        (ROOT / "README.md").read_text(encoding="utf-8")
    )


MARKDOWN = """# title

```bash
echo not in the section
```

## Quick start

Some text.

```python
print("a python block is not a command")
```

```bash
first command
```

```bash

second command

```

## Next section

```bash
echo after the section
```
"""


def test_only_bash_blocks_of_the_section_count():
    assert extractor.quick_start_commands(MARKDOWN) == ["first command", "second command"]


@pytest.mark.parametrize(
    "markdown, message",
    [
        (MARKDOWN.replace("## Quick start", "## Start"), "no '## Quick start' heading"),
        (MARKDOWN.replace("first command", "first\nsecond"), "one command line, got 2"),
        (MARKDOWN.replace("## Next section", "```bash\nthird\n```\n## Next"), "found 3"),
        (MARKDOWN.replace("```bash\nfirst command\n```", ""), "found 1"),
    ],
)
def test_a_readme_ci_cannot_run_verbatim_is_an_error(markdown, message):
    with pytest.raises(extractor.ReadmeError, match=re.escape(message)):
        extractor.quick_start_commands(markdown)


def ci_steps() -> list[tuple[str, str, int, str | None]]:
    """``(name, script, budget_s, lane)`` of each step of ``.ci/run``: ``step NAME BUDGET SCRIPT``
    lines (lane ``None``) and the ``NAME:BUDGET:SCRIPT`` specs of each ``lane``."""
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        words = line.split("#")[0].split()
        if words[:1] == ["step"]:
            steps.append((words[1], words[3], int(words[2]), None))
        elif words[:1] == ["lane"]:
            for spec in words[2:]:
                name, budget_s, script = spec.split(":")
                steps.append((name, script, int(budget_s), words[1]))
    return steps


def test_every_ci_step_is_a_script_that_exists():
    steps = ci_steps()
    names = [name for name, _, _, _ in steps]
    assert {"lint", "readme_commands", "vllm", "clients"} <= set(names)
    assert "mkdocs build --strict" in (ROOT / ".ci" / "lint.sh").read_text()  # docs built there
    assert len(names) == len(set(names))
    for _, script, _, _ in steps:
        assert (ROOT / script).is_file(), script
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)  # parses


def test_the_step_budgets_fit_in_the_ci_limit():
    """Steps outside lanes run first, one after another; then the lanes side by side. The
    limit is 30 minutes; 4 are kept as a margin (a shared machine runs slower some days)."""
    steps = ci_steps()
    lanes = {lane for _, _, _, lane in steps if lane is not None}
    assert len(lanes) == 2
    first = sum(budget_s for _, _, budget_s, lane in steps if lane is None)
    longest_lane = max(
        sum(budget_s for _, _, budget_s, lane in steps if lane == name) for name in lanes
    )
    assert first + longest_lane <= 26 * 60


def test_the_vllm_step_reruns_test_files_that_exist():
    """The vLLM step reruns a list of test files at the lowest transformers: each exists."""
    script = (ROOT / ".ci" / "vllm.sh").read_text()
    named = re.findall(r"tests/[\w/]+\.py", script)
    assert len(named) >= 10
    for name in named:
        assert (ROOT / name).is_file(), name
    # Tests picked by name from a file held in a shell variable: each is defined there.
    files = dict(re.findall(r"^(\w+)=(tests/[\w/]+\.py)$", script, re.M))
    picked = re.findall(r"\$(\w+)::(\w+)", script)
    assert picked
    for variable, test in picked:
        assert f"def {test}(" in (ROOT / files[variable]).read_text(), (variable, test)


def test_every_file_with_gpu_tests_is_in_the_gpu_session():
    """No CI step has a GPU: the GPU session's tests part runs ``-m gpu`` over a list of
    files, which must hold every file with a test marked ``gpu``."""
    script = (ROOT / "benchmarks" / "gpu" / "session.sh").read_text()
    command = re.search(r"\ntests\(\) \{\n(.*?)\n\}", script, re.S)
    assert command is not None and "-m gpu" in command.group(1)
    listed = set(re.findall(r"tests/[\w/]+\.py", command.group(1)))
    marked = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^\s*@?pytest\.mark\.gpu\b", path.read_text(encoding="utf-8"), re.M)
    }
    assert len(marked) >= 7
    assert marked <= listed, f"not in benchmarks/gpu/session.sh: {sorted(marked - listed)}"


def test_skip_reasons_are_matched_whole_against_the_listed_patterns():
    from tests.skip_check import expected_patterns, unlisted

    patterns = expected_patterns(
        "# a comment\n\nneeds a CUDA device\n\\d+ workers need \\d+ GPUs\n"
    )
    assert len(patterns) == 2
    reasons = ["needs a CUDA device", "2 workers need 2 GPUs", "needs a CUDA device!", "new"]
    assert unlisted(reasons + reasons, patterns) == ["needs a CUDA device!", "new"]
    listed = expected_patterns()  # the repository's list parses
    assert not unlisted(["needs a CUDA device", "this vLLM has no Model Runner V2"], listed)
