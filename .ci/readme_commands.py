"""Print the README's Quick-start commands, one per line (stdlib only, run before any install).

A Quick-start command is a ```bash fenced block under the "## Quick start"
heading (up to the next "## " heading); each block must hold exactly one
command line. Exits 1 with a message unless there are exactly two.

Usage: python3 .ci/readme_commands.py [README.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

SECTION = "## Quick start"
NUM_COMMANDS = 2


class ReadmeError(ValueError):
    """The README's Quick-start section is not what CI can run."""


def quick_start_commands(markdown: str) -> list[str]:
    """The command of each ```bash block of the Quick-start section, in order.

    Raises:
        ReadmeError: no Quick-start section, a block that is not one line, or
            not exactly :data:`NUM_COMMANDS` blocks.
    """
    lines = markdown.splitlines()
    if SECTION not in (line.rstrip() for line in lines):
        raise ReadmeError(f"no {SECTION!r} heading")
    start = [line.rstrip() for line in lines].index(SECTION) + 1
    section = []
    for line in lines[start:]:
        if line.startswith("## "):
            break
        section.append(line)
    commands = [_one_command(block) for block in _bash_blocks(section)]
    if len(commands) != NUM_COMMANDS:
        raise ReadmeError(
            f"expected {NUM_COMMANDS} bash blocks under {SECTION!r}, found {len(commands)}"
        )
    return commands


def _bash_blocks(lines: list[str]) -> list[list[str]]:
    """The bodies of the ```bash fenced blocks among ``lines`` (other languages skipped)."""
    blocks: list[list[str]] = []
    language, body = None, []
    for line in lines:
        fence = line.strip()
        if language is None and fence.startswith("```"):
            language, body = fence[3:].strip(), []
        elif language is not None and fence == "```":
            if language == "bash":
                blocks.append(body)
            language = None
        elif language is not None:
            body.append(line)
    return blocks


def _one_command(block: list[str]) -> str:
    lines = [line.strip() for line in block if line.strip()]
    if len(lines) != 1:
        raise ReadmeError(
            f"a Quick-start block must be one command line, got {len(lines)}: {lines}"
        )
    return lines[0]


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else "README.md")
    try:
        commands = quick_start_commands(path.read_text(encoding="utf-8"))
    except ReadmeError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
