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


def test_every_ci_step_is_a_script_that_exists():
    steps = re.findall(r"^step\s+(\S+)\s+(\S+)", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    names = [name for name, _ in steps]
    assert {"lint", "readme_commands", "vllm", "clients", "docs"} <= set(names)
    assert len(names) == len(set(names))
    for _, script in steps:
        assert (ROOT / script).is_file(), script
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)  # parses
