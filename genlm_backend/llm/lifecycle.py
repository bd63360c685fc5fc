"""Clearing, resetting and closing an :class:`~genlm_backend.llm.base.AsyncLM`."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genlm_backend.batching import LoopBatchers
    from genlm_backend.cache.output import OutputCache
    from genlm_backend.llm.runner import Runner


class LifecycleMethods:
    """Cache clearing, ``reset_async_queries``, ``close``/``aclose`` and context managers of ``AsyncLM``.

    Uses the ``AsyncLM`` attributes ``_compute_lock``, ``_batchers``,
    ``_is_closed``, ``output_cache`` and ``runner``.
    """

    if TYPE_CHECKING:  # provided by AsyncLM
        runner: Runner
        output_cache: OutputCache
        _compute_lock: threading.Lock
        _batchers: LoopBatchers
        _is_closed: bool

    def clear_cache(self) -> None:
        """Drop every cached result and reusable prefix; later results are recomputed."""
        with self._compute_lock:
            self.output_cache.clear()
            self.runner.clear()

    def clear_kv_cache(self) -> None:
        """Drop every retained key/value (results in the output cache stay)."""
        with self._compute_lock:
            self.runner.clear()

    def reset_async_queries(self) -> asyncio.Task | None:
        """Fail every pending request of the running event loop; later requests get a fresh batcher.

        A plain method: call it with or without ``await``. Inside a running
        loop it returns a task that finishes once those requests have failed
        (await it to wait for that); outside a loop nothing is pending and it
        returns ``None``.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return loop.create_task(self._batchers.reset_current())

    async def aclose(self) -> None:
        """Fail pending requests with :class:`BackendClosedError` and release the model.

        Pending callers fail at once; the model is released once a batch
        still computing has finished, without blocking the event loop
        meanwhile. Later calls raise :class:`BackendClosedError`. Idempotent.
        """
        self._is_closed = True
        await self._batchers.reset_current()
        # A batch may still be computing in the worker thread (its callers have
        # already failed): wait for it off the event loop, then release the model.
        await asyncio.to_thread(_wait_until_unlocked, self._compute_lock)
        self.close()

    def close(self) -> None:
        """Synchronous :meth:`aclose` for scripts: later calls raise :class:`BackendClosedError`. Idempotent."""
        self._is_closed = True
        self._batchers.shutdown()
        with self._compute_lock:
            self.output_cache.clear()
            runner = getattr(self, "runner", None)  # None if construction failed before it
            if runner is not None:
                runner.close()

    def cleanup(self) -> None:
        """Same as :meth:`close`."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def _wait_until_unlocked(lock: threading.Lock) -> None:
    with lock:  # acquired and released in this thread, even if the awaiting task is cancelled
        pass
