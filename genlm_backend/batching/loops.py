"""LoopBatchers: one AutoBatcher per running event loop, all feeding one worker thread (or the loop's own)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from genlm_backend.batching.batcher import AutoBatcher
from genlm_backend.batching.config import BatchingConfig
from genlm_backend.batching.stats import BatcherStats

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

logger = logging.getLogger(__name__)


class LoopBatchers(Generic[K, V]):
    """One :class:`AutoBatcher` per running event loop, all feeding one worker thread.

    For objects that outlive an event loop (a backend used by several
    ``asyncio.run`` calls, a notebook's loop and a script's): each loop gets
    its own batcher on first use, while model work stays serialized on one
    thread.

    Recovery: a batcher whose worker died (see :class:`AutoBatcher`) fails the
    requests it held with :class:`~genlm_backend.errors.BatcherWorkerDiedError`;
    the next request of that loop gets a fresh batcher, and the death is logged
    as a warning on this module's logger.

    With :attr:`compute_in_loop` set, batches run in the event loop's own
    thread instead, blocking it while they compute: a process whose torch work
    all runs on one thread keeps one OpenMP team, whose threads stay spinning
    between the small operations of a decode step. With a second thread
    calling torch (the worker), GNU OpenMP keeps a team per calling thread,
    counts more threads than cores and stops spinning: a 16 x 576 by 576 x
    1,536 matrix product took 300 us instead of 216 us, and SmolLM2's decode
    steps 20% longer (2-vCPU machine, ``bench_hf.py``). Meant for a CPU
    model in a process of its own whose coroutines all wait for the model: the
    team then spins between parallel regions, which is also why several such
    processes on one machine slow each other down badly (off by default; a
    server keeps the worker thread).

    Args:
        process_batch: As for :class:`AutoBatcher`.
        config: As for :class:`AutoBatcher`.
        request_tokens: As for :class:`AutoBatcher`.
        thread_name: Prefix of the worker thread's name.
        compute_in_loop: Initial value of :attr:`compute_in_loop`.
    """

    def __init__(
        self,
        process_batch: Callable[[list[K]], Sequence[V]],
        config: BatchingConfig | None = None,
        *,
        request_tokens: Callable[[K], int] | None = None,
        thread_name: str = "genlm-worker",
        compute_in_loop: bool = False,
    ):
        self._process_batch = process_batch
        self.compute_in_loop = compute_in_loop
        """Whether batchers made from now on run batches in their event loop's thread."""
        self.config = BatchingConfig() if config is None else config
        self._request_tokens = request_tokens
        # The worker runs torch with the intra-op thread count in force when this
        # object was made, whatever the threads that submit work use.
        num_threads = _torch_num_threads()
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=thread_name,
            initializer=_set_torch_num_threads,
            initargs=(num_threads,),
        )
        self._batchers: dict[asyncio.AbstractEventLoop, AutoBatcher[K, V]] = {}
        self.num_worker_deaths = 0
        """Batchers replaced because their worker died."""

    def current(self) -> AutoBatcher[K, V]:
        """The running loop's batcher (a new one if it has none or it was closed)."""
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None or batcher.is_closed:
            if batcher is not None and batcher.worker_error is not None:
                self.num_worker_deaths += 1
                logger.warning("replacing a batcher whose worker died: %r", batcher.worker_error)
            # A batcher holds its loop, so entries of finished loops are dropped here.
            for old_loop in [old for old in self._batchers if old.is_closed()]:
                del self._batchers[old_loop]
            batcher = AutoBatcher(
                self._process_batch,
                self.config,
                request_tokens=self._request_tokens,
                executor=_IN_LOOP if self.compute_in_loop else self._executor,
            )
            self._batchers[loop] = batcher
        return batcher

    async def reset_current(self) -> None:
        """Close the running loop's batcher (failing its pending requests); the next request gets a new one."""
        batcher = self._batchers.pop(asyncio.get_running_loop(), None)
        if batcher is not None:
            await batcher.aclose()

    async def aclose(self) -> None:
        """Close the running loop's batcher and stop the worker thread."""
        await self.reset_current()
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the worker thread; a batch already running finishes in it."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> BatcherStats | None:
        """The running loop's batcher's stats, ``None`` outside a loop or before its first request."""
        try:
            batcher = self._batchers.get(asyncio.get_running_loop())
        except RuntimeError:
            return None
        return None if batcher is None else batcher.stats


def _torch_num_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _set_torch_num_threads(num_threads: int | None) -> None:
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)


class _InLoopExecutor(Executor):
    """Runs each submitted call at once, in the submitting thread (the event loop's)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001  # for the awaiting batcher, as from a worker
            future.set_exception(exc)
        return future


_IN_LOOP = _InLoopExecutor()
