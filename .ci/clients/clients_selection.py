"""pytest plugin for the client suites: applies the selection lists and records every outcome.

Reads ``CLIENTS_SUITE`` (control, bytes, llamppl, upstream), ``CLIENTS_BACKEND``
(ours, upstream) and ``CLIENTS_OUTCOMES`` (a JSON file to write) from the environment.

* ``not_runnable.txt``: deselected on every backend (GPU/MLX/SGLang/vLLM-only tests,
  hub assets that cannot exist offline, tests that fail on upstream here too);
* ``known_departures.txt``: marked ``xfail`` on genlm_backend only (documented
  departures from upstream 0.3.1; an unexpected pass is reported as XPASS).

Both files hold one entry a line, ``SUITE<TAB>NODE-ID-PREFIX<TAB>REASON``; ``#`` starts a comment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def read_entries(path: Path, suite: str) -> list[tuple[str, str]]:
    """``(node id prefix, reason)`` pairs of ``suite`` in a selection file.

    Raises:
        ValueError: a line that is not ``SUITE<TAB>NODE-ID<TAB>REASON``.
    """
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 3 or not all(field.strip() for field in fields):
            raise ValueError(
                f"{path.name}:{number}: expected SUITE<TAB>NODE-ID<TAB>REASON, got {line!r}"
            )
        if fields[0] == suite:
            entries.append((fields[1], fields[2]))
    return entries


def _match(nodeid: str, entries: list[tuple[str, str]]) -> str | None:
    for prefix, reason in entries:
        if nodeid == prefix or nodeid.startswith((prefix + "[", prefix + "::")):
            return reason
        if prefix.endswith(".py") and nodeid.startswith(prefix):
            return reason
    return None


class ClientsSelection:
    def __init__(self, suite: str, backend: str, outcomes_path: Path):
        self.not_runnable = read_entries(HERE / "not_runnable.txt", suite)
        departures = read_entries(HERE / "known_departures.txt", suite)
        self.departures = departures if backend == "ours" else []
        self.outcomes_path = outcomes_path
        self.outcomes: dict[str, str] = {}
        self.durations_s: dict[str, float] = {}

    def pytest_ignore_collect(self, collection_path, config):
        """Whole files listed as not runnable are not even imported (they may fail to import)."""
        relative = collection_path.relative_to(config.rootpath).as_posix()
        if relative.endswith(".py") and any(prefix == relative for prefix, _ in self.not_runnable):
            self.outcomes[relative] = "deselected"
            return True
        return None

    def pytest_collection_modifyitems(self, config, items):
        kept, deselected = [], []
        for item in items:
            if _match(item.nodeid, self.not_runnable) is not None:
                deselected.append(item)
                continue
            reason = _match(item.nodeid, self.departures)
            if reason is not None:
                item.add_marker(
                    pytest.mark.xfail(reason=f"known departure: {reason}", strict=False)
                )
            kept.append(item)
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            for item in deselected:
                self.outcomes[item.nodeid] = "deselected"
        items[:] = kept

    def pytest_runtest_logreport(self, report):
        self.durations_s[report.nodeid] = self.durations_s.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = _outcome(report)

    def pytest_collectreport(self, report):
        if report.failed:
            self.outcomes[report.nodeid] = "collect-error"

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput"):
            return  # a pytest-xdist worker: the controller sees every report and writes
        self.outcomes_path.parent.mkdir(parents=True, exist_ok=True)
        self.outcomes_path.write_text(json.dumps(self.outcomes, indent=0, sort_keys=True))
        durations = {test: round(seconds, 2) for test, seconds in self.durations_s.items()}
        durations_path = self.outcomes_path.with_name(self.outcomes_path.stem + "-durations.json")
        durations_path.write_text(json.dumps(durations, indent=0, sort_keys=True))


def _outcome(report) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return report.outcome  # passed or skipped


def pytest_configure(config):
    suite = os.environ.get("CLIENTS_SUITE")
    if not suite:
        raise pytest.UsageError("clients_selection needs CLIENTS_SUITE in the environment")
    plugin = ClientsSelection(
        suite, os.environ.get("CLIENTS_BACKEND", "ours"), Path(os.environ["CLIENTS_OUTCOMES"])
    )
    config.pluginmanager.register(plugin, "clients-selection-lists")
