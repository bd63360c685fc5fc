"""Batches that gather every client: a request waits until each client that is stepping has sent its own.

In one process, the auto-batcher dispatches when the event loop goes idle:
every particle whose row just arrived has had its turn and submitted its
next context, so a step is one batch. Across processes the server's loop
goes idle as soon as the *first* client's next request arrives, while the
other clients are still sampling from their rows: that request goes alone,
the others queue behind it, and from then on the clients step out of phase,
two batches per step. :class:`StepGather` restores the in-process rule
across processes with one piece of knowledge the server has: which clients
it answered. A client it answered is *expected back* until its next request
arrives; requests are held until

* no request is computing (the model is busy anyway: they would queue), and
* every client expected back has come back (its next request is held too),

and then all go to the model together, in one event-loop pass, where the
batcher takes them as one batch. A client that does not come back (its job
ended, or it works on something else) is waited for at most as long as a
group takes, counted from when the wait starts: past that, a group of the
waiting requests would have cost no more than the wait (the ski-rental
bound: at worst twice the better of "wait" and "go now"). What a group takes
is the longest of the server's recent groups, each earlier one counted at
half for every group since: a group answered from cached rows in a fraction
of a millisecond, or a client's first group, does not make the next wait
that short (clients that start together would then fall out of step for the
rest of their run), and groups that got cheaper for good are waited for less
within a few groups. The client is then no longer expected, until it is
answered again. So there is no count or timeout to tune; a client whose
session closes is not waited for at all.

Requests without a client identity (other client libraries) are never
expected back: they go with the next group.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass

GROUP_DECAY = 0.5
"""What an earlier group's duration counts for, per group since, in what a group takes."""


@dataclass(frozen=True)
class GatherStats:
    """A snapshot of a :class:`StepGather`."""

    num_groups: int
    """Groups of requests let through together (each goes to the model at once)."""
    num_requests: int
    """Requests let through."""
    num_waits_given_up: int
    """Times requests went without clients they waited for (those took longer than a group)."""
    num_held: int
    """Requests waiting now."""


class StepGather:
    """Holds requests until every client that is stepping has one in, then lets them all go.

    Used on one event loop. Each request calls :meth:`admit` before its
    model work and :meth:`answered` after it (in a ``finally``); a client
    that goes away is dropped with :meth:`forget`.

    Args:
        clock: Seconds, to time groups (``None``: the event loop's clock).
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._held: list[tuple[Hashable, asyncio.Future]] = []
        self._computing: Counter[Hashable] = Counter()
        self._expected: set[Hashable] = set()
        self._group_started_at = 0.0
        self._group_s = 0.0  # what a group takes (see the module)
        self._give_up: asyncio.TimerHandle | None = None
        self._counts = dict.fromkeys(("groups", "requests", "given_up"), 0)

    @property
    def stats(self) -> GatherStats:
        c = self._counts
        return GatherStats(c["groups"], c["requests"], c["given_up"], len(self._held))

    async def admit(self, client: Hashable) -> None:
        """Return once this request of ``client`` may go to the model.

        Cancellation-safe: a cancelled request leaves no trace (if it was let
        through just before, it counts as answered, not expected back).
        """
        self._expected.discard(client)
        future = asyncio.get_running_loop().create_future()
        self._held.append((client, future))
        self._release_if_ready()
        try:
            await future
        except asyncio.CancelledError:
            if future.cancelled():  # still held (or skipped by a release meanwhile)
                with contextlib.suppress(ValueError):
                    self._held.remove((client, future))
                self._release_if_ready()
            else:  # let through just before the cancellation
                self.answered(client, is_expected_back=False)
            raise

    def answered(self, client: Hashable, *, is_expected_back: bool = True) -> None:
        """``client``'s request let through by :meth:`admit` is done (answered, failed or cancelled).

        ``is_expected_back``: the client got an answer and will likely send its
        next request (``False`` for a request whose client went away).
        """
        self._computing[client] -= 1
        if self._computing[client] <= 0:
            del self._computing[client]
            if is_expected_back and not any(held == client for held, _ in self._held):
                self._expected.add(client)
        if not self._computing:
            self._end_group()
        self._release_if_ready()

    def answered_without_model(self, client: Hashable) -> None:
        """``client`` sent a request that was answered at once, without the model (every row
        held): it came back, so nobody waits for it, and it is not expected until a request of
        its goes to the model again."""
        self._expected.discard(client)
        self._release_if_ready()

    def forget(self, client: Hashable) -> None:
        """``client`` went away: do not wait for it."""
        self._expected.discard(client)
        self._release_if_ready()

    def _now(self) -> float:
        return asyncio.get_running_loop().time() if self._clock is None else self._clock()

    def _end_group(self) -> None:
        """The last request of a group is done: with the earlier groups (halved), its duration
        bounds the next waits."""
        duration_s = max(0.0, self._now() - self._group_started_at)
        self._group_s = max(duration_s, GROUP_DECAY * self._group_s)

    def _release_if_ready(self) -> None:
        if not self._held or self._computing:
            return
        if self._expected:
            self._wait_for_expected()
            return
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None
        # A cancelled request is skipped: it cleans up after itself.
        held, self._held = [(c, f) for c, f in self._held if not f.cancelled()], []
        if not held:
            return
        self._group_started_at = self._now()
        self._counts["groups"] += 1
        self._counts["requests"] += len(held)
        for client, future in held:
            self._computing[client] += 1
            future.set_result(None)

    def _wait_for_expected(self) -> None:
        """Requests wait for the clients expected back, from now on, at most what a group takes."""
        if self._give_up is None:
            self._give_up = asyncio.get_running_loop().call_later(self._group_s, self._on_give_up)

    def _on_give_up(self) -> None:
        self._give_up = None
        if not self._held or self._computing:
            return  # nobody waits any more: those clients stay expected
        self._counts["given_up"] += 1
        self._expected.clear()
        self._release_if_ready()
