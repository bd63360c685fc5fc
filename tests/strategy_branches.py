"""Which branches of a Hypothesis test's strategies its examples reached, checked and shown.

A test names each branch an example takes (a value of a ``sampled_from``, an
alternative of a ``one_of``, an outcome that depends on the draw) with
:meth:`Branches.reach`: a ``hypothesis.event`` (``--hypothesis-show-statistics``
gives the share of generated examples reaching it) and a tally that also counts
the explicit ``@example`` ones, which Hypothesis leaves out of its statistics.
The tallies are printed at the end of the run (``tests/conftest.py``'s terminal
summary), and :meth:`Branches.check` fails a test whose examples missed one of
its branches: rare branches get an ``@example`` each, so CI's few examples reach
every one whatever the draw.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import hypothesis

REACHED: dict[str, Counter[str]] = {}
"""Test id -> branch -> examples that reached it (``"examples"``: all of them), this run."""


class Branches:
    """The branches one test must reach, and those its examples reached so far.

    Args:
        test_id: The test's pytest node id (the key of its tally in :data:`REACHED`).
        expected: Every branch the test's strategies can take.
    """

    def __init__(self, test_id: str, expected: Iterable[str]):
        self.expected = frozenset(expected)
        self.counts = REACHED.setdefault(test_id, Counter())

    def example(self, *branches: str) -> None:
        """One example ran, reaching ``branches``."""
        self.counts["examples"] += 1
        self.reach(*branches)

    def reach(self, *branches: str) -> None:
        """The running example reached ``branches`` (each must be an expected one)."""
        for branch in branches:
            if branch not in self.expected:
                raise ValueError(
                    f"branch {branch!r} is not among the expected {sorted(self.expected)}"
                )
            hypothesis.event(branch)
            self.counts[branch] += 1

    def check(self) -> None:
        """Fail if an expected branch was reached by no example.

        Raises:
            AssertionError: naming the branches no example reached.
        """
        missed = sorted(self.expected - set(self.counts))
        assert not missed, f"no example reached {missed}; reached: {dict(self.counts)}"
