"""Run one client library's test suite from its sdist, or summarize the recorded outcomes.

    python .ci/clients/run_suite.py --backend ours --sdists DIR --work DIR control
    python .ci/clients/run_suite.py --summary --backend ours --work DIR

Runs with the interpreter that runs this script (the clients venv). With
``--backend ours`` pytest loads the ``genlm_backend.alias`` plugin, so the suite's
``import genlm.backend`` is served by genlm_backend.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# suite -> (sdist folder name, package source folders removed from the unpacked copy)
SUITES = {
    "control": ("genlm_control-0.4.1", ["genlm"]),
    "bytes": ("genlm_bytes-0.2.0", ["genlm"]),
    "llamppl": ("llamppl-0.2.3", ["llamppl"]),
    "upstream": ("genlm_backend-0.3.1", ["genlm"]),
}
# A test that runs longer fails (random-weight stand-ins can make a sampler search
# without end); CLIENTS_TEST_TIMEOUT_S overrides it.
TIMEOUT_PER_TEST_S = int(os.environ.get("CLIENTS_TEST_TIMEOUT_S", "60"))


def unpack(sdists: Path, work: Path, suite: str, backend: str) -> Path:
    """A fresh copy of the suite's sdist without its package sources; returns its folder."""
    name, package_dirs = SUITES[suite]
    target = work / "src" / backend
    shutil.rmtree(target / name, ignore_errors=True)
    with tarfile.open(sdists / f"{name}.tar.gz") as tar:
        # Python before 3.11.4 (Debian 12's 3.11.2) has no extraction filters; these
        # sdists come from PyPI by pinned version.
        if hasattr(tarfile, "data_filter"):
            tar.extractall(target, filter="data")
        else:
            tar.extractall(target)
    for package_dir in package_dirs:
        shutil.rmtree(target / name / package_dir)
    return target / name


def outcomes_path(work: Path, backend: str, suite: str) -> Path:
    return work / "results" / f"{backend}-{suite}.json"


def run(suite: str, backend: str, sdists: Path, work: Path) -> int:
    """Run the suite's ``tests`` folder; returns pytest's exit status."""
    folder = unpack(sdists, work, suite, backend)
    env = {
        **os.environ,
        "CLIENTS_SUITE": suite,
        "CLIENTS_BACKEND": backend,
        "CLIENTS_OUTCOMES": str(outcomes_path(work, backend, suite)),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-q",
        "-rfEX",
        "-p",
        "no:cacheprovider",
        "-p",
        "clients_selection",
        # The test extra brings pytest-randomly; these suites are run in their own order.
        "-p",
        "no:randomly",
        f"--timeout={TIMEOUT_PER_TEST_S}",
        "--durations=25",  # CI time: the slowest tests of each suite
    ]
    if backend == "ours":
        command[3:3] = ["-p", "genlm_backend.alias"]
    workers = os.environ.get("CLIENTS_PYTEST_WORKERS")
    if workers:  # pytest-xdist; one file per worker keeps module-scoped models shared
        command += ["-n", workers, "--dist", "loadfile"]
    print(f"== {suite} ({backend}): {' '.join(command)}", flush=True)
    started = time.monotonic()
    status = subprocess.run(command, cwd=folder, env=env, check=False).returncode
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"== {suite} ({backend}): exit {status}, {time.monotonic() - started:.0f} s wall, "
        f"{usage.ru_utime + usage.ru_stime:.0f} s CPU",
        flush=True,
    )
    return status


def count(outcomes: dict[str, str]) -> collections.Counter:
    return collections.Counter(outcomes.values())


def summary(work: Path, backend: str) -> None:
    """Print one line per suite: total and counts per outcome."""
    print(f"{'suite':10} {'total':>6} " + " ".join(f"{k:>10}" for k in _COLUMNS))
    for suite in SUITES:
        path = outcomes_path(work, backend, suite)
        if not path.exists():
            continue
        counts = count(json.loads(path.read_text()))
        total = sum(counts.values())
        print(f"{suite:10} {total:>6} " + " ".join(f"{counts.get(k, 0):>10}" for k in _COLUMNS))


_COLUMNS = (
    "passed",
    "failed",
    "error",
    "skipped",
    "xfailed",
    "xpassed",
    "deselected",
    "collect-error",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", nargs="?", choices=sorted(SUITES))
    parser.add_argument("--backend", choices=("ours", "upstream"), default="ours")
    parser.add_argument("--sdists", type=Path)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--summary", action="store_true")
    args = parser.parse_args()
    if args.summary:
        summary(args.work, args.backend)
        return
    if args.suite is None or args.sdists is None:
        parser.error("a suite and --sdists are needed unless --summary")
    sys.exit(run(args.suite, args.backend, args.sdists, args.work))


if __name__ == "__main__":
    main()
