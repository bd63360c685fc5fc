"""The torch thread count of CPU steps run in the event loop's thread."""

from __future__ import annotations

import time

import torch


class CpuThreads:
    """The intra-op thread count of CPU steps: the process's own while a step gets its cores,
    one while it shares them with other processes.

    Each step's CPU time in the thread that computes it, over its wall time,
    says whether that thread had its core: close to one alone, well under one
    when other processes take the cores (its OpenMP team then spins on cores
    they need). Below :attr:`SHARED` the steps go on one thread; on one
    thread that gets its core, they try the full count again after a number
    of steps that doubles each time the try shows the cores still shared.
    Short steps are judged together: their times add up until they span
    :attr:`MIN_JUDGED_S`.

    Args:
        max_threads: The count while the cores are free (``torch.get_num_threads()``
            of the thread that built the backend).
        adaptive: ``False``: always ``max_threads``.
    """

    SHARED = 0.75
    FREE = 0.9
    MIN_JUDGED_S = 0.002
    FIRST_TRY_AFTER = 8
    LAST_TRY_AFTER = 1024

    def __init__(self, max_threads: int, adaptive: bool = True):
        self.max_threads = max_threads
        self.adaptive = adaptive and max_threads > 1
        self.num_threads = max_threads
        self._try_after = self.FIRST_TRY_AFTER
        self._num_free_steps = 0
        self._is_trying = False
        self._pending_cpu_s = 0.0
        self._pending_wall_s = 0.0

    def apply(self) -> tuple[int, float, float]:
        """Set this thread's torch threads for a step; returns what :meth:`observe` needs: the
        thread's own count, and the step's start on the thread's CPU clock and the wall clock."""
        own = torch.get_num_threads()
        if own != self.num_threads:
            torch.set_num_threads(self.num_threads)
        return own, time.thread_time(), time.perf_counter()

    def observe(self, start: tuple[int, float, float]) -> None:
        """Give the thread its own count back, and judge the step begun at ``start`` (see the class)."""
        own, cpu_start_s, wall_start_s = start
        if own != self.num_threads:
            torch.set_num_threads(own)
        if not self.adaptive:
            return
        self.record(time.thread_time() - cpu_start_s, time.perf_counter() - wall_start_s)

    def record(self, cpu_s: float, wall_s: float) -> None:
        """A step's CPU time in its thread and its wall time, judged once the steps since
        the last judgement span :attr:`MIN_JUDGED_S`."""
        self._pending_cpu_s += cpu_s
        self._pending_wall_s += wall_s
        if self._pending_wall_s >= self.MIN_JUDGED_S:
            share = self._pending_cpu_s / self._pending_wall_s
            self._pending_cpu_s = self._pending_wall_s = 0.0
            self.judge(share)

    def judge(self, share: float) -> None:
        """One step's CPU share: the next steps' thread count."""
        if self.num_threads > 1:
            if share < self.SHARED:
                if self._is_trying:
                    self._try_after = min(2 * self._try_after, self.LAST_TRY_AFTER)
                self.num_threads, self._num_free_steps, self._is_trying = 1, 0, False
            elif self._is_trying:
                self._try_after, self._is_trying = self.FIRST_TRY_AFTER, False
            return
        self._num_free_steps = self._num_free_steps + 1 if share >= self.FREE else 0
        if self._num_free_steps >= self._try_after:
            self.num_threads, self._is_trying = self.max_threads, True
