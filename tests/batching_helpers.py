"""Helpers for the batcher's tests: a recording ``process_batch``, bounded awaits, settled checks."""

from __future__ import annotations

import asyncio
import threading

from genlm_backend.batching import AutoBatcher, BatchingConfig

LONG_S = 60.0  # a timeout no test waits for: reaching it would fail the test's own bound
BOUND_S = 60.0  # a hang guard on each await: never reached by a correct build, however loaded


class Recorder:
    """A ``process_batch`` that records its batches and may block or fail on demand."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.batches: list[list] = []
        self.threads: list[threading.Thread] = []
        self.gate: threading.Event | None = None  # when set up, each batch waits for it
        self.loop = loop
        self.started: asyncio.Future | None = None  # set when a batch starts (needs loop)
        self.fail_on = None

    def block(self) -> None:
        self.gate = threading.Event()
        self.started = self.loop.create_future()

    def __call__(self, keys: list) -> list:
        self.batches.append(list(keys))
        self.threads.append(threading.current_thread())
        if self.started is not None:
            started, self.started = self.started, None
            self.loop.call_soon_threadsafe(started.set_result, list(keys))
        if self.gate is not None and not self.gate.wait(BOUND_S):
            raise TimeoutError("the test never opened the gate")
        if self.fail_on is not None and self.fail_on in keys:
            raise ValueError(f"cannot process {self.fail_on!r}")
        return [f"value:{key}" for key in keys]

    def seen_keys(self) -> list:
        return [key for batch in self.batches for key in batch]


def make_batcher(process_batch, executor=None, request_tokens=None, **options) -> AutoBatcher:
    return AutoBatcher(
        process_batch, BatchingConfig(**options), request_tokens=request_tokens, executor=executor
    )


def bounded(awaitable):
    return asyncio.wait_for(awaitable, BOUND_S)


def assert_settled(batcher: AutoBatcher) -> None:
    stats = batcher.stats
    assert (stats.num_pending, stats.num_inflight) == (0, 0), stats
    # No waiter is still counted, and no computation is still marked as shared.
    assert not batcher._num_waiters and not batcher._joined
    assert batcher._group is None  # no caller's group computing
