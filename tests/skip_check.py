"""Every skip of a run is explained: its reason matches a line of ``tests/expected_skips.txt``.

``tests/conftest.py`` collects the reason of each skipped test or module
(:func:`skip_reason`) and fails the run, naming them, when some match no
listed pattern (:func:`unlisted`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

EXPECTED_SKIPS = Path(__file__).resolve().with_name("expected_skips.txt")


def expected_patterns(text: str | None = None) -> list[re.Pattern]:
    """The patterns of ``text`` (default: ``tests/expected_skips.txt``): one a line, ``#`` lines
    and blank lines left out.

    Raises:
        re.error: a line is not a regular expression.
    """
    if text is None:
        text = EXPECTED_SKIPS.read_text(encoding="utf-8")
    lines = (line.strip() for line in text.splitlines())
    return [re.compile(line) for line in lines if line and not line.startswith("#")]


def skip_reason(report) -> str | None:
    """The reason a pytest test or collection report was skipped for (without pytest's
    ``"Skipped: "``); ``None`` if it was not skipped (an expected failure is not a skip)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def unlisted(reasons: Iterable[str], patterns: list[re.Pattern]) -> list[str]:
    """The distinct ``reasons`` that no pattern matches whole, in their first order."""
    return [
        reason
        for reason in dict.fromkeys(reasons)
        if not any(pattern.fullmatch(reason) for pattern in patterns)
    ]
