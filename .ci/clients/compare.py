"""Compare the client suites' outcomes on genlm_backend with those on upstream genlm-backend 0.3.1.

    python .ci/clients/compare.py OURS_WORK UPSTREAM_WORK

Reads ``results/ours-SUITE.json`` under OURS_WORK and ``results/upstream-SUITE.json``
under UPSTREAM_WORK (written by ``clients.sh``), prints the Markdown table (per suite:
tests selected, skipped and passed on upstream, passed on genlm_backend, known departures) and every
test that passes on upstream but not on genlm_backend and is not a known departure.
Exits 1 if there is such a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SUITES = ("control", "bytes", "llamppl", "upstream")
TITLES = {
    "control": "genlm-control 0.4.1",
    "bytes": "genlm-bytes 0.2.0",
    "llamppl": "llamppl 0.2.3",
    "upstream": "genlm-backend 0.3.1 (upstream's own)",
}


def load(work: Path, backend: str, suite: str) -> dict[str, str]:
    path = work / "results" / f"{backend}-{suite}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def compare(ours_work: Path, upstream_work: Path) -> list[str]:
    """Print the table; return ``suite: test (outcome)`` for each unexplained regression."""
    regressions = []
    print(
        "| suite | tests selected | skipped on upstream (GPU, MLX, ...) | passed on upstream 0.3.1 "
        "| passed on genlm_backend | known departures (xfail) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for suite in SUITES:
        ours, upstream = load(ours_work, "ours", suite), load(upstream_work, "upstream", suite)
        if not ours or not upstream:
            continue
        run = [test for test, outcome in upstream.items() if outcome != "deselected"]
        upstream_passed = [test for test in run if upstream[test] == "passed"]
        ours_passed = [test for test in run if ours.get(test) in ("passed", "xpassed")]
        departures = [test for test in run if ours.get(test) == "xfailed"]
        skipped = [test for test in run if upstream[test] == "skipped"]
        print(
            f"| {TITLES[suite]} | {len(run)} | {len(skipped)} | {len(upstream_passed)} "
            f"| {len(ours_passed)} | {len(departures)} |"
        )
        for test in upstream_passed:
            if ours.get(test) not in ("passed", "xpassed", "xfailed"):
                regressions.append(f"{suite}: {test} ({ours.get(test, 'not run')})")
    return regressions


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    regressions = compare(Path(sys.argv[1]), Path(sys.argv[2]))
    if regressions:
        print("\npass on upstream, not on genlm_backend, not a known departure:")
        print("\n".join(regressions))
        sys.exit(1)


if __name__ == "__main__":
    main()
